"""A training stack we did not write: Lightning Fabric with FSDP2 (``ModelParallelStrategy``) on CPU.

``Fabric(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(parallelize_fn))`` launched by
torchrun: Fabric finds torchrun through its ``TORCHELASTIC_*`` / ``RANK`` variables (its
``TorchElasticEnvironment``), initializes the gloo process group, builds the 2-rank device mesh
and calls ``parallelize_fn(model, mesh)``, which applies ``fully_shard`` per block and to the root
on the mesh's ``data_parallel`` dimension. Fabric also seeds every rank (``seed_everything``), shards
the data loader (its ``DistributedSampler``), skips the gradient sync of the first of two
micro-batches (``no_backward_sync``: FSDP2's ``set_requires_gradient_sync``), clips gradients over
the DTensors and averages the loss over ranks (``all_reduce``).

Why not ``FSDPStrategy`` (FSDP1): Fabric's connector refuses it on CPU ("You selected the FSDP
strategy but FSDP is only available on GPU"); ``ModelParallelStrategy`` runs on CPU and gloo.

Prints ``step N loss X`` per optimizer step (rank 0) and writes the rank's local parameter shards
to --save-params ({rank} is replaced).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn as nn
from lightning_fabric import Fabric, seed_everything
from lightning_fabric.strategies import ModelParallelStrategy
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

VOCAB, DIM, SEQ, ACCUM = 64, 32, 8, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.ff = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Dropout(0.1), nn.Linear(2 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def parallelize(model: TinyLM, mesh: DeviceMesh) -> TinyLM:
    dp = mesh["data_parallel"]
    for block in model.blocks:
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--save-params", default="")
    args, _unknown = p.parse_known_args()

    strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=2, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()  # under torchrun: this process is already its rank; sets up the process group
    seed_everything(0)

    with fabric.init_module():
        model = TinyLM()
    model = fabric.setup(model)  # parallelize(model, mesh): fully_shard
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (64, SEQ + 1), generator=g)
    loader = fabric.setup_dataloaders(
        DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=4, shuffle=True)
    )
    model.train()

    step, micro = 0, 0
    while step < args.steps:
        for x, y in loader:
            last = micro == ACCUM - 1
            with fabric.no_backward_sync(model, enabled=not last):
                logits = model(x)
                loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
                fabric.backward(loss / ACCUM)
            micro += 1
            if not last:
                continue
            fabric.clip_gradients(model, opt, max_norm=1.0)
            opt.step()
            opt.zero_grad()
            mean = fabric.all_reduce(loss.detach(), reduce_op="mean")
            fabric.print(f"step {step} loss {mean.item():.6f}")
            step, micro = step + 1, 0
            if step == args.steps:
                break

    if args.save_params:
        path = args.save_params.format(rank=fabric.global_rank)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        torch.save({n: t.to_local().detach().clone() for n, t in model.module.named_parameters()}, path)
    fabric.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
