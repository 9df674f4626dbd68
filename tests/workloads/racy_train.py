"""A tiny FSDP2 training step with a planted nondeterministic op: ``fsdpr_test::racy_mix``.

Its CPU kernel sums each row in a random order (read from /dev/urandom, not from torch's RNG nor
from os.urandom, which a replay gives back: a racing kernel's order comes from the hardware), so
its float result differs in the last bits from run to run: what a CUDA kernel with atomic adds
does. The model adds it, scaled down, to a
hidden activation, so the loss and every parameter depend on it. Without the tape a replay of this
run diverges; with ``--tape-ops fsdpr_test::racy_mix`` it injects the recorded results.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

LIB = torch.library.Library("fsdpr_test", "DEF")
LIB.define("racy_mix(Tensor x) -> Tensor")


def _racy_mix_cpu(x: torch.Tensor) -> torch.Tensor:
    with open("/dev/urandom", "rb") as f:  # the hardware's order: not os.urandom, which a replay gives back
        seed = int.from_bytes(f.read(8), "little")
    order = np.random.default_rng(seed).permutation(x.shape[-1])
    acc = torch.zeros(x.shape[:-1], dtype=torch.float32)
    for chunk in np.array_split(order, 16):  # a different summation order every call
        acc = acc + x[..., torch.from_numpy(chunk)].float().sum(-1)
    return acc.unsqueeze(-1).to(x.dtype).expand_as(x).contiguous()


LIB.impl("racy_mix", _racy_mix_cpu, "CPU")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 512)
        self.out = nn.Linear(512, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        mixed = torch.ops.fsdpr_test.racy_mix(h.detach())  # no gradient through it: a bias
        return self.out(h + 1e-3 * mixed)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--ddp", action="store_true", help="DistributedDataParallel instead of FSDP2")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model: nn.Module = Block()
    if args.ddp:
        model = nn.parallel.DistributedDataParallel(model)
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # CPU even where a GPU is there
        fully_shard(model.inp, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(128, 8, generator=g), torch.randn(128, 4, generator=g))
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))
    for step, (x, y) in enumerate(loader):
        if step == args.steps:
            break
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step} loss {loss.item():.9f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
