"""Tensor fingerprints computed where the data is.

- CPU tensors: ``zlib64`` = crc32 of the bytes (which releases the GIL and runs at memory speed)
  combined with the wrapping sum of the bytes read as int64 words.
- CUDA tensors: ``lin64`` = three wrapping int64 sums of the int32 words (plain, weighted by
  column and by row of a 1024-wide layout), computed by reductions on the tensor's own stream and
  mixed to 64 bits on the host. Nothing is synchronised: the three sums are copied to pinned host
  memory behind a CUDA event, and the agent's writer thread reads them later (``Pending``).

Both change for every single-bit change and for a swap of two unequal elements (a plain sum
misses swaps; ``torch.hash_tensor`` is an xor-reduce and misses them too). The numpy reference
in ``fsdp_replay.trace.fingerprint`` computes the same values from raw bytes.
"""

from __future__ import annotations

import ctypes
import zlib
from typing import Any

import torch

from fsdp_replay.trace import schema
from fsdp_replay.trace.fingerprint import LIN64_ROW, combine_lin64, combine_zlib64

_FLOAT_SUM_DTYPE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def host_buffer(t: torch.Tensor) -> Any:
    """A zero-copy buffer over a contiguous CPU tensor's bytes (keep ``t`` alive while used)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return b""
    return (ctypes.c_char * n).from_address(t.data_ptr())


class Pending:
    """A value still on the device; ``value()`` waits for its event (writer thread only)."""

    __slots__ = ("_combine", "_event", "_host")

    def __init__(self, host: torch.Tensor, event: Any, combine: Any) -> None:
        self._host = host
        self._event = event
        self._combine = combine

    def value(self) -> Any:
        self._event.synchronize()
        return self._combine(self._host)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.reshape(-1).view(torch.uint8)


def _nonfinite(t: torch.Tensor) -> torch.Tensor | None:
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return None
    return ~torch.isfinite(t.detach().sum(dtype=_FLOAT_SUM_DTYPE.get(t.dtype, t.dtype)))


def zlib64_cpu(t: torch.Tensor) -> int:
    b = _as_bytes(t)
    n = b.numel()
    n8 = n // 8 * 8
    if b.storage_offset() % 8:
        b = b.clone()
    total = int(b[:n8].view(torch.int64).sum()) if n8 else 0
    if n8 < n:
        total += int.from_bytes(bytes(b[n8:].tolist()) + b"\0" * (8 - (n - n8)), "little", signed=True)
    return combine_zlib64(zlib.crc32(host_buffer(b)), total)


def lin64_sums(t: torch.Tensor) -> torch.Tensor:
    """The (S, A, B) int64 sums of lin64, as a 3-element tensor on t's device."""
    b = _as_bytes(t)
    n = b.numel()
    n4 = n // 4 * 4
    if b.storage_offset() % 4:
        b = b.clone()
    w = b[:n4].view(torch.int32)
    rows = w.numel() // LIN64_ROW
    out = torch.zeros(3, dtype=torch.int64, device=t.device)
    if rows:
        m = w[: rows * LIN64_ROW].view(rows, LIN64_ROW)
        rowsum = m.sum(1, dtype=torch.int64)
        colsum = m.sum(0, dtype=torch.int64)
        kw = torch.arange(1, LIN64_ROW + 1, dtype=torch.int64, device=t.device)
        jw = torch.arange(1, rows + 1, dtype=torch.int64, device=t.device)
        out[0] += rowsum.sum()
        out[1] += (colsum * kw).sum()
        out[2] += (rowsum * jw).sum()
    tail = w[rows * LIN64_ROW :].to(torch.int64)
    if n4 < n:
        extra = int.from_bytes(bytes(b[n4:].cpu().tolist()) + b"\0" * (4 - (n - n4)), "little", signed=True)
        tail = torch.cat([tail, torch.tensor([extra], dtype=torch.int64, device=t.device)])
    if tail.numel():
        kw = torch.arange(1, tail.numel() + 1, dtype=torch.int64, device=t.device)
        ts = tail.sum()
        out[0] += ts
        out[1] += (tail * kw).sum()
        out[2] += ts * (rows + 1)
    return out


def _combine_lin64_host(nbytes: int) -> Any:
    def combine(host: torch.Tensor) -> int:
        s, a, b = (int(x) for x in host[:3].tolist())
        return combine_lin64(s, a, b, nbytes)

    return combine


def fingerprint(t: torch.Tensor, algo: str | None = None) -> tuple[Any, Any, str]:
    """(fingerprint, nonfinite, algo) of a tensor. On CUDA the first two may be ``Pending``."""
    algo = algo or (schema.FP_ZLIB64 if t.device.type == "cpu" else schema.FP_LIN64)
    nf = _nonfinite(t)
    if t.device.type == "cpu":
        if algo == schema.FP_ZLIB64:
            return zlib64_cpu(t), bool(nf) if nf is not None else False, algo
        s, a, b = lin64_sums(t).tolist()
        return combine_lin64(s, a, b, nbytes_of(t)), bool(nf) if nf is not None else False, algo
    if algo != schema.FP_LIN64:
        raise ValueError(f"{algo} fingerprints are computed on the CPU only")
    sums = lin64_sums(t)
    packed = torch.cat(
        [
            sums,
            (nf if nf is not None else torch.zeros((), dtype=torch.bool, device=t.device))
            .to(torch.int64)
            .reshape(1),
        ]
    )
    host = torch.empty(4, dtype=torch.int64, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    nbytes = nbytes_of(t)
    return (
        Pending(host, event, _combine_lin64_host(nbytes)),
        Pending(host, event, lambda h: bool(int(h[3]))),
        algo,
    )


def fingerprint_many(tensors: list[torch.Tensor]) -> list[tuple[Any, Any, str]]:
    """fingerprint() of each tensor; on CUDA with one device-to-host copy and one event for all."""
    if not tensors or tensors[0].device.type == "cpu" or any(t.device != tensors[0].device for t in tensors):
        return [fingerprint(t) for t in tensors]
    device = tensors[0].device
    rows = torch.zeros(len(tensors), 4, dtype=torch.int64, device=device)
    for i, t in enumerate(tensors):
        rows[i, :3] = lin64_sums(t)
        nf = _nonfinite(t)
        if nf is not None:
            rows[i, 3] = nf.to(torch.int64)
    host = torch.empty(rows.shape, dtype=torch.int64, pin_memory=True)
    host.copy_(rows, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    out: list[tuple[Any, Any, str]] = []
    for i, t in enumerate(tensors):
        combine = _combine_lin64_host(nbytes_of(t))
        out.append(
            (
                Pending(host, event, lambda h, i=i, c=combine: c(h[i])),
                Pending(host, event, lambda h, i=i: bool(int(h[i, 3]))),
                schema.FP_LIN64,
            )
        )
    return out


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def host_values(t: torch.Tensor) -> Any:
    """A small tensor's values as a list: now on the CPU, as a ``Pending`` on a device."""
    if t.device.type == "cpu":
        return t.detach().double().tolist()
    host = torch.empty(t.shape, dtype=torch.float64, pin_memory=True)
    host.copy_(t.detach().double(), non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return Pending(host, event, lambda h: h.tolist())
