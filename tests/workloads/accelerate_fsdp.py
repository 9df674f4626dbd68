"""A training stack we did not write: Hugging Face ``accelerate`` with its FSDP2 plugin, on CPU.

``Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2, ...))`` owns the
process group (gloo), the sharding (its ``fsdp2_prepare_model``: ``fully_shard`` on every ``Block``
by its transformer-based auto-wrap policy, then on the root; with ``cpu_ram_efficient_loading``
the model goes to the meta device and rank 0's full state dict is broadcast into every rank's
shards, ``fsdp2_load_full_state_dict``), the data loader's sharding across ranks, ``backward``,
gradient clipping and the loss reduction; this script only writes a tiny model and the loop.

FSDP on CPU: accelerate 1.15 never enables its FSDP plugin on CPU. ``AcceleratorState.__init__``
adopts ``fsdp_plugin`` (and sets ``distributed_type = FSDP``) only inside its branch for
``MULTI_GPU/MLU/SDAA/MUSA/NPU/XPU/HPU/NEURON``; with ``cpu=True`` ``PartialState._prepare_backend``
gives ``MULTI_CPU`` (gloo), the plugin is dropped without a word, and ``prepare`` wraps the model
in DDP (its ``MULTI_CPU`` branch). Without ``cpu=True`` a CPU-only host gives ``DistributedType.NO``
(one process, no process group). So by default (``--mode auto``) this script asks for FSDP2
exactly as the accelerate docs say and, on CPU, gets plain DDP under ``Accelerator``.

``--mode fsdp2`` makes FSDP2 run on CPU anyway: after ``Accelerator(cpu=True, ...)`` initialized the
gloo group, it sets the shared ``AcceleratorState``'s ``distributed_type`` to ``FSDP`` and hands it
the plugin, which is what the GPU branch does; from there ``prepare`` runs accelerate's own FSDP2
path (``fsdp2_prepare_model``, ``fsdp2_load_full_state_dict``), which works on CPU with gloo. The
two assignments touch accelerate's state object (not a documented API), and nothing else does.

Prints the distributed type, then ``step N loss X`` per optimizer step (rank 0; the loss averaged
over ranks by ``accelerator.reduce``), and writes the rank's final parameters to --save-params
({rank} is replaced): local shards under FSDP2, full tensors under DDP.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, set_seed
from torch.utils.data import DataLoader, TensorDataset

VOCAB, DIM, SEQ = 64, 32, 8


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


def local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--mode", choices=["auto", "fsdp2"], default="auto", help="see the module docstring")
    p.add_argument("--save-params", default="")
    args, _unknown = p.parse_known_args()

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        reshard_after_forward=True,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"],
        state_dict_type="SHARDED_STATE_DICT",
        cpu_ram_efficient_loading=True,
    )
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    if args.mode == "fsdp2" and not accelerator.is_fsdp2:
        # What AcceleratorState does for a GPU; on CPU it stops at MULTI_CPU (see the docstring).
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
    accelerator.print(
        f"accelerate distributed_type {accelerator.distributed_type} fsdp2 {accelerator.is_fsdp2}"
    )

    set_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 2))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (64, SEQ + 1), generator=g)
    loader = DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=4, shuffle=True)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    model.train()

    step = 0
    while step < args.steps:
        for x, y in loader:
            logits = model(x)
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            mean = accelerator.reduce(loss.detach(), reduction="mean")
            accelerator.print(f"step {step} loss {mean.item():.6f}")
            step += 1
            if step == args.steps:
                break

    if args.save_params:
        path = args.save_params.format(rank=accelerator.process_index)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        unwrapped = accelerator.unwrap_model(model)
        torch.save({n: local(t) for n, t in unwrapped.named_parameters()}, path)
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
