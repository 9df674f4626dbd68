"""The collector: per-rank spools in, one Zarr v3 trace out.

Runs after ``fsdp-replay record`` (and, in Kubernetes, in the sidecar). It never deletes or
changes a spool: a damaged record is reported (file and byte offset) and skipped, and everything
else is still converted. Payload blobs are content-addressed by BLAKE2b-128 of their bytes, so
identical bytes from any rank are stored once in ``blobs/``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import zarr

from fsdp_replay.errors import TraceFormatError
from fsdp_replay.trace import layout, schema, spool
from fsdp_replay.trace.rank_builder import CollectReport, RankBuilder, RankReport, jsonable
from fsdp_replay.trace.store import open_root

__all__ = ["CollectReport", "RankReport", "collect", "collect_lock"]


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


def _collect_rank(
    root: zarr.Group, rank: int, folder: Path, strict: bool, verified: set[str]
) -> tuple[RankReport, RankBuilder | None]:
    """One rank's spool into its group. A rank that cannot be read at all (a segment of another
    format version, a segment that vanished) is reported and not written; other ranks go on."""
    rr = RankReport(rank=rank)
    builder = RankBuilder(root, rank, rr, verified)
    seg_report = spool.SegmentReport()
    seen = 0
    try:
        for rec in spool.read_rank(folder, seg_report, strict=strict):
            if len(seg_report.damage) > seen:  # records were lost just before this one
                for d in seg_report.damage[seen:]:
                    if d.records_lost:
                        builder.tracker.incident(f"damaged spool record: {d}")
                seen = len(seg_report.damage)
            if rec.kind == schema.KIND_BLOB:
                builder.blob(int(rec.obj["blob"]), rec.raw)
                continue
            try:
                builder.event(rec.obj, rec)
            except (KeyError, TypeError, ValueError) as e:
                if strict:
                    raise TraceFormatError(
                        f"unusable event: {e}", path=str(rec.path), offset=rec.offset
                    ) from e
                dmg = spool.Damage(str(rec.path), rec.offset, 0, f"unusable event: {e}")
                seg_report.damage.append(dmg)
                builder.tracker.incident(f"damaged spool record: {dmg}")
                seen = len(seg_report.damage)
    except TraceFormatError as e:
        if strict:
            raise
        rr.error = str(e)
        rr.damage = [*(str(d) for d in seg_report.damage), str(e)]
        return rr, None
    for d in seg_report.damage[seen:]:  # after the last record: the record ends there
        if d.records_lost:
            builder.tracker.cut(builder.tracker.last_step_done, f"the spool ends damaged: {d}", lost=False)
    rr.records = seg_report.records
    rr.damage = [str(d) for d in seg_report.damage]
    builder.write()
    return rr, builder


def collect(
    spool_root: str | os.PathLike[str],
    trace_url: str | os.PathLike[str],
    *,
    run: dict[str, Any] | None = None,
    strict: bool = False,
    ranks: Iterable[int] | None = None,
    on_wait: Callable[[str], None] | None = None,
) -> CollectReport:
    """Convert every rank folder under ``spool_root`` into the trace at ``trace_url``.

    Re-running is safe: each rank group is rewritten whole; blobs already present are reused
    once they are known whole (finished, and their bytes matching their digest). One collector
    runs at a time per spool (``collect_lock``; ``on_wait`` hears that another one holds it).
    With ``strict``, the first damaged record raises TraceFormatError naming the file; without,
    damage is reported per rank and a rank that cannot be read at all does not stop the others.
    """
    with collect_lock(spool_root, on_wait):
        return _collect(spool_root, trace_url, run=run, strict=strict, ranks=ranks)


def _collect(
    spool_root: str | os.PathLike[str],
    trace_url: str | os.PathLike[str],
    *,
    run: dict[str, Any] | None,
    strict: bool,
    ranks: Iterable[int] | None,
) -> CollectReport:
    t0 = time.monotonic()
    folders = spool.spool_ranks(spool_root)
    if ranks is not None:
        wanted = set(ranks)
        folders = {r: f for r, f in folders.items() if r in wanted}
    if not folders:
        raise TraceFormatError("no rank spools found (nothing was recorded?)", path=str(spool_root))
    try:
        root = open_root(trace_url, mode="a")
    except OSError:
        raise
    except Exception as e:  # a damaged trace where the new one should go: rebuild elsewhere
        raise TraceFormatError(
            f"the trace there is unreadable ({type(e).__name__}: {e}); remove it or write the trace "
            "elsewhere (fsdp-replay collect RUN --trace OTHER): the spools hold everything",
            path=f"{os.fspath(trace_url)}/zarr.json",
        ) from None
    report = CollectReport(trace=os.fspath(trace_url))
    world_sizes = set()
    verified: set[str] = set()
    for rank, folder in folders.items():
        rr, builder = _collect_rank(root, rank, folder, strict, verified)
        report.ranks.append(rr)
        start = builder.attrs["rank_start"] if builder is not None else None
        if start is not None:
            world_sizes.add(int(start["world_size"]))
    old = root.attrs.get(schema.ROOT_ATTR)
    meta: dict[str, Any] = dict(old) if isinstance(old, dict) else {}
    written = {r.rank for r in report.ranks if r.error is None}
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
    root.attrs[schema.ROOT_ATTR] = meta
    report.seconds = time.monotonic() - t0
    return report
