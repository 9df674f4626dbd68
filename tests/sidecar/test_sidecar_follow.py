"""trace.follow.SpoolFollower on spools written by the real SpoolWriter while they grow.

The oracle is spool.read_rank on the finished files: whatever the polls saw on the way, the
records (kind, JSON, raw bytes, file, offset) and the damage reports must be the ones a reader of
the final spool gets. Bytes a writer could leave mid-write (half a record, half a segment header)
are produced with spool.encode_record, the writer's own encoder, and appended by hand.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from fsdp_replay.errors import TraceVersionError
from fsdp_replay.trace import schema, spool
from fsdp_replay.trace.follow import SpoolFollower
from fsdp_replay.trace.spool import Record, SpoolWriter


def _key(r: Record) -> tuple[Any, ...]:
    return (r.kind, json.dumps(r.obj, sort_keys=True), bytes(r.raw), str(r.path), r.offset)


def _oracle(folder: Path) -> tuple[list[tuple[Any, ...]], list[str]]:
    report = spool.SegmentReport()
    records = [_key(r) for r in spool.read_rank(folder, report)]
    return records, [str(d) for d in report.damage]


def _ev(i: int, **extra: Any) -> dict[str, Any]:
    return {"type": "alive", "seq": i, "step": 0, "t_ns": i, **extra}


def _record_bytes(obj: dict[str, Any], raw: bytes | None = None) -> bytes:
    return b"".join(
        bytes(p) for p in spool.encode_record(schema.KIND_BLOB if raw else schema.KIND_EVENT, obj, raw)
    )


def _append_raw(path: Path, data: bytes) -> None:
    with open(path, "ab") as f:
        f.write(data)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return spool.rank_dir(tmp_path / "spool", 3)


def test_records_appended_between_polls_are_read_once_in_order(folder: Path) -> None:
    f = SpoolFollower(folder)
    assert f.poll() == []  # the folder does not exist yet
    w = SpoolWriter(folder, 3)
    seen: list[tuple[Any, ...]] = []
    assert f.poll() == []  # a segment with its header only
    for batch in range(5):
        for i in range(batch * 10, batch * 10 + 10):
            w.append(schema.KIND_EVENT, _ev(i))
            if i % 3 == 0:
                w.append(schema.KIND_BLOB, {"blob": i, "nbytes": i}, os.urandom(i))
        got = f.poll()
        assert [r.obj["seq"] for r in got if r.kind == schema.KIND_EVENT] == list(
            range(batch * 10, batch * 10 + 10)
        )
        seen += [_key(r) for r in got]
        assert f.poll() == []  # nothing new: nothing returned twice
    w.close()
    records, damage = _oracle(folder)
    assert seen == records and damage == []
    assert f.report.records == len(records) and f.report.damage == []
    assert f.bytes_read == f.disk_bytes == sum(p.stat().st_size for p in spool.segments(folder))


def test_only_new_bytes_are_read(folder: Path) -> None:
    """Bytes already consumed are never read again: overwriting them on disk changes nothing."""
    w = SpoolWriter(folder, 3)
    for i in range(20):
        w.append(schema.KIND_EVENT, _ev(i))
    f = SpoolFollower(folder)
    assert len(f.poll()) == 20
    seg = spool.segments(folder)[0]
    consumed = seg.stat().st_size
    with open(seg, "r+b") as fh:  # scribble over everything read so far (header included)
        fh.write(b"\xaa" * consumed)
    w.append(schema.KIND_EVENT, _ev(20))
    got = f.poll()
    assert [r.obj["seq"] for r in got] == [20] and got[0].offset == consumed
    assert f.report.damage == []
    w.close()


def test_a_record_split_across_two_polls_is_kept_for_the_next(folder: Path) -> None:
    w = SpoolWriter(folder, 3)
    w.append(schema.KIND_EVENT, _ev(0))
    seg = w.segment_path
    f = SpoolFollower(folder)
    assert [r.obj["seq"] for r in f.poll()] == [0]
    blob = os.urandom(5000)
    data = _record_bytes({"blob": 7, "nbytes": len(blob)}, blob)
    for cut in (3, 16, 40, 2000, len(data) - 1):  # inside the header, the JSON, the raw part
        _append_raw(seg, data[:cut])
        assert f.poll() == [] and f.report.damage == [], cut  # unfinished, not damaged
        _append_raw(seg, data[cut:])
        (rec,) = f.poll()
        assert (
            rec.kind == schema.KIND_BLOB and bytes(rec.raw) == blob and rec.obj == {"blob": 7, "nbytes": 5000}
        )
    w.close()
    records, damage = _oracle(folder)
    assert damage == [] and len(records) == 6


def test_a_segment_header_split_across_polls(tmp_path: Path, folder: Path) -> None:
    # The header bytes of a real segment, written in pieces.
    SpoolWriter(tmp_path / "model", 3).close()
    header = (tmp_path / "model" / "seg-000000.fsrs").read_bytes()
    folder.mkdir(parents=True)
    seg = folder / "seg-000000.fsrs"
    f = SpoolFollower(folder)
    for cut in (0, 5, len(schema.SEGMENT_MAGIC) + 4, len(header) - 1):
        seg.write_bytes(header[:cut])
        assert f.poll() == [] and f.report.damage == [], cut
    seg.write_bytes(header + _record_bytes(_ev(1)))
    assert [r.obj["seq"] for r in f.poll()] == [1]
    assert f.report.damage == []


def test_segment_roll_over(folder: Path) -> None:
    w = SpoolWriter(folder, 3, max_segment_bytes=600)
    f = SpoolFollower(folder)
    seen: list[tuple[Any, ...]] = []
    for i in range(40):
        w.append(schema.KIND_EVENT, _ev(i, pad="x" * 50))
        if i % 7 == 0:
            seen += [_key(r) for r in f.poll()]
    w.roll()  # an explicit roll with nothing after it, then more records
    seen += [_key(r) for r in f.poll()]
    for i in range(40, 45):
        w.append(schema.KIND_EVENT, _ev(i))
    seen += [_key(r) for r in f.poll()]
    w.close()
    records, damage = _oracle(folder)
    assert len(spool.segments(folder)) > 5
    assert seen == records and damage == []
    assert [json.loads(k[1])["seq"] for k in seen] == list(range(45))
    assert f.segments_done == len(spool.segments(folder)) - 1  # the last one is still open


def test_truncated_tail_is_damage_once_the_segment_is_complete(folder: Path) -> None:
    """A process killed mid-write leaves half a record; its restart writes the next segment."""
    w = SpoolWriter(folder, 3)
    for i in range(3):
        w.append(schema.KIND_EVENT, _ev(i))
    seg0 = w.segment_path
    w.close()
    half = _record_bytes(_ev(3))[:30]
    _append_raw(seg0, half)
    f = SpoolFollower(folder)
    assert [r.obj["seq"] for r in f.poll()] == [0, 1, 2]
    assert f.report.damage == []  # it may still be written
    w2 = SpoolWriter(folder, 3)  # the restarted rank: a new segment, never appending to the old one
    w2.append(schema.KIND_EVENT, _ev(10))
    got = f.poll()
    assert [r.obj["seq"] for r in got] == [10]
    _, damage = _oracle(folder)
    assert [str(d) for d in f.report.damage] == damage and len(damage) == 1
    assert "truncated record" in damage[0] and str(seg0) in damage[0]
    # And a truncated tail of the last segment is damage once the writer is gone for good.
    w2.close()
    _append_raw(w2.segment_path, _record_bytes(_ev(11))[:20])
    assert f.poll() == [] and len(f.report.damage) == 1
    assert f.finish() == []
    _, damage = _oracle(folder)
    assert [str(d) for d in f.report.damage] == damage and len(damage) == 2
    assert f.bytes_read == f.disk_bytes


def test_damaged_record_in_the_middle_is_reported_and_the_rest_read(folder: Path) -> None:
    w = SpoolWriter(folder, 3)
    offsets = []
    for i in range(10):
        offsets.append(w._offset)
        w.append(schema.KIND_EVENT, _ev(i))
    w.append(schema.KIND_BLOB, {"blob": 1, "nbytes": 100}, os.urandom(100))
    seg = w.segment_path
    with open(seg, "r+b") as fh:  # a flipped bit in the body of record 4: checksum mismatch
        fh.seek(offsets[4] + schema.RECORD_HEADER_SIZE + 5)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0x10]))
    f = SpoolFollower(folder)
    got = f.poll()
    assert [r.obj.get("seq") for r in got if r.kind == schema.KIND_EVENT] == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    (d,) = f.report.damage
    assert d.reason == "checksum mismatch" and d.offset == offsets[4] and d.nbytes == offsets[5] - offsets[4]
    for i in range(10, 13):
        w.append(schema.KIND_EVENT, _ev(i))
    assert [r.obj["seq"] for r in f.poll()] == [10, 11, 12]
    w.close()
    records, damage = _oracle(folder)
    assert [str(x) for x in f.report.damage] == damage
    assert f.report.records == len(records) == 13  # 10 + 1 blob + 3, less the damaged one


def test_damage_at_the_growing_tail_waits_for_the_next_record(folder: Path) -> None:
    """Garbage, or a length field pointing past the end, is reported once a whole record follows it."""
    w = SpoolWriter(folder, 3)
    w.append(schema.KIND_EVENT, _ev(0))
    seg = w.segment_path
    f = SpoolFollower(folder)
    assert len(f.poll()) == 1
    bad = bytearray(_record_bytes(_ev(1)))
    bad[4:8] = (1 << 30).to_bytes(4, "little")  # claims a GiB: looks unfinished
    _append_raw(seg, bytes(bad))
    _append_raw(seg, b"\x00" * 37)  # and some garbage
    assert f.poll() == [] and f.report.damage == []
    _append_raw(seg, _record_bytes(_ev(2))[:25])  # the next record, unfinished: still waiting
    assert f.poll() == [] and f.report.damage == []
    _append_raw(seg, _record_bytes(_ev(2))[25:])
    assert [r.obj["seq"] for r in f.poll()] == [2]
    (d,) = f.report.damage
    assert d.reason.startswith("truncated record") and d.nbytes == len(bad) + 37
    w.close()
    assert [str(x) for x in f.report.damage] == _oracle(folder)[1]


def test_a_cut_back_write_held_from_the_last_poll_is_read_again(folder: Path) -> None:
    """A full disk: the writer cuts a failed record back and writes another over it."""
    w = SpoolWriter(folder, 3)
    w.append(schema.KIND_EVENT, _ev(0))
    seg, start = w.segment_path, w._offset
    f = SpoolFollower(folder)
    assert len(f.poll()) == 1
    _append_raw(seg, _record_bytes(_ev(1, pad="y" * 500))[:300])  # a write that failed half-way
    assert f.poll() == []
    os.truncate(seg, start)  # what SpoolWriter does after a failed write
    w.append(schema.KIND_EVENT, _ev(2, pad="z" * 900))  # longer than what was held
    w.append(schema.KIND_EVENT, _ev(3))
    assert [r.obj["seq"] for r in f.poll()] == [2, 3]
    assert f.report.damage == []
    # The file shrinking below what was held is noticed too.
    _append_raw(seg, _record_bytes(_ev(4))[:40])
    assert f.poll() == []
    os.truncate(seg, seg.stat().st_size - 40)
    w.append(schema.KIND_EVENT, _ev(5))
    assert [r.obj["seq"] for r in f.poll()] == [5] and f.report.damage == []
    w.close()
    assert _oracle(folder)[1] == []


def test_damaged_segment_header_is_reported_and_its_records_read(folder: Path) -> None:
    w = SpoolWriter(folder, 3)
    for i in range(4):
        w.append(schema.KIND_EVENT, _ev(i))
    w.close()
    seg = w.segment_path
    data = bytearray(seg.read_bytes())
    data[len(schema.SEGMENT_MAGIC) + 6] ^= 0xFF  # inside the header's JSON
    seg.write_bytes(bytes(data))
    f = SpoolFollower(folder)
    assert [r.obj["seq"] for r in f.finish()] == [0, 1, 2, 3]
    _, damage = _oracle(folder)
    assert [str(d) for d in f.report.damage] == damage and "every record after it was read" in damage[0]
    assert f.report.damage[0].records_lost is False


def test_a_segment_of_another_format_version_raises(folder: Path) -> None:
    folder.mkdir(parents=True)
    header = json.dumps({"format_version": 999, "rank": 3, "segment": 0}).encode()
    (folder / "seg-000000.fsrs").write_bytes(
        schema.SEGMENT_MAGIC + len(header).to_bytes(4, "little") + header
    )
    with pytest.raises(TraceVersionError):
        SpoolFollower(folder).poll()
