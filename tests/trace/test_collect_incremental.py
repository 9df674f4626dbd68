"""Incremental collection: each collection appends what the spools gained, and costs only that.

The spools come from ``spool_gen.Trainer`` (the agent's records, no torch), with the cases that
make a collection touch rows an earlier one wrote: collectives and CUPTI rows that arrive late,
payloads the flight recorder held (some written by a dump), a restarted process attempt. The
oracle is one collection of the finished spools (itself checked against hand-written spools in
``test_collect.py``): whatever the spools looked like at each collection, and whether the
collector was kept, restarted, or killed at any of its writes, the trace ends the same.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from spool_gen import Trainer, write_run
from zarr.storage import LocalStore, WrapperStore

from fsdp_replay.errors import TraceFormatError
from fsdp_replay.trace import schema, spool
from fsdp_replay.trace.collect import Collector, collect
from fsdp_replay.trace.reader import Trace


def dump(url: Any) -> dict[str, Any]:
    """Every column and attribute of every rank (the collector's own state left out)."""
    root = (
        zarr.open_group(store=url, mode="r")
        if not isinstance(url, Path)
        else zarr.open_group(str(url), mode="r")
    )
    out: dict[str, Any] = {"root": dict(root.attrs)}
    for name, g in root.groups():
        if name.startswith("rank_"):
            attrs = dict(g.attrs)
            attrs.pop(schema.COLLECTOR_ATTR, None)
            out[name] = {"attrs": json.dumps(attrs, sort_keys=True)}  # NaN as "NaN": equal to itself
            for table, cols in schema.TABLES.items():
                for col in cols:
                    out[name][f"{table}/{col}"] = np.asarray(g[table][col][:]).tolist()  # type: ignore[index]
    return out


def grow(src: Path, dst: Path, fraction: float) -> None:
    """``dst`` holds the first ``fraction`` of ``src``'s spools as a writer leaves them: each rank's
    segments in order, the one being written cut anywhere (mid-record too), later ones absent."""
    for folder in sorted(src.glob("rank-*")):
        segs = spool.segments(folder)
        total = sum(p.stat().st_size for p in segs)
        left = int(total * fraction)
        for seg in segs:
            if left <= 0:
                break
            data = seg.read_bytes()
            out = dst / folder.name / seg.name
            out.parent.mkdir(parents=True, exist_ok=True)
            if not out.exists() or out.stat().st_size != min(len(data), left):
                out.write_bytes(data[:left])
            left -= len(data)


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The finished spools, and their trace collected in one go."""
    tmp = tmp_path_factory.mktemp("inc")
    write_run(tmp / "spool", steps=12)
    collect(tmp / "spool", tmp / "once.zarr")
    return tmp / "spool", dump(tmp / "once.zarr")


@pytest.mark.parametrize("restart", [False, True], ids=["kept", "restarted"])
def test_a_growing_spool_collected_in_pieces_gives_the_trace_of_one_collection(
    finished: tuple[Path, dict[str, Any]], tmp_path: Path, restart: bool
) -> None:
    src, once = finished
    grown, trace = tmp_path / "spool", tmp_path / "trace.zarr"
    pieces = 9
    collector = Collector(grown, trace, chunk_rows=32)
    rewrites = resolved = 0
    for k in range(1, pieces + 1):
        grow(src, grown, k / pieces)
        if restart:  # a new process each time: everything it needs comes from the store
            collector.close()
            collector = Collector(grown, trace, chunk_rows=32)
        report = collector.collect(final=k == pieces)
        assert not report.damaged and all(not r.rebuilt for r in report.ranks), report
        rewrites += sum(s.store.stats.rewrites for s in collector._ranks.values())
        if k in (2, 5):  # mid-run: a reader gets a whole trace, never a damaged one
            t = Trace.open(trace)
            for rank in t.ranks:
                t.rank(rank).read_all()
    collector.close()
    got = dump(trace)
    assert got == once
    assert rewrites > 0  # late collectives and kernel rows did sort before rows already written
    r0 = Trace.open(trace).rank(0)
    payload = r0.tensors["payload"]
    resolved = int((payload >= 0).sum())
    assert r0.attrs["flight_unwritten"] > 0 and resolved > 0 and (payload >= -1).all()


def test_a_collection_costs_what_the_spool_gained_not_its_history(tmp_path: Path) -> None:
    """16 rounds of 3 steps each: every collection writes the new rows and the new blobs (plus the
    rows after a late kernel record, read back and written again: a few), and changes about the
    same bytes in the store (the last, partial chunk of each column it appends to, the new chunks
    and blobs, the attributes) whether the history is 3 steps long or 45."""
    root, trace = tmp_path / "spool", tmp_path / "trace.zarr"
    trainers = [Trainer(root, 0, seed=7)]
    collector = Collector(root, trace, chunk_rows=64)
    rows, blobs, changed, read = [], [], [], []
    before: dict[str, tuple[int, int]] = {}
    for _ in range(16):
        blob_ids = [t.blob_id for t in trainers]
        for t in trainers:
            for _ in range(3):
                t.step()
        report = collector.collect(final=False)
        after = {str(p): (p.stat().st_mtime_ns, p.stat().st_size) for p in trace.rglob("*") if p.is_file()}
        changed.append(sum(size for p, (mt, size) in after.items() if before.get(p) != (mt, size)))
        before = after
        rows.append(sum(r.rows_written for r in report.ranks))
        blobs.append(sum(r.blobs_written + r.blobs_shared for r in report.ranks))
        assert blobs[-1] <= sum(t.blob_id - b for t, b in zip(trainers, blob_ids, strict=True))
        read.append(sum(s.store.stats.rows_read for s in collector._ranks.values()) - sum(read))
    for t in trainers:
        t.end()
    collector.collect(final=True)
    collector.close()
    n = sum(len(v) for k, v in dump(trace)["rank_00000"].items() if k != "attrs")
    # the same steps every round: the same rows, bar the late rows' rewrites, and no growth
    assert max(rows[1:]) <= 1.25 * min(rows[1:]), rows
    assert sum(rows) < 1.2 * n
    assert max(blobs) <= 2 * min(blobs[1:]), blobs
    # a late kernel row: the rows around its place are read back (bounded: not the history)
    assert max(read[-5:]) <= max(read[1:6]) <= 150, read
    assert np.mean(changed[-5:]) < 1.5 * np.mean(changed[1:6]), changed


class Crash(Exception):
    pass


class CrashingStore(WrapperStore[LocalStore]):
    """The store of a collector that dies after ``budget`` writes (nothing after them lands)."""

    budget = -1

    async def set(self, key: str, value: Any) -> None:
        if CrashingStore.budget == 0:
            raise Crash(key)
        CrashingStore.budget -= 1
        await self._store.set(key, value)


def test_a_collector_killed_at_any_write_resumes_and_readers_never_see_a_wrong_trace(
    finished: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    src, once = finished
    grown = tmp_path / "spool"
    grow(src, grown, 0.4)
    first = tmp_path / "first.zarr"
    c = Collector(grown, first, chunk_rows=32)
    c.collect(final=False)
    c.close()
    old = dump(first)
    grow(src, grown, 1.0)
    # how many writes the second collection makes, then a crash after each of a spread of them
    probe = tmp_path / "probe.zarr"
    shutil.copytree(first, probe)
    CrashingStore.budget = 10**9
    c = Collector(grown, CrashingStore(LocalStore(str(probe))), chunk_rows=32)
    c.collect(final=True)
    c.close()
    writes = 10**9 - CrashingStore.budget
    new = dump(probe)
    assert writes > 20 and new == once
    seen = {"old": 0, "new": 0, "unfinished": 0}
    for budget in sorted({*range(0, writes, max(1, writes // 12)), writes - 2, writes - 1}):
        trace = tmp_path / f"crash-{budget}.zarr"
        shutil.copytree(first, trace)
        CrashingStore.budget = budget
        c = Collector(grown, CrashingStore(LocalStore(str(trace))), chunk_rows=32)
        with pytest.raises(Crash):
            c.collect(final=True)
        c.close()
        try:  # what a reader gets now: the old trace, the new one, or "unfinished"
            t = Trace.open(trace)
            for rank in t.ranks:
                t.rank(rank).read_all()
            state = dump(trace)
            for name in ("rank_00000", "rank_00001"):
                assert state[name] in (old[name], new[name]), (budget, name)
            seen["old" if state == old else "new"] += 1
        except TraceFormatError as e:
            assert "unfinished" in str(e), (budget, e)
            seen["unfinished"] += 1
        CrashingStore.budget = 10**9
        report = collect(grown, trace, chunk_rows=32)  # a new process resumes (or rebuilds)
        assert dump(trace) == once, budget
        assert not any(r.rebuilt for r in report.ranks), [r.rebuilt for r in report.ranks]
    assert seen["unfinished"] and seen["old"], seen


def test_a_reader_that_opened_a_rank_before_a_collection_is_told_it_changed(
    finished: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    src, _ = finished
    grown, trace = tmp_path / "spool", tmp_path / "trace.zarr"
    grow(src, grown, 0.5)
    collector = Collector(grown, trace)
    collector.collect(final=False)
    rank = Trace.open(trace).rank(0)
    assert len(rank.steps) > 0  # its attributes and array list are read now
    grow(src, grown, 1.0)
    collector.collect(final=True)
    collector.close()
    with pytest.raises(TraceFormatError, match="changed while it was read"):
        rank.collectives["seq"]
    assert len(Trace.open(trace).rank(0).collectives["seq"]) > 0  # read again: the new trace


def test_a_blob_damaged_after_its_collection_is_written_again_by_the_next_one(
    finished: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """A collection resumes from where the last one read the spool, so it would never meet an
    old blob again: a new collector checks the blobs each rank names before it takes the rank
    over; one lost or unfinished since makes it collect that rank anew from its spool."""
    src, once = finished
    run = tmp_path / "spool"
    shutil.copytree(src, run)
    trace = tmp_path / "trace.zarr"
    collect(run, trace)
    blobs = sorted(p for p in (trace / "blobs").glob("*/*") if p.is_dir())
    assert len(blobs) >= 3
    for chunk in (blobs[0] / "c").glob("*"):
        chunk.unlink()  # its bytes lost
    meta_path = blobs[1] / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["attributes"].pop(schema.BLOB_COMPLETE_ATTR)  # its completion mark lost
    meta_path.write_text(json.dumps(meta))
    report = collect(run, trace)
    assert any("payload blob" in r.rebuilt for r in report.ranks), [r.rebuilt for r in report.ranks]
    t = Trace.open(trace)
    for rank in t.ranks:
        rt = t.rank(rank)
        for row in range(len(rt.payloads["nbytes"])):
            rt.payload(row)  # every blob whole again (its digest is checked on read)
    assert dump(trace) == once
    assert collect(run, trace).ranks[0].rebuilt == ""  # whole: the next one resumes
