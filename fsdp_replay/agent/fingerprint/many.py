"""Many tensors at once: lin64 of every tensor of one device with a fixed number of kernel
launches (a step's parameters on a GPU), and the per-tensor path elsewhere."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import torch

from fsdp_replay.agent.fingerprint import native
from fsdp_replay.agent.fingerprint.fused import lin64_fused
from fsdp_replay.agent.fingerprint.pending import Pending, nbytes_of
from fsdp_replay.agent.fingerprint.tensor import _nonfinite, fingerprint, lin64_sums
from fsdp_replay.trace import schema
from fsdp_replay.trace.fingerprint import (
    LIN64_ROW,
    combine_lin64,
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


def _pending_fp(rows: Any, r: int, nbytes: int) -> Any:
    def combine(host: torch.Tensor) -> int:
        s, a, b, _ = rows.get(host)[r]
        return combine_lin64(s, a, b, nbytes)

    return combine


def _pending_nf(rows: Any, r: int) -> Any:
    return lambda host: bool(rows.get(host)[r][3])


def fingerprint_many(tensors: list[torch.Tensor]) -> list[tuple[Any, Any, str]]:
    """fingerprint() of each tensor. On CUDA: a fixed number of kernel launches for all of them
    (one for up to ``fused.MAX_TENSORS`` tensors where Triton runs), one device-to-host copy and
    one event."""
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
    launched = lin64_fused(tensors)  # a few tensors (a taped op's outputs): one launch
    if launched is not None:
        rows_of_slot, event = launched
        return _pendings(tensors, list(range(len(tensors))), rows_of_slot, event, None)
    if len(tensors) == 1:
        return [fingerprint(tensors[0])]  # fewer launches than the batched path's for one
    rows, row_of = _lin64_rows(tensors)
    host = torch.empty(rows.shape, dtype=torch.int64, pin_memory=True)
    host.copy_(rows, non_blocking=True)
    event = torch.cuda.Event(blocking=True)
    event.record(torch.cuda.current_stream(tensors[0].device))
    return _pendings(tensors, row_of, _HostRows(), event, host)


def _pendings(
    tensors: list[torch.Tensor], row_of: list[int], shared: Any, event: Any, host: torch.Tensor | None
) -> list[tuple[Any, Any, str]]:
    """``shared.get(host)``: the rows, once ``event`` is done (``_HostRows`` or ``fused``'s)."""
    return [
        (
            Pending(host, event, _pending_fp(shared, r, nbytes_of(t))),
            Pending(host, event, _pending_nf(shared, r)),
            schema.FP_LIN64,
        )
        for t, r in zip(tensors, row_of, strict=True)
    ]
