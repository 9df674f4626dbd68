"""A job that resumes from ``resume.pt`` in its working directory when it finds one, and whose
rank 0 alone writes that file during the run: a replay of any rank, in the recorded folder right
after recording, must start fresh as the recorded ranks did (``replayer/overlay.py``).

``resume_if_present.py [--steps N] [--save-at S]``, under torchrun (gloo, DDP on CPU).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

CHECKPOINT = "resume.pt"  # relative: in the working directory


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--save-at", type=int, default=2)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = 0
    if os.path.exists(CHECKPOINT):  # every rank resumes from what rank 0 saved
        state = torch.load(CHECKPOINT)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"] + 1
    ddp = DDP(model)
    g = torch.Generator().manual_seed(1 + rank)
    for step in range(start, args.steps):
        loss = ddp(torch.randn(4, 8, generator=g)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step == args.save_at and rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, CHECKPOINT)
        print(f"rank {rank} step {step} loss {loss.item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
