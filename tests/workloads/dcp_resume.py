"""Checkpoint and resume: plain FSDP2 with a ``torch.distributed.checkpoint`` (DCP) in between.

A first run trains steps 0..``--save-at`` (default 2) and saves the model, the optimizer (AdamW's
sharded moments), the LR scheduler and the step with ``dcp.save`` into ``--ckpt-dir``, then stops, as
a preempted job would. Started again with ``--resume``, it builds the same model, ``dcp.load``s that
checkpoint (state dicts through ``torch.distributed.checkpoint.state_dict``, as torchtitan does) and
trains on to step ``--steps - 1`` (default 4), skipping the batches the first run consumed. DCP's
save and load take part in collectives of their own (planning: gather/broadcast of objects).

Prints ``step N loss X`` per optimizer step (rank 0) and writes the rank's local parameter shards
to --save-params ({rank} is replaced) at the end of each run.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class AppState(Stateful):
    """What the checkpoint holds: model, optimizer, scheduler and step (the DCP tutorial's pattern)."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, sched: Any) -> None:
        self.model, self.opt, self.sched, self.step = model, opt, sched, 0

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        return {"model": model_sd, "optim": optim_sd, "sched": self.sched.state_dict(), "step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.opt, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"]
        )
        self.sched.load_state_dict(state_dict["sched"])
        self.step = state_dict["step"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5, help="optimizer steps over both runs")
    p.add_argument("--save-at", type=int, default=2, help="the first run saves after this step and stops")
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--save-params", default="")
    args, _unknown = p.parse_known_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4)
    )
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=args.steps)
    state = AppState(model, opt, sched)

    start = 0
    if args.resume:
        dcp.load({"app": state}, checkpoint_id=args.ckpt_dir)
        start = state.step + 1
        torch.manual_seed(1000 + start)  # dropout after the resume: a fresh, known stream
        if rank == 0:
            print(f"resumed from step {state.step}", flush=True)
    stop = args.steps if args.resume else args.save_at + 1

    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(512, 16, generator=g), torch.randn(512, 4, generator=g))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))
    for step, (x, y) in enumerate(loader):
        if step < start:
            continue  # consumed by the run before the checkpoint
        if step == stop:
            break
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
        if not args.resume and step == args.save_at:
            state.step = step
            dcp.save({"app": state}, checkpoint_id=args.ckpt_dir)
            if rank == 0:
                print(f"saved step {step} to {args.ckpt_dir}", flush=True)

    if args.save_params:
        path = args.save_params.format(rank=rank)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        torch.save({n: p.to_local().detach().clone() for n, p in model.named_parameters()}, path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
