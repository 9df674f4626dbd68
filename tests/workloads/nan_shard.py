"""A tiny FSDP2 job (gloo) whose rank --nan-rank sets one element of its shard of a parameter to NaN.

Before the forward of step --nan-at-step (after the previous step's optimizer step and its
recorded parameters), rank --nan-rank writes NaN into element 0 of its local shard of the first
Linear's weight. The first non-finite value the job produces is then that rank's input to the
forward all-gather of that layer: ``fsdp-replay nan`` must name it, not the loss that follows.
Gradient accumulation over 2 micro-batches, so a step has forward and backward collectives twice.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--nan-at-step", type=int, default=2)
    p.add_argument("--nan-rank", type=int, default=0)
    p.add_argument("--micro", type=int, default=2)
    args, _unknown = p.parse_known_args()  # the test harness adds --save-params
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1 + rank)
    for step in range(args.steps):
        if step == args.nan_at_step and rank == args.nan_rank:
            weight = model[0].weight
            assert isinstance(weight, DTensor)  # fully_shard made it one: this rank's shard is local
            with torch.no_grad():
                weight.to_local().view(-1)[0] = float("nan")
        for _ in range(args.micro):
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
            loss = nn.functional.mse_loss(model(x), y) / args.micro
            loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
