"""Where a NaN or Inf first appeared, from the trace alone: ``fsdp-replay nan``.

``nonfinite_origin(trace)``: the first (step, rank, collective) where a NaN/Inf appeared, and each
rank's first non-finite event.

Findings are ordered by when their data was produced. Inside a rank: steps, then micro-batches
(``micro`` counts completed ``backward()`` calls), then the collectives in issue order (``seq``),
a collective's inputs before its outputs. A micro-batch's batch comes before its collectives (the
forward's all-gathers use it), and the parameters after step ``s`` come after every event of step
``s``. The loss of micro-batch ``k`` is computed after that micro-batch's forward and before its
backward. The trace does not time it, so it is placed by what it can feed: just before the first
collective of micro-batch ``k`` that *reduces* (reduce-scatter, reduce, all-reduce) a flagged input
(the backward of a bad loss feeds the gradients' reduction), and after every other collective of
the micro-batch. An all-gather's flagged input (FSDP's parameter shards) or output in the forward
is therefore named before the loss it made non-finite. A forward that itself reduces a flagged
tensor (tensor parallelism's all-reduce) is the one case this order gets wrong: the loss is then
named first.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fsdp_replay.analysis.columns import (
    AFTER_ALL_MICRO,
    batch_name,
    checked_ranks,
    fmt_shape,
    incomplete_ranks,
    issue_order,
    name_of,
    param_name,
    pg_names,
)
from fsdp_replay.trace.ops import ALL_GATHER, ALL_REDUCE, OPS, REDUCE, REDUCE_SCATTER
from fsdp_replay.trace.ops import info as op_info
from fsdp_replay.trace.reader import RankTrace, Trace
from fsdp_replay.trace.schema import ROLE_INPUT, ROLE_NAMES

# ops whose output reduces their inputs: the backward's gradient reductions (what a bad loss feeds)
_REDUCING_OPS = frozenset(op.name for op in OPS if op.family in (REDUCE_SCATTER, REDUCE, ALL_REDUCE))

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
    reducing = np.array([n in _REDUCING_OPS for n in ops] + [False])  # op code -> reduces (-1: no)
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
                "shape": fmt_shape(r, t["shape_start"][trow], t["ndim"][trow]),
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
            # after the forward: just before the first collective of that micro-batch that
            # reduces a flagged input (its backward's gradients), or after all of its collectives
            here = in_pos[(co.step[in_pos] == s) & (co.micro[in_pos] == m)]
            here = here[reducing[co.op[here]]]
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
            ev["batch_index"], ev["loader"] = int(b["index"][brow]), int(b["loader"][brow])
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
        return f"non-finite tensor {ev['tensor_index']} of {batch_name(ev)} at {where}"
    tensor = f"{ev['role']} {ev['tensor_index']}"
    if ev.get("dtype") is not None and ev.get("shape") is not None:
        tensor += f" ({ev['dtype']} {list(ev['shape'])})"
    return f"non-finite {tensor} of {ev['op']} (seq {ev['seq']}, process group {ev['pg']}) at {where}"


def _params_finite_after(r: RankTrace, step: int) -> bool | None:
    """Whether every parameter the rank recorded after step ``step`` was finite; None when that
    step's parameters are not in the trace."""
    st = r.steps
    rows = np.flatnonzero(st["step"] == step) if step >= 0 and len(st) else np.zeros(0, dtype=np.int64)
    if not rows.size:
        return None
    row = int(rows[-1])
    start, count = int(st["param_start"][row]), int(st["param_count"][row])
    if not count:
        return None
    return not bool(r.table("step_params")["nonfinite"][start : start + count].any())


def _cause(ev: dict[str, Any], rank: int, r: RankTrace) -> str:
    kind = ev["kind"]
    if kind == "collective output":
        return (
            f"every rank's inputs to {ev['op']} were finite: the collective's result itself is not "
            "(an overflowing reduction, or a NaN the flag cannot see in the inputs' sum)"
        )
    if kind == "collective input":
        cause = (
            f"rank {rank} fed a non-finite {ev['role']} into {ev['op']} (process group {ev['pg']}); "
            "the other ranks received it"
        )
        op = op_info(str(ev["op"]))
        step = int(ev["step"])
        if op is not None and op.family == ALL_GATHER and _params_finite_after(r, step - 1):
            cause += (
                f"; its parameters were all finite after step {step - 1}: if this input is its "
                "parameter shard (FSDP's all-gathers), the shard became non-finite after that "
                "optimizer step, outside the optimizer"
            )
        return cause
    if kind == "loss":
        return (
            f"rank {rank}'s own forward pass produced a non-finite loss "
            "(its batch and the collectives before it were finite)"
        )
    if kind == "batch":
        return f"rank {rank} drew a batch that already held non-finite values"
    return f"rank {rank}'s optimizer step produced non-finite parameters from finite gradients"


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
    cause = _cause(ev0, rank0, rts[rank0])
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
