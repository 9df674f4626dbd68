"""The agent's background writer: events are batched, yet written in order with the blobs they
refer to, soon after they happen, and completely by a flush marker.

No training run: the writer is driven by hand with a real spool.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp_replay.agent.writer import POLL_S, BackgroundWriter, BlobRef
from fsdp_replay.trace import schema, spool


def _writer(tmp_path: Path) -> tuple[BackgroundWriter, list[tuple[str, BaseException]]]:
    errors: list[tuple[str, BaseException]] = []
    w = BackgroundWriter(
        spool.SpoolWriter(tmp_path / "rank-00000", 0), lambda where, e: errors.append((where, e))
    )
    return w, errors


def _records(tmp_path: Path) -> list[spool.Record]:
    report = spool.SegmentReport()
    out = list(spool.read_rank(tmp_path / "rank-00000", report))
    assert report.damage == []
    return out


def test_events_and_blobs_keep_their_order_and_references(tmp_path: Path) -> None:
    w, errors = _writer(tmp_path)
    expected: list[Any] = []
    for i in range(50):
        ref = BlobRef()
        data = torch.full((16,), float(i))
        w.blob(ref, data, 1000 + i, 64, "zlib64")
        w.event({"type": "x", "i": i, "blob": ref})
        expected.append(i)
        if i % 7 == 0:
            w.call(lambda i=i: [("ev", {"type": "call", "i": i})])
    assert w.flush(10)
    w.close()
    assert errors == []
    records = _records(tmp_path)
    blob_ids = {r.obj["blob"] for r in records if r.kind == schema.KIND_BLOB}
    events = [r.obj for r in records if r.kind == schema.KIND_EVENT]
    xs = [e for e in events if e["type"] == "x"]
    assert [e["i"] for e in xs] == expected
    assert all(e["blob"] in blob_ids for e in xs), "an event was encoded before its blob was written"
    # each call's event comes after the x event enqueued before it
    order = [(e["type"], e["i"]) for e in events]
    for i in range(0, 50, 7):
        assert order.index(("call", i)) > order.index(("x", i))
    assert w.pending_bytes == 0


def test_a_flush_marker_covers_pending_events(tmp_path: Path) -> None:
    w, errors = _writer(tmp_path)
    for i in range(200):
        w.event({"type": "x", "i": i})
    assert w.flush(10)
    assert [r.obj["i"] for r in _records(tmp_path)] == list(range(200))
    w.close()
    assert errors == []


def test_events_reach_the_spool_without_a_flush(tmp_path: Path) -> None:
    """A program killed mid-step keeps what happened more than a poll interval before."""
    w, _ = _writer(tmp_path)
    w.event({"type": "x", "i": 0})
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not _records(tmp_path):
        time.sleep(POLL_S)
    assert [r.obj for r in _records(tmp_path)] == [{"type": "x", "i": 0}]
    w.close()


def test_writer_cpu_time_is_measured(tmp_path: Path) -> None:
    w, _ = _writer(tmp_path)
    for i in range(2000):
        w.event({"type": "x", "i": i, "pad": list(range(50))})
    assert w.flush(10)
    assert w.cpu_ns() > 0
    w.close()


def test_a_kick_hands_over_pending_events_from_its_threshold_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The recorder kicks the writer as the training thread blocks in a wait: below the threshold
    the events stay pending (no wake-up), from it on they are handed over, and written in order
    before anything queued later."""
    from fsdp_replay.agent import writer

    monkeypatch.setattr(writer, "POLL_S", 60.0)  # no poll takes the events meanwhile
    w, errors = _writer(tmp_path)
    for i in range(3):
        w.event({"type": "x", "i": i})
    w.kick(min_pending=4)
    assert len(w._events) == 3  # not handed over: fewer than the threshold
    w.event({"type": "x", "i": 3})
    w.kick(min_pending=4)
    assert w._events == []  # handed over as one batch
    w.event({"type": "x", "i": 4})
    assert w.flush(10)
    assert [r.obj["i"] for r in _records(tmp_path)] == list(range(5))
    w.close()
    assert errors == []
