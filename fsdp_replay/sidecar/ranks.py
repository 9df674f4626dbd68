"""What one rank's spool says, as running numbers: the sidecar's view of a rank for its metrics.

``RankState.apply(record)`` takes the records a ``trace.follow.SpoolFollower`` yields, in order,
and keeps counts (records, bytes, events by type, collectives by op, steps), the recording cost the
agent measured (``step.cpu_ns``: [agent hooks ns, writer ns], cumulative per process), the end
counters, stuck collectives, the dump requests answered and the time of the last record. Nothing
here reads files or knows Prometheus; every value is a plain number, so the unit tests compute them by hand.

The per-step cost is the statistic ``fsdp-replay inspect`` reports (``analysis.summary.recording_cost``),
replicated exactly rather than approximated, so the two can be compared to the last bit: the median
of the increments of the cumulative ``cpu_ns`` between consecutive ``step`` events in spool order
(the collector's order), over the steps from ``skip_steps`` on, with ``-1`` for a step without
``cpu_ns``; none for fewer than ``max(2, 3 - skip_steps)`` such steps or any negative value. The
median is kept incrementally in a sorted ``array`` (8 bytes a step), so a scrape costs O(1).
"""

from __future__ import annotations

import bisect
from array import array
from collections import Counter
from typing import Any

from fsdp_replay.trace import schema
from fsdp_replay.trace.spool import Damage, Record

OTHER = "other"
"""Label value for an event type or op outside the schema's tables (keeps cardinality bounded)."""
EVENT_TYPES = frozenset(schema.EVENT_KEYS)
OPS = frozenset(schema.C10D_OPS)
DROP_REASONS = ("blobs_dropped", "events_dropped", "write_errors")
PAYLOAD_WAIT = "payload_wait"  # the training's wall time waiting for room for payloads (not a CPU part)
"""Counters of the ``end`` event that count what the agent gave up, by reason."""
_NO_CPU = (-1, -1)  # what the collector stores for a step without cpu_ns


class Median:
    """The running median of integers, as ``numpy.median`` computes it (mean of the middle two)."""

    __slots__ = ("_sorted",)

    def __init__(self) -> None:
        self._sorted = array("q")

    def add(self, value: int) -> None:
        bisect.insort(self._sorted, value)

    def __len__(self) -> int:
        return len(self._sorted)

    def value(self) -> float | None:
        s, n = self._sorted, len(self._sorted)
        if n == 0:
            return None
        if n % 2:
            return float(s[n // 2])
        return (s[n // 2 - 1] + s[n // 2]) / 2


class StepCost:
    """The agent's own measure of what recording costs, from the ``cpu_ns`` of step events."""

    __slots__ = (
        "_attempt_prev",
        "_prev",
        "hooks",
        "hooks_ns_sum",
        "negative",
        "skip_steps",
        "step_ns",
        "steps",
        "wall_ns_sum",
        "writer",
        "writer_ns_sum",
    )

    def __init__(self, skip_steps: int = 0) -> None:
        self.skip_steps = skip_steps
        self.steps = 0
        """Step events seen (all attempts)."""
        self.hooks = Median()
        """Increments of the agent-hooks CPU ns (summary.recording_cost's agent_cpu_ms_per_step)."""
        self.writer = Median()
        """Increments of the writer-thread CPU ns (writer_cpu_ms_per_step)."""
        self.step_ns = Median()
        """Wall-clock ns between consecutive steps of one attempt (after skip_steps)."""
        self.negative = False
        """A step from skip_steps on had no cpu_ns (or a negative one): no per-step cost, as in summary."""
        self.hooks_ns_sum = 0
        self.writer_ns_sum = 0
        self.wall_ns_sum = 0
        """Sums of the increments within attempts (after skip_steps): the share of step time."""
        self._prev: tuple[int, int] | None = None
        self._attempt_prev: tuple[int, int, int] | None = None

    def new_attempt(self) -> None:
        """A restarted process: its counters start again from 0 (the median still spans attempts,
        as the trace's steps table does; the shares do not)."""
        self._attempt_prev = None

    def add(self, hooks_ns: int, writer_ns: int, t_ns: int) -> None:
        i = self.steps
        self.steps += 1
        if i >= self.skip_steps and (hooks_ns < 0 or writer_ns < 0):
            self.negative = True
        if i >= self.skip_steps + 1 and self._prev is not None:
            self.hooks.add(hooks_ns - self._prev[0])
            self.writer.add(writer_ns - self._prev[1])
        self._prev = (hooks_ns, writer_ns)
        ap = self._attempt_prev
        if i >= self.skip_steps + 1 and ap is not None and min(hooks_ns, writer_ns, ap[0], ap[1]) >= 0:
            self.hooks_ns_sum += hooks_ns - ap[0]
            self.writer_ns_sum += writer_ns - ap[1]
            self.wall_ns_sum += t_ns - ap[2]
            self.step_ns.add(t_ns - ap[2])
        self._attempt_prev = (hooks_ns, writer_ns, t_ns)

    def per_step_ns(self) -> tuple[float, float] | None:
        """(hooks, writer) CPU ns per step: summary.recording_cost's statistic, in ns."""
        if self.steps - self.skip_steps < max(2, 3 - self.skip_steps) or self.negative:
            return None
        hooks, writer = self.hooks.value(), self.writer.value()
        if hooks is None or writer is None:
            return None
        return hooks, writer


class RankState:
    """Running numbers of one rank's spool (all attempts of the rank in its folder)."""

    def __init__(self, rank: int, *, skip_steps: int = 0) -> None:
        self.rank = rank
        self.records: Counter[str] = Counter()
        """Whole records read, by kind: "event", "blob"."""
        self.blob_bytes = 0
        """Raw bytes of the blob records (payloads, snapshots, RNG states)."""
        self.events: Counter[str] = Counter()
        """Events by type (unknown types as "other")."""
        self.collectives: Counter[str] = Counter()
        """Collective events by c10d op (unknown ops as "other")."""
        self.attempts = 0
        """rank_start events: 1, plus one per restart of the rank's process."""
        self.cost = StepCost(skip_steps)
        self.cpu_ns_done = [0, 0]
        """[hooks, writer] CPU ns of the attempts before the current one (their last value)."""
        self.cpu_ns_now = [0, 0]
        """[hooks, writer] CPU ns of the current attempt, as last reported (step or end event)."""
        self.cpu_parts_done: Counter[str] = Counter()
        self.cpu_parts_now: dict[str, int] = {}
        """The hooks' CPU ns by part (``schema.AGENT_CPU_PARTS``) of the current attempt, as last
        reported (a step's or the end event's counters; agents before session 14 report none)."""
        self.end_counters_done: Counter[str] = Counter()
        self.end_counters_now: dict[str, int] = {}
        """The ``end`` event's counters of the current attempt (empty until it ends)."""
        self.ended = False
        """The current attempt wrote its ``end`` event."""
        self.agent_error_events = 0
        self.unusable_events = 0
        """Events whose keys or values are not what the schema says (counted by type, nothing more)."""
        self.stuck_events = 0
        self.stuck_seq: int | None = None
        """Sequence number of the collective the rank is stuck in (a ``stuck`` event not followed by it)."""
        self.state_ids: set[int] = set()
        """Dump requests the rank answered (the ids of its ``state`` events, all attempts)."""
        self.t0_wall_ns: int | None = None
        """Wall-clock time of t_ns == 0 of the current attempt (rank_start.t0_wall_ns)."""
        self.last_t_ns: int | None = None
        """Latest time an event of the current attempt carried (a collective: its completion)."""
        self.last_coll_t_ns: int | None = None
        """Completion time of the latest collective of the current attempt."""
        self.damage = 0
        self.damage_bytes = 0
        self.bytes_read = 0
        """Spool bytes the follower consumed (segment headers, records, damaged spans)."""
        self.disk_bytes = 0
        """Size of the rank's segment files at the last look."""
        self.collected_bytes = 0
        """Spool bytes already collected into the trace (the collector lowers the backlog by them)."""

    # -- feeding ------------------------------------------------------------------------------
    def apply(self, rec: Record) -> None:
        """One record from the rank's spool, in write order."""
        if rec.kind == schema.KIND_BLOB:
            self.records["blob"] += 1
            self.blob_bytes += rec.raw.nbytes
            return
        self.records["event"] += 1
        ev = rec.obj
        if not isinstance(ev, dict):
            self.events[OTHER] += 1
            return
        kind = ev.get("type")
        self.events[kind if kind in EVENT_TYPES else OTHER] += 1
        try:
            self._event(str(kind), ev)
        except (KeyError, TypeError, ValueError, IndexError):
            self.unusable_events += 1  # the collector refuses it too (keys missing, wrong types)

    def add_damage(self, damage: list[Damage]) -> None:
        self.damage += len(damage)
        self.damage_bytes += sum(d.nbytes for d in damage)

    def _event(self, kind: str, ev: dict[str, Any]) -> None:
        if kind == schema.EV_COLLECTIVE:
            op = ev.get("op")
            self.collectives[op if op in OPS else OTHER] += 1
            done = int(ev["t_ns"]) + int(ev.get("dur_ns") or 0)
            self.last_coll_t_ns = done if self.last_coll_t_ns is None else max(self.last_coll_t_ns, done)
            self._saw(done)
            if self.stuck_seq is not None and int(ev["seq"]) >= self.stuck_seq:
                self.stuck_seq = None
        elif kind == schema.EV_STEP:
            hooks, writer = ev.get("cpu_ns", _NO_CPU)
            self.cost.add(int(hooks), int(writer), int(ev["t_ns"]))
            if hooks >= 0 and writer >= 0:
                self.cpu_ns_now = [int(hooks), int(writer)]
            self._cpu_parts(ev.get("counters"))
            self._saw(int(ev["t_ns"]))
        elif kind == schema.EV_RANK_START:
            if self.attempts:
                self._close_attempt()
            self.attempts += 1
            self.cost.new_attempt()
            self.t0_wall_ns = int(ev["t0_wall_ns"]) if ev.get("t0_wall_ns") is not None else None
        elif kind == schema.EV_END:
            counters = ev.get("counters") or {}
            self.end_counters_now = {k: int(v) for k, v in counters.items() if isinstance(v, int | float)}
            hooks, writer = counters.get("agent_cpu_ns"), counters.get("writer_cpu_ns")
            if isinstance(hooks, int) and isinstance(writer, int):
                self.cpu_ns_now = [max(hooks, self.cpu_ns_now[0]), max(writer, self.cpu_ns_now[1])]
            self._cpu_parts(counters)
            self.ended = True
            self.stuck_seq = None
            self._saw(int(ev["t_ns"]))
        elif kind == schema.EV_STUCK:
            self.stuck_events += 1
            self.stuck_seq = int(ev["seq"])
            self._saw(int(ev["t_ns"]) + int(ev.get("waited_ns") or 0))
        elif kind == schema.EV_ALIVE:
            self._saw(int(ev["t_ns"]))
        elif kind == schema.EV_STATE:
            self.state_ids.add(int(ev["id"]))
            self._saw(int(ev["t_ns"]))
        elif kind == schema.EV_AGENT_ERROR:
            self.agent_error_events += 1

    def _cpu_parts(self, counters: Any) -> None:
        if not isinstance(counters, dict):
            return
        for part in schema.AGENT_CPU_PARTS:
            ns = counters.get(f"agent_cpu_{part}_ns")
            if isinstance(ns, int) and ns >= self.cpu_parts_now.get(part, 0):
                self.cpu_parts_now[part] = ns
        waited = counters.get("payload_wait_ns")  # kept beside the parts: folded the same way
        if isinstance(waited, int) and waited >= self.cpu_parts_now.get(PAYLOAD_WAIT, 0):
            self.cpu_parts_now[PAYLOAD_WAIT] = waited

    def _saw(self, t_ns: int) -> None:
        self.last_t_ns = t_ns if self.last_t_ns is None else max(self.last_t_ns, t_ns)

    def _close_attempt(self) -> None:
        """A new rank_start: fold the finished attempt's totals so that counters never go down."""
        self.cpu_ns_done = [a + b for a, b in zip(self.cpu_ns_done, self.cpu_ns_now, strict=True)]
        self.cpu_ns_now = [0, 0]
        self.cpu_parts_done.update(self.cpu_parts_now)
        self.cpu_parts_now = {}
        self.end_counters_done.update(self.end_counters_now)
        self.end_counters_now = {}
        self.ended = False
        self.stuck_seq = None
        self.last_t_ns = self.last_coll_t_ns = None

    # -- reading ------------------------------------------------------------------------------
    @property
    def steps(self) -> int:
        return self.events[schema.EV_STEP]

    @property
    def collective_count(self) -> int:
        return self.events[schema.EV_COLLECTIVE]

    @property
    def hooks_cpu_ns(self) -> int:
        """Agent-hooks CPU ns, all attempts."""
        return self.cpu_ns_done[0] + self.cpu_ns_now[0]

    def cpu_part_ns(self, part: str) -> int:
        """Agent-hooks CPU ns of one part (``schema.AGENT_CPU_PARTS``), all attempts."""
        return self.cpu_parts_done.get(part, 0) + self.cpu_parts_now.get(part, 0)

    @property
    def writer_cpu_ns(self) -> int:
        return self.cpu_ns_done[1] + self.cpu_ns_now[1]

    def end_counter(self, name: str) -> int:
        """An ``end`` counter summed over the attempts that ended."""
        return self.end_counters_done.get(name, 0) + self.end_counters_now.get(name, 0)

    @property
    def agent_errors(self) -> int:
        """Internal errors of the agent: the end counter where the rank ended, else the events seen
        (the agent writes one agent_error event and counts the errors after it)."""
        return max(self.agent_error_events, self.end_counter("agent_errors"))

    @property
    def stuck(self) -> bool:
        return self.stuck_seq is not None

    @property
    def backlog_bytes(self) -> int:
        """Spool bytes on disk not collected yet."""
        return max(0, self.disk_bytes - self.collected_bytes)

    def last_record_wall_s(self) -> float | None:
        """Wall-clock time (s since the epoch) of the latest event time, if the agent gave t0_wall_ns."""
        if self.t0_wall_ns is None or self.last_t_ns is None:
            return None
        return (self.t0_wall_ns + self.last_t_ns) / 1e9

    def last_collective_wall_s(self) -> float | None:
        if self.t0_wall_ns is None or self.last_coll_t_ns is None:
            return None
        return (self.t0_wall_ns + self.last_coll_t_ns) / 1e9
