# mypy: disable-error-code="no-untyped-def"
"""The Triton kernel of ``fused.py`` (a module of its own: it imports triton, which CPU builds of
torch come without, and Triton resolves the functions a kernel calls among its module's globals)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _one(acc, base, n, kind, W, d1, d2, s0, s1, s2, blk, R: tl.constexpr, ROW: tl.constexpr):
    # the tensor's bytes as int32 words: `base` is its address (an integer argument, so that one
    # compiled kernel takes every dtype)
    ptr = base.to(tl.int64).to(tl.pointer_type(tl.int32))
    rows = blk.to(tl.int64) * R + tl.arange(0, R)
    cols = tl.arange(0, ROW)
    offs = rows[:, None] * ROW + cols[None, :]  # the words in the tensor's logical order
    if W > 0:
        # a strided tensor, seen as rows of W contiguous words, at most three dimensions of
        # rows (d0, d1, d2; strides s0, s1, s2 in words): each word's address from its place
        # (int32: ``launch`` takes this path for tensors of fewer than 2**31 words only)
        o = offs.to(tl.int32)
        r = o // W
        c = o - r * W
        r1 = r // d2
        i2 = r - r1 * d2
        i0 = r1 // d1
        i1 = r1 - i0 * d1
        addr = i0.to(tl.int64) * s0 + i1.to(tl.int64) * s1 + i2.to(tl.int64) * s2 + c
    else:
        addr = offs
    w = tl.load(ptr + addr, mask=offs < n, other=0)
    w64 = w.to(tl.int64)
    rowsum = tl.sum(w64, axis=1)
    colsum = tl.sum(w64, axis=0)
    s = tl.sum(rowsum, axis=0)
    a = tl.sum(colsum * (cols.to(tl.int64) + 1), axis=0)
    b = tl.sum(rowsum * (rows + 1), axis=0)
    # non-finite elements: every exponent bit set (masked words read 0: finite); a word holds
    # two 16-bit elements, one float32, or half of a float64 (its upper half: the odd words)
    hi32 = ((w & 0x7F800000) == 0x7F800000).to(tl.int32)  # float32, or the upper bfloat16
    lo_bf16 = ((w & 0x7F80) == 0x7F80).to(tl.int32)
    f16 = ((w & 0x7C00) == 0x7C00).to(tl.int32) + ((w & 0x7C000000) == 0x7C000000).to(tl.int32)
    f64 = (((w & 0x7FF00000) == 0x7FF00000) & ((offs & 1) == 1)).to(tl.int32)
    bad = tl.where(
        kind == 1, f16, tl.where(kind == 2, hi32 + lo_bf16, tl.where(kind == 3, hi32, f64 * (kind == 4)))
    )
    nbad = tl.sum(tl.sum(bad.to(tl.int64), axis=1), axis=0)
    tl.atomic_add(acc + 0, s, sem="relaxed")
    tl.atomic_add(acc + 1, a, sem="relaxed")
    tl.atomic_add(acc + 2, b, sem="relaxed")
    tl.atomic_add(acc + 3, nbad, sem="relaxed")


@triton.jit(
    do_not_specialize=[
        "host",
        "p0",
        "n0",
        "k0",
        "w0",
        "a0",
        "b0",
        "x0",
        "y0",
        "z0",
        "p1",
        "n1",
        "k1",
        "w1",
        "a1",
        "b1",
        "x1",
        "y1",
        "z1",
        "p2",
        "n2",
        "k2",
        "w2",
        "a2",
        "b2",
        "x2",
        "y2",
        "z2",
        "p3",
        "n3",
        "k3",
        "w3",
        "a3",
        "b3",
        "x3",
        "y3",
        "z3",
        "e0",
        "e1",
        "e2",
    ]
)
def lin64_kernel(
    acc,
    count,
    host,
    p0,
    n0,
    k0,
    w0,
    a0,
    b0,
    x0,
    y0,
    z0,
    p1,
    n1,
    k1,
    w1,
    a1,
    b1,
    x1,
    y1,
    z1,
    p2,
    n2,
    k2,
    w2,
    a2,
    b2,
    x2,
    y2,
    z2,
    p3,
    n3,
    k3,
    w3,
    a3,
    b3,
    x3,
    y3,
    z3,
    e0,
    e1,
    e2,
    R: tl.constexpr,
    ROW: tl.constexpr,
):
    # per tensor i: p (address), n (words), k (dtype kind), then its layout: w words per row
    # (0: contiguous), a and b the sizes of the second and third row dimensions, x, y, z the
    # three row dimensions' strides in words (``fused.launch``)
    # programs [0, e0) read tensor 0, [e0, e1) tensor 1, [e1, e2) tensor 2, the rest tensor 3;
    # each adds its sums into acc (4 int64 per tensor, zero between launches)
    pid = tl.program_id(0)
    if pid < e0:
        _one(acc, p0, n0, k0, w0, a0, b0, x0, y0, z0, pid, R, ROW)
    elif pid < e1:
        _one(acc + 4, p1, n1, k1, w1, a1, b1, x1, y1, z1, pid - e0, R, ROW)
    elif pid < e2:
        _one(acc + 8, p2, n2, k2, w2, a2, b2, x2, y2, z2, pid - e1, R, ROW)
    else:
        _one(acc + 12, p3, n3, k3, w3, a3, b3, x3, y3, z3, pid - e2, R, ROW)
    # the last program to finish moves the sums to `host` (pinned memory, written over the bus)
    # and leaves acc and count zero for the next launch on this stream
    done = tl.atomic_add(count, 1, sem="acq_rel")
    if done == tl.num_programs(0) - 1:
        i = tl.arange(0, 16)
        sums = tl.atomic_xchg(acc + i, tl.zeros([16], dtype=tl.int64), sem="acq_rel")
        tl.store(host.to(tl.int64).to(tl.pointer_type(tl.int64)) + i, sums)
        tl.atomic_xchg(count, 0, sem="relaxed")
