"""One rank's recorded columns, resolved for analysis: issue order, names, shapes, completeness.

What ``nan``, ``desync`` and ``diff`` share: the collectives in issue order as numpy columns
(``issue_order``), the rank-local code tables resolved to shared ids (``Interner``), process-group
names, shape hashes, and what each must say about the trace itself (missing ranks, records that end
early or lost something: ``record_notes``). Numpy only, never torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fsdp_replay.trace.reader import RankTrace, Trace

AFTER_ALL_MICRO = 1 << 30  # the micro key of "parameters after the step"


class Interner:
    """Strings -> small ints, shared by the ranks/traces being compared (codes are per rank)."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def __call__(self, name: str) -> int:
        return self.ids.setdefault(name, len(self.ids))

    def lut(self, names: list[str]) -> np.ndarray:
        """Code -> global id; index -1 (the code for "none") maps to -1."""
        return np.array([self(n) for n in names] + [-1], dtype=np.int64)


@dataclass
class Colls:
    """One rank's collectives in issue order (sorted by attempt, then seq), as numpy columns."""

    rows: np.ndarray  # row in the collectives table, for each position
    seq: np.ndarray
    step: np.ndarray
    micro: np.ndarray
    op: np.ndarray  # rank-local codes
    pg: np.ndarray
    reduce_op: np.ndarray
    tensor_start: np.ndarray
    tensor_count: np.ndarray
    rel: np.ndarray  # position inside its (step, micro) run
    pos_of_row: np.ndarray  # inverse of rows

    def __len__(self) -> int:
        return len(self.rows)


def issue_order(r: RankTrace) -> Colls:
    c = r.collectives
    seq = c["seq"]
    n = len(seq)
    if int(r.attrs.get("attempts", 1) or 1) > 1 and n:
        attempt = np.cumsum(seq == 0) - (1 if seq[0] == 0 else 0)
        rows = np.lexsort((seq, attempt))
    else:
        rows = np.argsort(seq, kind="stable")
    step, micro = c["step"][rows], c["micro"][rows]
    pos_of_row = np.empty(n, dtype=np.int64)
    pos_of_row[rows] = np.arange(n)
    if n:
        change = np.r_[True, (step[1:] != step[:-1]) | (micro[1:] != micro[:-1])]
        starts = np.flatnonzero(change)
        rel = np.arange(n) - starts[np.cumsum(change) - 1]
    else:
        rel = np.zeros(0, dtype=np.int64)
    return Colls(
        rows=rows,
        seq=seq[rows],
        step=step,
        micro=micro,
        op=c["op"][rows],
        pg=c["pg"][rows],
        reduce_op=c["reduce_op"][rows],
        tensor_start=c["tensor_start"][rows],
        tensor_count=c["tensor_count"][rows],
        rel=rel,
        pos_of_row=pos_of_row,
    )


def pg_names(r: RankTrace) -> dict[int, str]:
    return {int(g["pg"]): str(g.get("name", g["pg"])) for g in r.attrs.get("process_groups", []) or []}


def pg_ranks(r: RankTrace) -> dict[str, list[int]]:
    return {
        str(g.get("name", g["pg"])): list(g.get("ranks") or [])
        for g in r.attrs.get("process_groups", []) or []
    }


def name_of(names: list[str], code: int) -> str | None:
    return names[code] if 0 <= code < len(names) else None


def param_name(r: RankTrace, index: int) -> str | None:
    for snap in r.attrs.get("snapshots", []) or []:
        params = snap.get("params") or []
        if 0 <= index < len(params) and params[index]:
            return str(params[index][0])
    return None


def rank_steps_done(r: RankTrace) -> int:
    end = r.attrs.get("end")
    if isinstance(end, dict) and "steps" in end:
        return int(end["steps"])
    s = r.steps["step"]
    return int(s.max()) + 1 if len(s) else 0


def incomplete_ranks(trace: Trace, ranks: list[int] | None = None) -> list[dict[str, Any]]:
    """``[{"rank", "through_step", "reasons"}]`` for each rank whose record is not whole."""
    present = trace.ranks if ranks is None else [r for r in ranks if r in trace.ranks]
    out = []
    for rk in present:
        c = trace.rank(rk).completeness
        if not c["complete"]:
            out.append({"rank": rk, "through_step": c["through_step"], "reasons": c["reasons"]})
    return out


def checked_ranks(trace: Trace, ranks: list[int] | None = None) -> dict[int, RankTrace]:
    """The ranks an analysis reads, each with all its metadata read and checked first: an
    analysis reads only some columns, and must not answer from a rank whose others are damaged."""
    present = trace.ranks if ranks is None else [r for r in ranks if r in trace.ranks]
    out = {}
    for rk in present:
        r = trace.rank(rk)
        r.read_all()
        out[rk] = r
    return out


def record_notes(trace: Trace, ranks: list[int] | None = None, label: str = "") -> list[str]:
    """What an answer drawn from this trace must say about the trace itself: ranks it lacks,
    records that end early or lost something, damage the collector skipped."""
    present = trace.ranks if ranks is None else [r for r in ranks if r in trace.ranks]
    where = f" of trace {label}" if label else ""
    notes = []
    missing = sorted(set(range(trace.world_size or 0)) - set(trace.ranks))
    if missing:
        notes.append(f"ranks {missing} are missing from this trace{where}: nothing of theirs was collected")
    for x in incomplete_ranks(trace, present):
        notes.append(
            f"rank {x['rank']}'s record{where} is complete only through step {x['through_step']}: "
            + "; ".join(x["reasons"])
        )
    for rk in present:
        damage = trace.rank(rk).attrs.get("damage") or []
        if damage:
            notes.append(f"rank {rk}'s spool{where} was damaged ({len(damage)} places, first: {damage[0]})")
    return notes


def last_seen_wall_ns(r: RankTrace) -> int | None:
    """The wall-clock time of the last thing this rank's record shows it doing (a collective, a
    step, an ``alive`` mark, a wait), or None where the trace cannot tell (before format 3)."""
    t0 = r.meta.get("t0_wall_ns")
    if not isinstance(t0, int):
        return None
    times: list[int] = []
    c, s = r.collectives, r.steps
    if len(c):
        times.append(int((c["t_ns"] + np.maximum(c["dur_ns"], 0)).max()))
    if len(s):
        times.append(int(s["t_ns"].max()))
    alive = r.attrs.get("last_alive")
    if isinstance(alive, dict):
        times.append(int(alive["t_ns"]))
    times += [int(st["t_ns"]) + int(st["waited_ns"]) for st in r.attrs.get("stuck") or []]
    return t0 + max(times) if times else None


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 on a uint64 array (wrapping arithmetic)."""
    x = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def shape_hashes(r: RankTrace, shape_start: np.ndarray, ndim: np.ndarray) -> np.ndarray:
    """One uint64 per tensor for its shape (vectorized over all tensors)."""
    dims = r.table("shapes")["dim"]
    nd = ndim.astype(np.int64)
    out = mix64(nd.astype(np.uint64))
    total = int(nd.sum())
    if total:
        owner = np.repeat(np.arange(len(nd)), nd)
        off = np.arange(total) - np.repeat(np.cumsum(nd) - nd, nd)
        vals = dims[np.repeat(shape_start.astype(np.int64), nd) + off].astype(np.int64).view(np.uint64)
        np.add.at(out, owner, mix64(vals ^ mix64(off.astype(np.uint64) + np.uint64(1))))
    return out


def fmt_shape(r: RankTrace, start: int, ndim: int) -> list[int]:
    return list(r.shape(int(start), int(ndim)))


def hex64(x: int) -> str:
    return f"{int(x):016x}"


def expand(start: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Rows start[i] .. start[i]+count[i]-1 for every i, concatenated."""
    count = count.astype(np.int64)
    total = int(count.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    off = np.arange(total) - np.repeat(np.cumsum(count) - count, count)
    return np.repeat(start.astype(np.int64), count) + off


def first_true(mask: np.ndarray) -> int | None:
    hit = np.flatnonzero(mask)
    return int(hit[0]) if hit.size else None


def batch_name(ev: dict[str, Any]) -> str:
    """``batch 0 of DataLoader iterator #1``: a divergent batch, by its iterator (an evaluation
    loop's is not the training loop's)."""
    it = f" of DataLoader iterator #{ev['loader']}" if ev.get("loader") is not None else ""
    return f"batch {ev.get('batch_index')}{it}"
