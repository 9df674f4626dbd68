"""The per-rank spool: round trip, roll-over, and what damage costs (only the damaged record).

Everything here writes spools by hand with ``SpoolWriter``; no torch, no training run.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import struct
import subprocess
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fsdp_replay.errors import TraceFormatError, TraceVersionError
from fsdp_replay.trace import schema, spool

EVENTS: list[dict[str, Any]] = [
    {"type": "step", "step": 0, "micro_steps": 1, "colls": 0, "params": [], "loss": [1.5], "t_ns": 7},
    {"type": "agent_error", "where": "wörker ✓", "message": "boom", "traceback": ""},
    {"type": "end", "reason": "exit", "steps": 1, "colls": 0, "t_ns": 9, "counters": {}},
]


def write_mixed(folder: Path, **kw: Any) -> list[tuple[int, Any, bytes]]:
    """Events and blobs (empty, small, large) in one rank folder; returns what was written."""
    written: list[tuple[int, Any, bytes]] = []
    w = spool.SpoolWriter(folder, 3, **kw)
    blobs = [b"", b"\x00\x01\x02", bytes(range(256)) * 40]
    for i, ev in enumerate(EVENTS):
        w.append(schema.KIND_EVENT, ev)
        written.append((schema.KIND_EVENT, ev, b""))
        raw = blobs[i]
        meta = {"blob": i, "nbytes": len(raw)}
        w.append(schema.KIND_BLOB, meta, raw)
        written.append((schema.KIND_BLOB, meta, raw))
    w.close()
    return written


def as_tuples(records: Iterator[spool.Record]) -> list[tuple[int, Any, bytes]]:
    return [(r.kind, r.obj, bytes(r.raw)) for r in records]


def three_records(folder: Path) -> tuple[Path, list[int], bytes]:
    """A segment of three records (event, blob, event): its path, record offsets and bytes."""
    w = spool.SpoolWriter(folder, 0)
    w.append(schema.KIND_EVENT, {"type": "x", "i": 0})
    w.append(schema.KIND_BLOB, {"blob": 0, "nbytes": 64}, bytes(range(64)))
    w.append(schema.KIND_EVENT, {"type": "x", "i": 2})
    path = w.segment_path
    w.close()
    offsets = [r.offset for r in spool.read_segment(path)]
    return path, offsets, path.read_bytes()


# -- round trip -------------------------------------------------------------------------------
def test_round_trip_events_and_blobs(tmp_path: Path) -> None:
    written = write_mixed(tmp_path / "rank-00003")
    report = spool.SegmentReport()
    records = list(spool.read_rank(tmp_path / "rank-00003", report))
    assert as_tuples(iter(records)) == written
    assert report.records == len(written) and report.damage == []
    assert [r.offset for r in records] == sorted(r.offset for r in records)
    assert all(r.path.name == "seg-000000.fsrs" for r in records)


def test_segment_header_and_record_layout(tmp_path: Path) -> None:
    w = spool.SpoolWriter(tmp_path, 5)
    w.append(schema.KIND_BLOB, {"blob": 0, "nbytes": 3}, b"xyz")
    w.close()
    data = w.segment_path.read_bytes()
    assert data[:8] == schema.SEGMENT_MAGIC
    (hlen,) = struct.unpack_from("<I", data, 8)
    header = json.loads(data[12 : 12 + hlen])
    assert header["format_version"] == schema.FORMAT_VERSION
    assert (header["rank"], header["segment"]) == (5, 0)
    pos = 12 + hlen
    magic, kind, flags, length, crc, jlen = struct.unpack_from(schema.RECORD_HEADER, data, pos)
    body = data[pos + schema.RECORD_HEADER_SIZE :]
    assert (magic, kind, flags) == (schema.RECORD_MAGIC, schema.KIND_BLOB, 0)
    assert length == len(body) and body[jlen:] == b"xyz"
    assert json.loads(body[:jlen]) == {"blob": 0, "nbytes": 3}
    assert crc == zlib.crc32(body)


def test_writer_reports_sizes(tmp_path: Path) -> None:
    w = spool.SpoolWriter(tmp_path, 0)
    size = w.append(schema.KIND_BLOB, {"blob": 0, "nbytes": 10}, memoryview(b"0123456789"))
    w.close()
    assert size == schema.RECORD_HEADER_SIZE + len(b'{"blob":0,"nbytes":10}') + 10
    assert (w.records_written, w.bytes_written) == (1, size)
    assert w.segment_path.stat().st_size > size


def test_segment_roll_over(tmp_path: Path) -> None:
    limit = 400
    written = write_mixed(tmp_path, max_segment_bytes=limit)
    segs = spool.segments(tmp_path)
    assert len(segs) > 2
    assert [s.name for s in segs] == [schema.SEGMENT_FMT.format(index=i) for i in range(len(segs))]
    for seg in segs:
        records = list(spool.read_segment(seg))
        assert records, f"{seg.name} is empty"
        # a segment exceeds the limit only when it holds one record larger than the limit
        assert seg.stat().st_size <= limit or len(records) == 1
    assert as_tuples(spool.read_rank(tmp_path)) == written


def test_restarted_writer_starts_a_new_segment(tmp_path: Path) -> None:
    first = write_mixed(tmp_path)
    w = spool.SpoolWriter(tmp_path, 3)
    w.append(schema.KIND_EVENT, {"type": "end"})
    w.close()
    assert [s.name for s in spool.segments(tmp_path)] == ["seg-000000.fsrs", "seg-000001.fsrs"]
    assert as_tuples(spool.read_rank(tmp_path)) == [*first, (schema.KIND_EVENT, {"type": "end"}, b"")]


def test_spool_ranks_and_rank_dir(tmp_path: Path) -> None:
    for r in (0, 12):
        spool.SpoolWriter(spool.rank_dir(tmp_path, r), r).close()
    (tmp_path / "rank-7").mkdir()  # not zero-padded: not ours
    (tmp_path / "notes.txt").write_text("x")
    assert spool.spool_ranks(tmp_path) == {0: tmp_path / "rank-00000", 12: tmp_path / "rank-00012"}
    assert spool.spool_ranks(tmp_path / "missing") == {}
    with pytest.raises(TraceFormatError, match="rank folder not found"):
        spool.segments(tmp_path / "rank-00005")


# -- damage -----------------------------------------------------------------------------------
def test_truncated_tail_at_every_length(tmp_path: Path) -> None:
    path, offsets, data = three_records(tmp_path / "src")
    last = offsets[-1]
    cut = tmp_path / "cut.fsrs"
    expected = as_tuples(spool.read_segment(path))[:2]
    for length in range(last + 1, len(data)):
        cut.write_bytes(data[:length])
        report = spool.SegmentReport()
        assert as_tuples(spool.read_segment(cut, report)) == expected, length
        assert len(report.damage) == 1, length
        d = report.damage[0]
        assert (d.path, d.offset, d.nbytes) == (str(cut), last, length - last)
        assert d.reason.startswith("truncated record")
        assert f"{cut} at byte {last}" in str(d)
        with pytest.raises(TraceFormatError, match="truncated record") as e:
            list(spool.read_segment(cut, strict=True))
        assert (e.value.path, e.value.offset) == (str(cut), last)
    cut.write_bytes(data[:last])  # cut exactly at a record boundary: nothing is damaged
    report = spool.SegmentReport()
    assert as_tuples(spool.read_segment(cut, report)) == expected and report.damage == []


def test_checksum_mismatch_resyncs(tmp_path: Path) -> None:
    path, offsets, data = three_records(tmp_path)
    good = as_tuples(spool.read_segment(path))
    body = offsets[1] + schema.RECORD_HEADER_SIZE
    for pos in range(body, offsets[2]):  # every byte of the middle record's body
        bad = bytearray(data)
        bad[pos] ^= 0x5A
        path.write_bytes(bad)
        report = spool.SegmentReport()
        assert as_tuples(spool.read_segment(path, report)) == [good[0], good[2]], pos
        assert [(d.offset, d.reason) for d in report.damage] == [(offsets[1], "checksum mismatch")]
        assert report.damage[0].nbytes == offsets[2] - offsets[1]


def test_bad_record_magic_resyncs(tmp_path: Path) -> None:
    path, offsets, data = three_records(tmp_path)
    good = as_tuples(spool.read_segment(path))
    bad = bytearray(data)
    bad[offsets[1]] ^= 0xFF
    path.write_bytes(bad)
    report = spool.SegmentReport()
    assert as_tuples(spool.read_segment(path, report)) == [good[0], good[2]]
    assert [(d.offset, d.reason) for d in report.damage] == [(offsets[1], "bad record header")]


def test_any_bit_flip_in_a_record_costs_only_that_record(tmp_path: Path) -> None:
    path, offsets, data = three_records(tmp_path)
    good = as_tuples(spool.read_segment(path))
    for pos in range(offsets[1], offsets[2]):
        for bit in range(8):
            bad = bytearray(data)
            bad[pos] ^= 1 << bit
            path.write_bytes(bad)
            report = spool.SegmentReport()
            got = as_tuples(spool.read_segment(path, report))
            # a flip in the unused flags byte may go unnoticed; anything else is reported
            assert got == good or (got == [good[0], good[2]] and report.damage), (pos, bit)


def test_strict_names_the_file(tmp_path: Path) -> None:
    path, offsets, data = three_records(tmp_path)
    bad = bytearray(data)
    bad[offsets[2] - 1] ^= 1
    path.write_bytes(bad)
    with pytest.raises(TraceFormatError) as e:
        list(spool.read_rank(tmp_path, strict=True))
    assert str(path) in str(e.value) and f"at byte {offsets[1]}" in str(e.value)
    assert "checksum mismatch" in str(e.value)
    assert isinstance(e.value, ValueError)


def _segment(header: dict[str, Any], magic: bytes = schema.SEGMENT_MAGIC) -> bytes:
    h = json.dumps(header).encode()
    return magic + struct.pack("<I", len(h)) + h


def test_wrong_segment_magic(tmp_path: Path) -> None:
    path = tmp_path / "seg-000000.fsrs"
    path.write_bytes(_segment({"format_version": 1}, magic=b"PK\x03\x04....") + b"rest")
    with pytest.raises(TraceFormatError, match="not an fsdp-replay spool segment") as e:
        list(spool.read_segment(path))
    assert str(path) in str(e.value)


def test_wrong_format_version(tmp_path: Path) -> None:
    path = tmp_path / "seg-000000.fsrs"
    path.write_bytes(_segment({"format_version": 99, "rank": 0, "segment": 0}))
    with pytest.raises(TraceVersionError, match="version 99") as e:
        list(spool.read_rank(tmp_path))
    assert str(path) in str(e.value) and f"reads {sorted(schema.READABLE_VERSIONS)}" in str(e.value)


def test_unreadable_segment_header(tmp_path: Path) -> None:
    path = tmp_path / "seg-000000.fsrs"
    path.write_bytes(schema.SEGMENT_MAGIC + struct.pack("<I", 5) + b"{nope")
    with pytest.raises(TraceFormatError, match="unreadable segment header") as e:
        list(spool.read_segment(path))
    assert str(path) in str(e.value)


def test_empty_last_segment_is_damage_not_fatal(tmp_path: Path) -> None:
    written = write_mixed(tmp_path)
    (tmp_path / "seg-000001.fsrs").write_bytes(b"")
    report = spool.SegmentReport()
    assert as_tuples(spool.read_rank(tmp_path, report)) == written
    assert len(report.damage) == 1 and report.damage[0].path.endswith("seg-000001.fsrs")


# -- a full disk ------------------------------------------------------------------------------
@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs (root only), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs to fill needs root")
    mount = shutil.which("mount")
    if mount is None:
        pytest.skip("no mount(8) on this machine")
    where = tmp_path / "tiny"
    where.mkdir()
    proc = subprocess.run(
        [mount, "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False, capture_output=True)


def test_full_disk_leaves_no_partial_record(tiny_fs: Path) -> None:
    folder = tiny_fs / "rank-00000"
    w = spool.SpoolWriter(folder, 0)
    written = []
    with pytest.raises(OSError) as e:  # fill until the disk refuses
        for i in range(1000):
            raw = bytes([i % 251]) * 10_000
            w.append(schema.KIND_BLOB, {"blob": i, "nbytes": len(raw)}, raw)
            written.append((schema.KIND_BLOB, {"blob": i, "nbytes": len(raw)}, raw))
    assert e.value.errno == errno.ENOSPC
    assert written, "the tmpfs did not take a single record"
    # the failed record was cut back: the file ends at the last whole record
    assert w.segment_path.stat().st_size == w._offset
    report = spool.SegmentReport()
    assert as_tuples(spool.read_rank(folder, report)) == written and report.damage == []
    # metadata still fits after a payload was refused, and lands right after the last record
    w.append(schema.KIND_EVENT, {"type": "drop", "what": "blob"})
    w.close()
    report = spool.SegmentReport()
    got = as_tuples(spool.read_rank(folder, report))
    assert got == [*written, (schema.KIND_EVENT, {"type": "drop", "what": "blob"}, b"")]
    assert report.damage == []


class _FullDiskOs:
    """``os`` for the spool module, whose ``write`` fails with ENOSPC while ``full`` is set."""

    def __init__(self) -> None:
        self.full = False

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def write(self, fd: int, data: bytes) -> int:
        if self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return os.write(fd, data)


def test_failed_roll_never_writes_into_another_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FullDiskOs()
    monkeypatch.setattr(spool, "os", fake)
    w = spool.SpoolWriter(tmp_path / "rank-00000", 0, max_segment_bytes=1000)
    w.append(schema.KIND_BLOB, {"blob": 0, "nbytes": 700}, b"a" * 700)
    fake.full = True
    with pytest.raises(OSError):
        w.append(schema.KIND_BLOB, {"blob": 1, "nbytes": 400}, b"b" * 400)  # rolls; header fails
    fake.full = False
    other = tmp_path / "someone-elses-file"
    fd = os.open(other, os.O_WRONLY | os.O_CREAT, 0o644)  # likely reuses the closed number
    try:
        with contextlib.suppress(OSError):  # refusing is fine; writing elsewhere is not
            w.append(schema.KIND_EVENT, {"type": "x"})
        w.close()
    finally:
        with contextlib.suppress(OSError):  # the writer may have closed it already
            os.close(fd)
    assert other.stat().st_size == 0
    report = spool.SegmentReport()
    list(spool.read_rank(tmp_path / "rank-00000", report))
    assert report.damage == []


def test_append_many_is_one_batch_of_records(tmp_path: Path) -> None:
    w = spool.SpoolWriter(tmp_path / "rank-00000", 0)
    events = [{"type": "x", "i": i, "pad": "y" * i} for i in range(700)]  # more pieces than one writev
    w.append(schema.KIND_EVENT, {"type": "first"})
    w.append_many([(schema.KIND_EVENT, json.dumps(e).encode()) for e in events])
    w.append(schema.KIND_EVENT, {"type": "last"})
    assert w.records_written == 702
    w.close()
    report = spool.SegmentReport()
    got = [r.obj for r in spool.read_rank(tmp_path / "rank-00000", report)]
    assert got == [{"type": "first"}, *events, {"type": "last"}] and report.damage == []


def test_append_many_on_a_full_disk_writes_none_of_the_batch(tiny_fs: Path) -> None:
    folder = tiny_fs / "rank-00000"
    w = spool.SpoolWriter(folder, 0)
    w.append(schema.KIND_EVENT, {"type": "kept"})
    batch = [
        (schema.KIND_EVENT, json.dumps({"type": "x", "pad": "z" * 1000, "i": i}).encode()) for i in range(100)
    ]
    with pytest.raises(OSError):
        w.append_many(batch)
    assert w.segment_path.stat().st_size == w._offset
    w.close()
    report = spool.SegmentReport()
    assert [r.obj for r in spool.read_rank(folder, report)] == [{"type": "kept"}] and report.damage == []


def test_large_blobs_carry_a_crc32c_small_records_zlibs_and_both_are_checked(tmp_path: Path) -> None:
    # the writer's CRC for a large payload is CRC-32C where google_crc32c runs in hardware (flag
    # bit 0): a reader checks each record by its own flag, and a flipped byte fails either way
    if spool._CRC32C is None:
        pytest.skip("google_crc32c's C implementation is not installed here")
    w = spool.SpoolWriter(tmp_path / "rank-00000", 0)
    big, small = bytes(range(256)) * 1024, b"x" * 100
    w.append(schema.KIND_BLOB, {"blob": 0, "nbytes": len(big)}, big)
    w.append(schema.KIND_BLOB, {"blob": 1, "nbytes": len(small)}, small)
    w.close()
    seg = next((tmp_path / "rank-00000").glob("seg-*"))
    data = seg.read_bytes()
    flags = [data[i + 3] for i in range(len(data) - 1) if data[i : i + 2] == b"\xd4\xf5"][:2]
    assert flags == [spool.FLAG_CRC32C, 0], flags
    records = list(spool.read_rank(tmp_path / "rank-00000"))
    assert [bytes(r.raw) for r in records] == [big, small]
    at = data.index(big[:64]) + 1000  # one byte of the large payload flipped on the disk
    seg.write_bytes(data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :])
    report = spool.SegmentReport()
    records = list(spool.read_rank(tmp_path / "rank-00000", report))
    assert [bytes(r.raw) for r in records] == [small] and report.damage, report.damage
    assert "checksum mismatch" in str(report.damage[0])
