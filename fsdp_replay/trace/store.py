"""Opening Zarr stores by path or fsspec URL, and the codecs the trace uses.

A local folder is the default; anything with ``://`` goes through fsspec (``s3://`` needs s3fs).
"""

from __future__ import annotations

import os
from typing import Any

import zarr
import zarr.codecs as zc
from zarr.storage import FsspecStore, LocalStore

# Metadata columns: zstd with its frame checksum, so a damaged chunk fails loudly.
COLUMN_CHUNK = 1 << 16


def column_codecs() -> tuple[Any, ...]:
    return (zc.ZstdCodec(level=3, checksum=True),)


# Payload blobs: fast lz4 with byte shuffle over 4-byte words (most payloads are fp32/bf16 pairs),
# then a CRC32C of each chunk.
BLOB_CHUNK = 4 << 20


def blob_codecs() -> tuple[Any, ...]:
    return (zc.BloscCodec(cname="lz4", clevel=5, shuffle="shuffle", typesize=4), zc.Crc32cCodec())


def open_store(url: str | os.PathLike[str], *, read_only: bool) -> Any:
    s = os.fspath(url)
    if "://" in s and not s.startswith("file://"):
        return FsspecStore.from_url(s, read_only=read_only)
    path = s.removeprefix("file://")
    if not read_only:
        os.makedirs(path, exist_ok=True)
    return LocalStore(path, read_only=read_only)


def open_root(url: str | os.PathLike[str], *, mode: str) -> zarr.Group:
    store = open_store(url, read_only=(mode == "r"))
    return zarr.open_group(store=store, mode=mode, zarr_format=3)  # type: ignore[arg-type]
