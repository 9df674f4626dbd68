"""A DDP-style loop with an evaluation every third step (more collectives in those steps) in which
rank 1 stops before the next step's first collective: a hang whose last step is unlike the one
before it for a reason that has nothing to do with the hang (the evaluation).

Rank 1 sleeps ``--stall-s`` seconds after step ``--stall-at-step``'s evaluation; rank 0 waits for
it in a gradient all_reduce until the process group's timeout (``--pg-timeout``) ends it.
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--stall-at-step", type=int, default=2)
    p.add_argument("--stall-s", type=float, default=30.0)
    p.add_argument("--pg-timeout", type=float, default=8.0)
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(args.steps):
        x = torch.randn(4, 8)
        model(x).pow(2).mean().backward()
        for param in model.parameters():
            dist.all_reduce(param.grad)
        opt.step()
        opt.zero_grad()
        if step % 3 == 2:  # the evaluation: two more collectives, after the optimizer step
            with torch.no_grad():
                score = model(torch.randn(4, 8)).sum().reshape(1)
            dist.all_reduce(score)
            dist.broadcast(score, src=0)
            if step == args.stall_at_step and rank == 1:
                time.sleep(args.stall_s)
        print(f"step {step}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
