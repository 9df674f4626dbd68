"""Reference workload: a small GPT-style language model trained with FSDP.

This is an ordinary, self-contained data-parallel training script of the kind
people launch with ``torchrun``:

* a decoder-only transformer (token + position embeddings, pre-LayerNorm blocks
  with causal self-attention through ``scaled_dot_product_attention``, a GELU
  MLP, dropout, and an LM head tied to the token embedding unless ``--untied``);
* sharded with FSDP2 (``fully_shard`` per block, then the root) by default, or
  with FSDP1 (``--fsdp1``) or DistributedDataParallel (``--ddp``);
* fed by a synthetic, deterministic Markov-chain token dataset through a
  ``DistributedSampler`` (shuffled, ``set_epoch`` every epoch) and a
  multi-worker ``DataLoader``;
* optimised with AdamW, linear warmup + cosine decay, gradient accumulation,
  gradient clipping, and bf16 autocast on CUDA (float32 on CPU by default).

The cross-entropy loss is computed in the training loop, outside the model.
Rank 0 prints ``step N loss X lr Y`` once per optimizer step (N counts from 0, like the optimizer steps in an fsdp-replay trace).
A handful of ``--*-at-step`` flags plant faults (NaN, wall-clock noise, a
skipped collective) for testing tools that observe training runs.

Examples::

    torchrun --nproc_per_node 2 examples/train_fsdp.py --steps 20
    python examples/train_fsdp.py --steps 3          # world size 1
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


@dataclass
class Config:
    steps: int = 20
    seed: int = 0
    lr: float = 3e-3
    warmup: int = 5
    weight_decay: float = 0.1
    grad_accum: int = 2
    clip: float = 1.0
    batch_size: int = 8
    seq_len: int = 64
    vocab: int = 256
    d_model: int = 128
    layers: int = 3
    heads: int = 4
    dropout: float = 0.1
    untied: bool = False
    dataset_size: int = 512
    data_dir: str | None = None
    prepare_data: str | None = None
    workers: int = 2
    fsdp1: bool = False
    ddp: bool = False
    cpu: bool = False
    one_gpu: bool = False
    amp: str = "auto"
    threads: int | None = None
    deterministic: bool = False
    pg_timeout: float = 1800.0
    save_params: str | None = None
    nan_at_step: int | None = None
    nan_rank: int = 0
    stop_on_nan: bool = False
    wallclock_noise_at_step: int | None = None
    noise_rank: int = 0
    skip_collective_at_step: int | None = None
    skip_rank: int = 0
    sleep_per_step: float = 0.0
    stall_at_step: int | None = None
    stall_rank: int = 0
    stall_s: float = 3600.0
    clamp_from_step: int | None = None


def parse_args(argv: list[str] | None = None) -> Config:
    d = Config()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--steps", type=int, default=d.steps, help="optimizer steps to run")
    add("--seed", type=int, default=d.seed, help="seed for model init, data and dropout")
    add("--lr", type=float, default=d.lr, help="peak learning rate")
    add("--warmup", type=int, default=d.warmup, help="linear warmup steps before cosine decay")
    add("--weight-decay", type=float, default=d.weight_decay, help="AdamW weight decay (matrices only)")
    add("--grad-accum", type=int, default=d.grad_accum, help="micro-batches per optimizer step")
    add("--clip", type=float, default=d.clip, help="max gradient norm (<= 0 disables clipping)")
    add("--batch-size", type=int, default=d.batch_size, help="micro-batch size per rank")
    add("--seq-len", type=int, default=d.seq_len, help="sequence length (context size)")
    add("--vocab", type=int, default=d.vocab, help="vocabulary size")
    add("--d-model", type=int, default=d.d_model, help="model width")
    add("--layers", type=int, default=d.layers, help="number of transformer blocks")
    add("--heads", type=int, default=d.heads, help="attention heads")
    add("--dropout", type=float, default=d.dropout, help="dropout probability")
    add("--untied", action="store_true", help="do not tie the LM head to the token embedding")
    add("--dataset-size", type=int, default=d.dataset_size, help="sequences in the synthetic dataset")
    add(
        "--data-dir",
        default=None,
        metavar="DIR",
        help="train on the token shards in DIR (written by --prepare-data) instead of generating the tokens",
    )
    add(
        "--prepare-data",
        default=None,
        metavar="DIR",
        help="write the synthetic dataset to DIR as token shards (int32 .bin files) and exit",
    )
    add("--workers", type=int, default=d.workers, help="DataLoader worker processes")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--fsdp1", action="store_true", help="use FSDP1 (FullyShardedDataParallel) instead of FSDP2"
    )
    mode.add_argument("--ddp", action="store_true", help="use DistributedDataParallel instead of FSDP2")
    add("--cpu", action="store_true", help="force CPU + gloo even if CUDA is available")
    add(
        "--one-gpu",
        action="store_true",
        help="every rank on cuda:0 over gloo (several ranks on a one-GPU machine; NCCL refuses that)",
    )
    add(
        "--amp",
        choices=["auto", "off", "bf16"],
        default=d.amp,
        help="autocast: auto = bf16 on CUDA, float32 on CPU",
    )
    add("--threads", type=int, default=None, help="torch.set_num_threads for each rank")
    add(
        "--deterministic",
        action="store_true",
        help="torch.use_deterministic_algorithms(True) (+ CUBLAS_WORKSPACE_CONFIG): bit-reproducible CUDA kernels",
    )
    add(
        "--pg-timeout",
        type=float,
        default=d.pg_timeout,
        help="process-group timeout in seconds (how long a hung collective waits)",
    )
    add(
        "--save-params",
        default=None,
        metavar="PATH",
        help="at the end, each rank torch.saves its local parameter shards to PATH.format(rank=...)",
    )
    f = p.add_argument_group("fault injection (for tests)")
    f.add_argument(
        "--nan-at-step",
        type=int,
        default=None,
        metavar="K",
        help="rank --nan-rank multiplies its activations by NaN during optimizer step K, "
        "so its loss (and then everyone's gradients) become NaN",
    )
    f.add_argument("--nan-rank", type=int, default=d.nan_rank, metavar="R", help="rank for --nan-at-step")
    f.add_argument(
        "--stop-on-nan",
        action="store_true",
        help="raise FloatingPointError on all ranks once the logged loss is not finite",
    )
    f.add_argument(
        "--wallclock-noise-at-step",
        type=int,
        default=None,
        metavar="K",
        help="rank --noise-rank scales its loss at step K by 1+eps, eps taken from "
        "time.time_ns() (an additive constant would not change the gradients)",
    )
    f.add_argument(
        "--noise-rank", type=int, default=d.noise_rank, metavar="R", help="rank for --wallclock-noise-at-step"
    )
    f.add_argument(
        "--skip-collective-at-step",
        type=int,
        default=None,
        metavar="K",
        help="rank --skip-rank skips the loss all_reduce at step K, so the job hangs until --pg-timeout",
    )
    f.add_argument(
        "--skip-rank", type=int, default=d.skip_rank, metavar="R", help="rank for --skip-collective-at-step"
    )
    f.add_argument(
        "--sleep-per-step",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="sleep this long after every optimizer step",
    )
    f.add_argument(
        "--stall-at-step",
        type=int,
        default=None,
        metavar="K",
        help="rank --stall-rank sleeps --stall-s seconds at step K, after its optimizer step and before "
        "the loss all_reduce: a rank hung outside any collective while the others wait in one",
    )
    f.add_argument(
        "--stall-rank", type=int, default=d.stall_rank, metavar="R", help="rank for --stall-at-step"
    )
    f.add_argument(
        "--stall-s", type=float, default=d.stall_s, metavar="SECONDS", help="how long --stall-at-step sleeps"
    )
    f.add_argument(
        "--clamp-from-step",
        type=int,
        default=d.clamp_from_step,
        metavar="N",
        help="from step N on, clamp every parameter to [-0.05, 0.05] in place right after optimizer.step() "
        "(a program that changes its state outside the optimizer, as weight constraints do)",
    )
    return Config(**vars(p.parse_args(argv)))


# ----------------------------------------------------------------------------- model


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(x).split(c, dim=2)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        if not cfg.untied:
            self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.ndim >= 2:  # residual projections get the GPT-2 depth scaling
                std = (
                    0.02 / math.sqrt(2 * cfg.layers)
                    if name.endswith(("proj.weight", "mlp.2.weight"))
                    else 0.02
                )
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# ----------------------------------------------------------------------------- data


class MarkovTokens(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sequences from a fixed sparse Markov chain: each token has 4 likely successors."""

    def __init__(self, size: int, seq_len: int, vocab: int, seed: int) -> None:
        self.size, self.seq_len, self.vocab, self.seed = size, seq_len, vocab, seed
        g = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(0, vocab, (vocab, 4), generator=g)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        choice = torch.randint(0, 4, (self.seq_len + 1,), generator=g)
        seq = torch.empty(self.seq_len + 1, dtype=torch.int64)
        seq[0] = torch.randint(0, self.vocab, (1,), generator=g)
        for t in range(1, self.seq_len + 1):
            seq[t] = self.successors[seq[t - 1], choice[t]]
        return seq[:-1].clone(), seq[1:].clone()


SHARD_SEQUENCES = 128


def prepare_data(cfg: Config) -> None:
    """The synthetic dataset as files: shard-NNNN.bin, each SHARD_SEQUENCES sequences of seq_len + 1
    int32 tokens."""
    os.makedirs(cfg.prepare_data or ".", exist_ok=True)
    tokens = MarkovTokens(cfg.dataset_size, cfg.seq_len, cfg.vocab, cfg.seed)
    for shard, start in enumerate(range(0, cfg.dataset_size, SHARD_SEQUENCES)):
        rows = [
            torch.cat([x[:1], y])
            for x, y in (tokens[i] for i in range(start, min(start + SHARD_SEQUENCES, cfg.dataset_size)))
        ]
        path = os.path.join(cfg.prepare_data or ".", f"shard-{shard:04d}.bin")
        with open(path, "wb") as f:
            f.write(torch.stack(rows).to(torch.int32).numpy().tobytes())


class TokenShards(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sequences read from the token shards in a folder, the way file-backed datasets work: the
    constructor lists and sizes the shards, each item is read from its file."""

    def __init__(self, folder: str, seq_len: int) -> None:
        self.row_bytes = 4 * (seq_len + 1)
        self.shards = [os.path.join(folder, n) for n in sorted(os.listdir(folder)) if n.endswith(".bin")]
        self.counts = [os.path.getsize(p) // self.row_bytes for p in self.shards]
        if not self.shards:
            raise FileNotFoundError(f"no token shards (*.bin) in {folder}: write them with --prepare-data")

    def __len__(self) -> int:
        return sum(self.counts)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        shard = 0
        while index >= self.counts[shard]:
            index -= self.counts[shard]
            shard += 1
        with open(self.shards[shard], "rb") as f:
            f.seek(index * self.row_bytes)
            row = torch.frombuffer(bytearray(f.read(self.row_bytes)), dtype=torch.int32).to(torch.int64)
        return row[:-1].clone(), row[1:].clone()


def micro_batches(loader: DataLoader[Any], sampler: DistributedSampler[Any]) -> Generator[Any, None, None]:
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


# ----------------------------------------------------------------------------- setup


def init_distributed(cfg: Config) -> tuple[int, int, torch.device, Any]:
    if "RANK" not in os.environ:  # plain `python train_fsdp.py`: a one-process job
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
    use_cuda = torch.cuda.is_available() and not cfg.cpu
    if use_cuda:
        device = torch.device("cuda", 0 if cfg.one_gpu else int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    timeout = datetime.timedelta(seconds=cfg.pg_timeout)
    nccl = use_cuda and not cfg.one_gpu
    dist.init_process_group("nccl" if nccl else "gloo", timeout=timeout, device_id=device if nccl else None)
    # Metrics get their own group so logging never interleaves with gradient traffic.
    metrics_group = dist.new_group(timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device, metrics_group


def wrap_model(model: GPT, cfg: Config, device: torch.device, world: int) -> nn.Module:
    if cfg.ddp:
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if cfg.fsdp1:
        # device_id is explicit because FSDP1 refuses to infer "cpu" on its own.
        return FSDP1(
            model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True, device_id=device
        )
    mesh = init_device_mesh(device.type, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def clean_name(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").removeprefix("module.")


def local_params(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        t = p.to_local() if hasattr(p, "to_local") else p  # FSDP2 DTensor -> local shard
        out[clean_name(name)] = t.detach().cpu().clone()
    return out


def lr_lambda(cfg: Config) -> Callable[[int], float]:
    """Linear warmup to the peak, then cosine decay to 10% of it at --steps."""

    def f(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return f


# ----------------------------------------------------------------------------- train


def train(cfg: Config) -> None:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    rank, world, device, metrics_group = init_distributed(cfg)
    use_bf16 = cfg.amp == "bf16" or (cfg.amp == "auto" and device.type == "cuda")

    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    model = GPT(cfg).to(device)
    no_decay = {n for n, p in model.named_parameters() if p.ndim < 2}
    first_block = model.blocks[0]
    model_w = wrap_model(model, cfg, device, world)
    torch.manual_seed(cfg.seed + rank)  # different dropout masks per rank

    params = dict(model_w.named_parameters())
    groups = [
        {
            "params": [p for n, p in params.items() if clean_name(n) not in no_decay],
            "weight_decay": cfg.weight_decay,
        },
        {"params": [p for n, p in params.items() if clean_name(n) in no_decay], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))

    dataset: Dataset[tuple[torch.Tensor, torch.Tensor]] = (
        TokenShards(cfg.data_dir, cfg.seq_len)
        if cfg.data_dir
        else MarkovTokens(cfg.dataset_size, cfg.seq_len, cfg.vocab, cfg.seed)
    )
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed
    )
    loader = DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=sampler,
        drop_last=True,
        num_workers=cfg.workers,
        persistent_workers=False,
        pin_memory=device.type == "cuda",
    )
    batches = micro_batches(loader, sampler)

    model_w.train()
    reported_nonfinite = False
    for step in range(cfg.steps):
        poison = None
        if step == cfg.nan_at_step and rank == cfg.nan_rank:
            poison = first_block.register_forward_hook(lambda _m, _i, out: out * float("nan"))
        loss_sum = torch.zeros((), device=device)
        for micro in range(cfg.grad_accum):
            last = micro == cfg.grad_accum - 1
            if isinstance(model_w, FSDPModule):
                model_w.set_requires_gradient_sync(last)
                sync: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
            elif isinstance(model_w, (DDP, FSDP1)) and not last:
                sync = model_w.no_sync()
            else:
                sync = contextlib.nullcontext()
            inputs, targets = (t.to(device, non_blocking=True) for t in next(batches))
            with sync:
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
                    logits = model_w(inputs)
                loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
                loss = loss / cfg.grad_accum
                if step == cfg.wallclock_noise_at_step and rank == cfg.noise_rank:
                    loss = loss * (1.0 + (time.time_ns() % 997 + 1) * 1e-7)
                loss.backward()
            loss_sum += loss.detach()
        if poison is not None:
            poison.remove()
        if not torch.isfinite(loss_sum) and not reported_nonfinite:
            print(f"rank {rank}: non-finite local loss at step {step}", file=sys.stderr, flush=True)
            reported_nonfinite = True

        if cfg.clip > 0:
            if isinstance(model_w, FSDP1):
                model_w.clip_grad_norm_(cfg.clip)
            else:
                torch.nn.utils.clip_grad_norm_(model_w.parameters(), cfg.clip)
        lr = optimizer.param_groups[0]["lr"]
        optimizer.step()
        if cfg.clamp_from_step is not None and step >= cfg.clamp_from_step:
            with torch.no_grad():
                for p in model_w.parameters():
                    p.clamp_(-0.05, 0.05)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

        if step == cfg.stall_at_step and rank == cfg.stall_rank:
            time.sleep(cfg.stall_s)  # the stall (--stall-at-step)
        if not (step == cfg.skip_collective_at_step and rank == cfg.skip_rank):
            dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM, group=metrics_group)
            loss_sum /= world
        logged = loss_sum.item()
        if rank == 0:
            print(f"step {step} loss {logged:.6f} lr {lr:.6e}", flush=True)
        if cfg.stop_on_nan and not math.isfinite(logged):
            raise FloatingPointError(f"rank {rank}: loss is {logged} at step {step}")
        if cfg.sleep_per_step > 0:
            time.sleep(cfg.sleep_per_step)

    batches.close()  # shuts the DataLoader workers down
    if cfg.save_params:
        path = cfg.save_params.format(rank=rank)
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        torch.save(local_params(model_w), path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    config = parse_args()
    if config.prepare_data:
        prepare_data(config)
    else:
        train(config)
