"""DDP over a ``torch.compile``d model whose forward pools rows with ``index_add`` (a kernel
Inductor generates itself), for the tests of compiled-graph tracking (``agent/compiled.py``).
Runs on CPU (gloo) or, with ``--device cuda``, on the GPU (NCCL for one rank per GPU)."""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Pooled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.proj(x))
        pooled = torch.zeros(8, 32, device=x.device, dtype=h.dtype).index_add(0, groups, h)
        return self.head(pooled / x.shape[0])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--save-params", default="")
    p.add_argument("--no-compile", action="store_true", help="eager: the index_add runs aten's kernel")
    args = p.parse_args()
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = Pooled().to(device)
    if not args.no_compile:
        model.compile()
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1 + rank)
    for step in range(args.steps):
        x = torch.randn(4096, 16, generator=g).to(device)
        groups = torch.randint(0, 8, (4096,), generator=g).to(device)
        loss = ddp(x, groups).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
    if (
        rank == 0 and not args.no_compile
    ):  # what Dynamo did: a recording must not change it (no graph break, no recompile)
        from torch._dynamo.utils import counters

        breaks = sum(counters["graph_break"].values())
        print(f"compile: {counters['stats']['unique_graphs']} graphs, {breaks} graph breaks", flush=True)
    if args.save_params:
        path = args.save_params.format(rank=rank)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        torch.save({n: p.detach().cpu().clone() for n, p in model.named_parameters()}, path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
