"""A training stack we did not write: the PyTorch Lightning ``Trainer`` with FSDP2 on CPU.

``Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(...), max_steps=3)`` launched by
torchrun: Lightning finds torchrun through its ``TORCHELASTIC_*`` / ``RANK`` variables (its
``TorchElasticEnvironment``), initializes the gloo process group and the device mesh, calls the
module's ``configure_model`` (which applies ``fully_shard`` per block and to the root on the mesh's
``data_parallel`` dimension), then ``configure_optimizers``, and runs its own fit loop: the data
loader gets Lightning's ``DistributedSampler``, ``seed_everything`` seeds the ranks, gradients are
accumulated over 2 micro-batches (``accumulate_grad_batches``) with the first one's sync skipped,
and clipped by Lightning's precision plugin (``gradient_clip_val``, over the DTensor gradients).

Why not ``FSDPStrategy`` (FSDP1): Lightning's accelerator connector refuses it on CPU ("The strategy
`fsdp` requires a GPU accelerator, but received `accelerator='cpu'`"); ``ModelParallelStrategy``
(FSDP2 through ``configure_model``) runs on CPU and gloo.

Prints ``step N loss X`` per optimizer step (rank 0; the loss averaged over ranks) and writes the
rank's local parameter shards to --save-params ({rank} is replaced).
"""

from __future__ import annotations

import argparse
import os

import pytorch_lightning as pl
import torch
import torch.nn as nn
from pytorch_lightning.strategies import ModelParallelStrategy
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


class TinyLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def configure_model(self) -> None:
        dp = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=dp)
        fully_shard(self, mesh=dp)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))
        if (batch_idx + 1) % ACCUM == 0:
            mean = self.trainer.strategy.reduce(loss.detach(), reduce_op="mean")
            if self.global_rank == 0:
                print(f"step {self.global_step} loss {mean.item():.6f}", flush=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--save-params", default="")
    args, _unknown = p.parse_known_args()

    pl.seed_everything(0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (64, SEQ + 1), generator=g)
    loader = DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=4, shuffle=True)
    model = TinyLM()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=args.steps,
        accumulate_grad_batches=ACCUM,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, train_dataloaders=loader)

    if args.save_params:
        path = args.save_params.format(rank=trainer.global_rank)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        torch.save({n: t.to_local().detach().clone() for n, t in model.named_parameters()}, path)
    trainer.strategy.barrier()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
