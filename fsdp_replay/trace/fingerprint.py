"""Reference fingerprints in numpy, to verify payload bytes without torch.

The agent computes the same functions where the data is (``fsdp_replay.agent.fingerprint``); a
test checks both give the same value for every dtype. Both algorithms change for every single-bit
change and for a swap of two unequal elements; see docs/trace-format.md#fingerprints.
"""

from __future__ import annotations

import zlib

import numpy as np

from fsdp_replay.trace import schema

MASK64 = (1 << 64) - 1
LIN64_ROW = 1024
SK64_ROW = 32  # int64 words per row of the sk64 layout (256 bytes)


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def combine_zlib64(crc: int, int64_sum: int) -> int:
    s = int64_sum & MASK64
    return ((crc & 0xFFFFFFFF) << 32) | ((s ^ (s >> 32)) & 0xFFFFFFFF)


def combine_sk64(crc: int, int64_sum: int) -> int:
    """The low half is (lo + hi) mod 2**32 of the word sum: it changes whenever the sum changes by
    +-2**b, so every single-bit change of the data changes it (an xor fold would not always)."""
    s = int64_sum & MASK64
    return ((crc & 0xFFFFFFFF) << 32) | (((s & 0xFFFFFFFF) + (s >> 32)) & 0xFFFFFFFF)


def sk64_crc(nbytes: int, colsums: bytes | memoryview, rowsums: bytes | memoryview) -> int:
    """CRC-32 of the sketch: the byte count (8 bytes), then the column and row sums (little-endian int64)."""
    return zlib.crc32(rowsums, zlib.crc32(colsums, zlib.crc32(nbytes.to_bytes(8, "little"))))


def combine_lin64(s: int, a: int, b: int, nbytes: int) -> int:
    h = splitmix64((b & MASK64) ^ nbytes)
    h = splitmix64((a & MASK64) ^ h)
    return splitmix64((s & MASK64) ^ h)


def _tail_word(tail: bytes, width: int) -> int:
    return int.from_bytes(tail + b"\0" * (width - len(tail)), "little", signed=True)


def _bytes_view(data: bytes | memoryview | np.ndarray) -> memoryview:
    if isinstance(data, np.ndarray):
        return memoryview(np.ascontiguousarray(data).view(np.uint8).reshape(-1))  # type: ignore[arg-type]
    return memoryview(data).cast("B")


def zlib64(data: bytes | memoryview | np.ndarray) -> int:
    buf = _bytes_view(data)
    n8 = len(buf) // 8 * 8
    total = int(np.frombuffer(buf[:n8], dtype="<i8").sum(dtype=np.int64)) if n8 else 0
    if n8 < len(buf):
        total += _tail_word(bytes(buf[n8:]), 8)
    return combine_zlib64(zlib.crc32(buf), total)


def lin64(data: bytes | memoryview | np.ndarray) -> int:
    buf = _bytes_view(data)
    nbytes = len(buf)
    n4 = nbytes // 4 * 4
    words = np.frombuffer(buf[:n4], dtype="<i4").astype(np.int64)
    if n4 < nbytes:
        words = np.append(words, np.int64(_tail_word(bytes(buf[n4:]), 4)))
    idx = np.arange(words.size, dtype=np.int64)
    with np.errstate(over="ignore"):
        s = int(words.sum(dtype=np.int64))
        a = int((words * (idx % LIN64_ROW + 1)).sum(dtype=np.int64))
        b = int((words * (idx // LIN64_ROW + 1)).sum(dtype=np.int64))
    return combine_lin64(s, a, b, nbytes)


def sk64(data: bytes | memoryview | np.ndarray) -> int:
    buf = _bytes_view(data)
    nbytes = len(buf)
    n8 = nbytes // 8 * 8
    words = np.frombuffer(buf[:n8], dtype="<i8")
    if n8 < nbytes:
        words = np.append(words, np.int64(_tail_word(bytes(buf[n8:]), 8)))
    rows = -(-words.size // SK64_ROW)
    flat = np.zeros(rows * SK64_ROW, dtype=np.int64)
    flat[: words.size] = words
    grid = flat.reshape(rows, SK64_ROW)
    with np.errstate(over="ignore"):
        rowsums = grid.sum(1, dtype=np.int64)
        colsums = grid.sum(0, dtype=np.int64)
        total = int(rowsums.sum(dtype=np.int64))
    crc = sk64_crc(nbytes, colsums.astype("<i8").tobytes(), rowsums.astype("<i8").tobytes())
    return combine_sk64(crc, total)


def fingerprint(algo: str, data: bytes | memoryview | np.ndarray) -> int:
    if algo == schema.FP_ZLIB64:
        return zlib64(data)
    if algo == schema.FP_LIN64:
        return lin64(data)
    if algo == schema.FP_SK64:
        return sk64(data)
    raise ValueError(f"unknown fingerprint algorithm {algo!r}")
