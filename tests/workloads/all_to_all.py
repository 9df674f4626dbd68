"""``dist.all_to_all_single`` with uneven splits feeding a model, a few DDP-style steps.

The c10d op under it, ``alltoall_base_``, names its tensors ``input`` and ``output``: the trace
must hold both, and a replay fills the output from them (the fake backend leaves it as it was).
Each rank sends ``rank + 1`` rows to rank 0 and the rest of its 4 rows to rank 1.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, "the splits are written for 2 ranks"
    torch.manual_seed(rank)
    model = torch.nn.Linear(8, 8)
    for param in model.parameters():  # the same start on every rank
        dist.broadcast(param.data, src=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sent = [[r + 1, 3 - r] for r in range(world)]  # rows rank r sends to rank 0 and rank 1
    for step in range(args.steps):
        rows = torch.randn(4, 8)
        received = torch.empty(sum(s[rank] for s in sent), 8)
        dist.all_to_all_single(
            received, rows, output_split_sizes=[s[rank] for s in sent], input_split_sizes=sent[rank]
        )
        loss = model(received).square().mean()
        loss.backward()
        for param in model.parameters():
            dist.all_reduce(param.grad)
        opt.step()
        opt.zero_grad()
        print(f"step {step} loss {loss.item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
