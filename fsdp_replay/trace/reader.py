"""Reading a trace: plain zarr underneath, with clear errors instead of codec tracebacks.

``Trace.open(url)`` checks the format version; ``trace.rank(r)`` gives one rank's tables as numpy
columns (read lazily, only that rank's arrays), its attributes, and its payloads by row.
"""

from __future__ import annotations

import os
from functools import cached_property
from typing import Any

import numpy as np
import zarr

from fsdp_replay.errors import TraceFormatError, TraceNotFoundError, TraceVersionError
from fsdp_replay.trace import schema
from fsdp_replay.trace.collect import TABLES, blob_path
from fsdp_replay.trace.fingerprint import fingerprint
from fsdp_replay.trace.store import open_root


def _read_array(arr: zarr.Array, where: str) -> np.ndarray:
    try:
        return np.asarray(arr[:])
    except Exception as e:
        bad = _first_bad_chunk(arr)
        raise TraceFormatError(f"cannot read {bad or 'array'}: {type(e).__name__}: {e}", path=where) from None


def _first_bad_chunk(arr: zarr.Array) -> str | None:
    chunk = arr.chunks[0]
    for i in range(0, max(arr.shape[0], 1), max(chunk, 1)):
        try:
            arr[i : i + chunk]
        except Exception:
            return f"chunk c/{i // chunk}"
    return None


class Table:
    """Equal-length columns of one table of one rank."""

    def __init__(self, group: zarr.Group, where: str) -> None:
        self._group = group
        self._where = where
        self._cache: dict[str, np.ndarray] = {}

    def __getitem__(self, column: str) -> np.ndarray:
        if column not in self._cache:
            try:
                arr = self._group[column]
            except KeyError:
                raise TraceFormatError(f"missing column {column!r}", path=self._where) from None
            assert isinstance(arr, zarr.Array)
            self._cache[column] = _read_array(arr, f"{self._where}/{column}")
        return self._cache[column]

    def __len__(self) -> int:
        first = next(iter(self._group.array_keys()), None)
        return 0 if first is None else int(self._group[first].shape[0])  # type: ignore[union-attr]


class RankTrace:
    def __init__(self, trace: Trace, rank: int, group: zarr.Group) -> None:
        self.trace = trace
        self.rank = rank
        self.group = group
        self.where = f"{trace.url}/{schema.RANK_GROUP_FMT.format(rank=rank)}"
        self._tables: dict[str, Table] = {}

    @cached_property
    def attrs(self) -> dict[str, Any]:
        return dict(self.group.attrs)

    @property
    def meta(self) -> dict[str, Any]:
        return self.attrs.get("rank_start") or {}

    def names(self, kind: str) -> list[str]:
        return list(self.attrs.get(f"{kind}_names", []))

    def table(self, name: str) -> Table:
        """One table (cached: its columns are read once)."""
        cached = self._tables.get(name)
        if cached is not None:
            return cached
        if name not in TABLES:
            raise KeyError(name)
        try:
            g = self.group[name]
        except KeyError:
            raise TraceFormatError(f"missing table {name!r}", path=self.where) from None
        assert isinstance(g, zarr.Group)
        table = self._tables[name] = Table(g, f"{self.where}/{name}")
        return table

    @cached_property
    def collectives(self) -> Table:
        return self.table("collectives")

    @cached_property
    def tensors(self) -> Table:
        return self.table("tensors")

    @cached_property
    def steps(self) -> Table:
        return self.table("steps")

    @cached_property
    def batches(self) -> Table:
        return self.table("batches")

    @cached_property
    def batch_tensors(self) -> Table:
        return self.table("batch_tensors")

    @cached_property
    def payloads(self) -> Table:
        return self.table("payloads")

    @cached_property
    def _dims(self) -> np.ndarray:
        return self.table("shapes")["dim"]

    def shape(self, start: int, ndim: int) -> tuple[int, ...]:
        return tuple(int(x) for x in self._dims[start : start + ndim])

    def payload_digest(self, row: int) -> str:
        p = self.payloads
        return f"{int(p['digest_hi'][row]):016x}{int(p['digest_lo'][row]):016x}"

    def payload(self, row: int, *, verify: tuple[str, int] | None = None) -> bytes:
        """The bytes of payload ``row``; with ``verify=(algo, fp)`` also check its fingerprint."""
        if row < 0:
            raise TraceNotFoundError(f"{self.where}: no payload stored for this tensor")
        digest = self.payload_digest(row)
        path = blob_path(digest)
        try:
            arr = self.trace.root[path]
        except KeyError:
            raise TraceNotFoundError(f"{self.trace.url}/{path}: payload blob missing") from None
        assert isinstance(arr, zarr.Array)
        data = _read_array(arr, f"{self.trace.url}/{path}").tobytes()
        if len(data) != int(self.payloads["nbytes"][row]):
            raise TraceFormatError(
                f"payload has {len(data)} bytes, expected {self.payloads['nbytes'][row]}",
                path=f"{self.trace.url}/{path}",
            )
        if verify is not None:
            algo, fp = verify
            got = fingerprint(algo, data)
            if got != int(fp):
                raise TraceFormatError(
                    f"payload bytes do not match their fingerprint ({got:#x} != {fp:#x})",
                    path=f"{self.trace.url}/{path}",
                )
        return data


class Trace:
    def __init__(self, url: str, root: zarr.Group, meta: dict[str, Any]) -> None:
        self.url = url
        self.root = root
        self.meta = meta

    @classmethod
    def open(cls, url: str | os.PathLike[str]) -> Trace:
        s = os.fspath(url)
        if "://" not in s and not os.path.exists(s):
            raise TraceNotFoundError(f"{s}: no such trace")
        try:
            root = open_root(s, mode="r")
        except FileNotFoundError:
            if "://" not in s:
                raise TraceFormatError("not an fsdp-replay trace (no zarr.json here)", path=s) from None
            raise TraceNotFoundError(f"{s}: no such trace") from None
        except Exception as e:
            raise TraceFormatError(f"not a Zarr v3 group: {e}", path=s) from None
        meta = root.attrs.get(schema.ROOT_ATTR)
        if not isinstance(meta, dict) or meta.get("kind") != "trace":
            raise TraceFormatError("not an fsdp-replay trace (no 'fsdp_replay' root attribute)", path=s)
        version = meta.get("format_version")
        if version not in schema.READABLE_VERSIONS:
            raise TraceVersionError(
                f"trace format version {version!r}; this fsdp-replay reads {sorted(schema.READABLE_VERSIONS)}",
                path=s,
            )
        return cls(s, root, meta)

    @property
    def ranks(self) -> list[int]:
        return [int(r) for r in self.meta.get("ranks", [])]

    @property
    def world_size(self) -> int | None:
        ws = self.meta.get("world_size")
        return None if ws is None else int(ws)

    def rank(self, rank: int) -> RankTrace:
        name = schema.RANK_GROUP_FMT.format(rank=rank)
        try:
            g = self.root[name]
        except KeyError:
            raise TraceNotFoundError(
                f"{self.url}: rank {rank} is not in this trace (ranks: {self.ranks})"
            ) from None
        assert isinstance(g, zarr.Group)
        return RankTrace(self, rank, g)
