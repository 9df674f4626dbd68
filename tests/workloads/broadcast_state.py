"""State sent from rank 0: ``broadcast_object_list`` of a full state dict, then FSDP2 training.

Rank 0 alone builds the state to start from, as programs do that read a checkpoint on rank 0 only:
the model's state dict and a full AdamW state dict keyed by parameter name (the layout of
``torch.distributed.checkpoint.state_dict.get_state_dict``) whose state holds tensors (``step``,
``exp_avg``, ``exp_avg_sq``) as a checkpoint taken after some steps would; it sends
``{"model", "optim"}`` to every rank with ``dist.broadcast_object_list``. The
other ranks start from a different seed, so only what they receive makes them agree. Every rank
then shards the model (``fully_shard``), loads the received model and optimizer state into its
shards (``set_state_dict(..., full_state_dict=True)``), and trains 3 steps. Rank 0 also sends one
tensor with ``dist.broadcast``, per-step LR factors, which rank 1 receives into a fresh
``torch.empty`` buffer (whatever bytes that memory held are overwritten by the broadcast).

Prints ``step N loss X`` per optimizer step (rank 0) and writes the rank's local parameter shards
to --save-params ({rank} is replaced).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def build() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 4))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--save-params", default="")
    args, _unknown = p.parse_known_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)  # the ranks' own initializations differ: only the broadcast aligns them
    model = build()

    box: list[object] = [None]
    if rank == 0:
        model_sd, optim_sd = get_state_dict(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        g = torch.Generator().manual_seed(2)
        optim_sd["state"] = {
            name: {
                "step": torch.tensor(10.0),
                "exp_avg": 1e-3 * torch.randn(t.shape, generator=g),
                "exp_avg_sq": 1e-6 * torch.rand(t.shape, generator=g),
            }
            for name, t in model_sd.items()
        }
        box = [{"model": model_sd, "optim": optim_sd}]
    dist.broadcast_object_list(box, src=0)
    received = box[0]
    assert isinstance(received, dict)

    lr_factors = torch.tensor([1.0, 0.75, 0.5, 0.25]) if rank == 0 else torch.empty(4)
    dist.broadcast(lr_factors, src=0)

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    set_state_dict(
        model,
        opt,
        model_state_dict=received["model"],
        optim_state_dict=received["optim"],
        options=StateDictOptions(full_state_dict=True),
    )

    torch.manual_seed(0)  # the same dropout stream on every rank from here
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(256, 16, generator=g), torch.randn(256, 4, generator=g))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))
    for step, (x, y) in enumerate(loader):
        if step == args.steps:
            break
        for group in opt.param_groups:
            group["lr"] = 1e-2 * float(lr_factors[step % len(lr_factors)])
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)

    if args.save_params:
        path = args.save_params.format(rank=rank)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        torch.save({n: p.to_local().detach().clone() for n, p in model.named_parameters()}, path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
