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

import ast
import re
import warnings
from bisect import bisect_right, insort
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from fsdp_replay.trace import schema
from fsdp_replay.trace.runs import Runs


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


@dataclass(slots=True)
class Progress:
    """What ``assess`` needs of a rank's collected rows, kept as the rows arrive (in any order),
    so that a collector running again and again over a growing spool never goes over the whole
    history: each numbering as ``Runs`` (its first gap, and the largest step below it)."""

    steps: Runs = field(default_factory=Runs)
    step_colls: list[tuple[int, int]] = field(default_factory=list)  # (step, colls), sorted
    coll_starts: list[int] = field(default_factory=list)  # each step's first sequence number
    colls_total: int = 0
    colls: Runs = field(default_factory=Runs)  # sequence numbers, tagged with their step
    loaders: dict[int, Runs] = field(default_factory=dict)  # batch indices, tagged with their step
    loader_first_step: dict[int, int] = field(default_factory=dict)
    loader_ids: Runs = field(default_factory=Runs)
    tape: Runs = field(default_factory=Runs)  # tape call numbers, tagged with their step
    modules: dict[int, int | Runs] = field(default_factory=dict)  # step -> idx 0..k-1, or Runs
    modules_gappy: set[int] = field(default_factory=set)
    n_steps: int = 0

    def step(self, step: int, colls: int) -> None:
        self.steps.add(step)
        self.n_steps += 1
        pair = (step, colls)
        if not self.step_colls or pair >= self.step_colls[-1]:
            self.coll_starts.append(self.colls_total)
            self.step_colls.append(pair)
        else:  # out of order: rare; the starts after it move
            insort(self.step_colls, pair)
            self.coll_starts = list(accumulate((c for _, c in self.step_colls[:-1]), initial=0))
        self.colls_total += colls

    def coll(self, seq: int, step: int) -> None:
        self.colls.add(seq, step)

    def batch(self, loader: int, index: int, step: int) -> None:
        runs = self.loaders.get(loader)
        if runs is None:
            runs = self.loaders[loader] = Runs()
            self.loader_ids.add(loader)
        runs.add(index, step)
        first = self.loader_first_step.get(loader)
        self.loader_first_step[loader] = step if first is None else min(first, step)

    def module(self, step: int, idx: int) -> None:
        seen = self.modules.get(step, 0)
        if isinstance(seen, int):
            if idx == seen:
                self.modules[step] = seen + 1
                return
            if 0 <= idx < seen:
                return
            runs = Runs()
            for i in range(seen):
                runs.add(i)
            seen = self.modules[step] = runs
        seen.add(idx)
        if seen.first_gap() is None:
            self.modules_gappy.discard(step)
        else:
            self.modules_gappy.add(step)

    def tape_call(self, seq: int, step: int) -> None:
        self.tape.add(seq, step)

    def assess(self, tracker: Tracker, end: Mapping[str, Any] | None, attempts: int) -> dict[str, Any]:
        """The rank's completeness (``tracker`` gets the cuts: pass a copy to keep yours)."""
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
            gap = self.steps.first_gap()
            if gap is not None:
                tracker.cut(gap - 1, f"the step event of step {gap} is missing")
            elif end is not None and int(end.get("steps", self.n_steps)) > self.n_steps:
                tracker.cut(
                    self.n_steps - 1, f"the process made {end['steps']} steps; {self.n_steps} were recorded"
                )
            self._collective_gaps(tracker)
            self._batch_gaps(tracker)
            gap = self.tape.first_gap()
            if gap is not None:  # a call of the nondeterministic-kernel tape is missing
                before = self.tape.tag_below(gap)
                tracker.cut((before or 0) - 1, f"call #{gap} of the nondeterministic-kernel tape is missing")
            if self.modules_gappy:
                step = min(self.modules_gappy)
                tracker.cut(step - 1, f"a module fingerprint of step {step} is missing")
        last = self.steps.max()
        last = -1 if last is None else last
        through = last if tracker.limit is None else min(tracker.limit, last)
        return {
            "complete": tracker.limit is None,
            "through_step": through,
            "prefix": not tracker.lost,
            "reasons": tracker.reasons,
        }

    def _collective_gaps(self, tracker: Tracker) -> None:
        # Each step event says how many collectives its step issued: together they give the step
        # every sequence number belongs to, so a missing one cuts the record exactly before its step.
        missing = self.colls.first_missing()
        if missing < self.colls_total:
            step = self.step_colls[bisect_right(self.coll_starts, missing) - 1][0]
            tracker.cut(step - 1, f"collective #{missing} (step {step}) is missing")
            return
        gap = self.colls.first_gap()
        if gap is not None and gap >= self.colls_total:  # after the last step: bounded by its neighbour
            before = self.colls.tag_below(gap)
            tracker.cut((before or 0) - 1, f"collective #{gap} is missing")

    def _batch_gaps(self, tracker: Tracker) -> None:
        for loader in sorted(self.loaders):
            runs = self.loaders[loader]
            gap = runs.first_gap()
            if gap is not None:
                before = runs.tag_below(gap)
                tracker.cut((before or 0) - 1, f"batch {gap} of loader {loader} is missing")
                return
        gap = self.loader_ids.first_gap()
        if gap is not None:  # a whole iterator is missing; it began after the one before it began
            lower = self.loader_first_step[gap - 1] if gap > 0 else 0
            tracker.cut(lower - 1, f"the batches of loader {gap} are missing")


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
    """The rank's completeness, from the tracker and the gaps in what was collected: ``Progress``
    fed with whole columns. ``batches`` are (loader, index, step), ``module_fps`` (step, idx) and
    ``tape`` (seq, step) in any order."""
    p = Progress()
    for step, colls in zip(steps, step_colls, strict=True):
        p.step(int(step), int(colls))
    for seq, step in zip(coll_seqs, coll_steps, strict=True):
        p.coll(int(seq), int(step))
    for loader, index, step in batches:
        p.batch(int(loader), int(index), int(step))
    for step, idx in module_fps:
        p.module(int(step), int(idx))
    for seq, step in tape:
        p.tape_call(int(seq), int(step))
    return p.assess(tracker, end, attempts)


_REPR = re.compile(r"^([A-Za-z_][\w.]*)\((['\"])(.*)\2\)$", re.DOTALL)
_REPR_CUT = re.compile(r"^([A-Za-z_][\w.]*)\((['\"])(.*)$", re.DOTALL)  # older agents kept 500 characters
_ERROR_LINE = re.compile(r"^\s*[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b")


def _unescape(body: str, quote: str) -> str:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an escape cut in two by the agent's shortening
            return str(ast.literal_eval(quote + body + quote))
    except (ValueError, SyntaxError):
        return body.replace("\\n", "\n").replace("\\" + quote, quote)


def exception_text(recorded: str, limit: int = 300) -> str:
    """One line for an exception the agent recorded as its ``repr`` (``end.exception``, or a
    traceback's text): ``Name: message``, its escapes undone. One carrying another's traceback in
    its message (a DataLoader worker's error, re-raised in the main process) shows its first line
    and the original error; a traceback, its error line. At most ``limit`` characters."""
    text = recorded.strip()
    m = _REPR.match(text) or _REPR_CUT.match(text)
    if m is not None:
        message = _unescape(m.group(3), m.group(2))
        text = f"{m.group(1)}: {message}" if message else m.group(1)
    elif re.match(r"^[A-Za-z_][\w.]*\(\)$", text):
        text = text[:-2]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if len(lines) > 1:
        errors = [ln for ln in lines[1:] if _ERROR_LINE.match(ln)]
        if lines[0].startswith("Traceback"):
            text = errors[-1] if errors else lines[-1]
        elif any("Traceback (" in ln for ln in lines):  # another's traceback, in its message
            text = lines[0] + (f" (original: {errors[-1]})" if errors else "")
        else:  # a message of several lines (NCCL's "Last error:" and what follows it)
            text = " / ".join(lines)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _abnormal_end(end: Mapping[str, Any]) -> str | None:
    """Why a process that closed its spool still did not finish its program, or None."""
    if end.get("reason") not in (None, "exit"):
        return f"the process was stopped by {end['reason']}"
    if end.get("exception"):
        return f"the process died of {exception_text(str(end['exception']))}"
    inflight = end.get("inflight")
    if isinstance(inflight, dict):
        return (
            f"the process ended inside collective #{inflight.get('seq')} ({inflight.get('op')}), "
            "which never completed"
        )
    return None


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
