"""What the sidecar's eBPF uprobes cost a caller of libnccl, per call and per training step.

As root, with bcc and the real ``libnccl.so.2`` of the nvidia-nccl-cu13 wheel
(``scripts/install-ebpf.sh .venv``) and gcc:

    python bench/bench_ebpf.py --calls 10000 --reps 150

The probes are the daemon's (``sidecar/main.py``): ``Probe`` over the whole NCCL API (uprobe and
uretprobe on each function), scope ``file``, the default transport and buffers, ``NcclStats`` as
the callback, the reader polling in its thread the whole time. The caller is the C load generator
of the eBPF tests (``tests/sidecar/helpers/nccl_loop.c``): ``ncclAllReduce`` on a communicator
NCCL rejects after its argument checks, so each call is NCCL's real host entry path with no GPU,
``--calls`` calls back to back, timed by the loop itself. Three arms, interleaved (the order rotated
every repetition, so that drift and the machine's other work hit all alike):

- ``unprobed``: the same library copied to another file (uprobes are per file: nothing attached);
- ``probed``: the probed file, the caller in the pod's set (the pid filter lets its calls through:
  each is trapped, recorded, delivered and counted);
- ``outside the set``: the probed file, a caller not in the set (scope ``file``: the trap, then the
  filter drops the call).

Per repetition, ns per call of each arm; the added cost of an arm is its difference with the
unprobed run of the same repetition, summarized by the median and a 95% bootstrap interval over the
repetitions. The sidecar's own CPU per call (the reader thread: bcc's delivery and the callback) is
this process's CPU time over the probed runs less the unprobed ones, per call. Then the share of a
training step at the call rates of FSDP2 on an 8B-parameter model (the issue: about 2 calls per
layer per step; assumptions in the table). Writes ``--results`` (markdown, with the command) and
the same numbers as JSON beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import REPO, bootstrap_median, machine_info, portable_command, version_of

sys.path.insert(0, str(REPO / "tests" / "sidecar"))
from sidecar_support import build_nccl_loop, find_libnccl, parse_loop_output

from fsdp_replay.sidecar.ebpf import nccl
from fsdp_replay.sidecar.ebpf.probe import Probe
from fsdp_replay.sidecar.ncclstats import NcclStats

ARMS = ("unprobed", "probed", "outside the set")
# FSDP2 on an 8B-parameter model (Llama-3-8B: 32 transformer blocks, each its own FSDP unit):
# 2 probed calls per block and step (the figure) to 6 (three times as many: the forward
# and backward all-gathers and the reduce-scatter, each with a group start/end or a stream
# wait around it); the step time of such a job on 8 H100/H200 GPUs: 6 x 8e9 parameters x 8,192
# tokens per GPU = 3.9e14 FLOP at ~400 TFLOP/s (40% MFU) is ~1 s, 0.25 s for 2,048 tokens.
LAYERS = 32
CALLS_PER_LAYER = (2, 6)
STEP_S = (0.25, 1.0, 2.0)


def settled(probe: Probe) -> Any:
    """The probe's counters once the reader has delivered every record the kernel emitted."""
    deadline = time.monotonic() + 30
    while True:
        stats = probe.stats()
        if stats.delivered >= stats.emitted or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def run_loop(exe: Path, lib: Path, calls: int, probe: Probe, allow: bool) -> dict[str, float]:
    """One run of the C loop: ``ready``, the pid let through the filter (or not), then go."""
    proc = subprocess.Popen(
        [str(exe), str(lib), str(calls), "wait"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdin is not None
    try:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the load generator did not start")
        if allow:
            probe.allow(proc.pid)
        proc.stdin.write("\n")
        proc.stdin.flush()
        out = parse_loop_output(proc.stdout.readline())
    finally:
        proc.wait(timeout=120)
        if allow:
            probe.untrack(proc.pid)
    if out.get("ret") != 4:  # ncclInvalidArgument: the real argument checks ran
        raise RuntimeError(f"unexpected return value from ncclAllReduce: {out}")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=10_000, help="calls per run")
    p.add_argument("--reps", type=int, default=150, help="repetitions of the three arms")
    p.add_argument("--results", default=str(REPO / "bench" / "results" / "ebpf_overhead.md"))
    a = p.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root (bcc attaches uprobes): run it as root")
    lib = find_libnccl()
    if lib is None:
        sys.exit("the nvidia-nccl-cu13 wheel is not installed (scripts/install-ebpf.sh .venv)")
    started, load_before = time.time(), os.getloadavg()
    tmp = Path(tempfile.mkdtemp(prefix="bench-ebpf-"))
    try:
        exe = build_nccl_loop(tmp)
        copy = tmp / "copy" / lib.name  # another inode: the uprobes of ``lib`` are not in it
        copy.parent.mkdir()
        shutil.copyfile(lib, copy)
        stats = NcclStats(nccl.API)
        probe = Probe(nccl.API, stats.on_event)  # the daemon's: scope "file", default transport
        try:
            t0 = time.perf_counter()
            probe.attach_library(str(lib))
            attach_s = time.perf_counter() - t0
            probe.start()  # the reader polls throughout, as in the daemon
            for _ in range(3):  # warm-up: page cache, the loop's first dlopen
                run_loop(exe, copy, a.calls, probe, False)
                run_loop(exe, lib, a.calls, probe, True)
            before = settled(probe)
            ns: dict[str, list[float]] = {arm: [] for arm in ARMS}
            cpu: dict[str, float] = dict.fromkeys(ARMS, 0.0)
            order = list(ARMS)
            for rep in range(a.reps):
                for arm in order[rep % 3 :] + order[: rep % 3]:
                    target = copy if arm == "unprobed" else lib
                    c0 = time.process_time()
                    out = run_loop(exe, target, a.calls, probe, arm == "probed")
                    cpu[arm] += time.process_time() - c0
                    ns[arm].append(out["ns_per_call"])
            after = settled(probe)
            points = probe.probe_points
        finally:
            probe.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    probed_calls = a.calls * a.reps
    delivered = after.delivered - before.delivered
    entries = after.entries - before.entries
    lost = after.lost - before.lost
    diffs = {arm: [x - u for x, u in zip(ns[arm], ns["unprobed"], strict=True)] for arm in ARMS[1:]}
    added = {arm: bootstrap_median(d) for arm, d in diffs.items()}
    sidecar_us = (cpu["probed"] - cpu["unprobed"]) / probed_calls * 1e6
    per_call_us = added["probed"][0] / 1000
    shares = [
        {
            "calls_per_layer": cpl,
            "calls_per_step": cpl * LAYERS,
            "step_s": step,
            "share_pct": 100 * cpl * LAYERS * per_call_us * 1e-6 / step,
            "share_pct_high": 100 * cpl * LAYERS * added["probed"][2] / 1000 * 1e-6 / step,
        }
        for cpl in CALLS_PER_LAYER
        for step in STEP_S
    ]
    m = machine_info()
    doc: dict[str, Any] = {
        "command": portable_command(),
        "date": datetime.datetime.fromtimestamp(started, datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": m,
        "bcc": str(getattr(sys.modules.get("bcc"), "__version__", "?")),
        "nccl": str(lib.name),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "calls_per_run": a.calls,
        "reps": a.reps,
        "probe_points": points,
        "attach_s": attach_s,
        "ns_per_call": ns,
        "added_ns": {arm: dict(zip(("median", "low", "high"), v, strict=True)) for arm, v in added.items()},
        "probed_calls": probed_calls,
        "delivered": delivered,
        "entries": entries,
        "lost": lost,
        "sidecar_cpu_us_per_call": sidecar_us,
        "shares": shares,
    }
    Path(a.results).with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    lines = [
        "# What the sidecar's eBPF uprobes cost a caller of libnccl",
        "",
        f"- Produced by: `{doc['command']}` (in the repository root, as root)",
        f"- Date: {doc['date']} (took {time.time() - started:.0f} s)",
        f"- Machine: {m['nproc']} CPUs ({m['cpus_usable']} usable), {m['cpu_model']}; {m['platform']}; "
        f"Python {m['python']}, bcc {doc['bcc']} (Debian python3-bpfcc), NCCL from nvidia-nccl-cu13 "
        f"{version_of('nvidia-nccl-cu13')}, fsdp-replay {m['fsdp_replay']}, commit {m['git_commit']}",
        f"- Load average before / after: {[round(x, 2) for x in load_before]} / "
        f"{[round(x, 2) for x in doc['load_after']]} (the machine is shared: see the spread below)",
        f"- Probes: the daemon's `Probe` over the NCCL API, {points} probe points (uprobe + uretprobe per "
        f"function), scope `file`, attached in {attach_s * 1e3:.0f} ms, `NcclStats` as the callback, the reader "
        "polling throughout",
        f"- Caller: `tests/sidecar/helpers/nccl_loop.c`, `ncclAllReduce` back to back, {a.calls:,} calls per run, "
        f"{a.reps} repetitions of the three arms, interleaved (order rotated each repetition), after 3 warm-up "
        "runs of each",
        "",
        "## Per call",
        "",
        "| arm | ns per call, median (min-max) over runs | added ns per call: median of paired differences [95% CI] |",
        "|---|---:|---:|",
    ]
    for arm in ARMS:
        xs = ns[arm]
        cell = "" if arm == "unprobed" else "{:.0f} [{:.0f}, {:.0f}]".format(*added[arm])
        lines.append(f"| {arm} | {statistics.median(xs):.0f} ({min(xs):.0f}-{max(xs):.0f}) | {cell} |")
    lines += [
        "",
        f"Probed calls: {probed_calls:,}; the filter let through {entries:,} (only the probed arm's), the reader "
        f"got {delivered:,}, lost {lost:,}. The sidecar's reader thread spent **{sidecar_us:.1f} us of CPU per probed "
        "call** (bcc's delivery and `NcclStats`; this process's CPU time in the probed runs less the unprobed "
        "ones): on the sidecar's CPUs, not the trainer's.",
        "",
        "## Share of a training step",
        "",
        f"Assumed: FSDP2 on an 8B-parameter model, {LAYERS} transformer blocks, each an FSDP unit; "
        f"{CALLS_PER_LAYER[0]} probed calls per block and step (the issue's figure) to {CALLS_PER_LAYER[1]} (three "
        "times as many: the forward and backward all-gathers and the reduce-scatter, each with a group start/end "
        "around it); a step on 8 H100/H200 GPUs of about 1 s (6 x 8e9 parameters x 8,192 tokens per GPU = 3.9e14 "
        "FLOP at ~400 TFLOP/s, 40% MFU), 0.25 s for 2,048 tokens, 2 s for 16,384. Added cost per call: "
        f"{per_call_us:.2f} us (upper end of its interval {added['probed'][2] / 1000:.2f} us).",
        "",
        "| probed calls per step | step time | added time per step | share of the step (at the interval's upper end) |",
        "|---:|---:|---:|---:|",
    ]
    for s in shares:
        lines.append(
            f"| {s['calls_per_step']} | {s['step_s']:.2f} s | {s['calls_per_step'] * per_call_us:.0f} us | "
            f"{s['share_pct']:.4f}% ({s['share_pct_high']:.4f}%) |"
        )
    lines += [
        "",
        "Reading it: the probes cost a caller microseconds per NCCL call, whatever the collective moves (the trap "
        "and the return trampoline run before NCCL does any work); a training step issues tens to hundreds of "
        "calls and lasts a large fraction of a second, so the share is a few hundredths of a percent at the "
        "issue's rate, and stays under a quarter of a percent with three times the calls and a 0.25 s step. A process "
        "outside the pod's set that maps the same file pays the trap too (scope `file`; scope `process` removes "
        "that, docs/sidecar-ebpf.md). On a shared 2-CPU VM the run-to-run spread is large; the paired differences "
        "and their interval are the figure to read.",
        "",
    ]
    Path(a.results).write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
