"""One rank's group in the trace store, grown by each collection: what is new is appended.

A collection (``collect.py``) reads a rank's spool from where the last one stopped, into a
``RankBuilder`` that holds the new rows; ``flush`` puts them into the store:

1. rows are put in order: collectives by sequence number and CUPTI's kernels and copies by
   correlation id, within the process attempt. A row that sorts before rows already in the store
   (a collective completed late) makes the table be rewritten from the first row after it
   (``appender``: the digest from the nearest checkpoint), and the ``tensors`` rows that point to
   moved collectives with it;
2. the flight recorder's references of an attempt that ended are resolved in the rows already in
   the store too (their ``payload`` column is rewritten: once per attempt that held any);
3. the rank's attributes lose their array list (``ARRAYS_ATTR``): a reader that opens the group
   now is told it is unfinished; then the columns are written, then the attributes with the new
   array list and ``COLLECTOR_ATTR``, the resume point (the spool position read up to, and what the
   next collection needs that the columns do not hold). Each of these writes is one object
   (``zarr.json`` or a chunk), replaced whole by the store.

``resume`` picks that state up in a new process: it reads every column, checks it against the
array list (the copy kept in ``COLLECTOR_ATTR`` while the group is unfinished: a collection
killed mid-write is undone by cutting the columns back to it), and rebuilds what the builder
derives from its rows (the gaps ``completeness`` looks for, the payload rows by digest, the spool's
blob ids, kept in the ``_collector`` table). A group it cannot take over (another collector's, a
damaged one, a different spool) is built again from the spool.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zarr

from fsdp_replay.trace import schema, signing, spool
from fsdp_replay.trace.appender import TableArrays, WriteStats, write_all
from fsdp_replay.trace.completeness import Tracker
from fsdp_replay.trace.rank_builder import RankBuilder, jsonable
from fsdp_replay.trace.schema import COLLECTOR_ATTR, COLLECTOR_TABLE, TABLES, digest_of

COLLECTOR_VERSION = 1
Writes = dict[str, dict[str, tuple[int, np.ndarray]]]
"""Per table and column: the first row written and the values from there to the column's end."""
SORTED = {"collectives": "seq", "kernels": "corr", "copies": "corr"}
"""Tables whose rows are put in order of a column within an attempt (``docs/trace-format.md``)."""
_COLLECTOR_COLUMNS = {"attempt": "int32", "blob": "int64", "payload": "int64"}
UNDO_ROWS = 1 << 16
"""Values a collection that rewrites rows keeps, at most, to be undone if it is killed."""


@dataclass(slots=True)
class Cursor:
    """Where a rank's spool has been read up to: segment ``index`` from byte ``offset`` (0: its
    header), and that segment's ``created_ns`` (None: not read yet) to tell it is the same file."""

    index: int
    offset: int
    created_ns: int | None

    def to_json(self) -> list[Any]:
        return [self.index, self.offset, self.created_ns]


def segment_created(path: Path) -> int | None:
    """The ``created_ns`` of a segment's header (None: unreadable or gone)."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(schema.SEGMENT_MAGIC) + 4)
            if len(head) < len(schema.SEGMENT_MAGIC) + 4 or not head.startswith(schema.SEGMENT_MAGIC):
                return None
            hlen = int.from_bytes(head[-4:], "little")
            header = json.loads(f.read(min(hlen, 1 << 20)))
        created = header.get("created_ns")
        return int(created) if isinstance(created, int) else None
    except (OSError, ValueError):
        return None


def segment_index(path: str | Path) -> int:
    m = schema.SEGMENT_RE.match(Path(path).name)
    return int(m.group(1)) if m else -1


def first_segment(folder: Path) -> list[Any] | None:
    """``[index, created_ns]`` of a rank folder's first segment: which spool this is."""
    try:
        segs = spool.segments(folder)
    except Exception:
        return None
    return [segment_index(segs[0]), segment_created(segs[0])] if segs else None


class Rebuild(Exception):
    """The group cannot be taken over: built again from the spool (the message says why)."""


class RankStore:
    """The rank group of one rank, for one collector process."""

    def __init__(
        self,
        root: zarr.Group,
        rank: int,
        folder: Path,
        chunk_rows: int,
        signing_key: signing.SigningKey | None = None,
    ) -> None:
        self.root = root
        self.signing_key = signing_key  # signs the group's attributes each time they are written
        self.rank = rank
        self.folder = folder
        self.chunk_rows = chunk_rows
        self.stats = WriteStats()
        self.name = schema.RANK_GROUP_FMT.format(rank=rank)
        self.group: zarr.Group | None = None
        self.tables: dict[str, TableArrays] = {}
        self.blob_ids: TableArrays | None = None
        self.last_key: dict[str, int | None] = dict.fromkeys(SORTED)
        self.written_attrs: str = ""  # the attributes last written (JSON), to skip an unchanged write
        self.written_doc: dict[str, Any] = {}
        self.fresh = True  # the group is to be created (no resume)
        self.rebuilt = ""  # why a group there was not taken over
        self.spool_id: list[Any] | None = None
        self.completeness: dict[str, Any] = {}  # the rank's, as last written

    def holds(self, attrs: dict[str, Any]) -> bool:
        """Whether the group's attributes are those this store wrote last (no other collector
        wrote the group since)."""
        return bool(self.written_attrs) and _text(attrs) == self.written_attrs

    # -- resume -------------------------------------------------------------------------------
    def resume(self, builder: RankBuilder) -> Cursor | None:
        """Take over the group the last collection left, filling ``builder`` (new), and return
        where to read the spool from. None: the group is built anew (``fresh``; ``rebuilt`` says
        why, when there was one) from the spool's start, with another new builder."""
        self.spool_id = first_segment(self.folder)
        try:
            node = self.root[self.name]
        except KeyError:
            return None
        try:
            if not isinstance(node, zarr.Group):
                raise Rebuild("not a group")
            return self._resume(node, builder)
        except Rebuild as e:
            self.rebuilt = str(e)
        except Exception as e:  # damaged metadata, chunks, attributes: the spool has it all
            self.rebuilt = f"{type(e).__name__}: {e}"
        self.tables, self.blob_ids, self.fresh = {}, None, True
        self.last_key = dict.fromkeys(SORTED)
        return None

    def _resume(self, group: zarr.Group, b: RankBuilder) -> Cursor:
        attrs = dict(group.attrs)
        st = attrs.get(COLLECTOR_ATTR)
        if not isinstance(st, dict) or st.get("version") != COLLECTOR_VERSION:
            raise Rebuild("written by a collector that cannot be resumed")
        listing = attrs.get(schema.ARRAYS_ATTR) or st.get("arrays")
        if not isinstance(listing, dict):
            raise Rebuild("no array list")
        if st.get("spool") != self.spool_id:
            raise Rebuild(f"collected from another spool ({st.get('spool')}, now {self.spool_id})")
        index, offset, created = st["cursor"]
        cursor = Cursor(int(index), int(offset), created)
        if offset > 0:
            seg = self.folder / schema.SEGMENT_FMT.format(index=index)
            try:
                size = seg.stat().st_size
            except OSError:
                raise Rebuild(f"{seg.name}, read up to byte {offset}, is gone") from None
            if size < offset or segment_created(seg) != created:
                raise Rebuild(f"{seg.name} is not the segment read up to byte {offset}")
        self.group = group
        for key, (start, values) in (st.get("undo") or {}).items() if schema.ARRAYS_ATTR not in attrs else ():
            arr = group[key]  # a collection was killed while rewriting these rows: put them back
            assert isinstance(arr, zarr.Array)
            end = start + len(values)
            if int(arr.shape[0]) < end:
                arr.resize((end,))
            arr[start:end] = np.asarray(values, dtype=arr.dtype)
        for table, columns in TABLES.items():
            ta = self.tables[table] = TableArrays(group, table, columns, self.chunk_rows, self.stats)
            self._load(ta, {f"{table}/{c}": listing.get(f"{table}/{c}") for c in columns}, b)
        self.blob_ids = TableArrays(group, COLLECTOR_TABLE, _COLLECTOR_COLUMNS, self.chunk_rows, self.stats)
        values = self._load(self.blob_ids, st["blob_ids"], None)
        self._restore(b, attrs, st, values)
        self.fresh = False
        self.written_attrs, self.written_doc = _text(attrs), attrs
        stored = attrs.get(schema.COMPLETENESS_ATTR)
        self.completeness = dict(stored) if isinstance(stored, dict) else {}
        return cursor

    def _load(self, ta: TableArrays, listed: dict[str, Any], b: RankBuilder | None) -> dict[str, np.ndarray]:
        """Read a table's columns, check them against the array list, take them over; feed what
        the builder derives from them. Returns the columns of the private table (others: {})."""
        columns = ta.open_columns()
        got: dict[str, np.ndarray] = {}
        for col, c in columns.items():
            entry = listed.get(f"{ta.name}/{col}")
            if not isinstance(entry, dict):
                raise Rebuild(f"{ta.name}/{col} is not in the array list")
            arr = ta.rank_group[f"{ta.name}/{col}"]
            n = int(entry["len"])
            if not isinstance(arr, zarr.Array) or int(arr.shape[0]) < n:
                raise Rebuild(f"{ta.name}/{col} is shorter than listed")
            values = np.asarray(arr[:n], dtype=c.dtype)
            self.stats.rows_read += n
            if digest_of(np.ascontiguousarray(values).tobytes()) != entry["blake2b"]:
                raise Rebuild(f"{ta.name}/{col} does not match the array list")
            c.load(arr, values)
            got[col] = values
        if b is not None:
            self._derive(b, ta.name, got)
            return {}
        return got

    def _derive(self, b: RankBuilder, table: str, cols: dict[str, np.ndarray]) -> None:
        """What the builder keeps of the rows in the store (their number, the gaps, ...)."""
        n = len(next(iter(cols.values())))
        b.base[table] = n
        p = b.progress
        if table == "steps":
            for step, colls in zip(cols["step"].tolist(), cols["colls"].tolist(), strict=True):
                p.step(step, colls)
        elif table == "collectives":
            for seq, step in zip(cols["seq"].tolist(), cols["step"].tolist(), strict=True):
                p.coll(seq, step)
        elif table == "batches":
            for loader, index, step in zip(
                cols["loader"].tolist(), cols["index"].tolist(), cols["step"].tolist(), strict=True
            ):
                p.batch(loader, index, step)
        elif table == "module_fps":
            for step, idx in zip(cols["step"].tolist(), cols["idx"].tolist(), strict=True):
                p.module(step, idx)
        elif table == "tape":
            for seq, step in zip(cols["seq"].tolist(), cols["step"].tolist(), strict=True):
                p.tape_call(seq, step)
        elif table == "payloads":
            for row, (hi, lo, nbytes) in enumerate(
                zip(
                    cols["digest_hi"].tolist(),
                    cols["digest_lo"].tolist(),
                    cols["nbytes"].tolist(),
                    strict=True,
                )
            ):
                digest = f"{hi:016x}{lo:016x}"
                if digest not in b.verified:  # (verified: written or read back by this collect)
                    self._check_blob(digest, int(nbytes))
                b._digests.setdefault(digest, row)
        if table in SORTED:
            key = cols[SORTED[table]]
            self.last_key[table] = int(key[-1]) if n else None

    def _check_blob(self, digest: str, nbytes: int) -> None:
        """A blob the rank's rows name must be whole in the store before the group is taken over:
        a collection that resumes reads only what the spool gained, so a blob damaged or lost
        after it was written (a store that lost objects, a chunk deleted by hand) would stay so.
        One that is not is a ``Rebuild``: the rank is collected again from its spool, which writes
        every blob that does not read back whole. Cheap when whole: its metadata and chunk list;
        its bytes are read only where chunks are absent (Zarr leaves out chunks of zeros)."""
        path = schema.blob_path(digest)
        try:
            arr = self.root[path]
        except KeyError:
            raise Rebuild(f"payload blob {digest} is missing") from None
        if not isinstance(arr, zarr.Array) or tuple(arr.shape) != (nbytes,):
            raise Rebuild(f"payload blob {digest} is not an array of {nbytes} bytes")
        if arr.attrs.get(schema.BLOB_COMPLETE_ATTR) is not True:
            raise Rebuild(f"payload blob {digest} was left unfinished")
        absent = nbytes and int(arr.nchunks_initialized) < int(arr.nchunks)
        if absent and digest_of(np.ascontiguousarray(arr[:]).tobytes()) != digest:
            raise Rebuild(f"payload blob {digest} has chunks missing")

    def _restore(
        self, b: RankBuilder, attrs: dict[str, Any], st: dict[str, Any], ids: dict[str, np.ndarray]
    ) -> None:
        for key in b.attrs:
            if key in attrs:  # a copy: the builder appends to them, the attributes read stay as read
                b.attrs[key] = copy.deepcopy(attrs[key])
        for kind, names in b.names.items():
            for name in attrs.get(f"{kind}_names", []):
                names.code(name)
        for sid, structure in enumerate(b.attrs["structures"]):
            b._structures[json.dumps(structure, sort_keys=True)] = sid
        t = st["tracker"]
        b.tracker = Tracker(int(t["last_step_done"]), t["limit"], bool(t["lost"]), list(t["reasons"]))
        b.attempt_rows = {k: int(st["attempt_rows"].get(k, 0)) for k in TABLES}
        b.held = bool(st["held"])
        b._kernel_codes = {int(k): int(v) for k, v in st["kernel_codes"].items()}
        b.pending_damage = list(st["pending_damage"])
        attempt = max(0, int(b.attrs["attempts"]) - 1)
        mine = ids["attempt"] == attempt
        b.blob_payload = dict(zip(ids["blob"][mine].tolist(), ids["payload"][mine].tolist(), strict=True))

    # -- flush --------------------------------------------------------------------------------
    def flush(self, b: RankBuilder, cursor: Cursor, *, final: bool) -> bool:
        """Put what ``b`` holds into the store, and the resume point ``cursor``; with ``final`` the
        spool has ended (its writers are gone). Returns whether anything was written."""
        if final:
            b.end_attempt()
            for d in b.pending_damage:
                b.tracker.cut(b.tracker.last_step_done, f"the spool ends damaged: {d}", lost=False)
            b.pending_damage = []
        writes: Writes = {}
        for table, columns in TABLES.items():
            rows = {c: np.asarray(b.cols[table][c], dtype=dtype) for c, dtype in columns.items()}
            if len(next(iter(rows.values()))) or self.fresh:
                writes[table] = {c: (b.base[table], v) for c, v in rows.items()}
        self._order(b, writes)
        self._resolve(b, writes)
        tracker = Tracker(b.tracker.last_step_done, b.tracker.limit, b.tracker.lost, list(b.tracker.reasons))
        for d in b.pending_damage:  # no record after it yet: the spool ends there, for now
            tracker.cut(tracker.last_step_done, f"the spool ends damaged: {d}", lost=False)
        completeness = b.progress.assess(tracker, b.attrs["end"], int(b.attrs["attempts"]))
        self.completeness = completeness
        ids = b.new_blob_ids
        state = {
            "version": COLLECTOR_VERSION,
            "spool": self.spool_id,
            "cursor": cursor.to_json(),
            "tracker": {
                "last_step_done": b.tracker.last_step_done,
                "limit": b.tracker.limit,
                "lost": b.tracker.lost,
                "reasons": b.tracker.reasons,
            },
            "attempt_rows": {t: r for t, r in b.attempt_rows.items() if r},
            "held": b.held,
            "kernel_codes": {str(k): v for k, v in b._kernel_codes.items()},
            "pending_damage": b.pending_damage,
        }
        if writes or ids or self.fresh:
            self._write(b, writes, ids, state, completeness)
        else:
            self._put_attrs(b, completeness, state)
        for ta in self.tables.values():
            ta.mark()
        for table, cols in b.cols.items():
            b.base[table] = self.tables[table].n
            for values in cols.values():
                values.clear()
        b.new_blob_ids, b.resolve_jobs = [], []
        return bool(writes or ids)

    def _write(
        self,
        b: RankBuilder,
        writes: Writes,
        ids: list[tuple[int, int, int]],
        state: dict[str, Any],
        completeness: dict[str, Any],
    ) -> None:
        if self.fresh:  # every column made as long as its rows (then written without a resize)
            self.group = group = self.root.create_group(self.name, overwrite=True)
            for table, columns in TABLES.items():
                self.tables[table] = TableArrays(group, table, columns, self.chunk_rows, self.stats)
            self.blob_ids = TableArrays(
                group, COLLECTOR_TABLE, _COLLECTOR_COLUMNS, self.chunk_rows, self.stats
            )
            lengths = {t: {c: len(v) for c, (_, v) in writes.get(t, {}).items()} for t in TABLES}
            lengths[COLLECTOR_TABLE] = dict.fromkeys(_COLLECTOR_COLUMNS, len(ids))
            write_all(
                [
                    *(ta.create(lengths[t]) for t, ta in self.tables.items()),
                    self.blob_ids.create(lengths[COLLECTOR_TABLE]),
                ]
            )
            self.fresh = False
        else:  # unfinished while the columns change; the old list stays with the resume point
            assert self.group is not None and self.blob_ids is not None
            old = dict(self.written_doc) if self.written_attrs else dict(self.group.attrs)
            listing = old.pop(schema.ARRAYS_ATTR, None)
            st: dict[str, Any] = dict(old.get(COLLECTOR_ATTR) or {})  # type: ignore[arg-type]
            if listing is not None:
                st["arrays"] = listing
            undo = self._undo(writes)
            if undo:
                st["undo"] = undo
            old[COLLECTOR_ATTR] = st
            self.group.attrs.put(old)
            self.written_attrs = ""
        puts = [
            self.tables[table].columns[col].write(start, values)
            for table, cols in writes.items()
            for col, (start, values) in cols.items()
        ]
        assert self.blob_ids is not None
        if ids:
            a, blob, row = (np.asarray(v, dtype=np.int64) for v in zip(*ids, strict=True))
            n = self.blob_ids.n
            puts += self.blob_ids.write(n, {"attempt": a.astype(np.int32), "blob": blob, "payload": row})
        write_all(puts)
        self._put_attrs(b, completeness, state)

    def _undo(self, writes: Writes) -> dict[str, list[Any]]:
        """The rows in the store that ``writes`` will overwrite, as they are: kept with the resume
        point while the group is unfinished, so that a collection killed in the middle is undone
        (``_resume``) instead of collected anew. Only up to UNDO_ROWS values (a late row rewrites
        a few rows; resolving a long attempt's held payloads may not fit: a kill then costs a
        rebuild of the rank)."""
        undo: dict[str, list[Any]] = {}
        total = 0
        for table, cols in writes.items():
            for col, (start, _) in cols.items():
                c = self.tables[table].columns[col]
                if start < c.n:
                    total += c.n - start
                    if total > UNDO_ROWS:
                        return {}
                    undo[f"{table}/{col}"] = [start, c.read(start, c.n).tolist()]
        return undo

    def _put_attrs(self, b: RankBuilder, completeness: dict[str, Any], state: dict[str, Any]) -> None:
        assert self.group is not None and self.blob_ids is not None
        attrs = dict(b.attrs)
        attrs.update({f"{k}_names": v.names for k, v in b.names.items()})
        attrs["rank"] = self.rank
        attrs[schema.COMPLETENESS_ATTR] = completeness
        state["blob_ids"] = self.blob_ids.listing()
        attrs[COLLECTOR_ATTR] = state
        listing: dict[str, Any] = {}
        for ta in self.tables.values():
            listing.update(ta.listing())
        attrs[schema.ARRAYS_ATTR] = listing  # last: a group without it is unfinished
        doc = jsonable(attrs)
        if self.signing_key is not None:
            doc[signing.SIGNATURE_ATTR] = signing.sign(self.signing_key, doc)
        text = _text(doc)
        if text != self.written_attrs:
            self.group.attrs.put(doc)
            self.written_attrs, self.written_doc = text, doc

    # -- order ----------------------------------------------------------------------------------
    def _order(self, b: RankBuilder, writes: Writes) -> None:
        """Sorted tables in order within the attempt; rows in the store after a new row's place
        are read back and written again (with the tensors of moved collectives)."""
        for table, key in SORTED.items():
            cols = writes.get(table)
            if cols is None or not len(cols[key][1]):
                continue
            base = b.base[table]
            start, new = base, {c: v for c, (_, v) in cols.items()}
            last = self.last_key[table]
            if last is not None and base > b.attempt_rows[table] and int(new[key].min()) < last:
                start = self._insertion(table, key, b.attempt_rows[table], base, int(new[key].min()))
                back = self.tables[table].read(start)
                new = {c: np.concatenate([back[c], new[c]]) for c in new}
            order = np.argsort(new[key], kind="stable")
            moved = bool((order != np.arange(len(order))).any())
            if moved:
                new = {c: v[order] for c, v in new.items()}
            if table == "collectives" and (moved or start < base):
                self._move_tensors(b, writes, start, order, int(new["tensor_start"].min()))
            writes[table] = {c: (start, v) for c, v in new.items()}
            self.last_key[table] = int(new[key][-1])

    def _insertion(self, table: str, key: str, attempt_row: int, base: int, first_new: int) -> int:
        """The first row of the attempt in the store whose key is above ``first_new``: searched
        backwards from the end in growing windows (a late row is usually only a little late)."""
        col = self.tables[table].columns[key]
        window = 16
        while True:
            lo = max(attempt_row, base - window)
            keys = col.read(lo, base)
            if lo == attempt_row or not len(keys) or keys[0] <= first_new:
                return lo + int(np.searchsorted(keys, first_new, side="right"))
            window *= 8

    def _move_tensors(
        self, b: RankBuilder, writes: Writes, start: int, order: np.ndarray, first: int
    ) -> None:
        """``tensors.coll`` after collectives rows ``start..`` were put in ``order``; ``first``:
        the first tensor row of those collectives (rows from there are written again)."""
        at = np.empty(len(order), dtype=np.int64)
        at[order] = np.arange(len(order))
        tbase = b.base["tensors"]
        plan = writes.get("tensors") or self._empty("tensors", tbase)
        tstart = min(tbase, first)
        values = {c: v for c, (_, v) in plan.items()}
        if tstart < tbase:
            back = self.tables["tensors"].read(tstart)
            values = {c: np.concatenate([back[c], v]) for c, v in values.items()}
        coll = values["coll"].copy()
        hit = coll >= start
        coll[hit] = start + at[coll[hit] - start]
        values["coll"] = coll
        writes["tensors"] = {c: (tstart, v) for c, v in values.items()}

    @staticmethod
    def _empty(table: str, at: int) -> dict[str, tuple[int, np.ndarray]]:
        return {c: (at, np.zeros(0, dtype=dt)) for c, dt in TABLES[table].items()}

    # -- the flight recorder's references -----------------------------------------------------
    def _resolve(self, b: RankBuilder, writes: Writes) -> None:
        """Rows in the store that name payloads held by an attempt that has ended: -2 - id ->
        the payload row its dump wrote, or -1 (not kept). The attempt's rows held in the builder
        were resolved by ``end_attempt`` (and this runs in the flush of the attempt's last rows)."""
        for first_rows, flight in b.resolve_jobs:
            for table, first in first_rows.items():
                plan = writes.get(table) or self._empty(table, b.base[table])
                at, planned = plan["payload"]
                column = np.concatenate([self.tables[table].columns["payload"].read(first, at), planned])
                held = np.flatnonzero(column <= -2)
                if not len(held):
                    continue
                for i in held.tolist():
                    row = flight.get(-2 - int(column[i]))
                    if row is None:
                        b.attrs["flight_unwritten"] += 1
                    column[i] = -1 if row is None else row
                start = first + int(held[0])
                plan["payload"] = (start, column[start - first :])
                writes[table] = plan


def _text(attrs: dict[str, Any]) -> str:
    return json.dumps(attrs, sort_keys=True, allow_nan=True, default=str)
