"""Host and device time of fingerprinting one taped call's outputs: one pass per output (what the
tape did before session 7), one batched torch pass for all of them (``fingerprint_many`` without
Triton), and the one-launch Triton kernel (``fingerprint/fused.py``, what ``fingerprint_many`` takes
where Triton runs). The values of the three ways are checked equal first.

The shapes are the cuDNN attention backward's dq, dk, dv at the reference size (batch 16, 16 heads,
sequence 512, head dim 64, bf16). Rounds interleave the two ways; each round times ``--calls``
calls with the values resolved at the end, as the writer thread does. Prints a markdown table.

    python bench/experiments/tape_fp_cost.py [--calls 200] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fsdp_replay.agent.fingerprint import fingerprint, fingerprint_many, fused
from fsdp_replay.agent.fingerprint.pending import Pending


def resolve(fps: list) -> None:
    for fp, nf, _ in fps:
        for v in (fp, nf):
            if isinstance(v, Pending):
                v.value()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    outs = [torch.randn(16, 16, 512, 64, device="cuda").to(torch.bfloat16) for _ in range(3)]
    kernel = fused._get()
    assert kernel, "Triton does not run here"

    def torch_batched() -> list:
        fused._kernel = False  # fingerprint_many's torch path
        try:
            return fingerprint_many(outs)
        finally:
            fused._kernel = kernel

    ways = {
        "per output": lambda: [fingerprint(t, "lin64") for t in outs],
        "batched (torch)": torch_batched,
        "fused (Triton)": lambda: fingerprint_many(outs),
    }
    got = {}
    for name, f in ways.items():  # warm up, and the same values every way
        fps = f()
        resolve(fps)
        got[name] = [(fp.value(), nf.value()) for fp, nf, _ in fps]
    assert len({repr(v) for v in got.values()}) == 1, got
    torch.cuda.synchronize()
    host: dict[str, list[float]] = {k: [] for k in ways}
    wall: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(args.rounds):
        for name, f in ways.items():
            kept = []
            torch.cuda.synchronize()
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(args.calls):
                kept.append(f())
            c1 = time.thread_time()
            for fps in kept:
                resolve(fps)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            host[name].append((c1 - c0) / args.calls * 1e6)
            wall[name].append((t1 - t0) / args.calls * 1e6)
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {args.calls} calls x {args.rounds} rounds"
    )
    print("| way | host CPU us/call (median, min-max) | wall us/call incl. device (median, min-max) |")
    print("|---|---:|---:|")
    for name in ways:
        h, w = host[name], wall[name]
        print(
            f"| {name} | {statistics.median(h):.0f} ({min(h):.0f}-{max(h):.0f}) | "
            f"{statistics.median(w):.0f} ({min(w):.0f}-{max(w):.0f}) |"
        )


if __name__ == "__main__":
    main()
