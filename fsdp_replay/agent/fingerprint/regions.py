"""In-place regions: an input that is a slice of an output (FSDP2's all-gathers), fingerprinted
together with the output in one pass over its bytes."""

from __future__ import annotations

import math
from typing import Any

import torch

from fsdp_replay.agent.fingerprint import native
from fsdp_replay.agent.fingerprint.pending import host_buffer, nbytes_of
from fsdp_replay.agent.fingerprint.tensor import (
    _SK64_ROW_BYTES,
    _device_event,
    _float_sum,
    _int64s,
    _sk64_sums,
    _sk64_value,
    _sketch,
    _sketch_pendings,
)
from fsdp_replay.trace import schema


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
