"""Reading a trace: plain zarr underneath, with clear errors instead of codec tracebacks.

``Trace.open(url)`` checks the format version; ``trace.rank(r)`` gives one rank's tables as numpy
columns (read lazily, only that rank's arrays), its attributes, and its payloads by row.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from functools import cached_property
from typing import Any

import numpy as np
import zarr
from zarr.core.sync import sync

import fsdp_replay
from fsdp_replay.errors import TraceFormatError, TraceNotFoundError, TraceVersionError
from fsdp_replay.trace import attrs_check, completeness, schema, signing
from fsdp_replay.trace.fingerprint import fingerprint
from fsdp_replay.trace.schema import TABLES, blob_path, digest_of
from fsdp_replay.trace.store import open_root


def _node(group: zarr.Group, key: str, where: str) -> Any:
    """``group[key]``, with a missing node as KeyError and a damaged one (garbage or truncated
    ``zarr.json``, an unknown codec) as a TraceFormatError naming the file."""
    try:
        return group[key]
    except KeyError:
        raise
    except Exception as e:
        raise TraceFormatError(
            f"unreadable metadata ({type(e).__name__}: {e})", path=f"{where}/{key}/zarr.json"
        ) from None


def _read_array(arr: zarr.Array, where: str, listed: dict[str, Any] | None = None) -> np.ndarray:
    """The whole array; with ``listed`` (its length and digest from the rank's array list,
    format 3), also checked against them, so a missing or short chunk is an error, not zeros."""
    if listed is not None and int(arr.shape[0]) != int(listed["len"]):
        raise TraceFormatError(
            f"the array has {arr.shape[0]} elements; the trace lists {listed['len']}", path=where
        )
    _check_claimed_size(arr, where)
    try:
        values = np.asarray(arr[:])
    except Exception as e:
        bad = _first_bad_chunk(arr)
        raise TraceFormatError(f"cannot read {bad or 'array'}: {type(e).__name__}: {e}", path=where) from None
    if listed is not None and digest_of(np.ascontiguousarray(values).tobytes()) != listed["blake2b"]:
        missing = _missing_chunks(arr)
        why = f"{missing} of its {arr.nchunks} chunks are missing" if missing else "its bytes changed"
        raise TraceFormatError(f"the array does not match the trace's array list: {why}", path=where)
    return values


CHECKED_ALLOCATION_BYTES = 256 << 20
"""Arrays larger than this are read only once their chunks are seen to be there: a crafted
``zarr.json`` claiming 10^12 elements must not size an allocation."""


MAX_CHUNKS_LISTED = 1 << 20


async def _count_keys(store: Any, prefix: str) -> int:
    n = 0
    async for _ in store.list_prefix(prefix):
        n += 1
    return n


def _check_claimed_size(arr: zarr.Array, where: str) -> None:
    nbytes = int(arr.shape[0]) * arr.dtype.itemsize if arr.ndim == 1 else int(arr.nbytes)
    if nbytes <= CHECKED_ALLOCATION_BYTES:
        return
    claimed = int(arr.nchunks)
    present = 0
    if claimed <= MAX_CHUNKS_LISTED:
        try:
            present = sync(_count_keys(arr.store, f"{arr.path}/c/"))
        except Exception:
            present = 0
    if present < claimed:
        raise TraceFormatError(
            f"the array claims {arr.shape} elements ({nbytes} bytes) in {claimed} chunks, "
            + (f"of which {present} are there" if claimed <= MAX_CHUNKS_LISTED else "more than a trace holds")
            + ": not read",
            path=where,
        )


def _missing_chunks(arr: zarr.Array) -> int:
    try:
        return int(arr.nchunks) - int(arr.nchunks_initialized)
    except Exception:
        return 0


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

    def __init__(
        self,
        group: zarr.Group,
        where: str,
        name: str = "",
        listed: dict[str, Any] | None = None,
        changed: Callable[[], bool] | None = None,
    ) -> None:
        self._group = group
        self._where = where
        self._name = name
        self._listed = listed  # the rank's array list (format 3), or None
        self._changed = changed  # whether the rank's array list changed since it was read
        self._cache: dict[str, np.ndarray] = {}

    def _entry(self, column: str) -> dict[str, Any] | None:
        if self._listed is None:
            return None
        entry = self._listed.get(f"{self._name}/{column}")
        if entry is None:
            raise TraceFormatError(f"column {column!r} is not in the trace's array list", path=self._where)
        return dict(entry)

    def __getitem__(self, column: str) -> np.ndarray:
        if column not in self._cache:
            try:
                arr = _node(self._group, column, self._where)
            except KeyError:
                raise TraceFormatError(f"missing column {column!r}", path=self._where) from None
            if not isinstance(arr, zarr.Array):
                raise TraceFormatError(f"{column!r} is not an array", path=self._where)
            try:
                self._cache[column] = _read_array(arr, f"{self._where}/{column}", self._entry(column))
            except TraceFormatError:
                if self._changed is not None and self._changed():
                    raise TraceFormatError(
                        f"this rank's group changed while it was read (a collection is adding to it, "
                        f"column {column!r}): read the trace again",
                        path=self._where,
                    ) from None
                raise
        return self._cache[column]

    def has(self, column: str) -> bool:
        """Whether the table has this column (one added in a later format is absent from older traces)."""
        if self._listed is not None:
            return f"{self._name}/{column}" in self._listed
        return column in set(self._group.array_keys())

    def __len__(self) -> int:
        if self._listed is not None:
            entry = next((v for k, v in self._listed.items() if k.startswith(f"{self._name}/")), None)
            return 0 if entry is None else int(entry["len"])
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
        attrs = dict(self.group.attrs)
        attrs_check.check_rank(attrs, self.rank, self.trace.world_size, self.where)
        version = self.trace.meta.get("format_version")
        if isinstance(version, int) and version >= 3 and schema.ARRAYS_ATTR not in attrs:
            raise TraceFormatError(
                "this rank's group is unfinished (a collect was interrupted while writing it): "
                "run `fsdp-replay collect` on the run folder again",
                path=self.where,
            )
        return attrs

    @cached_property
    def completeness(self) -> dict[str, Any]:
        """``{"complete", "through_step", "reasons"}``: how far this rank's record is whole."""
        return completeness.of_rank(self.attrs, len(self.steps))

    @property
    def meta(self) -> dict[str, Any]:
        return self.attrs.get("rank_start") or {}

    def names(self, kind: str) -> list[str]:
        return list(self.attrs.get(f"{kind}_names", []))

    def has_table(self, name: str) -> bool:
        """Whether this rank has table ``name`` (a trace written before the table existed has not).
        A table that the rank's array list names is there: if its group is gone, ``table`` says so."""
        listed = self.attrs.get(schema.ARRAYS_ATTR)
        if isinstance(listed, dict) and any(k.startswith(f"{name}/") for k in listed):
            return True
        try:
            _node(self.group, name, self.where)
        except KeyError:
            return False
        return True

    def table(self, name: str) -> Table:
        """One table (cached: its columns are read once)."""
        cached = self._tables.get(name)
        if cached is not None:
            return cached
        if name not in TABLES:
            raise KeyError(name)
        try:
            g = _node(self.group, name, self.where)
        except KeyError:
            raise TraceFormatError(f"missing table {name!r}", path=self.where) from None
        if not isinstance(g, zarr.Group):
            raise TraceFormatError(f"{name!r} is not a group", path=self.where)
        listed = self.attrs.get(schema.ARRAYS_ATTR)
        table = self._tables[name] = Table(
            g, f"{self.where}/{name}", name, listed if isinstance(listed, dict) else None, self._changed
        )
        return table

    def _changed(self) -> bool:
        """Whether the group's array list is no longer the one read (a collection, in the sidecar,
        appends to a trace while it is read): a column that does not match it is then not damage."""
        try:
            now = zarr.open_group(store=self.group.store, path=self.group.path, mode="r").attrs
            return dict(now).get(schema.ARRAYS_ATTR) != self.attrs.get(schema.ARRAYS_ATTR)
        except Exception:
            return False

    def read_all(self) -> int:
        """Read (and so check) every column of every table; returns how many arrays. An analysis
        calls this first, so that it never answers from a rank whose metadata is damaged."""
        n = 0
        for name, columns in TABLES.items():
            if not self.has_table(name):
                continue  # a trace from before the table existed (one its array list names is read)
            table = self.table(name)
            for column in columns:
                table[column]
                n += 1
        return n

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
        where = f"{self.trace.url}/{path}"
        try:
            arr = _node(self.trace.root, path, self.trace.url)
        except KeyError:
            raise TraceNotFoundError(f"{where}: payload blob missing") from None
        if not isinstance(arr, zarr.Array):
            raise TraceFormatError("a payload blob is not an array", path=where)
        data = _read_array(arr, where).tobytes()
        if len(data) != int(self.payloads["nbytes"][row]):
            raise TraceFormatError(
                f"payload has {len(data)} bytes, expected {self.payloads['nbytes'][row]}", path=where
            )
        # Every blob (payloads, snapshots, RNG states) is named by the digest of its bytes.
        if digest_of(data) != digest:
            missing = _missing_chunks(arr)
            why = f"{missing} of its {arr.nchunks} chunks are missing" if missing else "its bytes changed"
            raise TraceFormatError(f"the blob's bytes do not match its name: {why}", path=where)
        if verify is not None:
            algo, fp = verify
            got = fingerprint(algo, data)
            if got != int(fp):
                raise TraceFormatError(
                    f"payload bytes do not match their fingerprint ({got:#x} != {fp:#x})",
                    path=f"{self.trace.url}/{path}",
                )
        return data


def _release(version: str) -> tuple[int, ...]:
    """``1.2.3rc1`` -> ``(1, 2, 3)``: the numeric release, for ordering."""
    out = []
    for part in version.split(".")[:4]:
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


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
            where = s if "://" in s or not os.path.isdir(s) else os.path.join(s, "zarr.json")
            raise TraceFormatError(f"not a Zarr v3 group ({type(e).__name__}: {e})", path=where) from None
        meta = root.attrs.get(schema.ROOT_ATTR)
        if not isinstance(meta, dict) or meta.get("kind") != "trace":
            raise TraceFormatError("not an fsdp-replay trace (no 'fsdp_replay' root attribute)", path=s)
        version = meta.get("format_version")
        if version not in schema.READABLE_VERSIONS:
            newer = (
                isinstance(version, int) and not isinstance(version, bool) and version > schema.FORMAT_VERSION
            )
            raise TraceVersionError(
                f"trace format version {version!r}; this fsdp-replay reads {sorted(schema.READABLE_VERSIONS)}"
                + (": the trace was written by a newer fsdp-replay (upgrade this one)" if newer else ""),
                path=s,
            )
        attrs_check.check_root(meta, s)
        return cls(s, root, meta)

    @property
    def ranks(self) -> list[int]:
        return [int(r) for r in self.meta.get("ranks", [])]

    @property
    def world_size(self) -> int | None:
        ws = self.meta.get("world_size")
        return None if ws is None else int(ws)

    def newer_writer(self) -> str | None:
        """The fsdp-replay version that wrote the trace, where it is newer than this one (what it
        added beyond the format is not read: said, not silently passed over); else None."""
        run = self.meta.get("run")
        wrote = run.get("fsdp_replay") if isinstance(run, dict) else None
        if not isinstance(wrote, str) or _release(wrote) <= _release(fsdp_replay.__version__):
            return None
        return wrote

    def signature(self, key: signing.SigningKey | None, ranks: list[int] | None = None) -> tuple[str, bool]:
        """Whether the trace is signed, by which key, and with ``key`` whether the root's and the
        ranks' signatures match: one line, and whether it is bad (``trace/signing.py``)."""
        checks = {"the root": signing.check(dict(self.root.attrs), key)}
        for r in self.ranks if ranks is None else ranks:
            checks[f"rank {r}"] = signing.check(self.rank(r).attrs, key)
        return signing.describe(checks, key)

    def rank(self, rank: int) -> RankTrace:
        name = schema.RANK_GROUP_FMT.format(rank=rank)
        try:
            g = _node(self.root, name, self.url)
        except KeyError:
            if rank in self.ranks:
                raise TraceFormatError(
                    f"the group of rank {rank} is missing, although the trace lists ranks {self.ranks}",
                    path=f"{self.url}/{name}",
                ) from None
            raise TraceNotFoundError(
                f"{self.url}: rank {rank} is not in this trace (ranks: {self.ranks})"
            ) from None
        if not isinstance(g, zarr.Group):
            raise TraceFormatError(f"rank {rank} is not a group", path=f"{self.url}/{name}")
        return RankTrace(self, rank, g)
