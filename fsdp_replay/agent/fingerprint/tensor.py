"""One tensor's fingerprint: sk64, zlib64 and lin64 on the CPU or the device, computed where the
data is (the package docstring says which algorithm is used where)."""

from __future__ import annotations

import ctypes
import math
import struct
import sys
import zlib
from typing import Any

import torch

from fsdp_replay.agent.fingerprint import native
from fsdp_replay.agent.fingerprint.pending import Pending, host_buffer, nbytes_of
from fsdp_replay.trace import schema
from fsdp_replay.trace.fingerprint import (
    LIN64_ROW,
    SK64_ROW,
    combine_lin64,
    combine_sk64,
    combine_zlib64,
    sk64_crc,
)

# float8 formats have no sum kernel: their non-finite flag sums them converted to float32
_FLOAT8 = frozenset(
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, n)
)
_FLOAT_SUM_DTYPE = {
    torch.float16: torch.float32,
    torch.bfloat16: torch.float32,
    **dict.fromkeys(_FLOAT8, torch.float32),
}


def _float_sum(x: torch.Tensor, *dim: int) -> torch.Tensor:
    """The float sum behind the torch path's non-finite flag (half types summed in float32)."""
    acc = _FLOAT_SUM_DTYPE.get(x.dtype, x.dtype)
    return (x.to(acc) if x.dtype in _FLOAT8 else x).sum(*dim, dtype=acc)


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
    return ~torch.isfinite(_float_sum(t.detach()))


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


def _zlib64_fast(t: torch.Tensor) -> tuple[int, bool] | None:
    """zlib64 and the non-finite flag with as few torch calls as possible (the common case:
    a contiguous, 8-byte aligned real tensor), or None when the general path is needed.

    Recording calls this for every collective input and output; the per-call cost matters.
    """
    if not t.is_contiguous() or t.is_complex() or t.dtype == torch.bool:
        return None
    nbytes = t.numel() * t.element_size()
    if nbytes == 0 or nbytes % 8 or t.data_ptr() % 8:
        return None
    flat = t.detach().reshape(-1)
    total = int(flat.view(torch.int64).sum())
    crc = zlib.crc32((ctypes.c_char * nbytes).from_address(flat.data_ptr()))
    nonfinite = False
    if flat.is_floating_point():
        nonfinite = not math.isfinite(float(_float_sum(flat)))
    return combine_zlib64(crc, total), nonfinite


# -- sk64 --------------------------------------------------------------------------------------
# In a training process every torch call costs several microseconds (more than the reductions
# themselves for tensors of a few hundred kB), so the common cases below use as few calls as
# possible: a tensor of whole 256-byte rows takes two int64 reductions and one float sum, and an
# in-place all-gather output (equal rank slices) the same three for the output and every slice.
_SK64_ROW_BYTES = SK64_ROW * 8
_MASK64 = (1 << 64) - 1
_COLSUMS = struct.Struct(f"<{SK64_ROW}q")


def _signed64(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


def _int64s(t: torch.Tensor) -> memoryview:
    """A contiguous CPU int64 tensor's values, without copying (keep ``t`` alive while used)."""
    return memoryview(host_buffer(t)).cast("B").cast("q")


def _sk64_value(nbytes: int, colsums: list[int], rowsums: Any) -> int:
    """sk64 from the column sums (Python ints) and the row sums (a little-endian int64 buffer)."""
    crc = sk64_crc(nbytes, _COLSUMS.pack(*(_signed64(c) for c in colsums)), rowsums)
    return combine_sk64(crc, sum(colsums))


def _sk64_whole_rows(t: torch.Tensor) -> tuple[int, bool] | None:
    """sk64 and the non-finite flag of a CPU tensor of whole rows (the common case), or None
    when the general path is needed."""
    sums = _sketch_sums(t, 1) if t.device.type == "cpu" else None
    return None if sums is None else _Sketch(*sums, nbytes_of(t)).values()[0]


def _sk64_sums(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row sums, column sums) of 1-D int64 words on any device; the last row zero-padded."""
    n = words.numel()
    full = n // SK64_ROW
    grid = (words if full * SK64_ROW == n else words[: full * SK64_ROW]).view(full, SK64_ROW)
    rowsums, colsums = grid.sum(1), grid.sum(0)
    if full * SK64_ROW != n:
        tail = words[full * SK64_ROW :]
        rowsums = torch.cat([rowsums, tail.sum().reshape(1)])
        colsums[: tail.numel()] += tail
    return rowsums, colsums


def _sk64(t: torch.Tensor) -> tuple[int, bool]:
    """sk64 by torch (``fingerprint`` has tried the native core first)."""
    fast = _sk64_whole_rows(t)
    if fast is not None:
        return fast
    # the general path (any device, layout, size): the bytes, zero-padded to whole words
    nbytes = nbytes_of(t)
    b = _as_bytes(t)
    if nbytes % 8:
        padded = torch.zeros(nbytes + 8 - nbytes % 8, dtype=torch.uint8, device=b.device)
        padded[:nbytes] = b
        b = padded
    elif b.storage_offset() % 8:
        b = b.clone()
    rowsums, colsums = (x.cpu() for x in _sk64_sums(b.view(torch.int64)))
    if sys.byteorder == "little":
        fp = _sk64_value(nbytes, list(_int64s(colsums)), host_buffer(rowsums))
    else:
        fp = _sk64_value(nbytes, colsums.tolist(), rowsums.numpy().astype("<i8").tobytes())
    nf = _nonfinite(t)
    return fp, bool(nf) if nf is not None else False


def _sketch_sums(
    t: torch.Tensor, slices: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """(column sums (slices, 32), row sums (slices, rows), float sums (slices,) or None) of a
    contiguous, 8-byte aligned real tensor cut into ``slices`` equal slices of whole rows, on its
    device: three reductions. None when the layout needs the general path."""
    if not t.is_contiguous() or t.is_complex() or t.dtype == torch.bool or sys.byteorder != "little":
        return None
    if nbytes_of(t) % (_SK64_ROW_BYTES * slices) or t.data_ptr() % 8:
        return None
    flat = t.view(-1)
    grid = flat.view(torch.int64).view(slices, -1, SK64_ROW)
    fsums = _float_sum(flat.view(slices, -1), 1) if flat.is_floating_point() and flat.numel() else None
    return grid.sum(1), grid.sum(2), fsums


class _Sketch:
    """sk64 of a tensor and of its equal slices, from ``_sketch_sums`` on the host (computed once)."""

    __slots__ = ("_values", "colsums", "fsums", "nbytes", "rowsums")

    def __init__(
        self, colsums: torch.Tensor, rowsums: torch.Tensor, fsums: torch.Tensor | None, nbytes: int
    ) -> None:
        self.colsums = colsums
        self.rowsums = rowsums
        self.fsums = fsums
        self.nbytes = nbytes  # of the whole tensor
        self._values: list[tuple[int, bool]] | None = None

    def values(self) -> list[tuple[int, bool]]:
        """[(fp, nonfinite) of the whole tensor, then of each slice]."""
        if self._values is None:
            colsums = self.colsums.tolist()
            slices = len(colsums)
            flags = [False] * slices
            if self.fsums is not None:
                flags = [not math.isfinite(x) for x in self.fsums.tolist()]
            rows = memoryview(host_buffer(self.rowsums)).cast("B")
            row_bytes = self.rowsums.shape[1] * 8
            out = [
                (
                    _sk64_value(self.nbytes // slices, colsums[i], rows[i * row_bytes : (i + 1) * row_bytes]),
                    flags[i],
                )
                for i in range(slices)
            ]
            if slices == 1:
                whole = out[0]
            else:
                cols = [sum(col) for col in zip(*colsums, strict=True)]
                whole = (_sk64_value(self.nbytes, cols, rows), any(flags))
            self._values = [whole, *out]
        return self._values


def _sketch(t: torch.Tensor, slices: int = 1) -> Any:
    """The ``_Sketch`` of a tensor: at once on the CPU; on a device, a holder whose ``get()``
    unpacks one pinned host copy of the sums (made behind ``_device_event``, so nothing waits
    now). None when the layout needs the general path."""
    sums = _sketch_sums(t, slices)
    if sums is None:
        return None
    if t.device.type == "cpu":
        return _Sketch(*sums, nbytes_of(t))
    return _DeviceSketch(*sums, nbytes_of(t))


class _DeviceSketch:
    """A device sketch's sums copied into one pinned int64 buffer; unpacked by the writer thread."""

    __slots__ = ("host", "nbytes", "rows", "sketch", "slices", "with_floats")

    def __init__(
        self, colsums: torch.Tensor, rowsums: torch.Tensor, fsums: torch.Tensor | None, nbytes: int
    ) -> None:
        self.slices, self.rows = rowsums.shape
        self.with_floats = fsums is not None
        parts = [colsums.view(-1), rowsums.view(-1)]
        if fsums is not None:
            parts.append(fsums.to(torch.float64).view(torch.int64))
        packed = torch.cat(parts)
        self.host = torch.empty(packed.shape, dtype=torch.int64, pin_memory=packed.is_cuda)
        self.host.copy_(packed, non_blocking=True)
        self.nbytes = nbytes
        self.sketch: _Sketch | None = None

    def values(self) -> list[tuple[int, bool]]:
        if self.sketch is None:
            k, n = self.slices * SK64_ROW, self.slices * self.rows
            h = self.host
            fsums = h[k + n :].view(torch.float64) if self.with_floats else None
            self.sketch = _Sketch(
                h[:k].view(self.slices, SK64_ROW), h[k : k + n].view(self.slices, -1), fsums, self.nbytes
            )
        return self.sketch.values()


def _sketch_pendings(sketch: _Sketch | _DeviceSketch, event: Any, index: int) -> tuple[Pending, Pending]:
    return (
        Pending(sketch, event, lambda s: s.values()[index][0]),
        Pending(sketch, event, lambda s: s.values()[index][1]),
    )


def _device_event(t: torch.Tensor) -> Any:
    if t.device.type == "cpu":
        return None
    event = torch.cuda.Event(blocking=True)
    event.record()
    return event


def default_algo(t: torch.Tensor) -> str:
    """The algorithm recording uses for a tensor: by device, and on the CPU by size."""
    nbytes = nbytes_of(t)
    if t.device.type != "cpu":
        # sk64 where its three-reduction path applies, lin64 (any layout) otherwise
        whole_rows = nbytes and nbytes % _SK64_ROW_BYTES == 0 and t.is_contiguous() and not t.is_complex()
        return schema.FP_SK64 if whole_rows and t.dtype != torch.bool else schema.FP_LIN64
    if nbytes >= schema.SK64_MIN_BYTES or native.available():
        return schema.FP_SK64
    return schema.FP_ZLIB64


def fingerprint(t: torch.Tensor, algo: str | None = None) -> tuple[Any, Any, str]:
    """(fingerprint, nonfinite, algo) of a tensor. On CUDA the first two may be ``Pending``.

    ``algo`` defaults to ``default_algo(t)``. sk64 can be computed on any device (a replay of a
    CPU trace on a GPU), synchronously."""
    if (algo is None or algo == schema.FP_SK64) and t.device.type == "cpu":
        got = native.sk64(t)  # the common case: a contiguous CPU tensor
        if got is not None:
            return got[0][0], got[0][1], schema.FP_SK64
    algo = algo or default_algo(t)
    if algo == schema.FP_SK64:
        if t.device.type != "cpu":
            sketch = _sketch(t)
            if sketch is not None:
                return (*_sketch_pendings(sketch, _device_event(t), 0), algo)
        fp, nonfinite = _sk64(t)
        return fp, nonfinite, algo
    if t.device.type == "cpu" and algo == schema.FP_ZLIB64:
        fast = _zlib64_fast(t)
        if fast is not None:
            return fast[0], fast[1], algo
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
    event = torch.cuda.Event(blocking=True)
    event.record()
    nbytes = nbytes_of(t)
    return (
        Pending(host, event, _combine_lin64_host(nbytes)),
        Pending(host, event, lambda h: bool(int(h[3]))),
        algo,
    )
