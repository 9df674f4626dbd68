"""Measure what the sidecar's uprobes cost a caller of libnccl (the OVERHEAD section of
docs/sidecar-ebpf.md). As root, with bcc and the nvidia-nccl-cu13 wheel:

    .venv/bin/python tests/sidecar/helpers/overhead.py [--calls 200000] [--repeats 5]
    .venv/bin/python tests/sidecar/helpers/overhead.py --sustain 60000,130000,200000
    .venv/bin/python tests/sidecar/helpers/overhead.py --reader
    .venv/bin/python tests/sidecar/helpers/overhead.py --ctypes

The C load generator (nccl_loop.c) calls ncclAllReduce in a tight loop, unpaced, under each
configuration; the table gives the median ns per call of the loop and the difference from the
unprobed loop. Unless "live consumer" is named, the records are drained after the loop (the ring
buffer is made large enough to hold them all), so the figure is the cost in the calling thread
alone, not the competition for CPUs with the sidecar's Python reader. "live consumer" rows poll
in a thread while the loop runs flat out, with the default buffer sizes (ring buffer 4 MiB, perf
buffer 1 MiB per CPU): their "lost" column is what an unpaced caller outruns.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sidecar_support import NCCL_CALLS, build_nccl_loop, find_libnccl, parse_loop_output

from fsdp_replay.sidecar.ebpf import nccl
from fsdp_replay.sidecar.ebpf.probe import Event, Probe


def run_loop(
    exe: Path, lib: Path, calls: int, before_go: Callable[[int], None], rate: int = 0
) -> dict[str, float]:
    cmd = [str(exe), str(lib), str(calls), "wait", *([str(rate)] if rate else [])]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    assert proc.stdout.readline().strip() == "ready"
    before_go(proc.pid)
    proc.stdin.write("\n")
    proc.stdin.flush()
    out = proc.stdout.readline()
    proc.wait()
    return parse_loop_output(out)


def sustain(exe: Path, lib: Path, rates: list[int], seconds: int = 3) -> None:
    """Paced loops with the reader polling live, default buffers: the rates it keeps up with."""
    print(f"paced ncclAllReduce for {seconds} s, uprobe+uretprobe, reader polling live, default buffers")
    print(f"{'transport':<10} {'target/s':>9} {'reached/s':>10} {'calls':>8} {'delivered':>10} {'lost':>7}")
    for transport in ("ringbuf", "perf"):
        for rate in rates:
            with Probe(nccl.by_name("ncclAllReduce"), lambda e: None, transport=transport) as probe:

                def go(pid: int, probe: Probe = probe) -> None:
                    probe.track(pid)
                    probe.start(timeout_ms=50)

                result = run_loop(exe, lib, rate * seconds, go, rate=rate)
                probe.stop()
                probe.drain()
                stats = probe.stats()
            print(
                f"{transport:<10} {rate:>9} {result['rate']:>10.0f} {stats.entries:>8} "
                f"{stats.delivered:>10} {stats.lost:>7}"
            )


def reader(exe: Path, lib: Path, calls: int) -> None:
    """The Python side alone: records buffered first, then drained, per kind of callback."""
    pages = 1 << max(10, (calls * 200 // 4096).bit_length())
    seen = [0]

    def count(e: Event) -> None:
        seen[0] += 1

    def decode(e: Event) -> None:
        seen[0] += len(e.args)

    print(f"draining {calls} buffered records (ring buffer), per callback")
    print(f"{'callback':<44} {'records/s':>10} {'us/record':>10}")
    for label, callback in (("none (bcc + ctypes delivery only)", None), ("counts Events", count),
                            ("reads Event.args (a dict)", decode)):  # fmt: skip
        with Probe(nccl.by_name("ncclAllReduce"), callback, ringbuf_pages=pages) as probe:
            run_loop(exe, lib, calls, probe.track)
            t0 = time.perf_counter()
            n = probe.drain()
            dt = time.perf_counter() - t0
        print(f"{label:<44} {n / dt:>10.0f} {dt / n * 1e6:>10.2f}")


def ctypes_rate(lib: Path, calls: int) -> None:
    """How fast Python itself can call a probed function through ctypes (the helper's --repeat)."""
    print(f"ctypes loop (tests/sidecar/helpers/nccl_calls.py --repeat {calls}), calls/s")
    for label, probed in (("no probe", False), ("uprobe+uretprobe, reader polling live", True)):
        with Probe(nccl.by_name("ncclAllReduce"), lambda e: None) as probe:
            cmd = [sys.executable, str(NCCL_CALLS), str(lib), "--wait-stdin", "--repeat", str(calls)]
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert proc.stdout is not None and proc.stdin is not None
            assert proc.stdout.readline().strip() == "ready"
            if probed:
                probe.track(proc.pid)
                probe.start(timeout_ms=50)
            proc.stdin.write("\n")
            proc.stdin.flush()
            rate = json.loads(proc.stdout.readline())["repeat_rate"]
            proc.wait()
            probe.stop()
            probe.drain()
            lost = probe.stats().lost
        print(f"{label:<44} {rate:>10.0f}   lost {lost}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sustain", metavar="RATES", help="comma-separated calls/s: paced runs instead")
    ap.add_argument("--reader", action="store_true", help="the Python reader's cost per record instead")
    ap.add_argument("--ctypes", action="store_true", help="the rate of a ctypes caller instead")
    args = ap.parse_args()
    lib = find_libnccl()
    if lib is None:
        sys.exit("the nvidia-nccl-cu13 wheel is not installed (scripts/install-ebpf.sh VENV)")
    exe = build_nccl_loop(Path(tempfile.mkdtemp()))
    if args.ctypes:
        ctypes_rate(lib, args.calls)
        return
    if args.reader:
        reader(exe, lib, args.calls)
        return
    if args.sustain:
        sustain(exe, lib, [int(r) for r in args.sustain.split(",")])
        return
    allreduce = nccl.by_name("ncclAllReduce")
    pages = 1 << max(10, (args.calls * 200 // 4096).bit_length())  # room for every record

    configs: list[tuple[str, dict[str, object] | None, str]] = [
        ("no probe attached", None, "none"),
        ("uprobe+uretprobe, pid not in the filter (scope=file)", {}, "other"),
        ("uprobe+uretprobe, scope=process, attached to another pid", {"scope": "process"}, "other"),
        ("uprobe only (entry records)", {"returns": False}, "self"),
        ("uprobe+uretprobe, ring buffer", {}, "self"),
        ("uprobe+uretprobe, perf buffer", {"transport": "perf", "perf_pages": pages}, "self"),
        ("uprobe+uretprobe, ring buffer, live consumer", {}, "live"),
        ("uprobe+uretprobe, perf buffer (wakeup every 32), live consumer", {"transport": "perf"}, "live"),
        ("uprobe+uretprobe, perf buffer, wakeup every record, live consumer",
         {"transport": "perf", "perf_wakeup_events": 1}, "live"),
    ]  # fmt: skip
    rows: list[tuple[str, float, int, int]] = []
    base = 0.0
    for label, options, mode in configs:
        samples: list[float] = []
        lost = delivered = 0
        for _ in range(args.repeats):
            if options is None:
                samples.append(run_loop(exe, lib, args.calls, lambda pid: None)["ns_per_call"])
                continue
            # Drained afterwards: buffers big enough for every record. Live: the defaults.
            kwargs: dict[str, object] = (
                dict(options) if mode == "live" else {"ringbuf_pages": pages, **options}
            )
            with Probe(allreduce, lambda e: None, **kwargs) as probe:  # type: ignore[arg-type]
                probe.attach_library(str(lib), pid=os.getpid())  # pid: used by scope=process only

                def go(pid: int, probe: Probe = probe, mode: str = mode) -> None:
                    if mode in ("self", "live"):
                        probe.allow(pid)
                        if probe.scope == "process":
                            probe.attach_library(str(lib), pid=pid)
                    if mode == "live":
                        probe.start(timeout_ms=50)

                samples.append(run_loop(exe, lib, args.calls, go)["ns_per_call"])
                probe.stop()
                probe.drain()
                stats = probe.stats()
                lost += stats.lost
                delivered += stats.delivered
        ns = statistics.median(samples)
        if options is None:
            base = ns
        rows.append((label, ns, lost, delivered))
    print(f"ncclAllReduce, {args.calls} calls x {args.repeats} runs, median ns/call; NCCL {lib}")
    print(f"{'configuration':<68} {'ns/call':>9} {'+ns/call':>9} {'delivered':>10} {'lost':>8}")
    for label, ns, lost, delivered in rows:
        print(f"{label:<68} {ns:>9.0f} {ns - base:>9.0f} {delivered:>10} {lost:>8}")


if __name__ == "__main__":
    main()
