"""Tensor fingerprints computed where the data is.

- CPU tensors: ``sk64`` = the row sums and column sums of the bytes read as int64 words in rows
  of 32 (256 bytes), reduced to 64 bits by a crc32 of those sums and their total. The native
  core (``native.py``, ``_fpcore.c``) computes it in one pass for every contiguous CPU tensor,
  and the parameters of a step in one call. Without it, torch computes the same value with three
  reductions, and tensors under 64 KiB get ``zlib64`` instead (crc32 of the bytes combined with
  their wrapping int64 sum: fewer calls, which is what costs at those sizes).
- CUDA tensors: ``sk64`` where the bytes are whole rows (three reductions on the tensor's own
  stream), else ``lin64`` = three wrapping int64 sums of the int32 words (plain, weighted by
  column and by row of a 1024-wide layout); the parameters of a step take batched lin64. Nothing
  is synchronised: the sums are copied to pinned host memory behind a CUDA event, and the
  agent's writer thread reads them later (``Pending``).

All change for every single-bit change and for a swap of two unequal elements (a plain sum
misses swaps; ``torch.hash_tensor`` is an xor-reduce and misses them too). The numpy reference
in ``fsdp_replay.trace.fingerprint`` computes the same values from raw bytes.
"""

from __future__ import annotations

import ctypes
import math
import struct
import sys
import threading
import zlib
from collections import OrderedDict
from typing import Any

import torch

from fsdp_replay.agent import native
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


def host_buffer(t: torch.Tensor) -> Any:
    """A zero-copy buffer over a contiguous CPU tensor's bytes (keep ``t`` alive while used)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return b""
    return (ctypes.c_char * n).from_address(t.data_ptr())


# Events the writer thread waits on are created with blocking=True: it sleeps until the device
# gets there instead of spinning a core (cudaEventBlockingSync); nothing else waits on them.


class Pending:
    """A value still on the device; ``value()`` waits for its event (writer thread only)."""

    __slots__ = ("_combine", "_event", "_host")

    def __init__(self, host: Any, event: Any, combine: Any) -> None:
        self._host = host
        self._event = event
        self._combine = combine

    def value(self) -> Any:
        if self._event is not None:
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


def region_of(inner: torch.Tensor, outer: torch.Tensor) -> int | None:
    """The byte offset of ``inner`` in ``outer`` when ``inner`` is a contiguous part of ``outer``'s
    memory that starts and ends on sk64 row boundaries of ``outer`` (or at its end), both sk64
    tensors with a fast path: then ``fingerprint_with_region`` computes both in one pass. Else None.

    FSDP2's all-gathers are in place: each rank's input is its slice of the output. Called for
    every all-gather, so only cheap attribute reads come before the address test."""
    if inner.dtype != outer.dtype or inner.device != outer.device:
        return None
    n_in, n_out = nbytes_of(inner), nbytes_of(outer)
    p_in, p_out = inner.data_ptr(), outer.data_ptr()
    off = p_in - p_out
    if off < 0 or off + n_in > n_out:
        return None  # not inside (bytes inside another tensor's bytes are that tensor's memory)
    if n_in < schema.SK64_MIN_BYTES and not native.available():
        return None  # the torch path fingerprints it with zlib64
    if off % _SK64_ROW_BYTES or ((off + n_in) % _SK64_ROW_BYTES and off + n_in != n_out):
        return None
    if p_out % 8 or n_out % 8 or n_in % 8 or outer.dtype in (torch.bool,) or outer.is_complex():
        return None
    if not (inner.is_contiguous() and outer.is_contiguous()):
        return None
    return off


def fingerprint_with_region(
    outer: torch.Tensor, off: int, n_in: int
) -> tuple[tuple[Any, Any], tuple[Any, Any]] | None:
    """(sk64, nonfinite) of ``outer`` and of its bytes [off, off + n_in) (see ``region_of``),
    reading every byte once. The all-gather case (``outer`` is whole, equal rank slices of whole
    rows) takes three reductions for all of them. On a device the values are ``Pending``, and
    the all-gather case is the only one (None otherwise: fingerprint them apart)."""
    n_out = nbytes_of(outer)
    if n_in and n_out % n_in == 0 and off % n_in == 0:
        got = native.sk64(outer, n_out // n_in)
        if got is not None:
            return got[0], got[1 + off // n_in]
        sketch = _sketch(outer, n_out // n_in)
        if sketch is not None:
            mine = 1 + off // n_in
            if outer.device.type == "cpu":
                values = sketch.values()
                return values[0], values[mine]
            event = _device_event(outer)
            return _sketch_pendings(sketch, event, 0), _sketch_pendings(sketch, event, mine)
    if outer.device.type != "cpu":
        return None
    # any other layout: the slices before, at and after the region, each summed on its own
    flat = outer.view(-1)
    words = flat.view(torch.int64)
    floats = flat if flat.is_floating_point() else None
    w_in, w_end = off // 8, (off + n_in) // 8

    def part(w0: int, w1: int) -> tuple[torch.Tensor, list[int], bool]:
        rowsums, colsums = _sk64_sums(words[w0:w1])
        nf = False
        if floats is not None and w1 > w0:
            per_word = floats.numel() // words.numel()
            f = floats[w0 * per_word : w1 * per_word]
            nf = not math.isfinite(float(_float_sum(f)))
        return rowsums, list(_int64s(colsums)), nf

    inner = part(w_in, w_end)
    parts = ([part(0, w_in)] if w_in else []) + [inner]
    if w_end < words.numel():
        parts.append(part(w_end, words.numel()))
    all_rows = torch.cat([p[0] for p in parts]) if len(parts) > 1 else inner[0]
    whole = [sum(col) for col in zip(*(p[1] for p in parts), strict=True)]
    return (
        (_sk64_value(n_out, whole, host_buffer(all_rows)), any(p[2] for p in parts)),
        (_sk64_value(n_in, inner[1], host_buffer(inner[0])), inner[2]),
    )


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


# -- many tensors at once ----------------------------------------------------------------------
# fingerprint_many() computes lin64 for all the tensors of one device with a fixed number of kernel
# launches, however many tensors there are. Each tensor's bytes are copied into one buffer by a
# single torch.cat, zero-padded to whole rows of LIN64_ROW int32 words, so that word i of a tensor
# lands in column i % LIN64_ROW of its (i // LIN64_ROW)-th row. Zero words add nothing to S, A or B,
# and the zero padding of a last partial word is lin64's own tail rule. Then per buffer row:
# the int64 row sum, the column-weighted row sum, and the row sum times the row's weight within its
# tensor (row j of a tensor weighs j + 1); index_add_ adds the rows of each tensor (integer adds: exact in any order). The
# non-finite flag is the float sum of each tensor's rows, viewed as its own dtype, again added per
# tensor with index_add_. The buffer is processed in chunks (a tensor may span chunks: the sums are
# linear), and the per-row segment ids and weights are cached per layout (dtypes and sizes).
# The lin64 values are those of fingerprint() bit for bit. The float sums are added in another order
# than t.sum(): the flags differ only if partial sums of finite values overflow in one order and
# not in the other (any NaN or infinite element flags the tensor in both).

_ROW_BYTES = LIN64_ROW * 4
_SUB = 32  # a row is viewed as _SUB x _SUB words
assert _SUB * _SUB == LIN64_ROW
# The words of one chunk take at most this many bytes of device memory (plus 1/8 of it in per-row
# partial sums). Tests lower it to exercise chunking.
_CHUNK_BYTES = 256 << 20
_LAYOUT_CACHE_SIZE = 8

_FLOAT_ACC = {
    torch.float16: torch.float32,
    torch.bfloat16: torch.float32,
    torch.float32: torch.float32,
    torch.float64: torch.float64,
}
_PLAIN = native.PLAIN_DTYPES


class _Chunk:
    """One torch.cat: the byte spans it copies, and per output row its tensor and row weight."""

    __slots__ = ("floats", "row_seg", "row_weight", "rows", "spans")

    def __init__(
        self,
        spans: list[tuple[int, int, int, torch.Tensor | None]],
        rows: int,
        row_seg: torch.Tensor,
        row_weight: torch.Tensor,
        floats: list[tuple[torch.dtype, torch.dtype, int, int]],
    ) -> None:
        self.spans = spans  # (segment, first byte, end byte, zero pad after it or None)
        self.rows = rows
        self.row_seg = row_seg  # (rows,) int64: the segment of each row
        self.row_weight = row_weight  # (rows,) int64: 1 + the row's index within its tensor
        self.floats = floats  # (dtype, sum dtype, first row, end row): the rows of float tensors


class _Layout:
    """How a list of tensors of given dtypes and sizes is laid out in chunks (cached per layout)."""

    __slots__ = ("chunks", "col_weight", "fast", "has_f32", "has_f64", "slow")

    def __init__(self, key: tuple[Any, ...], device: torch.device, chunk_bytes: int) -> None:
        specs: tuple[tuple[torch.dtype, int], ...] = key[2]
        fast = [i for i, (d, _) in enumerate(specs) if d in _FLOAT_ACC or d in _PLAIN]
        # float tensors grouped by dtype, so that each dtype's rows in a chunk are one range
        fast.sort(key=lambda i: (specs[i][0] in _FLOAT_ACC, str(specs[i][0])))
        self.fast = fast  # segment k is tensor fast[k]
        self.slow = [i for i, (d, _) in enumerate(specs) if not (d in _FLOAT_ACC or d in _PLAIN)]
        self.has_f32 = any(_FLOAT_ACC.get(specs[i][0]) == torch.float32 for i in fast)
        self.has_f64 = any(_FLOAT_ACC.get(specs[i][0]) == torch.float64 for i in fast)
        # built on the host and copied with blocking copies, so they are ready on any stream
        sub = torch.arange(_SUB, dtype=torch.int64)
        self.col_weight = torch.cat([sub * _SUB, sub + 1]).to(device)  # see _lin64_rows
        zeros = torch.zeros(_ROW_BYTES, dtype=torch.uint8).to(device)
        cap = max(1, chunk_bytes // _ROW_BYTES)  # rows per chunk
        self.chunks: list[_Chunk] = []
        spans: list[tuple[int, int, int, torch.Tensor | None]] = []
        runs: list[tuple[int, int, int]] = []  # (segment, first row weight, rows)
        floats: list[tuple[torch.dtype, torch.dtype, int, int]] = []
        used = 0

        def close() -> None:
            nonlocal spans, runs, floats, used
            if used:
                seg = torch.tensor([k for k, _, _ in runs], dtype=torch.int64)
                first = torch.tensor([w for _, w, _ in runs], dtype=torch.int64)
                counts = torch.tensor([n for _, _, n in runs], dtype=torch.int64)
                starts = torch.cumsum(counts, 0) - counts
                row_seg = torch.repeat_interleave(seg, counts)
                row_weight = torch.arange(used, dtype=torch.int64) + torch.repeat_interleave(
                    first - starts, counts
                )
                self.chunks.append(_Chunk(spans, used, row_seg.to(device), row_weight.to(device), floats))
            spans, runs, floats, used = [], [], [], 0

        for k, i in enumerate(fast):
            dtype, numel = specs[i]
            nbytes = numel * dtype.itemsize
            nrows = -(-nbytes // _ROW_BYTES)
            row = 0
            while row < nrows:
                take = min(nrows - row, cap - used)
                b0, b1 = row * _ROW_BYTES, min((row + take) * _ROW_BYTES, nbytes)
                pad = take * _ROW_BYTES - (b1 - b0)
                spans.append((k, b0, b1, zeros[:pad] if pad else None))
                runs.append((k, row + 1, take))
                acc = _FLOAT_ACC.get(dtype)
                if acc is not None:
                    if floats and floats[-1][0] == dtype and floats[-1][3] == used:
                        floats[-1] = (dtype, acc, floats[-1][2], used + take)
                    else:
                        floats.append((dtype, acc, used, used + take))
                used += take
                row += take
                if used == cap:
                    close()
        close()


_LAYOUTS: OrderedDict[tuple[Any, ...], _Layout] = OrderedDict()
_LAYOUTS_LOCK = threading.Lock()


def _layout(tensors: list[torch.Tensor], device: torch.device) -> _Layout:
    key = (device, _CHUNK_BYTES, tuple((t.dtype, t.numel()) for t in tensors))
    with _LAYOUTS_LOCK:
        layout = _LAYOUTS.get(key)
        if layout is None:
            layout = _LAYOUTS[key] = _Layout(key, device, _CHUNK_BYTES)
            while len(_LAYOUTS) > _LAYOUT_CACHE_SIZE:
                _LAYOUTS.popitem(last=False)
        else:
            _LAYOUTS.move_to_end(key)
    return layout


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return (t if t.is_contiguous() else t.contiguous()).view(-1).view(torch.uint8)


def _lin64_rows(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """(rows, row_of): rows[row_of[i]] = (S, A, B, nonfinite) of tensors[i], int64 on their device."""
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        raise ValueError("all tensors must be on one device")
    layout = _layout(tensors, device)
    nfast = len(layout.fast)
    row_of = [0] * len(tensors)
    for k, i in enumerate(layout.fast):
        row_of[i] = k
    for k, i in enumerate(layout.slow):
        row_of[i] = nfast + k
    parts: list[torch.Tensor] = []
    with torch.no_grad():
        if nfast:
            sums = torch.zeros(nfast, 3, dtype=torch.int64, device=device)
            fsum = {
                acc: torch.zeros(nfast, dtype=acc, device=device)
                for acc, present in ((torch.float32, layout.has_f32), (torch.float64, layout.has_f64))
                if present
            }
            flat = [_flat_bytes(tensors[i]) for i in layout.fast]
            for chunk in layout.chunks:
                pieces: list[torch.Tensor] = []
                for k, b0, b1, pad in chunk.spans:
                    f = flat[k]
                    pieces.append(f if b0 == 0 and b1 == f.numel() else f[b0:b1])
                    if pad is not None:
                        pieces.append(pad)
                buf = torch.cat(pieces)
                # column k = 32 a + c of a row has weight k + 1 = 32 a + (c + 1): two int64 sums
                # over a 32 x 32 view give the column-weighted row sum without an int64 copy
                words = buf.view(torch.int32).view(chunk.rows, _SUB, _SUB)
                parts32 = torch.cat([words.sum(2, dtype=torch.int64), words.sum(1, dtype=torch.int64)], 1)
                rowsum = parts32[:, :_SUB].sum(1)
                rowa = (parts32 * layout.col_weight).sum(1)
                rowb = rowsum * chunk.row_weight
                sums.index_add_(0, chunk.row_seg, torch.stack([rowsum, rowa, rowb], 1))
                for dtype, acc, r0, r1 in chunk.floats:
                    part = buf[r0 * _ROW_BYTES : r1 * _ROW_BYTES].view(dtype).view(r1 - r0, -1)
                    fsum[acc].index_add_(0, chunk.row_seg[r0:r1], part.sum(1, dtype=acc))
            nf: torch.Tensor | None = None
            for total in fsum.values():
                bad = ~torch.isfinite(total)
                nf = bad if nf is None else nf | bad
            if nf is None:
                nf = torch.zeros(nfast, dtype=torch.bool, device=device)
            parts.append(torch.cat([sums, nf.to(torch.int64).unsqueeze(1)], 1))
        for i in layout.slow:  # dtypes without a batched path (complex, float8, ...): per tensor
            t = tensors[i]
            nf1 = _nonfinite(t)
            flag = torch.zeros(1, dtype=torch.int64, device=device) if nf1 is None else nf1.reshape(1)
            parts.append(torch.cat([lin64_sums(t), flag.to(torch.int64)]).reshape(1, 4))
    rows = parts[0] if len(parts) == 1 else torch.cat(parts)
    return rows, row_of


def _lin64_many(tensors: list[torch.Tensor]) -> list[tuple[int, bool]]:
    """(lin64 fingerprint, nonfinite) of each tensor, computed by the batched path, synchronously."""
    if not tensors:
        return []
    rows, row_of = _lin64_rows(tensors)
    host = rows.tolist()
    out = []
    for t, r in zip(tensors, row_of, strict=True):
        s, a, b, nf = host[r]
        out.append((combine_lin64(s, a, b, nbytes_of(t)), bool(nf)))
    return out


class _HostRows:
    """The rows copied to the host, turned into Python ints once for all the ``Pending`` values."""

    __slots__ = ("rows",)

    def __init__(self) -> None:
        self.rows: list[list[int]] | None = None

    def get(self, host: torch.Tensor) -> list[list[int]]:
        if self.rows is None:
            self.rows = host.tolist()
        return self.rows


def _pending_fp(rows: _HostRows, r: int, nbytes: int) -> Any:
    def combine(host: torch.Tensor) -> int:
        s, a, b, _ = rows.get(host)[r]
        return combine_lin64(s, a, b, nbytes)

    return combine


def _pending_nf(rows: _HostRows, r: int) -> Any:
    return lambda host: bool(rows.get(host)[r][3])


def fingerprint_many(tensors: list[torch.Tensor]) -> list[tuple[Any, Any, str]]:
    """fingerprint() of each tensor. On CUDA: a fixed number of kernel launches for all of them,
    one device-to-host copy and one event."""
    if not tensors:
        return []
    if tensors[0].device.type == "cpu":
        got = native.sk64_many(tensors)  # one native call for all of them
        if got is not None:
            return [
                fingerprint(t) if g is None else (g[0], g[1], schema.FP_SK64)
                for t, g in zip(tensors, got, strict=True)
            ]
    if tensors[0].device.type == "cpu" or any(t.device != tensors[0].device for t in tensors):
        return [fingerprint(t) for t in tensors]
    device = tensors[0].device
    rows, row_of = _lin64_rows(tensors)
    host = torch.empty(rows.shape, dtype=torch.int64, pin_memory=True)
    host.copy_(rows, non_blocking=True)
    event = torch.cuda.Event(blocking=True)
    event.record(torch.cuda.current_stream(device))
    return _pendings(tensors, row_of, host, event)


def _pendings(
    tensors: list[torch.Tensor], row_of: list[int], host: torch.Tensor, event: Any
) -> list[tuple[Any, Any, str]]:
    shared = _HostRows()
    return [
        (
            Pending(host, event, _pending_fp(shared, r, nbytes_of(t))),
            Pending(host, event, _pending_nf(shared, r)),
            schema.FP_LIN64,
        )
        for t, r in zip(tensors, row_of, strict=True)
    ]


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def host_values(t: torch.Tensor) -> Any:
    """A small tensor's values as a list: now on the CPU, as a ``Pending`` on a device."""
    if t.device.type == "cpu":
        return t.detach().double().tolist()
    host = torch.empty(t.shape, dtype=torch.float64, pin_memory=True)
    host.copy_(t.detach().double(), non_blocking=True)
    event = torch.cuda.Event(blocking=True)
    event.record()
    return Pending(host, event, lambda h: h.tolist())
