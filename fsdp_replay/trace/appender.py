"""A rank group's column arrays, grown in place: new rows appended, each array's digest kept running.

Format 3 lists every column with its length and the BLAKE2b-128 digest of all its bytes
(``ARRAYS_ATTR``). Recomputing that digest from the store at each collection would cost the whole
history, so each ``Column`` keeps the hash of the rows it holds, updated with the rows appended
(hashing is a stream: the digest of a column is the digest of its parts in order). A collection
that must change rows already written (a collective that completed late sorts before rows of an
earlier collection) rewrites the column from that row on: the hash at that row comes from the
nearest checkpoint (one where each of the last writes began and ended, and one every
``CHECKPOINT_EVERY`` rows within ``CHECKPOINT_ROWS`` of the end), plus the rows between it and that
row read back from the store; further back, from the column's start.

Arrays are chunked by a fixed ``chunk_rows`` from the first row, whatever their length (an array
created short and grown later would otherwise be cut into tiny chunks): an append rewrites at most
the last, partial chunk and writes the new ones.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr
from zarr.core.sync import sync

from fsdp_replay.trace.store import column_codecs

WRITE_CONCURRENCY = 16
"""Column writes in flight at once (a flush's objects go to an object store in parallel)."""
MARKS = 6
CHECKPOINT_EVERY = 1 << 14
CHECKPOINT_ROWS = 1 << 16
"""A rewrite within this many rows of a column's end reads at most ``CHECKPOINT_EVERY`` rows more."""


def _hasher() -> Any:
    return hashlib.blake2b(digest_size=16)


@dataclass(slots=True)
class WriteStats:
    """What a collection wrote into the column arrays (and why)."""

    rows: int = 0
    """Rows handed to the store: appended, or rewritten from an earlier row."""
    rows_read: int = 0
    """Rows read back from the store to rewrite from an earlier row (or to resume)."""
    arrays_created: int = 0
    rewrites: int = 0
    """Columns rewritten from a row already in the store."""


class Column:
    """One 1-D column array of a rank group: ``n`` rows in the store, hashed as they were written."""

    def __init__(self, group: zarr.Group, name: str, dtype: str, chunk_rows: int, stats: WriteStats) -> None:
        self.group = group  # the table's group
        self.name = name
        self.dtype = np.dtype(dtype)
        self.chunk_rows = chunk_rows
        self.stats = stats
        self.arr: zarr.Array | None = None
        self.n = 0
        self._hash = _hasher()
        self._checkpoints: list[tuple[int, Any]] = [(0, _hasher())]
        self._marks: list[tuple[int, Any]] = []  # the hash at the ends of the last collections

    # -- state -------------------------------------------------------------------------------
    def listing(self) -> dict[str, Any]:
        """Its entry in the rank's array list."""
        return {"len": self.n, "blake2b": self._hash.hexdigest()}

    def mark(self) -> None:
        """Keep the hash here (a write begins or a collection ends: a late row rewinds to it)."""
        if not self._marks or self._marks[-1][0] != self.n:
            self._marks = [*self._marks[-(MARKS - 1) :], (self.n, self._hash.copy())]

    def load(self, arr: zarr.Array, values: np.ndarray) -> None:
        """Take over an array of the store whose first ``len(values)`` rows are ``values`` (read and
        checked by the caller); rows past them are dropped."""
        self.arr = arr
        if int(arr.shape[0]) != len(values):
            arr.resize((len(values),))
        self._hash = _hasher()
        self._checkpoints, self._marks = [(0, _hasher())], []
        self.n = 0
        self._update(np.ascontiguousarray(values, dtype=self.dtype))
        self.mark()

    def _update(self, values: np.ndarray) -> None:
        """Hash ``values`` as rows ``n..``, checkpointing at every multiple of CHECKPOINT_EVERY."""
        pos = 0
        while pos < len(values):
            row = self.n + pos
            nxt = min(len(values), pos + CHECKPOINT_EVERY - row % CHECKPOINT_EVERY)
            self._hash.update(values[pos:nxt].tobytes())
            pos = nxt
            if (self.n + pos) % CHECKPOINT_EVERY == 0:
                self._checkpoints.append((self.n + pos, self._hash.copy()))
        self.n += len(values)
        floor = self.n - CHECKPOINT_ROWS
        self._checkpoints = [c for c in self._checkpoints if c[0] == 0 or c[0] >= floor]

    # -- writing ------------------------------------------------------------------------------
    def read(self, start: int, stop: int) -> np.ndarray:
        assert self.arr is not None
        if stop <= start:
            return np.zeros(0, dtype=self.dtype)
        self.stats.rows_read += stop - start
        return np.asarray(self.arr[start:stop], dtype=self.dtype)

    def write(self, start: int, values: np.ndarray) -> Coroutine[Any, Any, None]:
        """Rows ``start..`` become ``values`` (the column then ends after them). ``start`` is at
        most ``n``: below it, rows already in the store are rewritten. The digest and ``n`` are
        updated now; the returned coroutine does the writing (``write_all`` runs a flush's
        together: one round trip to the store's event loop, the objects put concurrently)."""
        assert self.arr is not None and 0 <= start <= self.n
        values = np.ascontiguousarray(values, dtype=self.dtype)
        if start < self.n:
            self._rewind(start)
            self.stats.rewrites += 1
        self.mark()  # where this write starts: a row arriving late next time goes after it, mostly
        new_n = start + len(values)
        self.stats.rows += len(values)
        self._update(values)
        arr = self.arr.async_array
        resize = new_n != int(self.arr.shape[0])

        async def put() -> None:
            if resize:
                await arr.resize((new_n,))
            if len(values):
                await arr.setitem(slice(start, new_n), values)

        return put()

    def _rewind(self, row: int) -> None:
        """The hash (and ``n``) back to rows ``[0, row)``: the nearest checkpoint at or before it,
        plus the rows between it and ``row`` read back from the store."""
        at, h = max((c for c in (*self._checkpoints, *self._marks) if c[0] <= row), key=lambda c: c[0])
        between = self.read(at, row)
        self._checkpoints = [c for c in self._checkpoints if c[0] <= at]
        self._marks = [c for c in self._marks if c[0] <= row]
        self._hash, self.n = h.copy(), at
        self._update(between)


class TableArrays:
    """The columns of one table (``schema.TABLES[name]``) in the rank group."""

    def __init__(
        self, rank_group: zarr.Group, name: str, columns: dict[str, str], chunk_rows: int, stats: WriteStats
    ) -> None:
        self.name = name
        self.rank_group = rank_group
        self.columns_spec = columns
        self.chunk_rows = chunk_rows
        self.stats = stats
        self.columns: dict[str, Column] = {}
        self._group: zarr.Group | None = None

    @property
    def n(self) -> int:
        """Rows in the store (every column has as many)."""
        return next(iter(self.columns.values())).n if self.columns else 0

    async def create(self, lengths: dict[str, int]) -> None:
        """Make the table's group and columns, each as long as ``lengths`` says (the rows are
        written next), at once (``write_all``): a store's objects are put concurrently."""
        rank_group = self.rank_group._async_group  # zarr's async half (its sync API has no gather)
        g = await rank_group.create_group(self.name, overwrite=True)
        self._group = zarr.Group(g)
        self.columns = {
            col: Column(self._group, col, dtype, self.chunk_rows, self.stats)
            for col, dtype in self.columns_spec.items()
        }
        arrays = await asyncio.gather(
            *(
                g.create_array(
                    col,
                    shape=(lengths.get(col, 0),),
                    dtype=dtype,
                    chunks=(self.chunk_rows,),
                    compressors=column_codecs(),
                    fill_value=0,
                    overwrite=True,
                )
                for col, dtype in self.columns_spec.items()
            )
        )
        for c, arr in zip(self.columns.values(), arrays, strict=True):
            c.arr = zarr.Array(arr)
            self.stats.arrays_created += 1

    def open_columns(self) -> dict[str, Column]:
        """Columns bound to the table's existing group (``load`` each before use)."""
        g = self.rank_group[self.name]
        assert isinstance(g, zarr.Group)
        self._group = g
        self.columns = {
            col: Column(g, col, dtype, self.chunk_rows, self.stats)
            for col, dtype in self.columns_spec.items()
        }
        return self.columns

    def read(self, start: int) -> dict[str, np.ndarray]:
        """Rows ``start..n`` of every column, from the store."""
        return {col: c.read(start, c.n) for col, c in self.columns.items()}

    def write(self, start: int, values: dict[str, np.ndarray]) -> list[Coroutine[Any, Any, None]]:
        return [c.write(start, values[col]) for col, c in self.columns.items()]

    def listing(self) -> dict[str, dict[str, Any]]:
        return {f"{self.name}/{col}": c.listing() for col, c in self.columns.items()}

    def mark(self) -> None:
        for c in self.columns.values():
            c.mark()


def write_all(writes: Iterable[Coroutine[Any, Any, None]]) -> None:
    """Run column writes (``Column.write``) concurrently, at most WRITE_CONCURRENCY at once; the
    first error is raised once all have stopped."""
    pending = list(writes)
    if not pending:
        return

    async def run() -> None:
        gate = asyncio.Semaphore(WRITE_CONCURRENCY)

        async def one(w: Coroutine[Any, Any, None]) -> None:
            async with gate:
                await w

        results = await asyncio.gather(*(one(w) for w in pending), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    sync(run())
