"""How far a rank's record is complete: the one question every verdict depends on.

A replay may call a rank DIVERGED, and ``desync``/``diff`` may call ranks inconsistent, only over
steps whose every record is in the trace. A record stops being complete where the process was
killed (its spool has no ``end`` event), where the agent stopped recording after an internal
error, where a spool record was damaged, or where the numbering of what it recorded (collective
sequence numbers, steps, batches, module calls) has a gap. The collector finds all of these and
stores the result in the rank's ``completeness`` attribute (format 3)::

    {"complete": bool, "through_step": K, "prefix": bool, "reasons": [str, ...]}

``through_step`` is the last step whose records are all present (-1: not even step 0), and
``reasons`` say why the record ends there. ``prefix`` says whether the record is an intact
prefix of what the process did: true when it only *ends* early (the process was killed, stopped
by SIGTERM, died of an exception or inside a collective, or the agent stopped recording), so that
everything up to its last record, the partial step after ``through_step`` included, is there;
false when something was *lost* on the way (damage, a gap), so that only steps up to
``through_step`` can be trusted. A replay of a prefix runs until it needs a record past the end;
a replay of a record with a loss stops after step ``through_step``. For traces written before
format 3, ``of_rank`` derives the same from the rank's end event and damage list.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fsdp_replay.trace import schema


@dataclass(slots=True)
class Tracker:
    """Fed in spool order by the collector: what broke the record, and where."""

    last_step_done: int = -1  # the highest step whose step event has been read
    limit: int | None = None  # complete through this step at most (None: nothing broke it)
    lost: bool = False  # records are missing before the end (not only at it)
    reasons: list[str] = field(default_factory=list)

    def cut(self, through_step: int, reason: str, *, lost: bool = True) -> None:
        """The record is complete through ``through_step`` at most, because of ``reason``;
        ``lost`` when records are missing (a replay must stop there), not only ending."""
        self.limit = through_step if self.limit is None else min(self.limit, through_step)
        self.lost = self.lost or lost
        self.reasons.append(reason)

    def incident(self, reason: str) -> None:
        """Something was lost here: what follows the last step read so far may be incomplete."""
        self.cut(self.last_step_done, reason)

    def step_done(self, step: int) -> None:
        self.last_step_done = max(self.last_step_done, step)

    def agent_error(self, ev: Mapping[str, Any]) -> None:
        step = ev.get("step")
        where = f" at step {step}" if step is not None else ""
        reason = f"the agent stopped recording{where} (an internal error: {ev.get('where')})"
        # Nothing before the error is lost; after it nothing was recorded: the record ends there.
        self.cut(step - 1 if isinstance(step, int) else self.last_step_done, reason, lost=False)


def _first_gap(values: Sequence[int]) -> int | None:
    """The smallest non-negative integer missing from ``values`` below their maximum."""
    present = sorted(set(values))
    for expected, got in enumerate(present):
        if got != expected:
            return expected
    return None


def assess(
    tracker: Tracker,
    *,
    steps: Sequence[int],
    step_colls: Sequence[int],
    coll_seqs: Sequence[int],
    coll_steps: Sequence[int],
    batches: Sequence[tuple[int, int, int]],
    module_fps: Sequence[tuple[int, int]],
    end: Mapping[str, Any] | None,
    attempts: int,
    tape: Sequence[tuple[int, int]] = (),
) -> dict[str, Any]:
    """The rank's completeness, from the tracker and the gaps in what was collected.

    ``batches`` are (loader, index, step), ``module_fps`` (step, idx) and ``tape`` (seq, step) in
    any order.
    """
    n_steps = len(steps)
    if end is None:
        tracker.cut(
            tracker.last_step_done, "the process ended without closing its spool (killed?)", lost=False
        )
    else:
        ended = _abnormal_end(end)
        if ended:
            tracker.cut(tracker.last_step_done, ended, lost=False)
    # A restarted rank (attempts > 1) numbers its steps and collectives again from where it
    # restarted: gaps between attempts are not losses, so only the incidents above count.
    if attempts <= 1:
        gap = _first_gap(steps)
        if gap is not None:
            tracker.cut(gap - 1, f"the step event of step {gap} is missing")
        elif end is not None and int(end.get("steps", n_steps)) > n_steps:
            tracker.cut(n_steps - 1, f"the process made {end['steps']} steps; {n_steps} were recorded")
        _collective_gaps(tracker, steps, step_colls, coll_seqs, coll_steps)
        _batch_gaps(tracker, batches)
        gap = _first_gap([seq for seq, _ in tape])
        if gap is not None:  # a call of the nondeterministic-kernel tape is missing
            before = max((st for sq, st in tape if sq < gap), default=0)
            tracker.cut(before - 1, f"call #{gap} of the nondeterministic-kernel tape is missing")
        by_step: dict[int, list[int]] = {}
        for step, idx in module_fps:
            by_step.setdefault(step, []).append(idx)
        for step in sorted(by_step):
            if _first_gap(by_step[step]) is not None:
                tracker.cut(step - 1, f"a module fingerprint of step {step} is missing")
                break
    last = max(steps) if steps else -1
    through = last if tracker.limit is None else min(tracker.limit, last)
    return {
        "complete": tracker.limit is None,
        "through_step": through,
        "prefix": not tracker.lost,
        "reasons": tracker.reasons,
    }


def _abnormal_end(end: Mapping[str, Any]) -> str | None:
    """Why a process that closed its spool still did not finish its program, or None."""
    if end.get("reason") not in (None, "exit"):
        return f"the process was stopped by {end['reason']}"
    if end.get("exception"):
        return f"the process died of {end['exception']}"
    inflight = end.get("inflight")
    if isinstance(inflight, dict):
        return (
            f"the process ended inside collective #{inflight.get('seq')} ({inflight.get('op')}), "
            "which never completed"
        )
    return None


def _collective_gaps(
    tracker: Tracker,
    steps: Sequence[int],
    step_colls: Sequence[int],
    coll_seqs: Sequence[int],
    coll_steps: Sequence[int],
) -> None:
    present = set(coll_seqs)
    # Each step event says how many collectives its step issued: together they give the step
    # every sequence number belongs to, so a missing one cuts the record exactly before its step.
    start = 0
    for step, count in sorted(zip(steps, step_colls, strict=True)):
        missing = next((s for s in range(start, start + count) if s not in present), None)
        if missing is not None:
            tracker.cut(step - 1, f"collective #{missing} (step {step}) is missing")
            return
        start += count
    gap = _first_gap(coll_seqs)
    if gap is not None and gap >= start:  # after the last recorded step: bounded by its neighbour
        before = max((st for sq, st in zip(coll_seqs, coll_steps, strict=True) if sq < gap), default=0)
        tracker.cut(before - 1, f"collective #{gap} is missing")


def _batch_gaps(tracker: Tracker, batches: Sequence[tuple[int, int, int]]) -> None:
    loaders: dict[int, list[tuple[int, int]]] = {}
    for loader, index, step in batches:
        loaders.setdefault(loader, []).append((index, step))
    for loader in sorted(loaders):
        rows = sorted(loaders[loader])
        gap = _first_gap([i for i, _ in rows])
        if gap is not None:
            before = max((st for i, st in rows if i < gap), default=0)
            tracker.cut(before - 1, f"batch {gap} of loader {loader} is missing")
            return
    gap = _first_gap(list(loaders))
    if gap is not None:  # a whole iterator is missing; it began after the one before it began
        lower = min(st for _, st in loaders[gap - 1]) if gap > 0 else 0
        tracker.cut(lower - 1, f"the batches of loader {gap} are missing")


def of_rank(attrs: Mapping[str, Any], n_steps: int) -> dict[str, Any]:
    """The completeness of a collected rank: its attribute, or (before format 3) derived."""
    stored = attrs.get(schema.COMPLETENESS_ATTR)
    if isinstance(stored, dict) and "through_step" in stored:
        return {
            "complete": bool(stored.get("complete")),
            "through_step": int(stored["through_step"]),
            "prefix": bool(stored.get("prefix", True)),
            "reasons": [str(r) for r in stored.get("reasons", [])],
        }
    reasons: list[str] = []
    through, prefix = n_steps - 1, True
    end = attrs.get("end")
    if end is None:
        reasons.append("the process ended without closing its spool (killed?)")
    elif ended := _abnormal_end(end):
        reasons.append(ended)
    if attrs.get("agent_errors"):
        reasons.append("the agent stopped recording")
    if attrs.get("damage"):
        reasons.append("damaged spool records (where they were is not recorded before format 3)")
        through, prefix = -1, False
    return {"complete": not reasons, "through_step": through, "prefix": prefix, "reasons": reasons}
