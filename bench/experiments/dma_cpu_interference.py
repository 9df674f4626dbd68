"""Does a stream of device-to-host copies slow the CPU's own work? (#13, session 18)

The flight recorder's window:4 steps are 20-45% slower than metadata-only ones on the reference
step, which is launch-bound (the GPU is idle most of a step), and session 16's profile showed every
library of the program's forward taking about twice the CPU, not the agent's frames. One mechanism
that would do that: about 1 GB a step of DMA writes into host memory (the kept outputs' host
copies), which on Intel servers land in the last-level cache (DDIO) and evict the program's
working set, and take memory bandwidth. This measures it without the recorder: the same CPU work
timed while the GPU's copy engines are idle, copy device to host (pinned), host to device, and
device to device, interleaved, several rounds.

CPU work: (a) launching small CUDA kernels from Python (what the launch-bound step does),
(b) pure Python (dict and list work), (c) a 16 MiB numpy copy (LLC-sized). Each copy load is
queued ahead on a side stream (enough bytes to outlast the measurement), so no thread of ours
runs while it is measured.

Writes JSON to ``$DMA_OUT`` (default ``dma_cpu_interference.json``) and prints a table.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import numpy as np
import torch

CHUNK = 256 << 20  # bytes a copy
ROUNDS = int(os.environ.get("DMA_ROUNDS", "5"))


def launches(xs: list[torch.Tensor]) -> None:
    for _ in range(4):
        for x in xs:
            x.mul_(1.0001).add_(0.5)


def python_work() -> None:
    d: dict[int, int] = {}
    for i in range(120_000):
        d[i & 4095] = d.get(i & 4095, 0) + i
    sorted(d.items())


def numpy_copy(a: np.ndarray, b: np.ndarray) -> None:
    for _ in range(20):
        np.copyto(b, a)


def main() -> None:
    dev = torch.device("cuda")
    src = torch.empty(CHUNK, dtype=torch.uint8, device=dev).fill_(7)
    dst_dev = torch.empty(CHUNK, dtype=torch.uint8, device=dev)
    hosts = [torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(4)]
    xs = [torch.randn(256, device=dev) for _ in range(500)]
    a = np.ones(16 << 20, dtype=np.uint8)
    b = np.empty_like(a)
    side = torch.cuda.Stream()
    works = {
        "launches": lambda: (launches(xs), torch.cuda.current_stream().synchronize()),
        "python": python_work,
        "numpy16M": lambda: numpy_copy(a, b),
    }

    def load(kind: str, n: int) -> None:
        with torch.cuda.stream(side):
            for i in range(n):
                if kind == "d2h":
                    hosts[i % 4].copy_(src, non_blocking=True)
                elif kind == "h2d":
                    dst_dev.copy_(hosts[i % 4], non_blocking=True)
                elif kind == "d2d":
                    dst_dev.copy_(src, non_blocking=True)

    for w in works.values():  # warm up
        w()
    torch.cuda.synchronize()
    # bandwidth of each copy kind (GB/s), to size the queued load
    gbps: dict[str, float] = {}
    for kind in ("d2h", "h2d", "d2d"):
        t = time.perf_counter()
        load(kind, 8)
        side.synchronize()
        gbps[kind] = 8 * CHUNK / (time.perf_counter() - t) / 1e9
    times: dict[str, dict[str, list[float]]] = {}
    busy_check: dict[str, list[bool]] = {}
    for r in range(ROUNDS):
        modes = ["idle", "d2h", "h2d", "d2d"]
        modes = modes[r % 4 :] + modes[: r % 4]
        for mode in modes:
            for name, w in works.items():
                if mode != "idle":  # enough copies to outlast the work (~0.5 s at the measured rate)
                    n = max(4, int(0.6 * gbps[mode] * 1e9 / CHUNK))
                    load(mode, n)
                t = time.perf_counter()
                w()
                dt = time.perf_counter() - t
                busy_check.setdefault(mode, []).append(mode == "idle" or not side.query())
                side.synchronize()
                times.setdefault(mode, {}).setdefault(name, []).append(dt * 1e3)
    out = {
        "gbps": gbps,
        "rounds": ROUNDS,
        "chunk_bytes": CHUNK,
        "ms": {m: {n: statistics.median(v) for n, v in d.items()} for m, d in times.items()},
        "all_ms": times,
        "copies_still_running_at_end": {m: sum(v) / len(v) for m, v in busy_check.items()},
    }
    print(f"copy GB/s: {', '.join(f'{k} {v:.1f}' for k, v in gbps.items())}")
    print(f"{'mode':6} " + " ".join(f"{n:>12}" for n in works) + "   (median ms; ratio to idle)")
    for m in ("idle", "d2h", "h2d", "d2d"):
        row = out["ms"][m]
        print(
            f"{m:6} "
            + " ".join(f"{row[n]:7.2f} {row[n] / out['ms']['idle'][n]:4.2f}" for n in works)
            + f"   copies outlasted the work: {out['copies_still_running_at_end'][m]:.0%}"
        )
    with open(os.environ.get("DMA_OUT", "dma_cpu_interference.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
