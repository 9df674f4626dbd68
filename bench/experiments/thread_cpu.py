"""Run a training script and account, over its optimizer steps A..B, for each thread's CPU time
and context switches: an experiment for #13's flight-recorder cost (session 18).

Usage: ``torchrun ... bench/experiments/thread_cpu.py SCRIPT ARGS`` (as the example itself), with
``THREADCPU_STEPS=A-B`` (default 12-28) and ``THREADCPU_OUT`` (a JSON file; rank 0 writes it).

The question it answers: window:4's steps are about 26 ms slower than metadata-only ones on the
H200 while the agent's hooks account for about 10 ms of it, and the GPU is idle most of a step.
If the program's thread spends the rest running (its own code slower), its CPU time a step rises
with the wall time; if it spends it waiting (the GIL, a synchronization), its CPU time a step
does not, and its voluntary context switches a step rise. Per thread: name, CPU ms a step,
voluntary and involuntary context switches a step (``/proc/self/task/*``; the program's thread's
CPU also by ``time.thread_time_ns``, exact), and the CUDA caching allocators' counts a step
(device: cudaMalloc and frees, retries; pinned host: its allocations, ``torch.cuda.host_memory_stats``).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch.optim import optimizer as optim_module

TICK = os.sysconf("SC_CLK_TCK")


def threads() -> dict[int, dict[str, Any]]:
    """Every thread of this process: name, CPU seconds (user + system), context switches."""
    out: dict[int, dict[str, Any]] = {}
    for tid in os.listdir("/proc/self/task"):
        base = f"/proc/self/task/{tid}"
        try:
            with open(f"{base}/stat") as f:
                stat = f.read()
            with open(f"{base}/status") as f:
                status = dict(line.split(":\t", 1) for line in f.read().splitlines() if ":\t" in line)
        except OSError:  # the thread ended meanwhile
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        out[int(tid)] = {
            "name": name,
            "cpu_s": (int(fields[11]) + int(fields[12])) / TICK,
            "vol": int(status.get("voluntary_ctxt_switches", "0").strip()),
            "invol": int(status.get("nonvoluntary_ctxt_switches", "0").strip()),
        }
    return out


def delta(a: dict[int, dict[str, Any]], b: dict[int, dict[str, Any]], steps: int) -> list[dict[str, Any]]:
    """Per thread (present at the end), what the steps between ``a`` and ``b`` cost, per step."""
    rows = []
    for tid, end in b.items():
        start = a.get(tid, {"cpu_s": 0.0, "vol": 0, "invol": 0})
        rows.append(
            {
                "tid": tid,
                "name": end["name"],
                "cpu_ms_per_step": round((end["cpu_s"] - start["cpu_s"]) * 1e3 / steps, 2),
                "vol_per_step": round((end["vol"] - start["vol"]) / steps, 1),
                "invol_per_step": round((end["invol"] - start["invol"]) / steps, 1),
                "new": tid not in a,
            }
        )
    return sorted(rows, key=lambda r: -r["cpu_ms_per_step"])


def allocator_stats() -> dict[str, float]:
    """The CUDA caching allocators' cumulative counts (device and pinned host): how often they
    went to the driver (cudaMalloc / cudaHostAlloc and frees), retried, or synchronized. Empty
    without CUDA."""
    if not torch.cuda.is_available():
        return {}
    out: dict[str, float] = {}
    dev = torch.cuda.memory_stats()
    for k in ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams"):
        if k in dev:
            out[f"device.{k}"] = dev[k]
    for k in ("allocation.all.allocated", "allocated_bytes.all.allocated", "segment.all.allocated"):
        if k in dev:
            out[f"device.{k}"] = dev[k]
    for k, v in torch.cuda.host_memory_stats().items():
        if isinstance(v, int | float) and ("num" in k or "allocations" in k or "time" in k):
            out[f"host.{k}"] = v
    return out


def main() -> None:
    a, b = (int(x) for x in os.environ.get("THREADCPU_STEPS", "12-28").split("-"))
    out_file = Path(os.environ.get("THREADCPU_OUT", "thread_cpu.json"))
    rank = int(os.environ.get("RANK", "0"))
    marks: dict[str, Any] = {"step": 0}

    def after_step(_opt: Any, _args: Any, _kwargs: Any) -> None:
        step = marks["step"]  # the optimizer step that just ended
        marks["step"] = step + 1
        if step in (a - 1, b):
            key = "start" if step == a - 1 else "end"
            marks[key] = (time.perf_counter(), time.thread_time_ns(), threading.get_native_id(), threads())
            marks[key + "_alloc"] = allocator_stats()

    optim_module.register_optimizer_step_post_hook(after_step)
    script, *args = sys.argv[1:]
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        if rank == 0:
            if "start" not in marks or "end" not in marks:
                print(f"thread_cpu: the run ended before step {b}", file=sys.stderr)
            else:
                steps = b - a + 1
                (w0, c0, tid0, t0), (w1, c1, _tid1, t1) = marks["start"], marks["end"]
                rows = delta(t0, t1, steps)
                main_row = next((r for r in rows if r["tid"] == tid0), {})
                doc = {
                    "steps": f"{a}-{b}",
                    "wall_ms_per_step": round((w1 - w0) * 1e3 / steps, 2),
                    "main_thread_cpu_ms_per_step": round((c1 - c0) / 1e6 / steps, 2),
                    "main_thread": main_row,
                    "all_threads_cpu_ms_per_step": round(sum(r["cpu_ms_per_step"] for r in rows), 2),
                    "switch_interval_s": sys.getswitchinterval(),
                    # the allocators' counts over the steps, per step (cudaMalloc, cudaHostAlloc...)
                    "allocators_per_step": {
                        k: round((v - marks["start_alloc"].get(k, 0)) / steps, 2)
                        for k, v in marks["end_alloc"].items()
                    },
                    "threads": rows,
                }
                out_file.write_text(json.dumps(doc, indent=1))
                print("thread_cpu:", json.dumps({k: v for k, v in doc.items() if k != "threads"}))


if __name__ == "__main__":
    main()
