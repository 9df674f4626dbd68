"""The agent's background writer: the only code that touches the spool.

The training thread only enqueues; this thread resolves device values (``Pending``), assigns
content-addressed blob ids, encodes JSON and appends records. Identical payload bytes within a
rank are written once: a blob whose (fingerprint, size, algorithm) was seen before becomes an
alias of the first one. A full disk degrades in a fixed order: payload blobs are dropped first
(and counted), events are kept in a bounded retry buffer and written when space returns.
"""

from __future__ import annotations

import collections
import errno
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from fsdp_replay.agent.fingerprint import Pending, host_buffer
from fsdp_replay.trace import schema
from fsdp_replay.trace.spool import SpoolWriter

log = logging.getLogger(__name__)
RETRY_EVENTS_MAX = 100_000
# The writer takes pending events at least this often (the most a SIGKILL can lose of them,
# beyond the current step's sync), and asks ``on_idle`` about once per IDLE_S while idle. Each
# wake-up takes the GIL from the training thread: at 50 ms they cost a CPU step of the example
# 0.3 ms of writer time; step ends and queued items (blobs, snapshots, RNG states) still hand
# over at once.
POLL_S = 0.25
IDLE_S = 1.0
# ``kick`` hands over pending events from this many on (fewer wake-ups than one per collective).
KICK_EVENTS = 12
# Below this much free space, a failed write turns payloads off and releases the reserve.
LOW_WATER_BYTES = 4 << 20


class BlobRef:
    """A blob id, final once the writer has stored (or deduplicated, or dropped) the blob."""

    __slots__ = ("id",)

    def __init__(self) -> None:
        self.id = schema.NO_BLOB


def _json_default(o: Any) -> Any:
    if isinstance(o, BlobRef):
        return o.id
    if isinstance(o, Pending):
        return o.value()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


class Counters:
    """What the agent did and what it had to give up; reported in the ``end`` event."""

    def __init__(self) -> None:
        self.events = 0
        self.blobs = 0
        self.blob_bytes = 0
        self.blobs_deduplicated = 0
        self.dedup_bytes_saved = 0
        self.blobs_dropped = 0
        self.blob_bytes_dropped = 0
        self.ring_full_drops = 0  # of blobs_dropped: a device payload ring had no room
        self.ring_full_bytes = 0
        self.events_dropped = 0
        self.write_errors = 0
        # Back-pressure (``--when-full wait``): times the training waited for room for a payload
        # (the writer, the pending bound, a GPU's payload ring or the tape's copies in flight), and
        # the wall time it waited; and the wall time the writer spent writing payload bytes.
        self.payload_waits = 0
        self.payload_wait_ns = 0
        self.blob_write_ns = 0

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


def _host_tensor(data: Any) -> Any:
    """A CPU tensor, or a ring slot's host view (``payload_ring.Staged``)."""
    return getattr(data, "host", data)


class BackgroundWriter:
    def __init__(
        self,
        spool: SpoolWriter,
        on_error: Callable[[str, BaseException], None],
        on_idle: Callable[[], list[dict[str, Any]]] | None = None,
    ) -> None:
        self.spool = spool
        self.on_error = on_error
        self.on_idle = on_idle  # asked about once a second while idle: the events to write
        self.counters = Counters()
        self.pending_bytes = 0  # payload bytes enqueued and not yet written (read by the agent)
        self.payloads_off = False  # set once the disk filled: from then on, metadata only
        self._q: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._dedup: dict[tuple[Any, int, str], int] = {}
        self._next_blob = 0
        self._retry: collections.deque[bytes] = collections.deque()
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # pending_bytes went down
        self._events: list[dict[str, Any]] = []
        self._events_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="fsdp-replay-writer", daemon=True)
        self._thread.start()

    # -- training-thread side ---------------------------------------------------------------
    # Events are appended to a list, not put on the queue: the writer takes them in batches
    # (every POLL_S, or before the next queued item), so an event costs the training thread a
    # list append instead of waking the writer and handing it the GIL. Queued items (blobs,
    # calls, flush markers) first move the pending events onto the queue, under a lock, so
    # the writer sees everything in the order it was enqueued, and an event is never encoded
    # before the blobs it refers to were written.
    def event(self, obj: dict[str, Any]) -> None:
        with self._events_lock:
            self._events.append(obj)

    def kick(self, min_pending: int = KICK_EVENTS) -> None:
        """Hand the pending events to the writer now if there are at least ``min_pending``: the
        recorder calls this right before the training thread blocks in a collective's wait, so
        that the writer encodes them while the GIL is free, instead of at the step-end flush
        (where the training thread would wait for it) or at a poll (where it would take the GIL
        from the training thread)."""
        if len(self._events) >= min_pending:
            self._put(None)

    def _put(self, item: tuple[str, Any] | None) -> None:
        """Queue the pending events (as one batch), then ``item`` if any, in that order."""
        with self._events_lock:
            if self._events:
                self._q.put(("evs", self._events))
                self._events = []
            if item is not None:
                self._q.put(item)

    def blob(self, ref: BlobRef, data: Any, fp: Any, nbytes: int, algo: str, ready: Any = None) -> None:
        """Enqueue payload bytes. ``data`` is a CPU tensor or bytes; ``ready`` an event to wait on."""
        with self._lock:
            self.pending_bytes += nbytes
        self._put(("blob", (ref, data, fp, nbytes, algo, ready)))

    def wait_room(self, nbytes: int, limit: int, timeout: float) -> bool:
        """Wait (training thread) until ``nbytes`` more pending payload bytes stay within ``limit``
        (or nothing is pending: a payload larger than the bound goes alone), the disk has filled
        (the writer then drops payloads itself), or the writer has stopped; a wait is counted.
        False: still no room after ``timeout`` seconds (the writer is stuck)."""
        t0 = time.monotonic_ns()
        deadline = time.monotonic() + timeout
        waited = False
        with self._room:
            while self.pending_bytes > 0 and self.pending_bytes + nbytes > limit:
                left = deadline - time.monotonic()
                if self.payloads_off or not self._thread.is_alive() or left <= 0:
                    break
                waited = True
                self._room.wait(min(left, POLL_S))
            if waited:
                self.waited(time.monotonic_ns() - t0)
            return (
                self.pending_bytes == 0
                or self.pending_bytes + nbytes <= limit
                or self.payloads_off
                or not self._thread.is_alive()
            )

    def waited(self, ns: int) -> None:
        """Count one wait for room of ``ns`` (the training thread's, whatever it waited for)."""
        self.counters.payload_waits += 1
        self.counters.payload_wait_ns += ns

    def call(self, fn: Callable[[], list[tuple[str, Any]]]) -> None:
        """Run fn on the writer thread; it returns ("ev", obj), ("raw", (ref, bytes)) (metadata
        blobs: RNG states), ("payload", (ref, bytes)) (snapshots: dropped first) and ("held",
        (blob id, data, nbytes, ready)) (the flight recorder's payloads, ``flight.py``) items."""
        self._put(("call", fn))

    def marker(self) -> threading.Event:
        """An event set once everything enqueued so far is written."""
        done = threading.Event()
        if not self._thread.is_alive():
            done.set()
            return done
        self._put(("flush", done))
        return done

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything enqueued so far is written. False on timeout."""
        if not self._thread.is_alive():
            return False
        return self.marker().wait(timeout)

    def cpu_ns(self) -> int:
        """The CPU time this thread has used so far (0 where the platform cannot tell)."""
        ident = self._thread.ident
        try:
            return time.clock_gettime_ns(time.pthread_getcpuclockid(ident)) if ident is not None else 0
        except (AttributeError, OSError):  # not on Linux, or the thread has ended
            return 0

    def close(self, timeout: float = 30.0) -> None:
        if self._thread.is_alive():
            self._put(("stop", None))
            self._thread.join(timeout)
        self.spool.close()

    # -- writer-thread side -----------------------------------------------------------------
    def _run(self) -> None:
        idle_since = time.monotonic()
        while True:
            try:
                kind, item = self._q.get(timeout=POLL_S)
            except queue.Empty:
                with self._events_lock:
                    # Only when nothing is queued: every blob an event refers to is written.
                    taken, self._events = (self._events, []) if self._q.empty() else ([], self._events)
                if taken:
                    self._write_events(taken)
                elif time.monotonic() - idle_since >= IDLE_S:
                    idle_since = time.monotonic()
                    self._idle()
                continue
            idle_since = time.monotonic()
            if kind == "evs":
                self._write_events(item)
                continue
            try:
                if kind == "stop":
                    self._drain_retry()
                    return
                if kind == "flush":
                    self._drain_retry()
                    item.set()
                elif kind == "blob":
                    self._write_blob(*item)
                elif kind == "call":
                    for k2, i2 in item():
                        if k2 == "ev":
                            self._write_event(i2)
                        elif k2 == "held":
                            self._write_held(*i2)
                        elif k2 == "payload" and self.payloads_off:  # a snapshot, once the disk is full
                            ref, raw = i2
                            self.counters.blobs_dropped += 1
                            self.counters.blob_bytes_dropped += memoryview(raw).nbytes
                        else:
                            ref, raw = i2
                            self._write_raw(ref, raw)
            except BaseException as e:  # a bug here must stop recording, never the training
                self.on_error("writer", e)
                if kind == "flush":
                    item.set()

    def _idle(self) -> None:
        if self.on_idle is None:
            return
        try:
            for ev in self.on_idle():
                self._write_event(ev)
        except BaseException as e:
            self.on_error("writer (idle)", e)

    def _write_events(self, batch: list[dict[str, Any]]) -> None:
        """Write a batch of events with as few system calls as possible."""
        try:
            if len(batch) == 1 or self._retry:
                for obj in batch:
                    self._write_event(obj)
                return
            data = [json.dumps(o, default=_json_default, separators=(",", ":")).encode() for o in batch]
            try:
                self.spool.append_many([(schema.KIND_EVENT, d) for d in data])
                self.counters.events += len(data)
            except OSError as e:
                self._note_write_error(e)
                for d in data:
                    self._queue_retry(d)
        except BaseException as e:  # a bug here must stop recording, never the training
            self.on_error("writer", e)

    def _write_event(self, obj: dict[str, Any]) -> None:
        # Encoding resolves Pending/BlobRef values, so a retried event holds no device memory.
        data = json.dumps(obj, default=_json_default, separators=(",", ":")).encode()
        if self._retry:
            self._drain_retry()
        if self._retry:
            self._queue_retry(data)
            return
        try:
            self.spool.append(schema.KIND_EVENT, data)
            self.counters.events += 1
        except OSError as e:
            self._note_write_error(e)
            self._queue_retry(data)

    def _queue_retry(self, obj: bytes) -> None:
        if len(self._retry) >= RETRY_EVENTS_MAX:
            self._retry.popleft()
            self.counters.events_dropped += 1
        self._retry.append(obj)

    def _drain_retry(self) -> None:
        while self._retry:
            try:
                self.spool.append(schema.KIND_EVENT, self._retry[0])
            except OSError as e:
                self._note_write_error(e)
                return
            self._retry.popleft()
            self.counters.events += 1

    def _note_write_error(self, e: OSError) -> None:
        if self.counters.write_errors == 0:
            what = "the disk is full" if e.errno == errno.ENOSPC else str(e)
            log.warning("fsdp-replay: cannot write the spool (%s); dropping payloads, keeping metadata", what)
        self.counters.write_errors += 1
        if not self.payloads_off and self._free_bytes() < LOW_WATER_BYTES:
            # Payloads filled the disk; dropping later ones frees nothing. The space held back
            # at start is what lets the metadata of the rest of the run still be written.
            # (A single payload larger than the free space is only dropped, above the mark.)
            self.payloads_off = True
            self.spool.release_reserve()

    def _free_bytes(self) -> int:
        try:
            st = os.statvfs(self.spool.folder)
        except OSError:
            return 0
        return st.f_bavail * st.f_frsize

    def _write_blob(self, ref: BlobRef, data: Any, fp: Any, nbytes: int, algo: str, ready: Any) -> None:
        try:
            if ready is not None:
                ready.synchronize()
            fpv = fp.value() if isinstance(fp, Pending) else fp
            key = (fpv, nbytes, algo)
            if key in self._dedup:
                ref.id = self._dedup[key]
                self.counters.blobs_deduplicated += 1
                self.counters.dedup_bytes_saved += nbytes
                return
            if self.payloads_off:
                self.counters.blobs_dropped += 1
                self.counters.blob_bytes_dropped += nbytes
                return
            buf = (
                data if isinstance(data, bytes | bytearray | memoryview) else host_buffer(_host_tensor(data))
            )
            if self._write_raw(ref, buf):
                self._dedup[key] = ref.id
        finally:
            with self._room:
                self.pending_bytes -= nbytes
                self._room.notify_all()
            if hasattr(data, "release"):  # a device payload ring's slot (payload_ring.Staged)
                data.release()

    def _write_raw(self, ref: BlobRef, raw: Any) -> bool:
        nbytes = memoryview(raw).nbytes
        blob_id = self._next_blob
        t0 = time.monotonic_ns()
        try:
            self.spool.append(schema.KIND_BLOB, {"blob": blob_id, "nbytes": nbytes}, raw)
        except OSError as e:
            self._note_write_error(e)
            self.counters.blobs_dropped += 1
            self.counters.blob_bytes_dropped += nbytes
            ref.id = schema.NO_BLOB
            return False
        self._next_blob += 1
        ref.id = blob_id
        self.counters.blob_write_ns += time.monotonic_ns() - t0
        self.counters.blobs += 1
        self.counters.blob_bytes += nbytes
        return True

    def _write_held(self, blob_id: int, data: Any, nbytes: int, ready: Any) -> None:
        """A payload the flight recorder held, under the id its events already name (so never
        deduplicated here: the recorder did that when it held it): a CPU tensor (pinned, for a
        device payload, complete once ``ready`` is) or bytes."""
        if ready is not None:
            ready.synchronize()
        if not self.payloads_off:
            buf: Any = (
                data if isinstance(data, bytes | bytearray | memoryview) else host_buffer(_host_tensor(data))
            )
            try:
                t0 = time.monotonic_ns()
                self.spool.append(schema.KIND_BLOB, {"blob": blob_id, "nbytes": nbytes}, buf)
                self.counters.blob_write_ns += time.monotonic_ns() - t0
                self.counters.blobs += 1
                self.counters.blob_bytes += nbytes
                return
            except OSError as e:
                self._note_write_error(e)
        self.counters.blobs_dropped += 1
        self.counters.blob_bytes_dropped += nbytes

    def count_dropped(self, nbytes: int, ring_full: bool = False) -> None:
        """Called by the agent for payloads it did not even enqueue (memory bound reached, or
        with ``ring_full`` the device payload ring had no room)."""
        with self._lock:
            self.counters.blobs_dropped += 1
            self.counters.blob_bytes_dropped += nbytes
            if ring_full:
                self.counters.ring_full_drops += 1
                self.counters.ring_full_bytes += nbytes
