"""The payload flight recorder (``--payloads window:N``): its ring in memory (``agent/flight.py``), and
a dump through the real writer, spool and collector (``agent/record_flight.py``,
``trace/rank_builder.py``). No training run: the steps are driven by hand, as the recorder does
(a snapshot every ``every`` steps, payloads during a step, ``advance`` at its end)."""

from __future__ import annotations

import hashlib
import logging
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import CLI, child_env, run

from fsdp_replay.agent.config import RecordConfig
from fsdp_replay.agent.counters import AgentState
from fsdp_replay.agent.flight import (
    FlightRecorder,
    NoMemory,
    auto_window_bytes,
    cgroup_available,
    local_ranks,
    mem_available,
    window_bound,
)
from fsdp_replay.agent.payload_ring import Landing, RingSpace
from fsdp_replay.agent.record_flight import FlightDumps
from fsdp_replay.agent.writer import BackgroundWriter
from fsdp_replay.analysis.findings import _rank_findings, flight_findings
from fsdp_replay.cli.render import print_collect
from fsdp_replay.errors import ConfigError
from fsdp_replay.trace import schema, spool
from fsdp_replay.trace.collect import collect
from fsdp_replay.trace.rank_builder import CollectReport, RankReport
from fsdp_replay.trace.reader import Trace


def _fp(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _copy_of(data: bytes) -> Callable[[], tuple[Any, Any]]:
    return lambda: (data, None)


class Steps:
    """Drives a ring as the recorder does; counts the copies it was asked to make."""

    def __init__(self, window: int, every: int, max_bytes: int = 1 << 20) -> None:
        self.ring = FlightRecorder(window, max_bytes)
        self.every = every
        self.copies = 0
        self.ids: dict[bytes, int] = {}
        self.ring.hold_snapshot(0, {"step": 0}, [], 100)

    def hold(self, step: int, data: bytes) -> int:
        def copy() -> tuple[Any, Any]:
            self.copies += 1
            return data, None

        blob = self.ring.hold(step, _fp(data), len(data), "zlib64", copy)
        self.ids[data] = blob
        return blob

    def end(self, step: int) -> None:
        nxt = step + 1
        if nxt % self.every == 0:
            self.ring.hold_snapshot(nxt, {"step": nxt}, [], 100)
        self.ring.advance(nxt)


def test_the_window_reaches_n_steps_back_to_a_snapshot_and_lets_older_steps_go() -> None:
    s = Steps(window=2, every=2)
    for step in range(8):
        s.hold(step, f"payload of step {step}".encode())
        s.end(step)
    # step 8 begins: a window for it starts at the newest snapshot at or before 6; 0..5 are gone
    assert s.ring.held_bytes == len(b"payload of step 6") * 2
    s.hold(8, b"payload of step 8 so far")
    # the failure is in step 8: steps 6..8 at least, from the newest snapshot at or before 6
    dump = s.ring.take("exception", "RuntimeError: boom")
    assert (dump.first_step, dump.last_step, dump.snapshot_step) == (6, 8, 6)
    assert dump.snapshot is not None and dump.snapshot.state == {"step": 6}
    assert sorted(b.data for b in dump.blobs) == sorted(
        [b"payload of step 6", b"payload of step 7", b"payload of step 8 so far"]
    )
    assert all(b.id >= schema.FLIGHT_BLOB_BASE for b in dump.blobs)
    assert s.ring.held_bytes == 0 and s.ring.counters()["flight_dumps"] == 1


def test_identical_bytes_are_held_once_and_kept_while_a_newer_step_names_them() -> None:
    s = Steps(window=1, every=1)
    same = b"the same parameters, gathered in forward and backward"
    first = s.hold(0, same)
    assert s.hold(0, same) == first and s.copies == 1
    s.end(0)
    s.hold(1, b"other")
    assert s.hold(1, same) == first and s.copies == 2  # named by step 1 as well
    s.end(1)
    s.end(2)  # the window for step 3 starts at 2: step 0's and step 1's entries go...
    assert s.ring.held_bytes == 0
    s2 = Steps(window=2, every=1)
    kept = s2.hold(0, same)
    s2.end(0)
    s2.hold(1, same)
    s2.end(1)
    s2.end(2)  # ...but here the window for step 3 starts at 1, which still names the step-0 blob
    assert s2.ring.held_bytes == len(same)
    dump = s2.ring.take("sigterm", "")
    assert [b.id for b in dump.blobs] == [kept]
    # written now: the same bytes later are named by that id, with no copy and no second write
    copies = s2.copies
    s2.end(3)
    assert s2.hold(4, same) == kept and s2.copies == copies
    assert s2.ring.take("stuck", "").blobs == []
    # a device fingerprint is not known on the host: no content address, a blob each
    ring = FlightRecorder(1, 1 << 20)
    pending = object()
    a = ring.hold(0, pending, 4, "lin64", lambda: (b"abcd", None))
    assert ring.hold(0, pending, 4, "lin64", lambda: (b"abcd", None)) != a


def test_the_memory_bound_first_shortens_the_window_then_restarts_it_never_leaving_a_hole() -> None:
    s = Steps(window=4, every=2, max_bytes=100)
    for step in range(3):
        s.hold(step, bytes([step]) * 30)
        s.end(step)  # snapshots 0 and 2 held; steps 0..2 held (90 bytes)
    # step 3: 30 more bytes do not fit: the window starts at snapshot 2 instead of 0
    assert s.hold(3, b"\x03" * 30) != schema.NO_BLOB
    c = s.ring.counters()
    assert c["flight_window_shrinks"] == 1 and c["flight_held_bytes"] == 60
    assert s.ring.hold(3, _fp(b"\x04" * 30), 30, "zlib64", lambda: (b"\x04" * 30, None)) != schema.NO_BLOB
    # now only steps 2..3 are held (90 bytes) and no later snapshot can make room: step 3 cannot
    # be held whole, so no window through it can be replayed: everything up to it is let go
    assert s.hold(3, b"\x05" * 30) == schema.NO_BLOB
    c = s.ring.counters()
    assert (c["flight_blobs_dropped"], c["flight_bytes_dropped"], c["flight_window_holes"]) == (1, 30, 1)
    assert c["flight_held_bytes"] == 0 and c["flight_snapshot_bytes"] == 0
    assert s.hold(3, b"\x06" * 5) == schema.NO_BLOB  # the rest of step 3 is not kept either
    assert s.ring.take_drops() == (2, 35, 0) and s.ring.take_drops() == (0, 0, 0)
    dump = s.ring.take("nonfinite", "a non-finite loss at the end of step 3", at_step=3)
    # a failure now finds no complete window: an empty step range, nothing written, the hole named
    assert dump.first_step > dump.last_step and dump.blobs == [] and dump.snapshot is None
    assert (dump.hole_step, dump.dropped) == (3, 2)
    s.end(3)  # snapshot 4: the window starts afresh there
    s.hold(4, b"\x07" * 30)
    s.end(4)
    s.hold(5, b"\x08" * 30)
    dump = s.ring.take("exception", "RuntimeError: later")
    assert (dump.first_step, dump.last_step, dump.snapshot_step, dump.hole_step) == (4, 5, 4, -1)
    assert sorted(b.data for b in dump.blobs) == [b"\x07" * 30, b"\x08" * 30]


def test_a_later_dump_continues_an_earlier_one_and_a_late_rng_state_is_written_with_it() -> None:
    s = Steps(window=2, every=2)
    for step in range(5):
        s.hold(step, f"step {step}".encode())
        if step < 4:
            s.end(step)
    first = s.ring.take("nonfinite", "", at_step=4)  # at step 4's end, before it advances
    assert (first.first_step, first.last_step, first.snapshot is not None) == (2, 4, True)
    s.end(4)
    s.hold(5, b"step 5")
    s.end(5)  # snapshot 6; the window for step 6 would start at 4, inside the steps written
    rng_id, fill = s.ring.hold_later(6)  # an RNG state the writer has not encoded yet
    second = s.ring.take("exception", "")
    assert (second.first_step, second.last_step, second.snapshot_step, second.snapshot) == (2, 6, 2, None)
    late = [b for b in second.blobs if b.id == rng_id]
    assert late and late[0].data is None
    fill(b"rng json")  # the writer encodes it before it writes the dump
    assert late[0].data == b"rng json"
    assert sorted(b.data for b in second.blobs if b.id != rng_id) == [b"step 5"]
    # a failure long after, whose window starts past the written steps: a new window and snapshot
    for step in range(6, 12):
        s.hold(step, f"step {step}".encode())
        s.end(step)
    third = s.ring.take("sigterm", "")
    assert (third.first_step, third.snapshot_step) == (10, 10) and third.snapshot is not None


# -- through the writer, the spool and the collector ----------------------------------------------
def _rank_start() -> dict[str, Any]:
    keys = schema.EVENT_KEYS[schema.EV_RANK_START] - {"type", "format_version", "rank", "world_size"}
    return {
        "type": schema.EV_RANK_START,
        "format_version": schema.FORMAT_VERSION,
        "rank": 0,
        "world_size": 1,
        **{k: {} for k in keys},
        "argv": ["train.py"],
        "orig_argv": ["python", "train.py"],
        "local_rank": 0,
        "pid": 1,
        "executable": "/usr/bin/python3",
        "cwd": "/",
        "policy": {"payloads": "window:1"},
    }


def _batch(step: int, blob: int, data: bytes) -> dict[str, Any]:
    entry = ["", "uint8", [len(data)], _fp(data), "zlib64", False, blob, "cpu"]
    return {
        "type": schema.EV_BATCH,
        "step": step,
        "micro": 0,
        "index": step,
        "loader": 0,
        "structure": {"T": 0},
        "tensors": [entry],
    }


def _step(step: int, loss: float) -> dict[str, Any]:
    ev = {"type": schema.EV_STEP, "step": step, "micro_steps": 1, "colls": 0, "params": [], "loss": [loss]}
    return {**ev, "t_ns": step}


def test_a_dump_is_written_under_the_ids_its_events_named_and_the_rest_reads_as_not_kept(
    tmp_path: Path,
) -> None:
    st = AgentState(payload_now=True)
    w = BackgroundWriter(spool.SpoolWriter(tmp_path / "spool" / "rank-00000", 0), lambda *_: None)
    st.writer = w
    ring = FlightRecorder(1, 1 << 20)
    dumps = FlightDumps(ring, st)
    w.event(_rank_start())
    data = {k: f"batch of step {k}".encode() for k in range(4)}
    ring.hold_snapshot(0, {"step": 0}, [], 8)
    for k in range(4):  # steps 0..2 finite, step 3's loss is not
        blob = ring.hold(k, _fp(data[k]), len(data[k]), "zlib64", _copy_of(data[k]))
        w.event(_batch(k, blob, data[k]))
        loss = [math.nan if k == 3 else 1.0]
        w.event(_step(k, loss[0]))
        dumps.step_end(w, k, loss, [])
        if k + 1 == 2:
            ring.hold_snapshot(2, {"step": 2}, [], 8)
        ring.advance(k + 1)
    w.event(_batch(4, ring.hold(4, _fp(b"late"), 4, "zlib64", _copy_of(b"late")), b"late"))
    dumps.at_exit(w, "exit", torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    w.event({"type": schema.EV_END, "reason": "exit", "steps": 4, "colls": 0, "t_ns": 9, "counters": {}})
    assert w.flush(10)
    w.close()
    report = collect(tmp_path / "spool", tmp_path / "trace.zarr")
    assert not report.damaged
    rt = Trace.open(tmp_path / "trace.zarr").rank(0)
    got = [d["reason"] for d in rt.attrs["flight_dumps"]]
    assert got == ["nonfinite", "oom"]
    nonfinite, oom = rt.attrs["flight_dumps"]
    assert (nonfinite["first_step"], nonfinite["last_step"], nonfinite["snapshot_step"]) == (2, 3, 2)
    assert nonfinite["detail"] == "a non-finite loss at the end of step 3" and nonfinite["blobs"] == 2
    assert (oom["first_step"], oom["last_step"], oom["blobs"]) == (2, 4, 1)
    assert "OutOfMemoryError: CUDA out of memory" in oom["detail"]
    assert [s["step"] for s in rt.attrs["snapshots"]] == [2]
    bt, batches = rt.batch_tensors, rt.batches
    payload = dict(zip(batches["step"][bt["batch"]].tolist(), bt["payload"].tolist(), strict=True))
    assert payload[0] == payload[1] == -1  # held, and let go before the failure: not kept
    for step, raw in ((2, data[2]), (3, data[3]), (4, b"late")):
        assert rt.payload(payload[step]) == raw
    assert rt.attrs["flight_unwritten"] == 2 and rt.attrs["payload_missing"] == 0


# -- device payloads landed through the payload ring in memory of their own -----------------------
class Copy:
    """A side-stream copy into pinned memory: its event, done when the test says."""

    def __init__(self) -> None:
        self.done = False
        self.waited = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:  # the writer waits for it before it writes the bytes
        self.waited += 1
        self.done = True


class Slots:
    """A GPU's payload ring (``payload_ring.py``) without the GPU: a real ``RingSpace`` and
    ``Landing``, each payload copied into a slot and from it into a tensor of its own, the slot
    freed once that copy is done. What a device adds (the copies on two streams and their events)
    is tested on the GPU (tests/system/test_gpu.py)."""

    def __init__(self, capacity: int) -> None:
        self.space = RingSpace(capacity)
        self.landing = Landing(self.space)
        self.dev = torch.zeros(self.space.capacity, dtype=torch.uint8)
        self.copies: list[Copy] = []

    def stage(self, data: bytes) -> Callable[[], tuple[Any, Any] | None]:
        def copy() -> tuple[Any, Any] | None:
            self.landing.reap()
            off = self.space.take(len(data))
            if off is None:
                return None
            slot = self.dev[off : off + len(data)]
            slot.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            own = slot.clone()
            done = Copy()
            self.copies.append(done)
            self.landing.add(done, off)
            return own, done

        return copy


def test_a_landed_payload_is_its_own_memory_and_its_slot_is_freed_when_the_copy_is_done() -> None:
    slots, ring = Slots(4096), FlightRecorder(2, 1 << 20)
    ring.hold_snapshot(0, {"step": 0}, [], 8)
    a, held_a = ring.hold_new(0, object(), 1000, "lin64", slots.stage(b"a" * 1000), cost=1024)
    b, held_b = ring.hold_new(0, object(), 1000, "lin64", slots.stage(b"b" * 1000), cost=1024)
    assert held_a is not None and held_b is not None and slots.space.live() == 2
    assert ring.counters()["flight_held_bytes"] == 2048  # charged at the pinned blocks' size
    slots.copies[0].done = True
    assert slots.landing.reap() == 1 and slots.space.live() == 1
    slots.dev.fill_(0)  # the slots' bytes are reused: the held copies are their own
    dump = ring.take("exception", "")
    held = {h.id: h for h in dump.blobs}
    assert bytes(held[a].data.numpy()) == b"a" * 1000 and bytes(held[b].data.numpy()) == b"b" * 1000
    assert held[b].ready is slots.copies[1]  # the writer waits for it before writing
    assert ring.counters()["flight_held_bytes"] == 0


def test_a_payload_whose_pinned_block_exceeds_the_bound_is_dropped_though_its_bytes_fit() -> None:
    slots, ring = Slots(1 << 16), FlightRecorder(2, 3000)
    ring.hold_snapshot(0, {"step": 0}, [], 8)
    assert ring.hold(0, object(), 1500, "lin64", slots.stage(b"a" * 1500), cost=2048) != schema.NO_BLOB
    assert ring.hold(0, object(), 1000, "lin64", slots.stage(b"b" * 1000), cost=1024) == schema.NO_BLOB
    assert ring.take_drops() == (1, 1000, 0) and slots.space.live() == 1


def test_evicted_payloads_give_back_their_charge_and_their_slots_still_free() -> None:
    slots, ring = Slots(4096), FlightRecorder(1, 1 << 20)
    ring.hold_snapshot(0, {"step": 0}, [], 8)
    assert ring.hold(0, object(), 500, "lin64", slots.stage(b"x" * 500), cost=512) != schema.NO_BLOB
    for step in (1, 2, 3):
        ring.hold_snapshot(step, {"step": step}, [], 8)
        ring.advance(step)  # the window (1 step back to a snapshot) lets step 0 go
    assert ring.counters()["flight_held_bytes"] == 0 and slots.space.live() == 1
    slots.copies[0].done = True
    assert slots.landing.reap() == 1 and slots.space.live() == 0


def test_a_payload_the_full_ring_could_not_take_restarts_the_window_and_says_so() -> None:
    # (--when-full drop, or a ring that stayed full for payload_ring.WAIT_LIMIT_S: the stage
    # found no room) the step cannot be held whole: the window restarts at the next snapshot
    slots, ring = Slots(1024), FlightRecorder(2, 1 << 20)
    ring.hold_snapshot(0, {"step": 0}, [], 8)
    assert ring.hold(0, object(), 1000, "lin64", slots.stage(b"a" * 1000)) != schema.NO_BLOB
    assert ring.hold(0, object(), 1000, "lin64", slots.stage(b"b" * 1000)) == schema.NO_BLOB
    assert ring.take_drops() == (1, 1000, 1)
    c = ring.counters()
    assert (c["flight_blobs_dropped"], c["flight_ring_full_drops"], c["flight_held_bytes"]) == (1, 1, 0)
    slots.copies[0].done = True  # the copy is done: the ring has room again...
    assert ring.hold(0, object(), 1000, "lin64", slots.stage(b"c" * 1000)) == schema.NO_BLOB  # ...not step 0
    ring.hold_snapshot(1, {"step": 1}, [], 8)
    ring.advance(1)
    assert ring.hold(1, object(), 1000, "lin64", slots.stage(b"d" * 1000)) != schema.NO_BLOB


def test_a_dump_taken_before_the_copies_are_done_waits_for_them(tmp_path: Path) -> None:
    st = AgentState(payload_now=True)
    w = BackgroundWriter(spool.SpoolWriter(tmp_path / "spool" / "rank-00000", 0), lambda *_: None)
    st.writer = w
    slots, ring = Slots(1 << 16), FlightRecorder(1, 1 << 20)
    dumps = FlightDumps(ring, st)
    w.event(_rank_start())
    ring.hold_snapshot(0, {"step": 0}, [], 8)
    data = [bytes(range(k, k + 200)) for k in range(3)]
    for raw in data:
        blob = ring.hold(0, _fp(raw), len(raw), "zlib64", slots.stage(raw))
        w.event(_batch(0, blob, raw))
    slots.copies[0].done = True  # the others are still in flight when the dump is taken
    dumps.at_exit(w, "exit", RuntimeError("boom"))
    w.event(_step(0, 1.0))
    w.event({"type": schema.EV_END, "reason": "exit", "steps": 1, "colls": 0, "t_ns": 9, "counters": {}})
    assert w.flush(10)
    w.close()
    assert [c.waited for c in slots.copies] == [1, 1, 1]  # each waited for before its bytes were written
    assert slots.landing.reap() == 3 and slots.space.live() == 0
    collect(tmp_path / "spool", tmp_path / "trace.zarr")
    rt = Trace.open(tmp_path / "trace.zarr").rank(0)
    assert [d["blobs"] for d in rt.attrs["flight_dumps"]] == [3]
    assert [rt.payload(int(p)) for p in rt.batch_tensors["payload"]] == data


def test_payloads_held_for_a_late_check_but_before_the_window_are_not_written() -> None:
    # on a GPU the non-finite check runs up to two steps behind (``lag``): the ring holds two
    # more steps, but a dump for step 9 writes the window's payloads only (from snapshot 4)
    s = Steps(window=4, every=2)
    s.ring.lag = 2
    for step in range(10):
        s.hold(step, f"step {step}".encode())
        if step < 9:
            s.end(step)
    held = s.ring.counters()["flight_held_bytes"]
    assert held == sum(len(f"step {k}") for k in range(2, 10))  # steps 2..9: the lag's two more
    dump = s.ring.take("nonfinite", "", at_step=9)
    assert (dump.first_step, dump.snapshot_step) == (4, 4)
    assert sorted(b.data for b in dump.blobs) == sorted(f"step {k}".encode() for k in range(4, 10))
    # content the dump did not write is held again when it comes back; written content is named
    assert s.hold(10, b"step 2") not in (s.ids[b"step 9"], schema.NO_BLOB)
    assert s.hold(10, b"step 9") == dump.blobs[[b.data for b in dump.blobs].index(b"step 9")].id


# -- the window's memory bound (--window-bytes, sized from memory by default) ----------------------
MEMINFO = """MemTotal:       263886948 kB
MemFree:         1200340 kB
MemAvailable:   201326592 kB
Buffers:          342112 kB
Cached:         190128732 kB
"""
AVAILABLE = 201326592 * 1024


def test_the_bound_sized_from_memory_is_a_quarter_of_memavailable_per_local_rank() -> None:
    assert mem_available(MEMINFO) == AVAILABLE
    assert mem_available("MemTotal: 1024 kB\nMemFree: 512 kB\n") is None  # kernels before 3.14
    assert auto_window_bytes(MEMINFO, {}, 1) == AVAILABLE // 4
    assert auto_window_bytes(MEMINFO, {"LOCAL_WORLD_SIZE": "8"}, 1) == AVAILABLE // 32
    for bad in ("", " ", "0", "-2", "two"):  # torchrun always sets it; anything else counts as one rank
        assert local_ranks({"LOCAL_WORLD_SIZE": bad}) == 1
    assert local_ranks({"LOCAL_WORLD_SIZE": " 4 "}) == 4
    # never below the writer's bound (--max-pending-bytes)
    assert auto_window_bytes(MEMINFO, {"LOCAL_WORLD_SIZE": "8"}, 1 << 40) == 1 << 40
    assert auto_window_bytes(MEMINFO, {"LOCAL_WORLD_SIZE": "8"}, AVAILABLE // 32 - 1) == AVAILABLE // 32
    assert auto_window_bytes(None, {}, 5) is None
    assert auto_window_bytes("MemTotal: 1024 kB\n", {}, 5) is None
    # in a container with a memory limit: what the limit leaves, where that is less
    assert cgroup_available("8589934592\n", "1073741824\n") == 7 << 30
    assert cgroup_available("max\n", "1073741824\n") is None and cgroup_available(None, "1") is None
    assert cgroup_available("100", "200") == 0
    assert auto_window_bytes(MEMINFO, {"LOCAL_WORLD_SIZE": "2"}, 1, cgroup=7 << 30) == (7 << 30) // 8
    assert auto_window_bytes(MEMINFO, {}, 1, cgroup=AVAILABLE * 2) == AVAILABLE // 4


def test_a_given_bound_wins_and_an_unreadable_meminfo_leaves_the_writers_bound(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(MEMINFO)
    assert window_bound(123, 1 << 30, {}, str(meminfo)) == (123, False)
    assert window_bound(0, 1 << 20, {"LOCAL_WORLD_SIZE": "2"}, str(meminfo)) == (AVAILABLE // 8, True)
    with caplog.at_level(logging.WARNING, logger="fsdp_replay.agent.flight"):
        assert window_bound(0, 1 << 30, {}, str(tmp_path / "gone")) == (1 << 30, True)
        meminfo.write_text("MemTotal: 1024 kB\n")
        assert window_bound(0, 1 << 30, {}, str(meminfo)) == (1 << 30, True)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and all("MemAvailable" in m and "--window-bytes" in m for m in said), said
    bound, auto = window_bound(0, 1, {})  # this host's /proc/meminfo
    assert auto and bound > 1


def test_window_bytes_is_an_option_of_its_own_and_reaches_the_agents_environment(tmp_path: Path) -> None:
    config = RecordConfig(out="x", window_bytes=5 << 30)
    env = config.to_env()
    back = RecordConfig.from_env(env)
    assert (back.window_bytes, back.max_pending_bytes) == (5 << 30, 1 << 30)
    assert RecordConfig(out="x").window_bytes == 0  # sized from memory
    with pytest.raises(ConfigError, match="FSDP_REPLAY_WINDOW_BYTES=-1 must be >= 0"):
        RecordConfig.from_env({**env, "FSDP_REPLAY_WINDOW_BYTES": "-1"})
    # the flag, over the variable, reaches the recorded command's environment (the agent reads it
    # there: tests/system/test_flight_recorder.py finds it in a recorded run's policy)
    seen = tmp_path / "seen"
    child = [
        sys.executable,
        "-c",
        f"import os; open({str(seen)!r}, 'w').write(os.environ['FSDP_REPLAY_WINDOW_BYTES'])",
    ]
    env = child_env(FSDP_REPLAY_WINDOW_BYTES="7")
    for out, flag, got in (("flag", ["--window-bytes", "123"], "123"), ("variable", [], "7")):
        record = [*CLI, "record", "--out", str(tmp_path / out), "--no-tape", "--no-collect", *flag]
        run([*record, "--", *child], env=env)
        assert seen.read_text() == got


class Events:
    """A writer that keeps the events it is given."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def event(self, ev: dict[str, Any]) -> None:
        self.events.append(ev)


def test_drops_of_a_window_run_name_its_bound(capsys: pytest.CaptureFixture[str]) -> None:
    ring = FlightRecorder(1, 10)
    ring.hold_snapshot(0, {"step": 0}, [], 8)
    assert ring.hold(0, 1, 11, "zlib64", _copy_of(b"x" * 11)) == schema.NO_BLOB
    w = Events()
    FlightDumps(ring, AgentState(payload_now=True)).step_end(w, 0, [1.0], [])  # type: ignore[arg-type]
    (drop,) = w.events
    assert (
        drop["count"] == 1
        and drop["reason"] == "the flight recorder's memory bound (--window-bytes) or no host memory left"
    )
    policy = {"payloads": "window:4", "window_bytes": 3 << 30, "window_bytes_auto": True}
    counters = {"blobs_dropped": 5, "blob_bytes_dropped": 500, "flight_blobs_dropped": 5, "flight_dumps": 1}
    dump = {"reason": "nonfinite", "detail": "a non-finite loss at the end of step 6", "t_ns": 1}
    dump |= {"first_step": 4, "last_step": 6, "snapshot_step": 4, "blobs": 9, "nbytes": 900, "dropped": 5}
    r = {
        "rank": 0,
        "steps": 7,
        "end": {"reason": "exit", "counters": counters},
        "environment": {"policy": policy},
        "flight_recorder": {"dumps": [dump]},
    }
    (dropped,) = [f for f in _rank_findings(r, "run") if f["kind"] == "payloads_dropped"]
    assert "--window-bytes" in dropped["next"] and "--max-pending-bytes" not in dropped["next"]
    (flight,) = flight_findings([r], "run")
    assert (
        "5 of their payloads had been dropped at the memory bound (--window-bytes: 3221.2 MB, sized "
        in (flight["message"])
    )
    plain = {**r, "end": {"reason": "exit", "counters": {"blobs_dropped": 5, "blob_bytes_dropped": 500}}}
    (dropped,) = [f for f in _rank_findings(plain, "run") if f["kind"] == "payloads_dropped"]
    assert "--max-pending-bytes" in dropped["next"]
    # what record and collect print
    ranks = [
        RankReport(0, payloads_dropped=5, window=True),
        RankReport(1, payloads_dropped=2),
        # on a GPU: payloads the payload ring had no room for (measured: the reference step's taped
        # results with the default ring, session 13)
        RankReport(2, payloads_dropped=380, window=True, ring_full_drops=380),
        RankReport(3, payloads_dropped=5, window=True, ring_full_drops=3),
    ]
    print_collect(CollectReport("trace", ranks))
    err = capsys.readouterr().err
    assert (
        "rank 0: 5 payloads dropped while recording (disk full or the flight recorder's memory bound: "
        "--window-bytes)" in err
    )
    assert (
        "rank 1: 2 payloads dropped while recording (disk full or memory bound: --max-pending-bytes)" in err
    )
    assert (
        "rank 2: 380 payloads dropped while recording (no room in the GPU's payload ring: --payload-ring-bytes)"
        in err
    )
    assert "rank 3: 5 payloads dropped while recording (3: no room in the GPU's payload ring" in err
    assert "the rest: disk full or the flight recorder's memory bound: --window-bytes)" in err


def test_a_copy_that_finds_no_memory_is_dropped_and_counted_not_raised() -> None:
    ring = FlightRecorder(2, 1 << 20)
    ring.hold_snapshot(0, {"step": 0}, [], 8)

    def no_memory() -> tuple[Any, Any] | None:
        raise NoMemory("CUDA error: out of memory (cudaHostAlloc)")

    assert ring.hold(0, object(), 1000, "lin64", no_memory) == schema.NO_BLOB
    assert ring.take_drops() == (1, 1000, 0)
    assert ring.counters()["flight_blobs_dropped"] == 1 and ring.counters()["flight_held_bytes"] == 0


def test_a_payload_the_tapes_cxx_hook_kept_is_held_and_one_it_could_not_keep_is_a_ring_full_drop(
    tmp_path: Path,
) -> None:
    """``TensorRecorder.hold_kept``: the C++ hook made the pinned copy (here a CPU tensor and no
    event); held at its pinned block's charge and counted as landed. One the hook could not keep
    (``host`` None: its bound of device copies in flight) is dropped as a full ring, in the flight
    recorder's counters and the writer's."""
    from fsdp_replay.agent.payload_ring import pinned_bytes
    from fsdp_replay.agent.tensor_record import TensorRecorder

    config = RecordConfig.from_env({"FSDP_REPLAY_OUT": str(tmp_path), "FSDP_REPLAY_PAYLOADS": "window:2"})
    state = AgentState(payload_now=True)
    flight = FlightRecorder(2, 1 << 20)
    flight.hold_snapshot(0, {"step": 0}, [], 8)
    drops: list[tuple[int, bool]] = []

    class Writer:
        def count_dropped(self, nbytes: int, ring_full: bool = False) -> None:
            drops.append((nbytes, ring_full))

    state.writer = Writer()  # type: ignore[assignment]
    tensors = TensorRecorder(config, state, flight)
    host = torch.arange(1000, dtype=torch.uint8)
    blob = tensors.hold_kept(0, 1000, host, None)
    assert blob != schema.NO_BLOB and flight.landed == 1
    assert flight.counters()["flight_held_bytes"] == pinned_bytes(1000) == 1024
    assert tensors.hold_kept(0, 3000, None, None) == schema.NO_BLOB
    assert drops == [(3000, True)] and flight.take_drops() == (1, 3000, 1)
    assert flight.counters()["flight_ring_full_drops"] == 1
