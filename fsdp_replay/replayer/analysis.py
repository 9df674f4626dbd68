"""Post-mortem analysis of one trace, from the recorded metadata alone (numpy, no torch).

- ``nonfinite_origin(trace)``: the first (step, rank, collective) where a NaN/Inf appeared, and
  each rank's first non-finite event.
- ``desync_report(trace)``: for a hang (or any run), where each rank stopped, and the first
  position at which the ranks' collective sequences on one process group disagree.

Ordering of events inside a rank: steps, then micro-batches (``micro`` counts completed
``backward()`` calls), then the collective's position in issue order (``seq``). Batches are drawn
before anything else of their micro-batch; the parameters after step ``s`` come after every event
of step ``s``. The loss of micro-batch ``k`` is computed after that micro-batch's forward and
before its backward: it is placed just before the rank's first collective of micro-batch ``k``
whose *input* is flagged (the backward of a bad loss feeds the reduce-scatter), and after the
collectives whose outputs were flagged before that (a forward all-gather that brought NaNs in).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fsdp_replay.trace import schema
from fsdp_replay.trace.ops import P2P_OPS, SAME_SHAPE_OPS
from fsdp_replay.trace.reader import RankTrace, Trace
from fsdp_replay.trace.schema import ROLE_INPUT, ROLE_NAMES, ROLE_OUTPUT

__all__ = ["P2P_OPS", "ROLE_INPUT", "ROLE_NAMES", "ROLE_OUTPUT", "SAME_SHAPE_OPS"]
AFTER_ALL_MICRO = 1 << 30  # the micro key of "parameters after the step"


# -- shared helpers (also used by diff.py) ------------------------------------------------------
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


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 on a uint64 array (wrapping arithmetic)."""
    x = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def shape_hashes(r: RankTrace, shape_start: np.ndarray, ndim: np.ndarray) -> np.ndarray:
    """One uint64 per tensor for its shape (vectorized over all tensors)."""
    dims = r.table("shapes")["dim"]
    nd = ndim.astype(np.int64)
    out = _mix(nd.astype(np.uint64))
    total = int(nd.sum())
    if total:
        owner = np.repeat(np.arange(len(nd)), nd)
        off = np.arange(total) - np.repeat(np.cumsum(nd) - nd, nd)
        vals = dims[np.repeat(shape_start.astype(np.int64), nd) + off].astype(np.int64).view(np.uint64)
        np.add.at(out, owner, _mix(vals ^ _mix(off.astype(np.uint64) + np.uint64(1))))
    return out


def _fmt_shape(r: RankTrace, start: int, ndim: int) -> list[int]:
    return list(r.shape(int(start), int(ndim)))


# -- non-finite origin -------------------------------------------------------------------------
_KIND_ORDER = {
    "batch": 0,
    "loss": 0,
    "collective input": 1,
    "collective output": 2,
    "parameters after step": 0,
}


def _first_nonfinite(r: RankTrace, pgn: dict[int, str]) -> tuple[tuple[float, ...], dict[str, Any]] | None:
    """(ordering key, event) of the rank's first non-finite event, or None."""
    ops = r.names("op")
    cands: list[tuple[tuple[float, ...], dict[str, Any]]] = []
    co = issue_order(r)
    t = r.tensors
    coll_ev: dict[str, Any] | None = None
    in_pos = np.zeros(0, dtype=np.int64)  # positions of collectives with a flagged input
    if len(co) and len(t):
        nf = np.flatnonzero(t["nonfinite"])
        if nf.size:
            pos = co.pos_of_row[t["coll"][nf]]
            role = t["role"][nf].astype(np.int64)
            key = pos * 4 + role
            i = int(np.argmin(key))
            trow, p = int(nf[i]), int(pos[i])
            s, m = int(co.step[p]), int(co.micro[p])
            role_i = int(role[i])
            start = int(co.tensor_start[p])
            same_role = t["role"][start:trow] == role_i
            coll_ev = {
                "kind": "collective input" if role_i == ROLE_INPUT else "collective output",
                "step": s,
                "micro": m,
                "seq": int(co.seq[p]),
                "op": name_of(ops, int(co.op[p])),
                "pg": pgn.get(int(co.pg[p]), str(int(co.pg[p]))),
                "pg_id": int(co.pg[p]),
                "role": ROLE_NAMES.get(role_i, str(role_i)),
                "tensor_index": int(same_role.sum()),
                "dtype": name_of(r.names("dtype"), int(t["dtype"][trow])),
                "shape": _fmt_shape(r, t["shape_start"][trow], t["ndim"][trow]),
            }
            cands.append(((s, m, float(co.rel[p]), _KIND_ORDER[coll_ev["kind"]]), coll_ev))
            in_pos = pos[role == ROLE_INPUT]
    # losses: loss k of a step belongs to micro-batch k
    st = r.steps
    if len(st):
        values = r.table("losses")["value"]
        bad = np.flatnonzero(~np.isfinite(values))
        if bad.size:
            li = int(bad[0])
            starts, counts = st["loss_start"], st["loss_count"]
            srow = int(np.flatnonzero((starts <= li) & (li < starts + counts))[0])
            s, m = int(st["step"][srow]), li - int(starts[srow])
            # just before the first collective of that micro-batch with a flagged input, or
            # after all of its collectives
            here = in_pos[(co.step[in_pos] == s) & (co.micro[in_pos] == m)]
            if here.size:
                rel = float(co.rel[int(here.min())]) - 0.5
            else:
                rel = float(((co.step == s) & (co.micro == m)).sum())
            ev = {"kind": "loss", "step": s, "micro": m, "seq": None, "op": None, "pg": None, "pg_id": None}
            ev.update({"role": None, "tensor_index": None, "value": float(values[li])})
            cands.append(((s, m, rel, 0), ev))
        sp = r.table("step_params")
        pnf = sp["nonfinite"]
        if len(pnf) and pnf.any():
            pi = int(np.flatnonzero(pnf)[0])
            starts, counts = st["param_start"], st["param_count"]
            srow = int(np.flatnonzero((starts <= pi) & (pi < starts + counts))[0])
            s = int(st["step"][srow])
            idx = pi - int(starts[srow])
            ev = {"kind": "parameters after step", "step": s, "micro": None, "seq": None, "op": None}
            ev.update({"pg": None, "pg_id": None, "role": None, "tensor_index": idx})
            ev["param_name"] = param_name(r, idx)
            cands.append(((s, AFTER_ALL_MICRO, 0.0, 0), ev))
    b = r.batches
    if len(b):
        bt = r.batch_tensors
        nfb = np.flatnonzero(bt["nonfinite"]) if len(bt) else np.zeros(0, dtype=np.int64)
        if nfb.size:
            trow = int(nfb[0])
            brow = int(bt["batch"][trow])
            s, m = int(b["step"][brow]), int(b["micro"][brow])
            ev = {"kind": "batch", "step": s, "micro": m, "seq": None, "op": None, "pg": None, "pg_id": None}
            ev.update({"role": None, "tensor_index": trow - int(b["tensor_start"][brow])})
            ev["batch_index"] = int(b["index"][brow])
            cands.append(((s, m, -1.0, 0), ev))
    if not cands:
        return None
    return min(cands, key=lambda kv: kv[0])


def _nonfinite_steps(r: RankTrace) -> set[int]:
    steps: set[int] = set()
    t = r.tensors
    if len(t):
        rows = t["coll"][t["nonfinite"]]
        if rows.size:
            steps.update(np.unique(r.collectives["step"][rows]).tolist())
    st = r.steps
    if len(st):
        steps.update(st["step"][st["nonfinite"]].tolist())
    b = r.batches
    if len(b) and len(r.batch_tensors):
        rows = r.batch_tensors["batch"][r.batch_tensors["nonfinite"]]
        if rows.size:
            steps.update(np.unique(b["step"][rows]).tolist())
    return {int(s) for s in steps}


def describe_nonfinite(ev: dict[str, Any]) -> str:
    kind = ev["kind"]
    where = f"step {ev['step']}" + (f" micro-batch {ev['micro']}" if ev.get("micro") is not None else "")
    if kind == "loss":
        return f"non-finite loss ({ev.get('value')}) at {where}"
    if kind == "parameters after step":
        name = ev.get("param_name")
        return (
            f"non-finite parameter {ev['tensor_index']}{f' ({name})' if name else ''} after step {ev['step']}"
        )
    if kind == "batch":
        return f"non-finite batch tensor {ev['tensor_index']} at {where}"
    return f"non-finite {ev['role']} {ev['tensor_index']} of {ev['op']} (seq {ev['seq']}, pg {ev['pg']}) at {where}"


def nonfinite_origin(trace: Trace, ranks: list[int] | None = None) -> dict[str, Any] | None:
    """The first (step, rank, collective) where a non-finite value appeared, or None.

    Keys: ``rank``, ``step``, ``micro``, ``kind`` ("loss", "collective input", "collective
    output", "parameters after step", "batch"), ``seq``, ``op``, ``pg`` (the group's name, the
    same on every rank), ``pg_id`` (the rank's id for it), ``role``, ``tensor_index`` (among the
    collective's inputs or outputs, the parameter index, or the batch tensor index),
    ``dtype``/``shape`` (collectives), ``value``
    (losses), ``param_name``, ``co_origins`` (ranks whose first event is equally early),
    ``ranks_affected`` (ranks with any non-finite value at that step), ``cause`` and ``message``
    (one line each), and ``per_rank``: ``[{"rank", "event"}]`` with each rank's first event
    (``None`` for a rank that stayed finite), each with the same keys as the origin.
    """
    rts = checked_ranks(trace, ranks)
    present = list(rts)
    firsts: list[tuple[int, tuple[float, ...] | None, dict[str, Any] | None]] = []
    for rk, r in rts.items():
        got = _first_nonfinite(r, pg_names(r))
        firsts.append((rk, None, None) if got is None else (rk, got[0], {"rank": rk, **got[1]}))
    hits = [(key, rk, ev) for rk, key, ev in firsts if key is not None and ev is not None]
    if not hits:
        return None
    hits.sort(key=lambda h: (h[0], h[1]))
    key0, rank0, ev0 = hits[0]
    co = [rk for key, rk, _ in hits if key == key0 and rk != rank0]
    step0 = int(ev0["step"])
    affected = [rk for rk, r in rts.items() if step0 in _nonfinite_steps(r)]
    if ev0["kind"] == "collective output":
        cause = (
            f"every rank's inputs to {ev0['op']} were finite: the collective's result itself is not "
            "(an overflowing reduction, or a NaN the flag cannot see in the inputs' sum)"
        )
    elif ev0["kind"] == "collective input":
        cause = f"rank {rank0} fed a non-finite tensor into {ev0['op']}; the other ranks received it"
    elif ev0["kind"] == "loss":
        cause = f"rank {rank0}'s own forward pass produced a non-finite loss (its inputs were finite)"
    elif ev0["kind"] == "batch":
        cause = f"rank {rank0} drew a batch that already held non-finite values"
    else:
        cause = f"rank {rank0}'s optimizer step produced non-finite parameters from finite gradients"
    msg = f"first non-finite value: rank {rank0}, {describe_nonfinite(ev0)}"
    if co:
        msg += f" (ranks {co} at the same point)"
    msg += f"; ranks affected at step {step0}: {affected}"
    blind = [x for x in incomplete_ranks(trace, present) if x["through_step"] < step0]
    if blind:
        msg += (
            "; first in what was recorded: the records of "
            + ", ".join(f"rank {x['rank']} (complete through step {x['through_step']})" for x in blind)
            + " end earlier, so an earlier non-finite value there would not be seen"
        )
    return {
        **{k: v for k, v in ev0.items()},
        "co_origins": co,
        "ranks_affected": affected,
        "cause": cause,
        "message": msg,
        "per_rank": [{"rank": rk, "event": ev} for rk, _, ev in firsts],
    }


# -- desync ------------------------------------------------------------------------------------
def _signatures(
    r: RankTrace, co: Colls, op_gid: np.ndarray, red_gid: np.ndarray, dt_lut: np.ndarray
) -> np.ndarray:
    """A uint64 per collective (issue order) over op, reduce op, tensor count, roles, dtypes, and
    the shapes of ops whose shapes agree across the group."""
    n = len(co)
    t = r.tensors
    sig = np.zeros(n, dtype=np.uint64)
    if n and len(t):
        strict = np.array([o in SAME_SHAPE_OPS for o in r.names("op")] + [False], dtype=bool)
        pos = co.pos_of_row[t["coll"]]
        keep = pos >= 0  # tensors of collectives left out (a record cut before its end)
        pos, rows = pos[keep], np.flatnonzero(keep)
        idx = rows - co.tensor_start[pos]
        th = _mix(
            t["role"][rows].astype(np.uint64) * np.uint64(7919) + dt_lut[t["dtype"][rows]].astype(np.uint64)
        )
        sh = shape_hashes(r, t["shape_start"][rows], t["ndim"][rows])
        th = np.where(strict[co.op[pos]], th ^ sh, th)
        np.add.at(sig, pos, _mix(th ^ _mix(idx.astype(np.uint64))))
    head = (
        op_gid.astype(np.uint64) * np.uint64(0x100000001B3)
        ^ (red_gid + 1).astype(np.uint64) * np.uint64(0x9E3779B1)
        ^ co.tensor_count.astype(np.uint64)
    )
    return _mix(sig ^ _mix(head))


@dataclass
class _RankCtx:
    rank: int
    r: RankTrace
    co: Colls
    ops: list[str]
    pgn: dict[int, str]
    sig: np.ndarray
    op_gid: np.ndarray
    inflight: dict[str, Any] | None  # entry of the in-flight collective
    inflight_pg: int
    inflight_gid: int
    t0_wall_ns: int | None  # wall-clock time of the rank's t_ns == 0 (format 3)
    last_seen_ns: int | None  # wall-clock time of the last thing its record shows
    cut: int | None  # its record is complete only through this step, before where it ends
    killed: bool  # its process never closed its spool

    def issued_wall_ns(self, pos: int | None) -> int | None:
        """When the collective at issue-order position ``pos`` (None: the in-flight one) was
        issued, in wall-clock ns."""
        if self.t0_wall_ns is None:
            return None
        if pos is not None:
            return self.t0_wall_ns + int(self.r.collectives["t_ns"][int(self.co.rows[pos])])
        if self.inflight is not None:
            return self.t0_wall_ns + int(self.inflight.get("t_ns", 0))
        return None

    def entry(self, p: int, *, signature: bool = False) -> dict[str, Any]:
        co = self.co
        e = {
            "seq": int(co.seq[p]),
            "step": int(co.step[p]),
            "micro": int(co.micro[p]),
            "op": name_of(self.ops, int(co.op[p])),
            "pg": self.pgn.get(int(co.pg[p]), str(int(co.pg[p]))),
            "in_flight": False,
        }
        if signature:
            e["signature"] = self.signature_text(p)
        return e

    def signature_text(self, p: int) -> str:
        t, co, r = self.r.tensors, self.co, self.r
        start, count = int(co.tensor_start[p]), int(co.tensor_count[p])
        dts = r.names("dtype")
        parts = []
        for row in range(start, start + count):
            role = "i" if int(t["role"][row]) == ROLE_INPUT else "o"
            parts.append(
                f"{role}:{name_of(dts, int(t['dtype'][row]))}{_fmt_shape(r, t['shape_start'][row], t['ndim'][row])}"
            )
        red = name_of(r.names("reduce_op"), int(co.reduce_op[p]))
        return f"{name_of(self.ops, int(co.op[p]))}{f'({red})' if red else ''} [{', '.join(parts)}]"

    @property
    def final(self) -> dict[str, Any] | None:
        if self.inflight is not None:
            return self.inflight
        return self.entry(len(self.co) - 1) if len(self.co) else None


def _rank_ctx(rk: int, r: RankTrace, intern: Interner) -> _RankCtx:
    co = issue_order(r)
    comp = r.completeness
    # Records lost before the end (damage, a gap): compare only what is whole.
    cut = None if comp["prefix"] else int(comp["through_step"])
    if cut is not None:
        keep = co.step <= cut
        co = Colls(**{k: (v[keep] if k != "pos_of_row" else v) for k, v in vars(co).items()})
        co.pos_of_row = np.full(len(r.collectives), -1, dtype=np.int64)
        co.pos_of_row[co.rows] = np.arange(len(co.rows))
    ops = r.names("op")
    pgn = pg_names(r)
    op_gid = intern.lut(ops)[co.op]
    red = intern.lut(["reduce:" + x for x in r.names("reduce_op")])[co.reduce_op]
    sig = _signatures(r, co, op_gid, red, intern.lut(["dtype:" + x for x in r.names("dtype")]))
    end = r.attrs.get("end")
    raw = end.get("inflight") if isinstance(end, dict) else None
    stuck = r.attrs.get("stuck") or []
    if raw is None and stuck:
        # A rank killed while it waited (SIGKILL, or a signal its blocked thread could not take):
        # the writer thread noted the collective it had waited in for a while.
        raw = stuck[-1]
    inflight = None
    ipg, igid = -2, -1
    seen_seq = (
        int(raw.get("seq", -1)) in set(co.seq.tolist()[-8:]) if isinstance(raw, dict) and len(co) else False
    )
    if isinstance(raw, dict) and not seen_seq and cut is None:
        ipg = int(raw.get("pg", -1))
        igid = intern(str(raw.get("op")))
        inflight = {
            "seq": int(raw.get("seq", -1)),
            "step": int(raw.get("step", -1)),
            "micro": None,
            "op": raw.get("op"),
            "pg": pgn.get(ipg, str(ipg)),
            "in_flight": True,
            "t_ns": int(raw.get("t_ns", 0)),
        }
    t0 = r.meta.get("t0_wall_ns")
    return _RankCtx(
        rk,
        r,
        co,
        ops,
        pgn,
        sig,
        op_gid,
        inflight,
        ipg,
        igid,
        t0 if isinstance(t0, int) else None,
        last_seen_wall_ns(r),
        cut,
        r.attrs.get("end") is None,
    )


def _deviation(ctx: _RankCtx, intern: Interner) -> dict[str, Any] | None:
    """Where the rank's last step departs from its previous step's (op, pg) pattern.

    Used to tell which side of a two-rank disagreement is odd. Compared only when the previous
    step is not step 0 (step 0 has no preceding optimizer step, so its pattern differs).
    """
    co = ctx.co
    steps = co.step.tolist()
    pat = list(zip(steps, ctx.op_gid.tolist(), co.pg.tolist(), strict=True))
    if ctx.inflight is not None:
        pat.append((ctx.inflight["step"], ctx.inflight_gid, ctx.inflight_pg))
    if not pat:
        return None
    last = pat[-1][0]
    if last - 1 < 1:
        return None
    cur = [(o, g) for s, o, g in pat if s == last]
    prev = [(o, g) for s, o, g in pat if s == last - 1]
    if not prev:
        return None
    names = {v: k for k, v in intern.ids.items()}
    for i, (o, g) in enumerate(cur):
        if i >= len(prev) or prev[i] != (o, g):
            exp = None if i >= len(prev) else {"op": names.get(prev[i][0]), "pg": ctx.pgn.get(prev[i][1])}
            return {
                "step": last,
                "index": i,
                "expected": exp,
                "got": {"op": names.get(o), "pg": ctx.pgn.get(g, str(g))},
                "message": f"collective {i} of step {last} is {names.get(o)} on pg {ctx.pgn.get(g, g)}"
                + (
                    f"; in step {last - 1} it was {exp['op']} on pg {exp['pg']}"
                    if exp
                    else f"; step {last - 1} had only {len(prev)}"
                ),
            }
    return None


def _unrecorded(ctx: _RankCtx, issued_ns: int | None) -> str | None:
    """Why a rank that shows no collective at some position may still have issued it (its
    record ends too early to tell), or None when its record shows it did not."""
    if ctx.cut is not None:
        return f"its record is complete only through step {ctx.cut}"
    if ctx.r.attrs.get("agent_errors"):
        return "the agent stopped recording it"
    if not ctx.killed or ctx.inflight is not None:
        return None  # it closed its trace, or it was waiting in another collective: it never did
    if ctx.last_seen_ns is None or issued_ns is None:
        return "it was killed before closing its trace, and the trace is too old to tell more"
    if ctx.last_seen_ns >= issued_ns + schema.STUCK_AFTER_NS:
        return None  # still recording well after the others issued it: it never did
    lag = (issued_ns - ctx.last_seen_ns) / 1e9
    return (
        f"it was killed before closing its trace, and its last recorded event is {lag:+.2f} s from "
        "when the others issued it: events that had not reached the disk were lost"
    )


def _entry_text(e: dict[str, Any]) -> str:
    what = e.get("signature") or e["op"]
    return f"{what} (step {e['step']}, seq {e['seq']}{', in flight' if e.get('in_flight') else ''})"


def _plural(xs: list[int]) -> str:
    return f"rank {xs[0]}" if len(xs) == 1 else f"ranks {xs}"


def _group_mismatch(
    name: str,
    want: list[int],
    ctxs: dict[int, _RankCtx],
    sels: dict[int, np.ndarray],
    deviations: dict[int, dict[str, Any]],
) -> dict[str, Any] | None:
    deviants = set(deviations)
    rks = [rk for rk in want if rk in sels] or sorted(sels)
    on_group = {
        rk: ctxs[rk].inflight is not None and ctxs[rk].pgn.get(ctxs[rk].inflight_pg) == name for rk in rks
    }
    lens = {rk: len(sels[rk]) for rk in rks}
    n_min = min(lens.values())
    ref = ctxs[rks[0]].sig[sels[rks[0]][:n_min]]
    diff = np.zeros(n_min, dtype=bool)
    for rk in rks[1:]:
        diff |= ctxs[rk].sig[sels[rk][:n_min]] != ref
    hit = np.flatnonzero(diff)

    def entry(rk: int, p: int) -> dict[str, Any] | None:
        if p < lens[rk]:
            return ctxs[rk].entry(int(sels[rk][p]), signature=True)
        if p == lens[rk] and on_group[rk]:
            return ctxs[rk].inflight
        return None

    if hit.size:
        p = int(hit[0])
    else:
        p = n_min
        while True:
            es = [entry(rk, p) for rk in rks]
            if all(e is None for e in es):
                return None  # every rank ended the group at the same place
            if any(e is None for e in es):
                break
            ops = {e["op"] for e in es if e is not None}
            if len(ops) > 1:
                break
            if all(e is not None and e["in_flight"] for e in es):
                return None  # all ranks inside the same collective: a hang in it, not a disagreement
            p += 1  # some completed it, others are inside it: did the former go on?
    entries = {rk: entry(rk, p) for rk in rks}
    issued = [rk for rk in rks if entries[rk] is not None]
    never = [rk for rk in rks if entries[rk] is None]
    if never and issued:
        times = [ctxs[rk].issued_wall_ns(int(sels[rk][p]) if p < lens[rk] else None) for rk in issued]
        first_issue = min((t for t in times if t is not None), default=None)
        unrecorded = {rk: _unrecorded(ctxs[rk], first_issue) for rk in never}
        if all(unrecorded.values()):
            # Not a disagreement: those ranks' records end where they could still have issued it.
            why = "; ".join(f"rank {rk}: {w}" for rk, w in unrecorded.items())
            e0 = entries[issued[0]]
            assert e0 is not None
            return {
                "pg": name,
                "pg_ranks": want,
                "position": p,
                "kind": "unrecorded",
                "issued": issued,
                "never": never,
                "message": f"pg {name} position {p}: {_plural(issued)} issued {_entry_text(e0)}; "
                f"the record of {_plural(never)} ends before it could show whether {'they' if len(never) > 1 else 'it'} "
                f"did ({why})",
                "_order": (int(e0["step"]), int(e0["seq"]), 1, name),
            }
    tie_suspects = [rk for rk in rks if rk in deviants] if 0 < len(deviants & set(rks)) < len(rks) else []
    if not never:
        kind = "mismatch"
        full = all(not e["in_flight"] for e in entries.values() if e is not None)
        by: dict[str, list[int]] = {}
        for rk in rks:
            e = entries[rk]
            assert e is not None
            by.setdefault(e["signature"] if full else str(e["op"]), []).append(rk)
        sizes = sorted((len(v) for v in by.values()), reverse=True)
        if len(sizes) > 1 and sizes[0] > sizes[1]:
            major = max(by.values(), key=len)
            suspects = [rk for rk in rks if rk not in major]
        else:
            suspects = tie_suspects
        parts = []
        for v in by.values():
            e0 = entries[v[0]]
            assert e0 is not None
            parts.append(f"{_plural(v)} issued {_entry_text(e0)}")
        message = f"pg {name} (ranks {want}) position {p}: ranks disagree: " + "; ".join(parts)
    else:
        kind = "missing"
        suspects = tie_suspects or list(never)
        e0 = entries[issued[0]]
        assert e0 is not None
        moved = []
        for rk in never:
            f = ctxs[rk].final
            if f is None:
                moved.append(f"rank {rk} issued no collective at all")
            else:
                verb = "is stuck in" if f.get("in_flight") else "last completed"
                text = f"rank {rk} {verb} {f['op']} on pg {f['pg']} (step {f['step']}, seq {f['seq']})"
                if ctxs[rk].r.attrs.get("end") is None:
                    text += " and was killed before closing its trace, so what it was waiting in is unknown"
                moved.append(text)
        message = (
            f"pg {name} (ranks {want}) position {p}: {_plural(issued)} issued {_entry_text(e0)}, "
            f"{_plural(never)} never did; " + "; ".join(moved)
        )
    if suspects:
        message += f" (suspect: {_plural(suspects)}"
        devs = [deviations[rk] for rk in suspects if rk in deviations]
        if devs:
            message += f"; {devs[0]['message']}"
        message += ")"
    live = [e for e in entries.values() if e is not None]
    blame = 0 if (kind == "missing" and suspects and set(never) <= set(suspects)) else 1
    return {
        "pg": name,
        "pg_ranks": want,
        "position": p,
        "kind": kind,
        "entries": {str(rk): e for rk, e in entries.items()},
        "issued": issued,
        "never": never,
        "moved_on": {str(rk): ctxs[rk].final for rk in never},
        "suspects": suspects,
        "message": message,
        "_order": (min(e["step"] for e in live), min(e["seq"] for e in live), blame, name),
    }


def desync_report(trace: Trace, ranks: list[int] | None = None) -> dict[str, Any]:
    """Where each rank stopped, and the first collective at which the ranks disagree.

    Keys: ``ranks``: ``[{"rank", "steps_done", "end" ("exit", "SIGTERM", or None when the process
    never closed its trace: SIGKILL, a crash), "collectives" (completed), "last_completed" and
    "in_flight" (``{"seq", "step", "micro", "op", "pg", "in_flight"}`` or None; ``pg`` is the group's
    name), "deviation" (where its last step departs from its previous step's pattern, or None)}]``;
    ``groups``: per process group, matched across ranks by name: ``{"pg", "ranks",
    "missing_ranks", "completed" ({rank: count}), "mismatch"}``; ``first_mismatch``: the earliest
    group mismatch or None: ``{"pg", "pg_ranks", "position" (group-local index), "kind"
    ("mismatch": different collectives, "missing": some ranks never issued it), "entries" ({rank:
    entry or None}), "issued", "never", "moved_on" ({rank: its final entry}), "suspects",
    "message"}``; ``consistent`` (no mismatch), ``stuck`` (ranks with an in-flight collective),
    ``missing_ranks`` (of the world, no data), ``message``.
    """
    rts = checked_ranks(trace, ranks)
    present = list(rts)
    intern = Interner()
    ctxs = {rk: _rank_ctx(rk, r, intern) for rk, r in rts.items()}
    deviations: dict[int, dict[str, Any]] = {}
    for rk, ctx in ctxs.items():
        dev = _deviation(ctx, intern)
        if dev is not None:
            deviations[rk] = dev
    members: dict[str, list[int]] = {}
    sels: dict[str, dict[int, np.ndarray]] = {}
    for rk, ctx in ctxs.items():
        p2p = np.array([o in P2P_OPS for o in ctx.ops] + [False], dtype=bool)[ctx.co.op]
        for name, rs in pg_ranks(ctx.r).items():
            if rs and name not in members:
                members[name] = rs
        for pg_id, name in [(-1, "none"), *ctx.pgn.items()]:
            sel = np.flatnonzero((ctx.co.pg == pg_id) & ~p2p)
            if pg_id == -1 and not sel.size:
                continue
            sels.setdefault(name, {})[rk] = sel
    per_rank: list[dict[str, Any]] = [
        {
            "rank": rk,
            "steps_done": rank_steps_done(ctx.r),
            "end": (ctx.r.attrs.get("end") or {}).get("reason"),
            "collectives": len(ctx.co),
            "last_completed": ctx.entry(len(ctx.co) - 1) if len(ctx.co) else None,
            "in_flight": ctx.inflight,
            "deviation": deviations.get(rk),
        }
        for rk, ctx in ctxs.items()
    ]
    groups: list[dict[str, Any]] = []
    mismatches: list[dict[str, Any]] = []
    unrecorded: list[dict[str, Any]] = []
    for name, by_rank in sels.items():
        want = members.get(name) or sorted(by_rank)
        mm = _group_mismatch(name, want, ctxs, by_rank, deviations)
        if mm is not None and mm["kind"] == "unrecorded":
            mm.pop("_order")
            unrecorded.append(mm)
            mm = None
        if mm is not None:
            mismatches.append(mm)
        groups.append(
            {
                "pg": name,
                "ranks": want,
                "missing_ranks": [rk for rk in want if rk not in by_rank],
                "completed": {str(rk): len(sel) for rk, sel in by_rank.items()},
                "mismatch": mm,
            }
        )
    first = min(mismatches, key=lambda m: m["_order"]) if mismatches else None
    for m in mismatches:
        m.pop("_order")
    stuck = [pr["rank"] for pr in per_rank if pr["in_flight"] is not None]
    if first is not None:
        message = first["message"]
    elif stuck:
        inside = ", ".join(
            f"rank {pr['rank']}: {pr['in_flight']['op']}" for pr in per_rank if pr["in_flight"]
        )
        message = f"ranks agree on every collective; still inside a collective when the run ended: {inside}"
    else:
        message = "ranks agree on every completed collective of every process group"
    if len({pr["steps_done"] for pr in per_rank}) > 1:
        message += "; steps completed: " + ", ".join(
            f"rank {pr['rank']}: {pr['steps_done']}" for pr in per_rank
        )
    return {
        "trace": trace.url,
        "ranks": per_rank,
        "missing_ranks": sorted(set(range(trace.world_size or 0)) - set(trace.ranks)),
        "groups": groups,
        "first_mismatch": first,
        "consistent": first is None,
        "stuck": stuck,
        "unrecorded": unrecorded,
        "notes": record_notes(trace, present),
        "message": message,
    }
