"""``completeness.Progress`` (fed row by row, in any order) against the whole-column computation
it replaced, kept here as the reference: the same completeness for every record, damaged or not.

The collector keeps a ``Progress`` per rank so that a collection never goes over the rank's whole
history to find its gaps; this checks it answers exactly what a pass over all the columns did.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from fsdp_replay.trace import completeness
from fsdp_replay.trace.completeness import Progress, Tracker
from fsdp_replay.trace.runs import Runs


def _first_gap(values: Sequence[int]) -> int | None:
    present = sorted(set(values))
    for expected, got in enumerate(present):
        if got != expected:
            return expected
    return None


def reference(
    tracker: Tracker,
    steps: list[int],
    step_colls: list[int],
    colls: list[tuple[int, int]],
    batches: list[tuple[int, int, int]],
    module_fps: list[tuple[int, int]],
    tape: list[tuple[int, int]],
    end: Mapping[str, Any] | None,
    attempts: int,
) -> dict[str, Any]:
    """The whole-column computation (``completeness.assess`` before Progress)."""
    if end is None:
        tracker.cut(
            tracker.last_step_done, "the process ended without closing its spool (killed?)", lost=False
        )
    elif ended := completeness._abnormal_end(end):
        tracker.cut(tracker.last_step_done, ended, lost=False)
    if attempts <= 1:
        gap = _first_gap(steps)
        if gap is not None:
            tracker.cut(gap - 1, f"the step event of step {gap} is missing")
        elif end is not None and int(end.get("steps", len(steps))) > len(steps):
            tracker.cut(len(steps) - 1, f"the process made {end['steps']} steps; {len(steps)} were recorded")
        present, start, cut = {s for s, _ in colls}, 0, False
        for step, count in sorted(zip(steps, step_colls, strict=True)):
            missing = next((s for s in range(start, start + count) if s not in present), None)
            if missing is not None:
                tracker.cut(step - 1, f"collective #{missing} (step {step}) is missing")
                cut = True
                break
            start += count
        gap = _first_gap([s for s, _ in colls])
        if not cut and gap is not None and gap >= start:
            before = max((st for sq, st in colls if sq < gap), default=0)
            tracker.cut(before - 1, f"collective #{gap} is missing")
        loaders: dict[int, list[tuple[int, int]]] = {}
        for loader, index, step in batches:
            loaders.setdefault(loader, []).append((index, step))
        for loader in sorted(loaders):
            gap = _first_gap([i for i, _ in loaders[loader]])
            if gap is not None:
                before = max((st for i, st in loaders[loader] if i < gap), default=0)
                tracker.cut(before - 1, f"batch {gap} of loader {loader} is missing")
                break
        else:
            gap = _first_gap(list(loaders))
            if gap is not None:
                lower = min(st for _, st in loaders[gap - 1]) if gap > 0 else 0
                tracker.cut(lower - 1, f"the batches of loader {gap} are missing")
        gap = _first_gap([seq for seq, _ in tape])
        if gap is not None:
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


def record(rng: random.Random) -> dict[str, Any]:
    """A rank's rows: steps with their collectives, batches, module fingerprints, tape calls;
    often with some rows lost (damage), shuffled (the collector sees them in any order)."""
    n = rng.randint(0, 9)
    steps, counts = list(range(n)), [rng.randint(0, 4) for _ in range(n)]
    colls = [
        (seq, st) for st, c in enumerate(counts) for seq in range(sum(counts[:st]), sum(counts[: st + 1]))
    ]
    colls += [(sum(counts) + k, n) for k in range(rng.randint(0, 3))]
    batches = [(ld, i, min(i, n)) for ld in range(rng.randint(0, 3)) for i in range(rng.randint(0, 5))]
    modules = [(st, i) for st in steps for i in range(rng.randint(0, 3))]
    tape = [(i, i // 2) for i in range(rng.randint(0, 6))]
    if rng.random() < 0.7:
        keep = [rng.random() > 0.15 for _ in steps]
        steps, counts = (
            [s for s, k in zip(steps, keep, strict=True) if k],
            [c for c, k in zip(counts, keep, strict=True) if k],
        )
        colls, batches, modules, tape = (
            [x for x in xs if rng.random() > 0.15] for xs in (colls, batches, modules, tape)
        )
    for xs in (colls, batches, modules, tape):
        rng.shuffle(xs)
    end = rng.choice(
        [None, {"reason": "exit", "steps": n}, {"reason": "exit", "steps": n + 1}, {"reason": "SIGTERM"}]
    )
    return {
        "steps": steps,
        "step_colls": counts,
        "colls": colls,
        "batches": batches,
        "module_fps": modules,
        "tape": tape,
        "end": end,
        "attempts": rng.choice([1, 1, 1, 2]),
    }


def test_progress_fed_in_any_order_agrees_with_the_whole_column_computation() -> None:
    rng = random.Random(14)
    for _ in range(3000):
        r = record(rng)
        incident = rng.random() < 0.3
        trackers = [Tracker(last_step_done=max(r["steps"], default=-1)) for _ in range(2)]
        if incident:
            for t in trackers:
                t.incident("damaged spool record")
        want = reference(trackers[0], **r)
        p = Progress()
        feed: list[Any] = [("s", s, c) for s, c in zip(r["steps"], r["step_colls"], strict=True)]
        feed += [("c", *x) for x in r["colls"]] + [("b", *x) for x in r["batches"]]
        feed += [("m", *x) for x in r["module_fps"]] + [("t", *x) for x in r["tape"]]
        rng.shuffle(feed)
        for kind, *args in feed:
            {"s": p.step, "c": p.coll, "b": p.batch, "m": p.module, "t": p.tape_call}[kind](*args)
        assert p.assess(trackers[1], r["end"], r["attempts"]) == want, r


def test_runs_keep_a_million_values_in_order_as_one_run() -> None:
    runs = Runs()
    for v in range(1_000_000):
        runs.add(v, v // 100)
    assert runs.first_gap() is None and runs.max() == 999_999 and runs.tag_below(1_000_000) == 9_999
    runs.add(1_000_001, 5)
    assert runs.first_gap() == 1_000_000 and len(runs) == 1_000_001
    runs.add(1_000_000, 7)
    assert runs.first_gap() is None and runs.tag_below(1_000_002) == 10_000 - 1
