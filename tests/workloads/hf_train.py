"""A workload we did not write: Hugging Face GPT-2 (tiny random config, no downloads) under FSDP2.

The model, its loss (``labels=input_ids``), its dropout and the LR schedule are transformers' code;
this script only writes the usual loop around them: ``fully_shard`` on each transformer block and
then the root, AdamW, a DataLoader with a DistributedSampler yielding dict batches of random token
ids, gradient accumulation (no gradient sync on the non-final micro-batches) and gradient clipping.
Writes its local parameter shards to --save-params ({rank} is replaced).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the Hub: the config is built here
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import argparse

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

VOCAB = 256


class RandomTokens(Dataset):
    """Random token ids from a fixed seed, as {"input_ids", "attention_mask"} like a tokenized set."""

    def __init__(self, n: int, seq_len: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, VOCAB, (n, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i])}


class FolderTokens(Dataset):
    """The same batches read from token shards in a folder (``--data-dir``, written by
    ``--prepare-data``): the constructor lists and sizes them, each item is read from its file, as
    file-backed datasets do."""

    ROWS = 64

    def __init__(self, folder: str) -> None:
        self.files = [os.path.join(folder, n) for n in sorted(os.listdir(folder)) if n.endswith(".pt")]
        if not self.files or any(os.path.getsize(f) == 0 for f in self.files):
            raise FileNotFoundError(f"no token shards in {folder}")

    def __len__(self) -> int:
        return len(self.files) * self.ROWS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.load(self.files[i // self.ROWS])[i % self.ROWS]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def prepare(folder: str, n: int, seq_len: int) -> None:
    os.makedirs(folder, exist_ok=True)
    ids = RandomTokens(n, seq_len).ids
    for k in range(0, n, FolderTokens.ROWS):
        torch.save(
            ids[k : k + FolderTokens.ROWS].clone(),
            os.path.join(folder, f"tokens-{k // FolderTokens.ROWS:04d}.pt"),
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4, help="optimizer steps")
    p.add_argument("--accum", type=int, default=2, help="gradient-accumulation micro-batches per step")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--save-params", default="")
    p.add_argument("--data-dir", default="", help="read the tokens from shards in this folder")
    p.add_argument("--prepare-data", default="", help="write the token shards to this folder and exit")
    args, _unknown = p.parse_known_args()
    n_samples = 16 * args.batch_size * args.accum * int(os.environ.get("WORLD_SIZE", "1"))
    if args.prepare_data:
        prepare(args.prepare_data, n_samples, args.seq_len)
        return

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.1,
        embd_pdrop=0.1,
        attn_pdrop=0.1,
    )
    model = GPT2LMHeadModel(config)
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)  # the root: embeddings (tied with lm_head), final layer norm
    model.train()

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=1, num_training_steps=args.steps)
    data = FolderTokens(args.data_dir) if args.data_dir else RandomTokens(n_samples, args.seq_len)
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)

    step, micro, epoch = 0, 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            last = micro == args.accum - 1
            model.set_requires_gradient_sync(last)
            out = model(**batch, labels=batch["input_ids"])
            (out.loss / args.accum).backward()
            micro += 1
            if not last:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            if rank == 0:
                print(f"step {step} loss {out.loss.item():.6f}", flush=True)
            step, micro = step + 1, 0
            if step == args.steps:
                break
        epoch += 1

    if args.save_params:
        path = args.save_params.format(rank=rank)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        torch.save({n: p.to_local().detach().clone() for n, p in model.named_parameters()}, path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
