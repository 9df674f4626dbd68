"""Rooted collectives, whose root holds a side the other ranks do not: ``gather_object`` and
``gather`` (the root's outputs), ``scatter_object_list`` and ``scatter`` (the root's inputs), with
objects of a different size on each rank; then one optimizer step. ``desync`` must find the ranks
agreeing, and each rank must replay bit-exact."""

from __future__ import annotations

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out: list[object] | None = [None] * world if rank == 0 else None
    dist.gather_object({"r": rank, "x": list(range(rank + 3))}, out, dst=0)
    got: list[object] = [None]
    dist.scatter_object_list(got, [{"to": i} for i in range(world)] if rank == 0 else None, src=0)
    t = torch.ones(3) * rank
    dist.gather(t, [torch.zeros(3) for _ in range(world)] if rank == 0 else None, dst=0)
    s = torch.zeros(3)
    dist.scatter(s, [torch.full((3,), float(i)) for i in range(world)] if rank == 0 else None, src=0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(s).sum().backward()
    opt.step()
    print(f"rank {rank} got {got[0]}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
