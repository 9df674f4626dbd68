"""A DataLoader without workers whose dataset augments with the process's own RNG (noise from
``torch.randn`` and a flip from ``random``), then a model with dropout: what the dataset draws
decides the dropout masks after it. A replay that serves the recorded batches without running the
dataset must leave the RNG where the fetch left it.

    torchrun --nproc_per_node 2 augment_train.py [--steps N] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import random

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class Noisy(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, folder: str) -> None:
        if folder:  # a file-backed set: the constructor sizes it from its folder
            self.n = sum(os.path.getsize(os.path.join(folder, f)) for f in sorted(os.listdir(folder))) // 64
        else:
            self.n = 256

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(16, generator=g)
        x = x + 0.1 * torch.randn(16)  # the process's RNG: augmentation
        if random.random() < 0.5:
            x = x.flip(0)
        return x, (x.sum() > 0).long()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--data-dir", default="")
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(64, 2)
    )
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1 + dist.get_rank())
    random.seed(dist.get_rank())
    data = Noisy(args.data_dir)
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0), num_workers=0)
    it = iter(loader)
    for step in range(args.steps):
        x, y = next(it)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
