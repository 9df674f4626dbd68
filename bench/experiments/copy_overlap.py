"""Run a training script with torch.profiler (CUDA activities) over a few of its steps, and say
where the GPU's main stream waited: an experiment for #13's flight-recorder cost (session 17).

Usage: ``torchrun ... bench/experiments/copy_overlap.py SCRIPT ARGS`` (as the example itself), with
``OVERLAP_STEPS=A-B`` (optimizer steps A..B, counted from 0, default 16-18) and ``OVERLAP_OUT`` (a
folder). Under ``fsdp-replay record`` the agent's CUPTI capture stands aside while the profiler
traces (its coexistence rules): what the profiler sees includes the agent's own copies, which is the
point. Rank 0 writes ``overlap.json`` and the profiler's Chrome trace (``trace.json.gz``).

The question it answers: the flight recorder's steps (``--payloads window:4``) are 20-30 ms slower
than metadata-only ones on the H200 with about 1 GB a step of device-to-host copies on a side
stream. If the program's stream's device-to-device copies (the tape's kept outputs, the payload
ring's slots: memcpys) queue on a copy engine behind those host copies, the main stream shows gaps
before its DtoD copies while a DtoH copy is in flight; ``overlap.json`` sums them.
"""

from __future__ import annotations

import gzip
import json
import os
import runpy
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from torch.optim import optimizer as optim_module
from torch.profiler import ProfilerActivity, profile

Interval = tuple[int, int]


def union(intervals: list[Interval]) -> list[Interval]:
    """The intervals merged (sorted, disjoint)."""
    out: list[Interval] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def covered(span: Interval, merged: list[Interval]) -> int:
    """How much of ``span`` the merged intervals cover (ns)."""
    s, e = span
    return sum(max(0, min(e, b) - max(s, a)) for a, b in merged if b > s and a < e)


def copy_kind(name: str) -> str:
    """'DtoD', 'DtoH', 'HtoD', ... from Kineto's memcpy name ("Memcpy DtoH (Device -> Pinned)")."""
    parts = name.split()
    return (
        parts[1]
        if name.startswith("Memcpy") and len(parts) > 1
        else "memset"
        if name.startswith("Memset")
        else ""
    )


def summarize(events: list[Any], steps: int) -> dict[str, Any]:
    gpu = [e for e in events if str(e.device_type()).endswith("CUDA") and e.duration_ns() > 0]
    by_stream: dict[int, list[tuple[int, int, str, str]]] = {}
    for e in gpu:
        start = e.start_ns()
        kind = copy_kind(e.name()) or "kernel"
        by_stream.setdefault(int(e.device_resource_id()), []).append(
            (start, start + e.duration_ns(), kind, e.name())
        )
    if not by_stream:
        return {"error": "no GPU events"}
    streams: dict[str, Any] = {}
    for sid, ops in by_stream.items():
        kinds: dict[str, list[int]] = {}
        for s, e, kind, _ in ops:
            k = kinds.setdefault(kind, [0, 0])
            k[0] += 1
            k[1] += e - s
        streams[str(sid)] = {kind: {"count": n, "ms": round(ns / 1e6, 3)} for kind, (n, ns) in kinds.items()}
    main = max(by_stream, key=lambda sid: sum(e - s for s, e, kind, _ in by_stream[sid] if kind == "kernel"))
    ops = sorted(by_stream[main])
    dtoh = union(
        [(s, e) for sid, o in by_stream.items() if sid != main for s, e, kind, _ in o if kind == "DtoH"]
    )
    gaps: dict[str, list[int]] = {}  # kind of the op after the gap -> [n, gap ns, of it under a DtoH]
    prev_end = ops[0][1]
    for s, e, kind, _ in ops[1:]:
        if s > prev_end:
            g = gaps.setdefault(kind, [0, 0, 0])
            g[0] += 1
            g[1] += s - prev_end
            g[2] += covered((prev_end, s), dtoh)
        prev_end = max(prev_end, e)
    span = ops[-1][1] - ops[0][0]
    busy = sum(b - a for a, b in union([(s, e) for s, e, _, _ in ops]))
    per = max(1, steps)
    return {
        "steps": steps,
        "main_stream": main,
        "main_span_ms_per_step": round(span / per / 1e6, 3),
        "main_busy_ms_per_step": round(busy / per / 1e6, 3),
        "main_idle_ms_per_step": round((span - busy) / per / 1e6, 3),
        "gaps_before_by_kind_per_step": {
            kind: {
                "count": round(n / per, 1),
                "ms": round(ns / per / 1e6, 3),
                "under_dtoh_ms": round(under / per / 1e6, 3),
            }
            for kind, (n, ns, under) in sorted(gaps.items())
        },
        "dtoh_elsewhere_ms_per_step": round(sum(b - a for a, b in dtoh) / per / 1e6, 3),
        "streams": streams,
    }


def main() -> None:
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    first, _, last = os.environ.get("OVERLAP_STEPS", "16-18").partition("-")
    a, b = int(first), int(last or first)
    out = Path(os.environ.get("OVERLAP_OUT", "overlap"))
    # (without CUDA, the CPU's activities: the script still runs, and says it saw no GPU events)
    prof = profile(activities=[ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU])
    seen = {"step": 0, "on": False, "done": False}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def after_step(_opt: Any, _args: Any, _kwargs: Any) -> None:
        step = seen["step"]  # the optimizer step that just ended
        seen["step"] = step + 1
        if step == a - 1 and not seen["on"]:
            sync()
            prof.start()
            seen["on"] = True
        elif step == b and seen["on"] and not seen["done"]:
            sync()
            prof.stop()
            seen["done"] = True

    optim_module.register_optimizer_step_post_hook(after_step)
    runpy.run_path(script, run_name="__main__")
    if not seen["done"] or os.environ.get("RANK", "0") != "0":
        if not seen["done"]:
            print(f"copy_overlap: the run ended before step {b}", file=sys.stderr)
        return
    out.mkdir(parents=True, exist_ok=True)
    doc = summarize(list(prof.profiler.kineto_results.events()), b - a + 1)
    (out / "overlap.json").write_text(json.dumps(doc, indent=1))
    raw = out / "trace.json"
    prof.export_chrome_trace(str(raw))
    with raw.open("rb") as src, gzip.open(out / "trace.json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    print("copy_overlap:", json.dumps({k: doc[k] for k in doc if k != "streams"}))


if __name__ == "__main__":
    main()
