"""A training stack we did not write: the Hugging Face ``Trainer`` on a tiny random Llama.

The loop, the optimizer (AdamW), the LR schedule with warmup, the data loader and its sharding
across ranks, gradient clipping, the seeding, the process group and the DDP wrapping are all the
Trainer's own code (through accelerate); this script only builds a tiny random ``LlamaForCausalLM``
(hidden 32, 2 layers, vocab 128; no downloads) and a random token data set. On CPU under torchrun
(``use_cpu=True``) the Trainer initializes a gloo process group and wraps the model in DDP.

No ``--fsdp``: ``TrainingArguments(fsdp=True, fsdp_config={"version": 2})`` does not shard on CPU.
The Trainer hands its FSDP settings to ``accelerate.Accelerator(fsdp_plugin=...)``, and accelerate
1.15 adopts a plugin only for ``MULTI_GPU/MLU/SDAA/MUSA/NPU/XPU/HPU/NEURON`` (``AcceleratorState``);
on CPU (``MULTI_CPU``) it drops it silently, ``Trainer.is_fsdp_enabled`` is False, and the run is the
same DDP run as without the flag (tried: identical losses and full, unsharded parameters).
tests/workloads/accelerate_fsdp.py says more and runs accelerate's FSDP2 path on CPU anyway.

Prints ``step N loss X`` per optimizer step (rank 0, from the Trainer's own logs), and writes the
rank's final parameters (full tensors, as DDP keeps them) to --save-params ({rank} is replaced).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the Hub: the config is built here
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import argparse
import tempfile

import torch
from torch.utils.data import Dataset
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

VOCAB = 128


class RandomTokens(Dataset):
    """Random token ids from a fixed seed, as a tokenized causal-LM set (labels = input ids)."""

    def __init__(self, n: int, seq_len: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, VOCAB, (n, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


class PrintLoss(TrainerCallback):
    """``step N loss X`` from the Trainer's logs (logging_steps=1: one log per optimizer step)."""

    def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
        if state.is_world_process_zero and logs and "loss" in logs:
            print(f"step {state.global_step - 1} loss {logs['loss']:.6f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (max_steps)")
    p.add_argument("--out-dir", default="", help="the Trainer's output_dir (a temporary folder if empty)")
    p.add_argument("--save-params", default="")
    args, _unknown = p.parse_known_args()

    out_dir = args.out_dir or tempfile.mkdtemp(prefix="hf-trainer-")
    targs = TrainingArguments(
        output_dir=out_dir,
        use_cpu=True,
        ddp_backend="gloo",
        max_steps=args.steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        learning_rate=1e-3,
        warmup_steps=1,
        weight_decay=0.01,
        max_grad_norm=1.0,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
        data_seed=0,
    )
    set_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        attention_dropout=0.1,
    )
    model = LlamaForCausalLM(config)
    trainer = Trainer(
        model=model,
        args=targs,
        train_dataset=RandomTokens(64, 16),
        callbacks=[PrintLoss()],
    )
    trainer.train()

    if args.save_params:
        rank = targs.process_index
        path = args.save_params.format(rank=rank)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        torch.save({n: t.detach().clone() for n, t in trainer.model.named_parameters()}, path)
    trainer.accelerator.wait_for_everyone()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
