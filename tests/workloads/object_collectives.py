"""Object collectives and a broadcast into a fresh buffer, around a few DDP-style steps.

Rank 0 broadcasts its model and optimizer state with ``broadcast_object_list`` (the pickled bytes
of a tensor embed its storage address: other bytes in every process), then a tensor into rank
1's ``torch.empty`` receive buffer; every rank gathers an object with ``all_gather_object``. With
``PLANT_OBJECT=1`` rank 0 adds random bytes to what it broadcasts: a real difference in what was
sent, which a replay must catch.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    note = os.urandom(4).hex() if os.environ.get("PLANT_OBJECT") else ""
    state = [{"model": model.state_dict(), "opt": opt.state_dict(), "note": note}] if rank == 0 else [None]
    dist.broadcast_object_list(state, src=0)
    model.load_state_dict(state[0]["model"])
    opt.load_state_dict(state[0]["opt"])
    scale = torch.randn(4) if rank == 0 else torch.empty(4)
    dist.broadcast(scale, src=0)
    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"rank": rank, "t": torch.full((3,), float(rank))})
    peer = gathered[(rank + 1) % len(gathered)]["t"]  # type: ignore[index]
    for step in range(args.steps):
        loss = (model(torch.randn(2, 8)) * scale.sum()).sum() + peer.sum()
        loss.backward()
        for param in model.parameters():
            dist.all_reduce(param.grad)
        opt.step()
        opt.zero_grad()
        print(f"step {step} loss {loss.item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
