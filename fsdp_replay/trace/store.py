"""Opening Zarr stores by path or fsspec URL, and the codecs the trace uses.

A local folder is the default; anything with ``://`` goes through fsspec (``s3://`` needs s3fs);
a zarr ``Store`` object is taken as it is (a wrapper that counts or fails writes, in tests).
"""

from __future__ import annotations

import os
from typing import Any

import zarr
import zarr.codecs as zc
from zarr.abc.store import Store
from zarr.storage import FsspecStore, LocalStore

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


def open_store(url: Location, *, read_only: bool) -> Any:
    if isinstance(url, Store):
        return url
    s = os.fspath(url)
    if "://" in s and not s.startswith("file://"):
        return FsspecStore.from_url(s, read_only=read_only)
    path = s.removeprefix("file://")
    if not read_only:
        os.makedirs(path, exist_ok=True)
    return LocalStore(path, read_only=read_only)


def open_root(url: Location, *, mode: str) -> zarr.Group:
    store = open_store(url, read_only=(mode == "r"))
    return zarr.open_group(store=store, mode=mode, zarr_format=3)  # type: ignore[arg-type]
