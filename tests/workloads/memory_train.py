"""A small CUDA training loop that prints the caching allocator's counters right after each
optimizer step, for the allocation tests (``tests/system/test_gpu_memory.py``).

Each rank trains a 2-layer MLP on its own GPU (``cuda:LOCAL_RANK``) with gradient accumulation,
all-reduces its loss, and after ``opt.step()`` prints ``MEM step=K max_allocated=N
max_reserved=N allocated=N``. ``--reset-peaks`` resets torch's peaks at each step's start, so the
printed peaks are the step's own. ``--oom-at-step K`` asks, in step K's second micro-step, for
twice the GPU's memory (a whole number of 2 MiB pages, so torch asks the driver for exactly that),
after printing ``OOM-ASK bytes=N allocated=N``: the run dies of ``torch.OutOfMemoryError``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn

PAGE = 2 << 20


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--reset-peaks", action="store_true")
    p.add_argument("--oom-at-step", type=int, default=-1)
    args = p.parse_args()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, args.width), nn.GELU(), nn.Linear(args.width, 512)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        if args.reset_peaks:
            torch.cuda.reset_peak_memory_stats(device)
        loss = torch.zeros((), device=device)
        for micro in range(args.grad_accum):
            x = torch.randn(256, 512, device=device)
            if step == args.oom_at_step and micro == 1:
                total = torch.cuda.get_device_properties(device).total_memory
                ask = (2 * total // PAGE) * PAGE
                print(f"OOM-ASK bytes={ask} allocated={torch.cuda.memory_allocated(device)}", flush=True)
                torch.empty(ask, dtype=torch.uint8, device=device)
            loss = model(x).pow(2).mean() / args.grad_accum
            loss.backward()
        dist.all_reduce(loss.detach())
        opt.step()
        print(
            f"MEM step={step} max_allocated={torch.cuda.max_memory_allocated(device)} "
            f"max_reserved={torch.cuda.max_memory_reserved(device)} "
            f"allocated={torch.cuda.memory_allocated(device)}",
            flush=True,
        )
        opt.zero_grad(set_to_none=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
