"""The collector: per-rank spools in, one Zarr v3 trace out, grown by each collection.

Runs after ``fsdp-replay record`` (``collect``: once, the spools finished) and, in Kubernetes, in
the sidecar (a ``Collector`` kept between collections while the spools grow). It never deletes or
changes a spool: a damaged record is reported (file and byte offset) and skipped, and everything
else is still converted. Payload blobs are content-addressed by BLAKE2b-128 of their bytes, so
identical bytes from any rank are stored once in ``blobs/``.

A collection costs what the spools gained since the last one: each rank's spool is read from the
position its group in the store records (``rank_store.py``), new blobs are written, new rows
appended to the columns. The position and everything else the next collection needs are in the
store, so a collector killed at any moment, or a new process, resumes there; a group it cannot
resume (a damaged one, one from another spool) is built again from the spool's start.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import zarr
from zarr.abc.store import Store

import fsdp_replay
from fsdp_replay.errors import TraceFormatError
from fsdp_replay.trace import layout, schema, signing, spool
from fsdp_replay.trace.follow import SpoolFollower
from fsdp_replay.trace.rank_builder import (
    CollectReport,
    RankBuilder,
    RankReport,
    UnknownEventError,
    jsonable,
    write_rate,
)
from fsdp_replay.trace.rank_store import Cursor, RankStore, segment_created, segment_index
from fsdp_replay.trace.store import COLUMN_CHUNK, DEFAULT_BLOB_CODEC, Location, open_root

__all__ = ["CollectReport", "Collector", "RankReport", "collect", "collect_lock"]

FLUSH_ROWS = 1 << 20
"""Rows a collection holds in memory at most: past them it flushes in the middle (a first
collection of a long spool then never holds the whole history)."""


@contextlib.contextmanager
def collect_lock(
    spool_root: str | os.PathLike[str], on_wait: Callable[[str], None] | None = None
) -> Iterator[None]:
    """One collector at a time per spool (``RUN/spool.lock``): a second one waits, after saying so.

    The lock is an ``flock``, so a holder that dies (SIGKILL) releases it with its last descriptor.
    """
    root = Path(spool_root)
    path = root.with_name(root.name + layout.COLLECT_LOCK_SUFFIX)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            if on_wait is not None:
                on_wait(f"another collect (pid {holder}) is writing this trace ({path}); waiting for it")
            fcntl.flock(fd, fcntl.LOCK_EX)
        with contextlib.suppress(OSError):  # the holder's pid is for messages only (a full disk)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


class _Rank:
    """A rank being collected: its group in the store, its builder, where its spool is read."""

    def __init__(self, store: RankStore, builder: RankBuilder, follower: SpoolFollower) -> None:
        self.store = store
        self.builder = builder
        self.follower = follower
        self.seen = 0  # damage reports of the follower applied to the builder


class Collector:
    """Collects the spools under ``spool_root`` into the trace at ``trace_url``, again and again
    (``collect``): each time what the spools gained since. One at a time per spool: the caller
    holds ``collect_lock``. With ``strict``, the first damaged record raises TraceFormatError
    naming the file; without, damage is reported per rank and a rank that cannot be read at all
    does not stop the others."""

    def __init__(
        self,
        spool_root: str | os.PathLike[str],
        trace_url: Location,
        *,
        strict: bool = False,
        chunk_rows: int = COLUMN_CHUNK,
        blob_codec: str = DEFAULT_BLOB_CODEC,
        signing_key: signing.SigningKey | None = None,
    ) -> None:
        self.spool_root = Path(spool_root)
        self.signing_key = signing_key  # signs the root's and each rank's attributes (trace/signing.py)
        self.trace = trace_url
        self.trace_url = str(trace_url) if isinstance(trace_url, Store) else os.fspath(trace_url)
        self.strict = strict
        self.chunk_rows = chunk_rows
        self.blob_codec = blob_codec
        self._ranks: dict[int, _Rank] = {}
        self._verified: set[str] = set()  # blob digests written or checked (all ranks)
        self._root: zarr.Group | None = None
        self._root_attrs = ""

    def close(self) -> None:
        for r in self._ranks.values():
            r.follower.close()
        self._ranks.clear()

    def collect(
        self, *, final: bool, run: dict[str, Any] | None = None, ranks: Iterable[int] | None = None
    ) -> CollectReport:
        """One collection. ``final``: the spools are finished (their writers gone), so a record
        cut short at a spool's end is damage, and the flight recorder's held payloads that no dump
        wrote are resolved as not kept. On an error (the store down, the disk full) the state
        held in memory is dropped: the next collection resumes from the store."""
        try:
            return self._collect(final, run, ranks)
        except BaseException:
            self.close()
            self._root, self._root_attrs = None, ""
            raise

    def _collect(self, final: bool, run: dict[str, Any] | None, ranks: Iterable[int] | None) -> CollectReport:
        t0 = time.monotonic()
        folders = spool.spool_ranks(self.spool_root)
        if ranks is not None:
            wanted = set(ranks)
            folders = {r: f for r, f in folders.items() if r in wanted}
        if not folders:
            raise TraceFormatError("no rank spools found (nothing was recorded?)", path=str(self.spool_root))
        root = self._open_root()
        report = CollectReport(trace=self.trace_url)
        for rank, folder in folders.items():
            rr = RankReport(rank=rank)
            report.ranks.append(rr)
            try:
                self._collect_rank(root, rank, folder, rr, final)
            except TraceFormatError as e:  # the rank cannot be read (a segment of another version)
                if self.strict:
                    raise
                state = self._ranks.pop(rank, None)
                if state is not None:
                    state.follower.close()
                rr.error = str(e)
                rr.damage = [*rr.damage, str(e)]
        self._write_root(root, report, run)
        report.seconds = time.monotonic() - t0
        return report

    def _open_root(self) -> zarr.Group:
        if self._root is not None:
            return self._root
        try:
            self._root = open_root(self.trace, mode="a")
        except OSError:
            raise
        except Exception as e:  # a damaged trace where the new one should go: rebuild elsewhere
            raise TraceFormatError(
                f"the trace there is unreadable ({type(e).__name__}: {e}); remove it or write the trace "
                "elsewhere (fsdp-replay collect RUN --trace OTHER): the spools hold everything",
                path=f"{self.trace_url}/zarr.json",
            ) from None
        return self._root

    def _state(self, root: zarr.Group, rank: int, folder: Path, rr: RankReport) -> _Rank:
        """The rank's state: kept from the last collection if the store still holds what it
        wrote (no other collector wrote there since), else resumed from the store."""
        state = self._ranks.get(rank)
        if state is not None:
            try:
                node = root[state.store.name]
                same = isinstance(node, zarr.Group) and state.store.holds(dict(node.attrs))
            except Exception:
                same = False
            if same:
                state.builder.report = rr
                return state
            state.follower.close()
        store = RankStore(root, rank, folder, self.chunk_rows, self.signing_key)
        builder = self._builder(root, rank, rr)
        # strict checks every record: it reads the spool from its start, as a first collection
        cursor = None if self.strict else store.resume(builder)
        if cursor is None:
            builder = self._builder(root, rank, rr)
            start = None
        else:
            start = (cursor.index, cursor.offset)
        state = self._ranks[rank] = _Rank(store, builder, SpoolFollower(folder, start=start))
        return state

    def _builder(self, root: zarr.Group, rank: int, rr: RankReport) -> RankBuilder:
        return RankBuilder(root, rank, rr, self._verified, blob_codec=self.blob_codec)

    def _collect_rank(self, root: zarr.Group, rank: int, folder: Path, rr: RankReport, final: bool) -> None:
        state = self._state(root, rank, folder, rr)
        store, b, f = state.store, state.builder, state.follower
        rows0 = store.stats.rows
        rr.rebuilt, store.rebuilt = store.rebuilt, ""
        changed = store.fresh
        while True:
            records = f.poll(segments=1)
            if not records:
                break
            changed = True
            self._apply(state, records, rr)
        if final:
            records = f.finish()
            changed = changed or bool(records) or len(f.report.damage) > state.seen
            self._apply(state, records, rr)
        for d in f.report.damage[state.seen :]:  # after the last record: no record follows it yet
            self._damage(b, d)
            if d.records_lost:
                b.pending_damage.append(str(d))
        changed = changed or state.seen < len(f.report.damage)
        state.seen = len(f.report.damage)
        index, offset = f.position
        if changed or final:
            store.flush(b, self._cursor(folder, index, offset), final=final)
        rr.collected_bytes = offset + sum(
            p.stat().st_size for p in spool.segments(folder) if segment_index(p) < index and p.exists()
        )
        rr.rows_written = store.stats.rows - rows0
        rr.steps, rr.collectives, rr.batches = b.n("steps"), b.n("collectives"), b.n("batches")
        end = b.attrs["end"]
        rr.clean_end = end is not None
        counters = (end or {}).get("counters") or {}
        rr.payloads_dropped = int(counters.get("blobs_dropped", 0))
        rr.ring_full_drops = int(counters.get("ring_full_drops", 0))
        rr.window = "flight_blobs_dropped" in counters
        rr.payload_waits = int(counters.get("payload_waits", 0))
        rr.payload_wait_ns = int(counters.get("payload_wait_ns", 0))
        rr.writer_rate = write_rate(counters)
        rr.payload_missing = int(b.attrs["payload_missing"])
        rr.damage = list(b.attrs["damage"])
        rr.completeness = dict(store.completeness)

    def _apply(self, state: _Rank, records: list[spool.Record], rr: RankReport) -> None:
        """Records read from the spool, in order, into the builder; the follower's damage reports
        where they fall between them. Flushes in the middle before a new process attempt and when
        too many rows are held."""
        b, f = state.builder, state.follower
        damage = f.report.damage
        for rec in records:
            where = (segment_index(rec.path), rec.offset)
            while (
                state.seen < len(damage)
                and (segment_index(damage[state.seen].path), damage[state.seen].offset) < where
            ):
                d = damage[state.seen]
                state.seen += 1
                self._damage(b, d)
                if d.records_lost:  # records were lost just before this one
                    b.tracker.incident(f"damaged spool record: {d}")
            for lost in b.pending_damage:  # damage at the end of an earlier read: a record follows now
                b.tracker.incident(f"damaged spool record: {lost}")
            b.pending_damage = []
            rr.records += 1
            if rec.kind == schema.KIND_BLOB:
                if b.held_rows() >= FLUSH_ROWS:
                    state.store.flush(b, self._cursor(f.rank_dir, *where), final=False)
                b.blob(int(rec.obj["blob"]), rec.raw)
                continue
            new_attempt = b.new_attempt(rec.obj)
            if new_attempt:  # the last attempt's rows go in first (sorted within their attempt)
                b.end_attempt()
            if new_attempt or b.held_rows() >= FLUSH_ROWS:
                state.store.flush(b, self._cursor(f.rank_dir, *where), final=False)
            try:
                b.event(rec.obj, rec)
            except UnknownEventError as e:
                if self.strict:
                    raise
                self._unread(b, e)
            except (KeyError, TypeError, ValueError) as e:
                if self.strict:
                    raise TraceFormatError(
                        f"unusable event: {e}", path=str(rec.path), offset=rec.offset
                    ) from e
                dmg = spool.Damage(str(rec.path), rec.offset, 0, f"unusable event: {e}")
                b.attrs["damage"].append(str(dmg))
                b.tracker.incident(f"damaged spool record: {dmg}")

    @staticmethod
    def _unread(b: RankBuilder, e: UnknownEventError) -> None:
        """An event a newer agent wrote: counted by type, and the record is incomplete from here
        (what it said is not known), with a reason that says so rather than calling it damage."""
        unread = b.attrs["unread_events"]
        unread[e.kind] = unread.get(e.kind, 0) + 1
        start = b.attrs["rank_start"] or {}
        wrote = (start.get("versions") or {}).get("fsdp_replay", "?")
        b.tracker.incident(
            f"an event of type {e.kind!r} that this fsdp-replay ({fsdp_replay.__version__}) cannot read, "
            f"written by the agent of fsdp-replay {wrote}"
        )

    def _damage(self, b: RankBuilder, d: spool.Damage) -> None:
        if self.strict:
            raise TraceFormatError(f"{d.reason} ({d.nbytes} bytes unreadable)", path=d.path, offset=d.offset)
        b.attrs["damage"].append(str(d))

    @staticmethod
    def _cursor(folder: Path, index: int, offset: int) -> Cursor:
        seg = folder / schema.SEGMENT_FMT.format(index=index)
        return Cursor(index, offset, segment_created(seg) if offset > 0 else None)

    def _write_root(self, root: zarr.Group, report: CollectReport, run: dict[str, Any] | None) -> None:
        old = root.attrs.get(schema.ROOT_ATTR)
        meta: dict[str, Any] = dict(old) if isinstance(old, dict) else {}
        written = {r.rank for r in report.ranks if r.error is None}
        world_sizes = {
            int(s.builder.attrs["rank_start"]["world_size"])
            for rank, s in self._ranks.items()
            if rank in written and s.builder.attrs["rank_start"] is not None
        }
        present = sorted(set(meta.get("ranks", [])) | written)
        meta.update(
            {
                "format_version": schema.FORMAT_VERSION,
                "kind": "trace",
                "ranks": present,
                "world_size": max(world_sizes) if world_sizes else meta.get("world_size"),
            }
        )
        if run is not None:
            meta["run"] = jsonable(run)
        doc: dict[str, Any] = {schema.ROOT_ATTR: meta}
        if self.signing_key is not None:
            doc[signing.SIGNATURE_ATTR] = signing.sign(
                self.signing_key, json.loads(json.dumps(doc, default=str))
            )
        text = json.dumps(doc, sort_keys=True, default=str)
        if text != self._root_attrs:
            root.attrs.update(doc)
            if self.signing_key is None and signing.SIGNATURE_ATTR in root.attrs:
                del root.attrs[signing.SIGNATURE_ATTR]  # an unsigned collection over a signed trace
            self._root_attrs = text


def collect(
    spool_root: str | os.PathLike[str],
    trace_url: Location,
    *,
    run: dict[str, Any] | None = None,
    strict: bool = False,
    ranks: Iterable[int] | None = None,
    on_wait: Callable[[str], None] | None = None,
    chunk_rows: int = COLUMN_CHUNK,
    blob_codec: str = DEFAULT_BLOB_CODEC,
    signing_key: signing.SigningKey | None = None,
) -> CollectReport:
    """Convert every rank folder under ``spool_root`` into the trace at ``trace_url``, the spools
    being finished: one collection (``Collector``) under ``collect_lock`` (``on_wait`` hears that
    another one holds it). Running it again reads only what the spools gained since (nothing:
    nothing is written), and a trace there that it cannot take over is rebuilt from the spools."""
    with collect_lock(spool_root, on_wait):
        collector = Collector(
            spool_root,
            trace_url,
            strict=strict,
            chunk_rows=chunk_rows,
            blob_codec=blob_codec,
            signing_key=signing_key,
        )
        try:
            return collector.collect(final=True, run=run, ranks=ranks)
        finally:
            collector.close()
