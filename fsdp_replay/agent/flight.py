"""The payload flight recorder (``--payloads window:N``): payloads held in memory, written on a failure.

Every step's payloads (collective outputs, batches, the tape's results) are copied as with
``--payloads all``, but into host memory instead of the spool, together with snapshots of the
rank's state taken every ``snapshot_interval`` steps (N unless ``--snapshot-every`` says
otherwise). Events and fingerprints are written as usual, naming each held payload by a blob id
from ``schema.FLIGHT_BLOB_BASE`` on, so the metadata of every step is on disk while its payloads
are not. When the run fails (``Recorder``: a non-finite loss or parameter at a step end, an
uncaught exception, SIGTERM, a collective stuck for a minute: ``record_flight.py``), ``take`` hands
the writer thread what it holds: the snapshot at or before the window's start and every payload
since, and a ``flight_dump`` event says what was written and why. A run that ends well writes
none of it. A SIGKILL loses what is held (the metadata before it is on disk as usual).

A device payload reaches host memory through its GPU's payload ring (``payload_ring.py``), as a
stored payload does without a window, so the training stream never copies to the host; but its
side-stream copy lands in pinned memory of its own (from torch's caching host allocator) rather
than in the ring's host buffer, and its device slot is freed as soon as that copy is done. So a
window of N steps never occupies the ring, no thread copies its bytes again on the host, and the
pinned blocks of payloads let go of are reused by the next steps' (their sizes repeat from step
to step). Such a payload is charged at its pinned block's size (``payload_ring.pinned_bytes``).

What is held: the steps from the newest snapshot at or before ``current - steps - lag`` to the
step in progress, so between N+1 and N+interval steps (plus ``lag``: on a GPU the non-finite
check runs on the writer thread, up to two steps behind the training thread), and the snapshots
from there on (two with the default interval). Payload bytes (as charged) are bounded by ``max_bytes``
(``--window-bytes``; by default sized from the host's available memory: ``window_bound``): past
it the window first starts at a later held snapshot (fewer steps, still replayable). A window is
never written with a hole in it: when even that leaves no room, the step in progress cannot be
held whole, so nothing before it can be replayed from memory either; the recorder lets go of
every snapshot and payload up to and including that step (``hole``), keeps no more of its
payloads (each counted as dropped, and reported at the step's end as a ``drop`` event), and
starts afresh at the next snapshot. A failure before that snapshot writes a ``flight_dump`` that
says no complete window was held (its step range empty) rather than a window a replay would stop
in. The device payload ring never drops for lack of room: a payload waits for the oldest copy
in flight to land (``payload_ring.PayloadRing.stage``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from fsdp_replay.trace import schema

log = logging.getLogger(__name__)
MEMINFO = "/proc/meminfo"

# ``take`` and the writer's ``fill`` wait this long for the lock, then go on without it. A SIGTERM
# handler takes the dump on the main thread, which may have been stopped inside ``hold`` holding
# the lock: neither it nor the writer (which the handler then waits for) may block on it, and the
# stopped thread cannot change the ring while its handler runs.
LOCK_WAIT_S = 2.0

Key = tuple[int, int, str]  # (fingerprint, bytes, algorithm): the agent's content address


CGROUP = "/sys/fs/cgroup"  # this process's cgroup (v2), as a container sees it


def mem_available(meminfo: str) -> int | None:
    """``MemAvailable`` in bytes from the text of /proc/meminfo, or None where it has none."""
    m = re.search(r"^MemAvailable:\s*(\d+)\s*kB\s*$", meminfo, re.MULTILINE)
    return int(m.group(1)) * 1024 if m else None


def local_ranks(env: Mapping[str, str]) -> int:
    """The ranks of this node (``LOCAL_WORLD_SIZE``, as torchrun sets it); 1 where unset or bad."""
    raw = env.get("LOCAL_WORLD_SIZE", "").strip()
    return int(raw) if raw.isdigit() and int(raw) >= 1 else 1


def cgroup_available(limit: str | None, current: str | None) -> int | None:
    """What a cgroup v2 memory limit leaves (``memory.max`` less ``memory.current``, their
    texts), or None where there is no limit ("max") or they cannot be read."""
    if limit is None or current is None or not limit.strip().isdigit() or not current.strip().isdigit():
        return None
    return max(0, int(limit) - int(current))


def auto_window_bytes(
    meminfo: str | None, env: Mapping[str, str], floor: int, cgroup: int | None = None
) -> int | None:
    """The flight recorder's bound when none is given: a quarter of the available memory (the
    host's, or what the container's memory limit leaves, ``cgroup``, where less) divided by the
    node's ranks, at least ``floor`` (``--max-pending-bytes``); None where ``meminfo`` (the text
    of /proc/meminfo, None if unreadable) gives no MemAvailable."""
    available = None if meminfo is None else mem_available(meminfo)
    if available is None:
        return None
    if cgroup is not None:
        available = min(available, cgroup)
    return max(floor, available // 4 // local_ranks(env))


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def window_bound(
    given: int, floor: int, env: Mapping[str, str] | None = None, meminfo_path: str = MEMINFO
) -> tuple[int, bool]:
    """The payload bytes the window holds at most, and whether they were sized here (``given``,
    ``--window-bytes``, is 0): ``auto_window_bytes``, or ``floor`` where /proc/meminfo cannot
    tell (logged). Read once, when the recorder starts."""
    if given:
        return given, False
    text = _read(meminfo_path)
    cgroup = cgroup_available(_read(CGROUP + "/memory.max"), _read(CGROUP + "/memory.current"))
    auto = auto_window_bytes(text, os.environ if env is None else env, floor, cgroup)
    if auto is None:
        log.warning(
            "fsdp-replay: %s gives no MemAvailable; the flight recorder holds at most %d payload bytes "
            "(--max-pending-bytes; --window-bytes sets its own bound)",
            meminfo_path,
            floor,
        )
        return floor, True
    return auto, True


@dataclass(slots=True)
class Held:
    """A payload in memory: its bytes (a CPU tensor, pinned for a device's, or bytes), the event
    after which a device copy is complete (or None), the last step whose events name it, and the
    memory it is charged against the bound (``nbytes``, or its pinned block's size)."""

    id: int
    data: Any
    nbytes: int
    ready: Any
    last_step: int
    key: Key | None
    cost: int


@dataclass(slots=True)
class HeldSnapshot:
    """The rank's state at the start of ``step`` (``capture.snapshot_state``: CPU copies)."""

    step: int
    state: Any
    metas: list[list[Any]]
    nbytes: int
    ready: list[Any]  # events after which its device copies are complete (``snapshots.DeviceCopies``)
    written: bool = False
    release: Callable[[], None] | None = None  # lets its pinned slab go (``snapshots.SnapshotArena``)

    def let_go(self) -> None:
        release, self.release = self.release, None
        if release is not None:
            release()


@dataclass(slots=True)
class Dump:
    """What one dump writes: the window's snapshot (None when an earlier dump wrote it) and
    every payload held; the spool then holds steps ``first_step..last_step`` whole."""

    reason: str
    detail: str
    first_step: int
    last_step: int
    snapshot_step: int  # the snapshot at first_step the spool holds after the dump, or -1
    snapshot: HeldSnapshot | None
    blobs: list[Held]
    dropped: int  # payloads of those steps dropped at the memory bound
    hole_step: int = -1  # the last step that could not be held whole (-1: none in reach)


class NoMemory(Exception):
    """Raised by a ``hold`` copy that found no memory (the host could not pin more): the payload
    is dropped and counted as at the memory bound."""


class FlightRecorder:
    """The ring. ``hold``, ``hold_snapshot`` and ``advance`` run on the program's threads, ``take``
    on the writer thread (or the training thread, for a failure seen there); one lock."""

    def __init__(self, steps: int, max_bytes: int) -> None:
        assert steps >= 1 and max_bytes >= 1
        self.steps = steps
        self.max_bytes = max_bytes
        self.lag = 0  # extra steps kept for a failure detected behind the training thread
        self.current = 0  # the step in progress
        self.held_bytes = 0
        self.snapshot_bytes = 0
        self.dropped = 0
        self.dropped_bytes = 0
        self.shrinks = 0  # times the window started at a later snapshot to make room
        self.dumps = 0
        self.fired: set[str] = set()  # the reasons that dump once per run (``Recorder``)
        self._lock = threading.Lock()
        self._next_id = schema.FLIGHT_BLOB_BASE
        self._held: dict[int, Held] = {}
        self._by_step: dict[int, list[int]] = {}  # step -> ids its events name (for eviction)
        self._keys: dict[Key, int] = {}  # content -> id of a held or already written blob
        self._snapshots: dict[int, HeldSnapshot] = {}
        self._dropped_in: dict[int, int] = {}  # step -> payloads dropped, not yet in a dump
        self._dumped: tuple[int, int, int] | None = None  # steps written so far, their snapshot
        self._unreported = [0, 0, 0]  # drops since ``take_drops``: count, bytes, ring full
        self.landed = 0  # device payloads copied by their GPU's ring into pinned memory of their own
        self.ring_full = 0  # of ``dropped``: the payload ring had no room
        self.hole = -1  # the last step whose payloads could not all be held (-1: none)
        self.holes = 0  # times a step could not be held whole (the window restarted)

    # -- the program's side -------------------------------------------------------------------
    def hold(self, *args: Any, **kwargs: Any) -> int:
        """``hold_new``'s blob id alone."""
        return self.hold_new(*args, **kwargs)[0]

    def hold_new(
        self,
        step: int,
        fp: Any,
        nbytes: int,
        algo: str,
        copy: Callable[[], tuple[Any, Any] | None],
        cost: int | None = None,
    ) -> tuple[int, Held | None]:
        """The blob id the events of ``step`` name for these bytes: one already held or written
        with the same content (fingerprint, size, algorithm), else a new one holding ``copy()``
        (data, ready event); ``NO_BLOB`` when the memory bound leaves no room, or ``copy`` found
        none in the payload ring (it returned None): counted. ``cost``: the memory the copy takes
        (``nbytes`` unless given), charged against the bound. With it the ``Held`` made (None
        where it named bytes held or written before, or dropped)."""
        cost = nbytes if cost is None else cost
        key = (fp, nbytes, algo) if isinstance(fp, int) else None  # a device fingerprint is not known yet
        with self._lock:
            if step <= self.hole:  # this step is not held whole already: none of it is kept
                return self._drop(step, nbytes), None
            if key is not None and (found := self._keys.get(key)) is not None:
                held = self._held.get(found)
                if held is not None and held.last_step < step:
                    held.last_step = step
                    self._by_step.setdefault(step, []).append(found)
                return found, None
            if self.held_bytes + cost > self.max_bytes and not self._shrink(cost):
                return self._break(step, nbytes), None
            try:
                made = copy()
            except NoMemory:
                return self._break(step, nbytes), None
            if made is None:  # a device payload its GPU's payload ring could not take in time
                return self._break(step, nbytes, ring_full=True), None
            data, ready = made
            blob_id = self._next_id
            self._next_id += 1
            held = self._held[blob_id] = Held(blob_id, data, nbytes, ready, step, key, cost)
            self._by_step.setdefault(step, []).append(blob_id)
            if key is not None:
                self._keys[key] = blob_id
            self.held_bytes += cost
            return blob_id, held

    def hold_later(self, step: int) -> tuple[int, Callable[[bytes], None]]:
        """An id for bytes made later on the writer thread (a snapshot step's RNG states), and
        the function that gives them: a dump taken in between names them and writes them, since
        the writer runs that function before it writes the dump."""
        with self._lock:
            blob_id = self._next_id
            self._next_id += 1
            held = self._held[blob_id] = Held(blob_id, None, 0, None, step, None, 0)
            self._by_step.setdefault(step, []).append(blob_id)

        def fill(data: bytes) -> None:
            with self._writer_side():
                held.data, held.nbytes, held.cost = data, len(data), len(data)
                if self._held.get(blob_id) is held:  # else evicted, or handed to a dump already
                    self.held_bytes += len(data)

        return blob_id, fill

    def hold_snapshot(
        self,
        step: int,
        state: Any,
        metas: list[list[Any]],
        nbytes: int,
        ready: list[Any] | None = None,
        release: Callable[[], None] | None = None,
    ) -> None:
        with self._lock:
            old = self._snapshots.pop(step, None)
            if old is not None:
                self.snapshot_bytes -= old.nbytes
                old.let_go()
            if step <= self.hole:  # the state at a step that cannot be replayed from memory
                if release is not None:
                    release()
                return
            self._snapshots[step] = HeldSnapshot(step, state, metas, nbytes, ready or [], release=release)
            self.snapshot_bytes += nbytes

    def advance(self, step: int) -> None:
        """``step`` begins: let go of what no window from here on needs."""
        with self._lock:
            self.current = step
            start = self._start(step - self.lag)
            if start is not None:
                self._evict_before(start)

    def take_drops(self) -> tuple[int, int, int]:
        """Payloads dropped since the last call (count, bytes, of the count those the payload
        ring had no room for): the step's ``drop`` event."""
        with self._lock:
            out = (self._unreported[0], self._unreported[1], self._unreported[2])
            self._unreported = [0, 0, 0]
        return out

    # -- the dump -----------------------------------------------------------------------------
    def take(self, reason: str, detail: str, at_step: int | None = None) -> Dump:
        """Everything a replay of the window up to ``at_step`` (default: the step in progress)
        needs that is not written yet, handed over (the ring lets go of it). A dump whose window
        starts inside the steps an earlier one wrote continues it: no second snapshot."""
        with self._writer_side():
            at = self.current if at_step is None else at_step
            start = self._start(at)
            done = self._dumped
            write = None
            if self.hole >= 0 and (start is None or start <= self.hole):
                # no complete window reaches the failure: nothing of it is written (an empty
                # step range), and what is held stays for a later dump past the hole
                dropped = sum(n for s, n in self._dropped_in.items() if s <= at)
                self.dumps += 1
                return Dump(reason, detail, self.current + 1, self.current, -1, None, [], dropped, self.hole)
            if done is not None and start is not None and done[0] <= start <= done[1]:
                first, snap_step = done[0], done[2]
            elif start is None:  # before the first snapshot (step 0's): a replay from 0 needs none
                first, snap_step = min(self._by_step, default=self.current), -1
            else:
                first = snap_step = start
                snap = self._snapshots[start]
                if not snap.written:  # handed over; the ring keeps its step only
                    write = HeldSnapshot(
                        snap.step, snap.state, snap.metas, snap.nbytes, snap.ready, True, snap.release
                    )
                    snap.state, snap.ready, snap.written, snap.release = None, [], True, None
                    self.snapshot_bytes -= snap.nbytes
                    snap.nbytes = 0
            self._dumped = (first, self.current, snap_step)
            # the window's payloads; older ones (held for a failure seen late: ``lag``) let go
            blobs = [h for h in self._held.values() if h.last_step >= first]
            for h in self._held.values():
                if h.last_step < first and h.key is not None and self._keys.get(h.key) == h.id:
                    del self._keys[h.key]  # (a written one's stays: later steps name it)
            self._held.clear()
            self.held_bytes = 0
            dropped = sum(self._dropped_in.values())  # since the last dump (older ones: evicted)
            self._dropped_in.clear()
            self.dumps += 1
            return Dump(reason, detail, first, self.current, snap_step, write, blobs, dropped)

    def counters(self) -> dict[str, int]:
        """For the step and end events' counters (the sidecar's metrics read them)."""
        return {
            "flight_held_bytes": self.held_bytes,
            "flight_snapshot_bytes": self.snapshot_bytes,
            "flight_blobs_dropped": self.dropped,
            "flight_bytes_dropped": self.dropped_bytes,
            "flight_window_shrinks": self.shrinks,
            "flight_dumps": self.dumps,
            "flight_ring_landed": self.landed,
            "flight_ring_full_drops": self.ring_full,
            "flight_window_holes": self.holes,
        }

    # -- inside the lock ----------------------------------------------------------------------
    def _drop(self, step: int, nbytes: int, ring_full: bool = False) -> int:
        self.dropped += 1
        self.dropped_bytes += nbytes
        self.ring_full += ring_full
        self._unreported[0] += 1
        self._unreported[1] += nbytes
        self._unreported[2] += ring_full
        self._dropped_in[step] = self._dropped_in.get(step, 0) + 1
        return schema.NO_BLOB

    def _break(self, step: int, nbytes: int, ring_full: bool = False) -> int:
        """A payload of ``step`` that cannot be held: the step cannot be replayed from memory, so
        neither can any before it. Let go of them all (their memory is the next steps'), keep no
        more of this step's, and let the window start again at the next snapshot."""
        self.hole = max(self.hole, step)
        self.holes += 1
        self._evict_before(step + 1)
        for s in [s for s in self._snapshots if s <= step]:
            old = self._snapshots.pop(s)
            self.snapshot_bytes -= old.nbytes
            old.let_go()
        return self._drop(step, nbytes, ring_full)

    @contextlib.contextmanager
    def _writer_side(self) -> Iterator[None]:
        """The lock, for the writer thread: given up after LOCK_WAIT_S (see there)."""
        acquired = self._lock.acquire(timeout=LOCK_WAIT_S)
        try:
            yield
        finally:
            if acquired:
                self._lock.release()

    def _start(self, step: int) -> int | None:
        """The window's first step for a failure in ``step``: the newest held snapshot at or
        before ``step - steps``, else the oldest held one (early in the run, or after a shrink)."""
        if not self._snapshots:
            return None
        lo = step - self.steps
        eligible = [s for s in self._snapshots if s <= lo]
        return max(eligible) if eligible else min(self._snapshots)

    def _evict_before(self, start: int) -> None:
        for step in [s for s in self._by_step if s < start]:
            for blob_id in self._by_step.pop(step):
                held = self._held.get(blob_id)
                if held is not None and held.last_step < start:
                    del self._held[blob_id]
                    self.held_bytes -= held.cost
                    if held.key is not None and self._keys.get(held.key) == blob_id:
                        del self._keys[held.key]
        for step in [s for s in self._snapshots if s < start]:
            old = self._snapshots.pop(step)
            self.snapshot_bytes -= old.nbytes
            old.let_go()
        for step in [s for s in self._dropped_in if s < start]:
            del self._dropped_in[step]

    def _shrink(self, nbytes: int) -> bool:
        """Room for ``nbytes`` by starting the window at a later held snapshot: fewer steps, each
        still replayable from a snapshot, rather than a window missing its newest payloads."""
        start = self._start(self.current - self.lag)
        for later in sorted(s for s in self._snapshots if start is not None and s > start):
            if self.held_bytes + nbytes <= self.max_bytes:
                break
            self._evict_before(later)
            self.shrinks += 1
        return self.held_bytes + nbytes <= self.max_bytes
