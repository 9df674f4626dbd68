"""A GPU training job shaped like the ones users run: Hugging Face GPT-2 under FSDP2.

What it does is what such jobs do, each with the library's own code: ``fully_shard`` on every
transformer block and then the root with a bf16 ``MixedPrecisionPolicy`` (fp32 gradient
reduction), activation checkpointing (transformers' ``gradient_checkpointing_enable``,
non-reentrant), SDPA attention, gradient accumulation without gradient sync on the non-final
micro-batches, ``clip_grad_norm_``, fused AdamW, a warm-up-then-linear LR schedule, and a
DataLoader with worker processes over a DistributedSampler. Its nondeterministic kernels (with
default, non-deterministic algorithms) are the SDPA backward and the embedding backward.

Sizes: ``--size 124m`` (d 768, 6 layers, seq 512) and ``--size 350m`` (d 1536, 12 layers, seq
1024; about 350M parameters with the default vocabulary), micro-batch 8, or each set by hand. On
CPU (no CUDA, or ``--cpu``) it runs the same code over gloo in fp32 (tiny sizes only).

Faults, for tests: ``--nan-at-step S --nan-rank R`` makes rank R's loss non-finite at step S;
``--flip-at-step S --flip-rank R --flip-switch FILE`` flips one bit of one gradient element on
rank R at step S, after the backward and before the optimizer, if FILE then reads ``flip``: the
test writes ``flip`` there for the recorded run and something else before the replay (a replay
reads a file as it is now), so the fault strikes the recorded run only, as a flaky GPU would.

Rank 0 prints ``step N loss X lr Y`` after each step (the benchmarks time those lines).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the Hub: the config is built here
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import argparse
import math
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

SIZES = {
    "tiny": {"d_model": 64, "layers": 2, "heads": 4, "seq_len": 64},
    "124m": {"d_model": 768, "layers": 6, "heads": 12, "seq_len": 512},
    "350m": {"d_model": 1536, "layers": 12, "heads": 16, "seq_len": 1024},
}


class RandomTokens(Dataset):
    """Random token ids from a fixed seed, as a tokenized dataset yields them."""

    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i])}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="tiny")
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=8, help="micro-batch size per rank")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--no-checkpointing", action="store_true", help="no activation checkpointing")
    p.add_argument("--one-gpu", action="store_true", help="every rank on cuda:0, over gloo")
    p.add_argument("--cpu", action="store_true", help="CPU and gloo even where CUDA is available")
    p.add_argument("--nan-at-step", type=int, default=None)
    p.add_argument("--nan-rank", type=int, default=0)
    p.add_argument("--flip-at-step", type=int, default=None)
    p.add_argument("--flip-rank", type=int, default=0)
    p.add_argument("--flip-switch", default="", help="the flip happens only if this file reads 'flip'")
    p.add_argument("--save-params", default="", help="write the local shards here ({rank} replaced)")
    args = p.parse_args()
    for k, v in SIZES[args.size].items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def flip_one_bit(model: torch.nn.Module) -> None:
    """Flip one mantissa bit (bit 20: the value changes by about 1/8) of this rank's largest
    gradient element, in place."""
    best = None
    for p in model.parameters():
        if p.grad is None:
            continue
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        if g.numel() and g.dtype == torch.float32 and g.is_contiguous():
            i = int(g.abs().view(-1).argmax())
            if best is None or abs(float(g.view(-1)[i])) > abs(float(best[0].view(-1)[best[1]])):
                best = (g, i)
    if best is not None:
        bits = best[0].view(-1)[best[1] : best[1] + 1].view(torch.int32)
        bits ^= 1 << 20


def switched_on(path: str) -> bool:
    try:
        with open(path) as f:
            return f.read().strip() == "flip"
    except OSError:
        return False


def main() -> None:
    args = parse()
    cuda = torch.cuda.is_available() and not args.cpu
    nccl = cuda and not args.one_gpu
    dist.init_process_group("nccl" if nccl else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", 0 if args.one_gpu else local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=args.layers,
        n_embd=args.d_model,
        n_head=args.heads,
        vocab_size=args.vocab,
        n_positions=args.seq_len,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="sdpa",
    )
    with torch.device(device):
        model = GPT2LMHeadModel(config)
    if not args.no_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else None
    kw = {"mp_policy": mp} if mp is not None else {}
    for block in model.transformer.h:
        fully_shard(block, **kw)
    fully_shard(model, **kw)  # the root: embeddings (tied with lm_head), final layer norm
    model.train()
    if rank == 0:
        n = sum(p.numel() for p in model.parameters())
        print(f"gpt2_job: {n / 1e6:.0f}M parameters, world {world}, {device}", file=sys.stderr, flush=True)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, fused=cuda)
    sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=max(args.steps, 3))
    n_samples = (args.steps + 1) * args.batch_size * args.accum * world
    data = RandomTokens(n_samples, args.seq_len, args.vocab)
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(
        data,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.workers,
        pin_memory=cuda,
        persistent_workers=args.workers > 0,
    )
    step, micro, epoch = 0, 0, 0
    loss_sum = torch.zeros((), device=device)
    while step < args.steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            last = micro == args.accum - 1
            model.set_requires_gradient_sync(last)
            out = model(**batch, labels=batch["input_ids"])
            loss = out.loss / args.accum
            if step == args.nan_at_step and rank == args.nan_rank:
                loss = loss * float("nan")
            loss.backward()
            loss_sum += loss.detach()
            micro += 1
            if not last:
                continue
            if step == args.flip_at_step and rank == args.flip_rank and switched_on(args.flip_switch):
                flip_one_bit(model)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
            opt.step()
            sched.step()
            lr = sched.get_last_lr()[0]
            opt.zero_grad(set_to_none=True)
            logged = loss_sum.item()
            loss_sum.zero_()
            if rank == 0:
                print(f"step {step} loss {logged:.6f} lr {lr:.6e}", flush=True)
            if not math.isfinite(logged):
                raise FloatingPointError(f"non-finite loss at step {step} on rank {rank}")
            step, micro = step + 1, 0
            if step == args.steps:
                break
        epoch += 1

    if args.save_params:
        path = args.save_params.format(rank=rank)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        torch.save({n: p.to_local().detach().cpu().clone() for n, p in model.named_parameters()}, path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
