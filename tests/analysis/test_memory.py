"""The CUDA allocator's record without a GPU: torch-shaped history entries and an OOM snapshot go
through the agent's own encoding and writer thread into a real spool, then the collector, the
reader, ``inspect`` (its memory section and OOM finding), ``export --memory-snapshot`` and the
Perfetto counters.

The history entries and the snapshot have the structure ``torch.cuda.memory._snapshot()``
documents (``torch/cuda/memory.py``: Snapshot, Segment, Block, TraceEntry); the GPU tests
(``tests/system/test_gpu_memory.py``) check the same path against a real allocator.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from harness import CLI, run

from fsdp_replay.agent.allocations import MemoryRecorder, action_rows
from fsdp_replay.agent.config import RecordConfig, StepSet
from fsdp_replay.agent.counters import AgentState
from fsdp_replay.agent.writer import BackgroundWriter
from fsdp_replay.analysis.memory import summarize_snapshot
from fsdp_replay.analysis.perfetto import COUNTER_ALLOCATOR, export
from fsdp_replay.trace import schema, spool
from fsdp_replay.trace.collect import collect
from fsdp_replay.trace.reader import Trace

MiB = 1 << 20
TORCH_LINEAR = str(Path(torch.__file__).parent / "nn" / "modules" / "linear.py")
SEG = 0x7F00_0000_0000  # segment addresses as the driver hands them out
STREAM = 0  # the default stream, as torch writes it (an int of the cudaStream_t)
T0_WALL = 1_800_000_000_000_000_000  # the agent's t_ns == 0, in Unix ns


def frames(line: int) -> list[dict[str, Any]]:
    """A Python stack as torch records it, innermost first: torch's frames, then the program's."""
    return [
        {
            "filename": TORCH_LINEAR,
            "line": 125,
            "name": "forward",
        },
        {"filename": "/work/train.py", "line": line, "name": "step"},
    ]


def entry(action: str, t_ns: int, size: int, addr: int, line: int = 0) -> dict[str, Any]:
    """One ``TraceEntry`` (``device_traces[d][i]``): an OOM's carries ``device_free``, not ``addr``."""
    e: dict[str, Any] = {
        "action": action,
        "size": size,
        "stream": STREAM,
        "time_us": (T0_WALL + t_ns) // 1000,
    }
    e["device_free" if action == "oom" else "addr"] = addr
    if line:
        e["frames"] = frames(line)
    return e


# step 0: micro-steps end at 10 ms and 20 ms, the step at 30 ms
MICRO_ENDS = [10_000_000, 20_000_000]
STEP0_TRACE = [
    entry("segment_alloc", 1_000_000, 20 * MiB, SEG),
    entry("alloc", 1_000_000, 8 * MiB, SEG, line=40),
    entry("alloc", 2_000_000, 2 * MiB, SEG + 8 * MiB, line=41),
    entry("free_requested", 12_000_000, 2 * MiB, SEG + 8 * MiB),
    entry("free_completed", 12_000_000, 2 * MiB, SEG + 8 * MiB),
    entry("alloc", 25_000_000, 3 * MiB, SEG + 10 * MiB, line=52),
    entry("segment_free", 26_000_000, 2 * MiB, SEG + 64 * MiB),
]
BASE = {"requested": 1 * MiB, "reserved": 4 * MiB}


def stats(allocated: int, reserved: int, requested: int, peak: int) -> dict[str, int]:
    return {
        "allocated": allocated,
        "reserved": reserved,
        "requested": requested,
        "allocated_peak": peak,
        "reserved_peak": reserved,
        "alloc_retries": 1,
        "ooms": 0,
    }


def oom_snapshot() -> dict[str, Any]:
    """The allocator at an OOM of 10 MiB: two 20 MiB segments, 12 MiB free in them but no free
    block of 10 MiB (fragmentation), and the history leading to it."""

    def block(addr: int, size: int, state: str, requested: int = 0, line: int = 0) -> dict[str, Any]:
        return {
            "address": addr,
            "size": size,
            "requested_size": requested,
            "state": state,
            "frames": frames(line) if line else [],
        }

    segments = []
    for i, big in enumerate((14 * MiB, 12 * MiB)):
        addr = SEG + i * 32 * MiB
        blocks = [
            block(addr, big, "active_allocated", big - 1000, line=60 + i),
            block(addr + big, 20 * MiB - big, "inactive"),
        ]
        segments.append(
            {
                "device": 0,
                "address": addr,
                "total_size": 20 * MiB,
                "allocated_size": big,
                "active_size": big,
                "requested_size": big - 1000,
                "stream": STREAM,
                "segment_type": "large",
                "segment_pool_id": [0, 0],
                "is_expandable": False,
                "frames": [],
                "blocks": blocks,
            }
        )
    trace = [
        entry("alloc", 40_000_000, 14 * MiB - 1000, SEG, line=60),
        entry("alloc", 41_000_000, 12 * MiB - 1000, SEG + 32 * MiB, line=61),
        entry("oom", 42_000_000, 10 * MiB, 1 * MiB),
    ]
    return {
        "segments": segments,
        "device_traces": [trace],
        "allocator_settings": {"expandable_segments": False},
    }


def rank_start(rank: int) -> dict[str, Any]:
    return {
        "type": schema.EV_RANK_START,
        "format_version": schema.FORMAT_VERSION,
        "rank": rank,
        "world_size": 1,
        "local_rank": rank,
        "pid": 4242,
        "host": "gpu0",
        "argv": ["train.py"],
        "orig_argv": ["python", "train.py"],
        "executable": "python",
        "cwd": "/work",
        "env": {},
        "versions": {"torch": "2.11.0+cu130"},
        "threads": {},
        "determinism": {},
        "script": {"path": "/work/train.py", "sha256": None},
        "policy": {"alloc_history": "all", "alloc_stacks": True},
        "start_ns": T0_WALL,
        "fingerprint_algos": {},
        "t0_wall_ns": T0_WALL,
    }


def step_event(step: int, t_ns: int, micro_ends: list[int]) -> dict[str, Any]:
    return {
        "type": schema.EV_STEP,
        "step": step,
        "micro_steps": len(micro_ends),
        "colls": 0,
        "params": [],
        "loss": [],
        "t_ns": t_ns,
        "micro_t_ns": micro_ends,
    }


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder whose rank 0 spool the agent's writer wrote: two steps (the first with its
    allocator history), then an OOM in step 2, then the end."""
    out = tmp_path_factory.mktemp("memory")
    errors: list[str] = []
    w = BackgroundWriter(
        spool.SpoolWriter(spool.rank_dir(out / schema.SPOOL_DIR, 0), 0),
        lambda where, e: errors.append(f"{where}: {e!r}"),
    )
    config = RecordConfig(out=str(out), alloc_history=StepSet.parse("steps:0"), alloc_stacks=True)
    state = AgentState(payload_now=False)
    rec = MemoryRecorder(
        config, state, lambda: w, lambda where, e: errors.append(f"{where}: {e!r}"), device=0
    )
    rec.t0_wall_ns = T0_WALL  # the clock the entries above were stamped with
    w.event(rank_start(0))
    w.event(step_event(0, 30_000_000, MICRO_ENDS))
    rec.base = dict(BASE)
    step0 = stats(13 * MiB, 22 * MiB, 12 * MiB, 15 * MiB)
    rec.write_step(w, 0, step0, [STEP0_TRACE], MICRO_ENDS, final=False, moved=True)
    rec.base = None
    w.event(step_event(1, 60_000_000, [45_000_000]))
    rec.write_step(w, 1, stats(13 * MiB, 22 * MiB, 12 * MiB, 15 * MiB), None, [45_000_000], final=False)
    where = {"step": 2, "micro": 0, "t_ns": 62_000_000}
    rec.write_oom(
        w,
        where,
        0,
        (10 * MiB, 80 * MiB, 1 * MiB),
        stats(26 * MiB, 40 * MiB, 26 * MiB, 26 * MiB),
        oom_snapshot(),
    )
    w.event(
        {
            "type": schema.EV_END,
            "reason": "exit",
            "steps": 2,
            "colls": 0,
            "t_ns": 63_000_000,
            "counters": {},
            "exception": "OutOfMemoryError('CUDA out of memory. Tried to allocate 10.00 MiB')",
        }
    )
    assert w.flush(30)
    w.close()
    assert not errors, errors
    (out / "run.json").write_text(json.dumps({"command": ["train.py"], "exit_code": 1}))
    report = collect(out / schema.SPOOL_DIR, out / schema.TRACE_DIR)
    assert not report.damaged, report
    return out


def test_action_rows_follow_torchs_trace_entries() -> None:
    rows, sites = action_rows([STEP0_TRACE], T0_WALL, MICRO_ENDS, stacks=True)
    assert sites == ["/work/train.py:40 step", "/work/train.py:41 step", "/work/train.py:52 step"]
    codes = schema.ALLOC_ACTION_CODES
    assert [r[2] for r in rows] == [codes[e["action"]] for e in STEP0_TRACE]
    assert [r[0] for r in rows] == [0, 0, 0, 1, 1, 2, 2]  # micro-steps end at 10 and 20 ms
    assert [r[1] for r in rows] == [
        1_000_000,
        1_000_000,
        2_000_000,
        12_000_000,
        12_000_000,
        25_000_000,
        26_000_000,
    ]
    assert [r[7] for r in rows] == [-1, 0, 1, -1, -1, 2, -1]
    # without stacks no site; an action this version does not know is left out, not misread
    rows, sites = action_rows(
        [[*STEP0_TRACE, {"action": "new_kind", "addr": 1, "size": 2}]], T0_WALL, [], False
    )
    assert len(rows) == len(STEP0_TRACE) and sites == [] and {r[7] for r in rows} == {-1}


def test_allocator_events_round_trip_into_the_trace(recorded: Path) -> None:
    r = Trace.open(recorded / schema.TRACE_DIR).rank(0)
    r.read_all()
    a = r.table("allocs")
    codes = schema.ALLOC_ACTION_CODES
    assert a["action"].tolist() == [codes[e["action"]] for e in STEP0_TRACE]
    assert a["bytes"].tolist() == [e["size"] for e in STEP0_TRACE]
    assert a["addr"].tolist() == [e["addr"] for e in STEP0_TRACE]
    assert set(a["step"].tolist()) == {0} and set(a["stream"].tolist()) == {STREAM}
    assert a["micro"].tolist() == [0, 0, 0, 1, 1, 2, 2]
    sites = r.names("alloc_site")
    assert [sites[i] if i >= 0 else None for i in a["site"].tolist()] == [
        None,
        "/work/train.py:40 step",
        "/work/train.py:41 step",
        None,
        None,
        "/work/train.py:52 step",
        None,
    ]
    m = r.table("memory_steps")
    assert m["step"].tolist() == [0, 1]
    assert m["history"].tolist() == [len(STEP0_TRACE), -1] and m["moved"].tolist() == [True, False]
    assert m["requested_base"].tolist() == [BASE["requested"], -1]
    assert m["reserved_base"].tolist() == [BASE["reserved"], -1]
    assert m["allocated_peak"].tolist() == [15 * MiB, 15 * MiB] and m["alloc_retries"].tolist() == [1, 1]
    ends = r.table("micro_steps")
    assert list(zip(ends["step"].tolist(), ends["micro"].tolist(), ends["t_ns"].tolist(), strict=True)) == [
        (0, 0, MICRO_ENDS[0]),
        (0, 1, MICRO_ENDS[1]),
        (1, 0, 45_000_000),
    ]
    (oom,) = r.attrs["ooms"]
    assert (oom["step"], oom["micro"], oom["requested"], oom["device_free"]) == (2, 0, 10 * MiB, 1 * MiB)
    assert json.loads(r.payload(oom["payload"])) == oom_snapshot()


def test_the_snapshot_summary_finds_fragmentation() -> None:
    s = summarize_snapshot(oom_snapshot(), 10 * MiB)
    assert (s["reserved"], s["allocated"], s["cached_free"]) == (40 * MiB, 26 * MiB, 14 * MiB)
    assert s["largest_free_block"] == 8 * MiB and s["free_blocks"] == 2
    assert s["fragmentation"] == pytest.approx(14 / 40)
    assert [b["bytes"] for b in s["largest"]] == [14 * MiB, 12 * MiB]
    assert s["largest"][0]["site"] == "/work/train.py:60 step"  # the program's line, below torch's frames
    assert s["cause"].startswith("fragmentation") and s["history_actions"] == 3
    # the same memory, asked for more than all the free blocks: not fragmentation
    assert summarize_snapshot(oom_snapshot(), 30 * MiB)["cause"].startswith("the program needed more")


def test_inspect_summarizes_memory_and_the_oom(recorded: Path) -> None:
    doc = json.loads(run([*CLI, "inspect", str(recorded), "--json"]).stdout)
    memory = doc["per_rank"][0]["memory"]
    assert [s["step"] for s in memory["steps"]] == [0, 1] and memory["history_steps"] == [0]
    assert memory["peak_allocated"] == 15 * MiB
    assert [(x["bytes"], x["site"]) for x in memory["largest"][:2]] == [
        (8 * MiB, "/work/train.py:40 step"),
        (3 * MiB, "/work/train.py:52 step"),
    ]
    (oom,) = [f for f in doc["findings"] if f["kind"] == "oom"]
    assert oom["severity"] == "problem" and oom["rank"] == 0 and oom["step"] == 2
    for text in (
        "step 2 micro-step 0",
        "10.0 MiB",
        "26.0 MiB allocated in 2 blocks",
        "40.0 MiB reserved",
        "fragmentation",
    ):
        assert text in oom["message"], oom["message"]
    assert "export --memory-snapshot" in oom["next"]
    text = run([*CLI, "inspect", str(recorded)]).stdout
    assert "CUDA memory per step" in text and "ran out of CUDA memory" in text


def test_export_memory_snapshot_writes_torchs_pickle(recorded: Path, tmp_path: Path) -> None:
    out = tmp_path / "oom.pickle"
    run([*CLI, "export", "--memory-snapshot", str(recorded), "-o", str(out)])
    assert pickle.loads(out.read_bytes()) == oom_snapshot()
    proc = run(
        [*CLI, "export", "--memory-snapshot", str(recorded), "--oom", "1", "-o", str(out)], check=False
    )
    assert proc.returncode == 3 and "no --oom 1" in proc.stderr


def test_perfetto_counters_follow_the_history(recorded: Path) -> None:
    doc = export(Trace.open(recorded / schema.TRACE_DIR))
    counters = [e for e in doc["traceEvents"] if e["ph"] == "C" and e["name"] == COUNTER_ALLOCATOR]
    # each action's effect on torch's requested bytes (allocations as asked, until their free
    # completes) and reserved bytes (segments), from the step's base
    requested = BASE["requested"] + np.cumsum([0, 8 * MiB, 2 * MiB, 0, -2 * MiB, 3 * MiB, 0])
    reserved = BASE["reserved"] + np.cumsum([20 * MiB, 0, 0, 0, 0, 0, -2 * MiB])
    assert [c["args"]["requested"] for c in counters] == requested.tolist()
    assert [c["args"]["reserved"] for c in counters] == reserved.tolist()
    origin = doc["otherData"]["origin_ns"]
    t_ns = [e["time_us"] * 1000 - T0_WALL for e in STEP0_TRACE]
    assert [c["ts"] for c in counters] == [(T0_WALL + t - origin) / 1000 for t in t_ns]
    (oom,) = [e for e in doc["traceEvents"] if e.get("cat") == "oom"]
    assert oom["ts"] == (T0_WALL + 62_000_000 - origin) / 1000
    micro = [e["name"] for e in doc["traceEvents"] if e.get("cat") == "micro"]
    assert micro == ["micro 0", "micro 1", "optimizer", "micro 0", "optimizer"]
