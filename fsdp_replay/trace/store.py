"""Opening Zarr stores by path or fsspec URL, and the codecs the trace uses.

A local folder is the default; anything with ``://`` goes through fsspec (``s3://`` needs s3fs);
a zarr ``Store`` object is taken as it is (a wrapper that counts or fails writes, in tests).
"""

from __future__ import annotations

import asyncio
import io
import os
import stat
from collections.abc import Iterable
from typing import Any

import zarr
import zarr.codecs as zc
from zarr.abc.store import ByteRequest, OffsetByteRequest, RangeByteRequest, Store, SuffixByteRequest
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype
from zarr.storage import FsspecStore, LocalStore

from fsdp_replay.errors import TraceFormatError

Location = str | os.PathLike[str] | Store
"""Where a trace is: a folder, an fsspec URL, or a zarr store."""

# Metadata columns: zstd with its frame checksum, so a damaged chunk fails loudly.
COLUMN_CHUNK = 1 << 16


def column_codecs() -> tuple[Any, ...]:
    return (zc.ZstdCodec(level=3, checksum=True),)


# Payload blobs: a compressor (BLOB_CODECS, chosen by measurement: bench/bench_codecs.py), then a
# CRC32C of each chunk. Any of them is plain Zarr v3: a reader decodes what the array says.
BLOB_CHUNK = 4 << 20
BLOB_CODECS: dict[str, tuple[Any, ...]] = {
    "none": (),
    "blosc-lz4": (zc.BloscCodec(cname="lz4", clevel=5, shuffle="shuffle", typesize=4),),
    "blosc-zstd1": (zc.BloscCodec(cname="zstd", clevel=1, shuffle="shuffle", typesize=4),),
    "zstd1": (zc.ZstdCodec(level=1),),
    "zstd3": (zc.ZstdCodec(level=3),),
    "zstd9": (zc.ZstdCodec(level=9),),
}
"""Blob compressors by name: blosc-* shuffle bytes over 4-byte words first (most payloads are
fp32, or bf16 pairs), then compress each block."""
DEFAULT_BLOB_CODEC = "blosc-lz4"


def blob_codecs(name: str = DEFAULT_BLOB_CODEC) -> tuple[Any, ...]:
    try:
        compressors = BLOB_CODECS[name]
    except KeyError:
        raise ValueError(f"unknown blob codec {name!r}: one of {', '.join(BLOB_CODECS)}") from None
    return (*compressors, zc.Crc32cCodec())


class UnsafeTraceFile(TraceFormatError):
    """A file of a trace that is not a regular file inside it: never opened."""


def _open_inside(root: str, key: str) -> int:
    """A file descriptor of the regular file ``key`` inside the folder ``root``, opened without
    following a link out of the folder and without blocking (a FIFO would). Raises
    ``FileNotFoundError`` where there is none, ``UnsafeTraceFile`` for anything else."""
    path = os.path.join(root, key)
    real, top = os.path.realpath(path), os.path.realpath(root)
    if os.path.commonpath([real, top]) != top:
        raise UnsafeTraceFile(f"{key} leads out of the trace (a link to another place): not read", path=root)
    fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafeTraceFile(f"{key} is not a regular file: not read", path=root)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_inside(
    root: str, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None
) -> Buffer | None:
    try:
        fd = _open_inside(root, key)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    except OSError as e:  # ELOOP: the file itself is a link (O_NOFOLLOW)
        raise UnsafeTraceFile(
            f"{key} cannot be opened as a file of the trace ({e.strerror})", path=root
        ) from None
    with os.fdopen(fd, "rb") as f:
        size = f.seek(0, io.SEEK_END)
        start, end = 0, size
        if isinstance(byte_range, RangeByteRequest):
            start, end = byte_range.start, min(byte_range.end, size)
        elif isinstance(byte_range, OffsetByteRequest):
            start = byte_range.offset
        elif isinstance(byte_range, SuffixByteRequest):
            start = max(0, size - byte_range.suffix)
        elif byte_range is not None:
            raise TypeError(f"Unexpected byte_range, got {byte_range}.")
        f.seek(start)
        return prototype.buffer.from_bytes(f.read(max(0, end - start)))


class TraceFolderStore(LocalStore):
    """A local trace opened for reading: every file it reads is a regular file inside the folder.

    A trace is untrusted input: a chunk that is a link to a FIFO would hang a reader, one that
    points out of the trace would read another file of this machine into an error message or a
    replay. Such files are refused with ``UnsafeTraceFile``; their contents are never read.
    """

    async def get(
        self, key: str, prototype: BufferPrototype | None = None, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        if not self._is_open:
            await self._open()
        return await asyncio.to_thread(
            _read_inside, str(self.root), key, prototype or default_buffer_prototype(), byte_range
        )

    async def get_partial_values(
        self, prototype: BufferPrototype, key_ranges: Iterable[tuple[str, ByteRequest | None]]
    ) -> list[Buffer | None]:
        return [await self.get(key, prototype, byte_range) for key, byte_range in key_ranges]

    async def getsize(self, key: str) -> int:
        fd = _open_inside(str(self.root), key)
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)


def open_store(url: Location, *, read_only: bool) -> Any:
    if isinstance(url, Store):
        return url
    s = os.fspath(url)
    if "://" in s and not s.startswith("file://"):
        return FsspecStore.from_url(s, read_only=read_only)
    path = s.removeprefix("file://")
    if not read_only:
        os.makedirs(path, exist_ok=True)
        return LocalStore(path, read_only=False)
    return TraceFolderStore(path, read_only=True)


def open_root(url: Location, *, mode: str) -> zarr.Group:
    store = open_store(url, read_only=(mode == "r"))
    return zarr.open_group(store=store, mode=mode, zarr_format=3)  # type: ignore[arg-type]
