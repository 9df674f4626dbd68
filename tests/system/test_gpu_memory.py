"""On a CUDA device: the caching allocator's record against the allocator itself.

A small workload (``tests/workloads/memory_train.py``) prints torch's counters after each
optimizer step; the trace must hold the same peaks, every allocator action of the history steps
(checked by torch's own byte counters: what the actions add up to is how far the counters moved),
and, for a provoked out-of-memory error, the allocator's snapshot that ``inspect`` summarizes.
The Perfetto export of the GPU trace must validate. Run on the GPU machine with
``bench/gpu_suite.sh`` (``GPU_TESTS=tests/system/test_gpu_memory.py bench/gpu_suite.sh tests``).
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness import CLI, REPO, child_env, run, torchrun_cmd
from trace_events import check, schema_validate

from fsdp_replay.analysis.perfetto import COUNTER_ALLOCATOR
from fsdp_replay.trace import schema
from fsdp_replay.trace.reader import RankTrace, Trace

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
WORKLOAD = REPO / "tests" / "workloads" / "memory_train.py"
CODES = schema.ALLOC_ACTION_CODES


def _record(tmp: Path, name: str, *args: str, options: tuple[str, ...] = ()) -> tuple[Path, str, int]:
    out = tmp / name
    proc = run(
        [
            *CLI,
            "record",
            "--out",
            str(out),
            "--payloads",
            "all",
            *options,
            "--",
            *torchrun_cmd(1, WORKLOAD, *args),
        ],
        env=child_env(),
        check=False,
    )
    text = proc.stdout + proc.stderr
    print(
        f"--- record {name} exited {proc.returncode}\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    )
    return out, text, proc.returncode


def _printed(text: str) -> dict[int, dict[str, int]]:
    """The workload's ``MEM step=K key=value ...`` lines, by step."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"MEM step=(\d+) (.*)", line.strip())
        if m:
            out[int(m.group(1))] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(2))}
    return out


def _agent_cost(r: RankTrace, label: str) -> None:
    """Log what recording cost per step (the agent's CPU on the training thread, ms): the
    history's read at a step's end is in it (docs/timeline-and-memory.md, "What it costs")."""
    cpu = r.steps["agent_cpu_ns"]
    m = r.table("memory_steps")
    per_step = np.diff(cpu, prepend=0) / 1e6
    print(
        f"agent CPU per step ({label}), ms:",
        np.round(per_step, 2).tolist(),
        "history actions:",
        m["history"].tolist(),
    )


def _memory(r: RankTrace) -> dict[str, np.ndarray]:
    m = r.table("memory_steps")
    return {c: m[c] for c in schema.TABLES["memory_steps"]}


def test_allocator_history_and_peaks_match_the_allocator(tmp_path: Path) -> None:
    rec, text, code = _record(
        tmp_path,
        "hist",
        "--steps",
        "4",
        "--reset-peaks",
        options=("--alloc-history", "always", "--alloc-stacks"),
    )
    assert code == 0, text[-3000:]
    printed = _printed(text)
    r = Trace.open(rec / schema.TRACE_DIR).rank(0)
    r.read_all()
    m = _memory(r)
    print("memory_steps:", {k: v.tolist() for k, v in m.items()})
    _agent_cost(r, "--alloc-history always --alloc-stacks")
    assert m["step"].tolist() == [0, 1, 2, 3] == sorted(printed)
    # the peaks are torch's own, read at the optimizer step's end: what the program read right after
    for i, step in enumerate(m["step"].tolist()):
        assert m["allocated_peak"][i] == printed[step]["max_allocated"], (step, printed[step])
        assert m["reserved_peak"][i] == printed[step]["max_reserved"], (step, printed[step])
        assert m["allocated_peak"][i] >= m["allocated_end"][i] > 0
    # every step has history; its actions add up to how far torch's counters moved in the step
    a = r.table("allocs")
    step, action, nbytes = a["step"], a["action"], a["bytes"]
    print("actions per step:", np.bincount(step).tolist(), "by action:", np.bincount(action).tolist())
    # (rows of the step after the last one are the program's teardown, read at the agent's end)
    per_step = np.bincount(step, minlength=len(m["step"]))
    assert (m["history"] > 0).all() and per_step[: len(m["step"])].tolist() == m["history"].tolist()
    assert (step[step >= len(m["step"])] == len(m["step"])).all()
    # (a step whose end another thread allocated or freed in, while the history was read and
    # cleared, says so: its identity cannot hold, and at least one step must have none)
    print("moved:", m["moved"].tolist())
    exact = 0
    for i, k in enumerate(m["step"].tolist()):
        rows = step == k
        alloc, freed = rows & (action == CODES["alloc"]), rows & (action == CODES["free_completed"])
        taken, given = rows & (action == CODES["segment_alloc"]), rows & (action == CODES["segment_free"])
        requested = int(nbytes[alloc].sum() - nbytes[freed].sum())
        segments = int(nbytes[taken].sum() - nbytes[given].sum())
        print(
            f"step {k}: requested {m['requested_base'][i]} + {requested} -> {m['requested_end'][i]}; "
            f"reserved {m['reserved_base'][i]} + {segments} -> {m['reserved_end'][i]}"
        )
        if m["moved"][i]:
            continue
        assert m["requested_base"][i] + requested == m["requested_end"][i], k
        assert m["reserved_base"][i] + segments == m["reserved_end"][i], k
        exact += 1
    assert exact >= 1
    assert (a["t_ns"] > 0).all() and (np.diff(a["t_ns"][step == 1]) >= -1000).all()  # torch's order, in time
    assert set(a["micro"][step == 1].tolist()) >= {0, 1, 2}  # two backward()s, then the optimizer step
    # sites: the program's line for allocations made on its thread (backward runs on autograd's
    # threads, which have no Python stack)
    sites = r.names("alloc_site")
    allocs = a["site"][action == CODES["alloc"]]
    print(f"sites ({(allocs >= 0).mean():.0%} of allocations have one):", sites[:8])
    assert any("memory_train.py" in s for s in sites) and (allocs >= 0).any()
    # inspect's memory section, and the Perfetto timeline with its allocator counters
    doc = json.loads(run([*CLI, "inspect", str(rec), "--json"]).stdout)
    memory = doc["per_rank"][0]["memory"]
    assert memory["peak_allocated"] == max(p["max_allocated"] for p in printed.values())
    assert memory["largest"][0]["bytes"] == int(nbytes[action == CODES["alloc"]].max())
    timeline = _export(rec, tmp_path)
    counters = [e for e in timeline["traceEvents"] if e["ph"] == "C" and e["name"] == COUNTER_ALLOCATOR]
    assert len(counters) == len(a)
    if not m["moved"][-1]:  # at the last step's last action the counter is where torch's ended
        last = int((step <= m["step"][-1]).sum()) - 1  # (the teardown's rows come after it)
        assert counters[last]["args"]["requested"] == int(m["requested_end"][-1])


def test_default_recording_keeps_the_first_two_steps_history(tmp_path: Path) -> None:
    rec, text, code = _record(tmp_path, "default", "--steps", "4")
    assert code == 0, text[-3000:]
    r = Trace.open(rec / schema.TRACE_DIR).rank(0)
    m = _memory(r)
    _agent_cost(r, "default: history in steps 0-1")
    history = m["history"].tolist()
    assert min(history[:2]) > 0 and history[2:] == [-1, -1], history
    assert set(r.table("allocs")["step"].tolist()) == {0, 1}
    printed = _printed(text)
    assert m["allocated_peak"].tolist() == [printed[k]["max_allocated"] for k in m["step"].tolist()]


def test_an_oom_leaves_the_allocators_snapshot_that_inspect_summarizes(tmp_path: Path) -> None:
    rec, text, code = _record(
        tmp_path, "oom", "--steps", "4", "--oom-at-step", "2", options=("--alloc-history", "always")
    )
    assert code != 0 and "OutOfMemoryError" in text, text[-3000:]
    m = re.search(r"OOM-ASK bytes=(\d+) allocated=(\d+)", text)
    assert m, text[-3000:]
    asked, allocated = int(m.group(1)), int(m.group(2))
    r = Trace.open(rec / schema.TRACE_DIR).rank(0)
    (oom,) = r.attrs["ooms"]
    print("oom event:", {k: v for k, v in oom.items() if k != "stats"}, "stats:", oom["stats"])
    assert (oom["step"], oom["micro"], oom["requested"]) == (2, 1, asked)
    assert oom["device_total"] > 0 and 0 <= oom["device_free"] <= oom["device_total"] and oom["payload"] >= 0
    snapshot = json.loads(r.payload(oom["payload"]))
    held = sum(
        b["size"] for s in snapshot["segments"] for b in s["blocks"] if b["state"] == "active_allocated"
    )
    assert held == allocated, (held, allocated)  # the snapshot is the allocator at the failure
    assert any(e["action"] == "oom" and e["size"] == asked for t in snapshot["device_traces"] for e in t)
    # the failing step's actions are in the trace too (written at the end), up to the OOM
    a = r.table("allocs")
    assert CODES["oom"] in a["action"][a["step"] == 2].tolist()
    doc = json.loads(run([*CLI, "inspect", str(rec), "--json"]).stdout)
    (finding,) = [f for f in doc["findings"] if f["kind"] == "oom"]
    print("finding:", finding["message"], "\nnext:", finding["next"])
    assert finding["rank"] == 0 and finding["step"] == 2 and finding["severity"] == "problem"
    summary = doc["per_rank"][0]["memory"]["ooms"][0]["snapshot"]
    assert summary["allocated"] == allocated and summary["reserved"] >= allocated
    assert summary["largest"] and summary["history_actions"] > 0
    assert "ran out of CUDA memory" in finding["message"] and "reserved" in finding["message"]
    out = tmp_path / "oom.pickle"
    run([*CLI, "export", "--memory-snapshot", str(rec), "-o", str(out)])
    assert pickle.loads(out.read_bytes())["segments"] == snapshot["segments"]
    _export(rec, tmp_path)


def _export(rec: Path, tmp: Path) -> dict[str, Any]:
    out = tmp / f"{rec.name}-timeline.json"
    run([*CLI, "export", "--perfetto", str(rec), "-o", str(out)])
    doc = json.loads(out.read_text())
    counts = check(doc)
    validated = schema_validate(doc)
    cats: dict[str, int] = {}
    for e in doc["traceEvents"]:
        cats[e.get("cat", e["ph"])] = cats.get(e.get("cat", e["ph"]), 0) + 1
    print(f"timeline of {rec.name}: {counts}, by category {cats}, JSON schema checked: {validated}")
    print("notes:", doc["otherData"]["notes"])
    assert cats.get("step") and cats.get("collective") and cats.get("micro")
    r = Trace.open(rec / schema.TRACE_DIR).rank(0)
    for table, cat in (("kernels", "kernel"), ("copies", "copy")):
        if r.has_table(table) and len(r.table(table)):
            assert cats.get(cat) == len(r.table(table)), (table, cats)
    return doc
