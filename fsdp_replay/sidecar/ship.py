"""The sidecar's collection: the agents' spools become the Zarr trace at the store, as they grow.

``Shipper.ship()`` runs the collector of ``fsdp-replay collect`` (``trace/collect.py``) from
``OUT/spool`` into the store: ``OUT/trace.zarr`` by default, or any fsspec URL (``s3://bucket/
prefix``). One ``Collector`` is kept from one collection to the next: each reads what the spools
gained since the last (it never reads a record twice), writes the new payload blobs and appends
the new rows to each rank's columns (``trace/rank_store.py``), so a collection costs what is new,
not the history. Where each rank's spool was read up to is in the store with the rows, so a
sidecar killed at any moment, or a store outage, loses and duplicates nothing: the next
collection, in this process or a new one, resumes from the store. The daemon ships every
``collect_interval_s`` while trainers run (0: only at the end), at once when a rank newly reports
being stuck in a collective (``main.py``: the store's trace then shows a hung, not yet killed, job
to ``fsdp-replay desync``), and once more when they have ended. While a collection writes a rank's
new rows, a reader that opens that rank is told it is unfinished (exit 3) and reads it again after
(``fsdp_replay_store_last_collection_timestamp_seconds`` moves).

A rank's spool is deleted only after its collection succeeded, its process ended cleanly, no
damage was skipped, and the store's copy reads back whole (every column's length and digest, and
every blob it references: ``trace.scrub``, as ``inspect --verify``), unless ``keep_spools``. A failed collection (the store
down, the disk full) keeps every spool and is counted; the next one retries.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_replay.errors import ConfigError
from fsdp_replay.trace import schema, signing

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ShipStats:
    """What the metrics show of the collection (``metrics.SidecarState.ship``)."""

    collections: int = 0
    failures: int = 0
    last_success_s: float = 0.0
    last_seconds: float = 0.0
    spools_deleted: int = 0
    ranks_held: int = 0
    last_error: str = ""
    rows_written: int = 0
    blobs_written: int = 0
    blob_bytes_written: int = 0
    rebuilds: int = 0


class Shipper:
    def __init__(
        self,
        out: str,
        store: str,
        *,
        interval_s: float,
        keep_spools: bool,
        signing_key: str = "",
        stats: ShipStats,
        lock: Any,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.spool_root = Path(out) / schema.SPOOL_DIR
        self.url = store or str(Path(out) / schema.TRACE_DIR)
        self.interval_s = interval_s
        self.keep_spools = keep_spools
        self.signing_key_file = signing_key
        self.stats = stats
        self.lock = lock
        self.clock = clock
        self._last_try: float | None = None
        self._collector: Any = None  # trace.collect.Collector, kept between collections
        self.collected: dict[int, int] = {}
        """Per rank, the spool bytes the store holds (the rest is the backlog)."""

    def _signing_key(self) -> signing.SigningKey | None:
        """The signing key, read when a collector is made (a Secret mounted later is found then).
        A key that cannot be read leaves the trace unsigned, said in the log each time; the
        trace is kept all the same (``inspect`` and ``replay`` say it is not signed)."""
        if not self.signing_key_file:
            return None
        try:
            return signing.load_key(self.signing_key_file)
        except ConfigError as e:
            log.error("the trace is collected UNSIGNED: %s", e)
            return None

    def due(self, now: float) -> bool:
        """While trainers run: every ``interval_s`` (never when 0)."""
        if self.interval_s <= 0:
            return False
        return self._last_try is None or now - self._last_try >= self.interval_s

    def ship(self, *, final: bool, now: float | None = None) -> bool:
        """Collect the spools into the store; with ``final`` (no trainer runs) delete the spools
        the store holds whole. Never raises: a failure is logged and counted."""
        from fsdp_replay.trace.collect import Collector, collect_lock

        self._last_try = time.monotonic() if now is None else now
        if not self.spool_root.is_dir() or not any(self.spool_root.glob("rank-*")):
            return False
        t0 = time.monotonic()
        try:
            with collect_lock(self.spool_root):
                if self._collector is None:
                    self._collector = Collector(self.spool_root, self.url, signing_key=self._signing_key())
                report = self._collector.collect(final=final, run=self._run_info())
        except Exception as e:  # the store down, the disk full, a damaged trace there: keep the spools
            self._collector = None  # it dropped its state: the next one resumes from the store
            with self.lock:
                self.stats.failures += 1
                self.stats.last_error = f"{type(e).__name__}: {e}"[:300]
            log.warning(
                "collecting the trace into %s failed (the spools are kept; retrying): %s", self.url, e
            )
            return False
        with self.lock:
            self.stats.collections += 1
            self.stats.last_success_s = self.clock()
            self.stats.last_seconds = time.monotonic() - t0
            for r in report.ranks:
                self.stats.rows_written += r.rows_written
                self.stats.blobs_written += r.blobs_written
                self.stats.blob_bytes_written += r.blob_bytes
                self.stats.rebuilds += bool(r.rebuilt)
                if r.error is None:
                    self.collected[r.rank] = r.collected_bytes
        for r in report.ranks:
            if r.rebuilt:
                log.warning(
                    "rank %d: the store's copy could not be resumed (%s): collected anew", r.rank, r.rebuilt
                )
        log.info(
            "trace collected into %s (%d ranks, %.1f s)", self.url, len(report.ranks), time.monotonic() - t0
        )
        if final:
            self._collector.close()  # a later collection (trainers back) resumes from the store
            self._collector = None
            if not self.keep_spools:
                self._delete_held(report)
        return True

    def _run_info(self) -> dict[str, Any] | None:
        import json

        run_json = self.spool_root.parent / "run.json"
        try:
            doc = json.loads(run_json.read_text())
        except (OSError, ValueError):
            return None
        return doc if isinstance(doc, dict) else None

    def _delete_held(self, report: Any) -> None:
        from fsdp_replay.trace.reader import Trace
        from fsdp_replay.trace.scrub import scrub

        try:
            trace = Trace.open(self.url)
        except Exception as e:
            log.warning("the trace at %s does not read back (%s): the spools are kept", self.url, e)
            return
        held = 0
        for r in report.ranks:
            if r.error is not None or not r.clean_end or r.damage:
                continue  # a rank the store may not hold whole: its spool is the only full copy
            problems = scrub(trace, [r.rank]).problems
            if problems:
                log.warning("rank %d does not read back whole (%s): its spool is kept", r.rank, problems[0])
                continue
            held += 1
            folder = self.spool_root / schema.RANK_SPOOL_FMT.format(rank=r.rank)
            shutil.rmtree(folder, ignore_errors=True)
            with self.lock:
                self.stats.spools_deleted += 1
            log.info("rank %d: the store holds it whole; its spool is deleted", r.rank)
        with self.lock:
            self.stats.ranks_held = held
