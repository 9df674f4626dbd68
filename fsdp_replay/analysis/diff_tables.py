"""The table-by-table comparison behind ``diff``: collectives, steps and batches of one rank in two
traces, each walked in issue order with numpy; ``diff.py`` orders what they find."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fsdp_replay.analysis.columns import (
    AFTER_ALL_MICRO,
    Colls,
    Interner,
    expand,
    first_true,
    hex64,
    issue_order,
    name_of,
    param_name,
    pg_names,
    shape_hashes,
)
from fsdp_replay.analysis.payloads import magnitude
from fsdp_replay.trace.ops import RECEIVED_OFF_ROOT
from fsdp_replay.trace.reader import RankTrace
from fsdp_replay.trace.schema import ROLE_INPUT, ROLE_NAMES, ROLE_OBJECTS


@dataclass
class Side:
    r: RankTrace
    co: Colls
    pgn: dict[int, str]
    ops: list[str]
    dtypes: list[str]
    algos: list[str]


def side_of(r: RankTrace) -> Side:
    return Side(r, issue_order(r), pg_names(r), r.names("op"), r.names("dtype"), r.names("algo"))


def coll_info(s: Side, p: int) -> dict[str, Any]:
    co = s.co
    t = s.r.tensors
    start, count = int(co.tensor_start[p]), int(co.tensor_count[p])
    tensors = []
    for row in range(start, start + count):
        role = ROLE_NAMES.get(int(t["role"][row]), "?")
        tensors.append(
            f"{role[:1]}:{name_of(s.dtypes, int(t['dtype'][row]))}{list(s.r.shape(int(t['shape_start'][row]), int(t['ndim'][row])))}"
        )
    return {
        "seq": int(co.seq[p]),
        "step": int(co.step[p]),
        "micro": int(co.micro[p]),
        "op": name_of(s.ops, int(co.op[p])),
        "pg": s.pgn.get(int(co.pg[p]), str(int(co.pg[p]))),
        "reduce_op": name_of(s.r.names("reduce_op"), int(co.reduce_op[p])),
        "tensors": tensors,
    }


def not_data(s: Side, rows: np.ndarray, owner: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The tensor rows that are not the program's data, so two runs may differ there: the receive
    buffers of a broadcast this rank is not the root of, and the pickled bytes of an object
    collective (they embed storage addresses; its ``objects sent`` rows are compared instead)."""
    t = s.r.tensors
    role = t["role"][rows]
    colls = s.r.collectives
    coll_rows = s.co.rows[positions]
    group_rank = {
        int(g["pg"]): int(g.get("group_rank", -1)) for g in s.r.attrs.get("process_groups", []) or []
    }
    receiving = np.zeros(len(positions), dtype=bool)
    bcast = [i for i, name in enumerate(s.ops) if name in RECEIVED_OFF_ROOT]
    if bcast:
        roots = colls["root"][coll_rows]
        mine = np.array(
            [group_rank.get(int(pg), -2) for pg in colls["pg"][coll_rows].tolist()], dtype=np.int64
        )
        receiving = np.isin(colls["op"][coll_rows], bcast) & (roots >= 0) & (roots != mine)
    objects = np.zeros(len(positions), dtype=bool)
    has_objects = role == ROLE_OBJECTS
    if has_objects.any():
        objects[np.unique(owner[has_objects])] = True
    return (receiving[owner] & (role == ROLE_INPUT)) | (objects[owner] & ~has_objects)


def align_start(a: Side, b: Side) -> tuple[int, int]:
    """Skip the leading collectives of the trace that starts at an earlier step (a partial replay)."""
    if not len(a.co) or not len(b.co):
        return 0, 0
    sa, sb = int(a.co.step[0]), int(b.co.step[0])
    if sa < sb:
        return int(np.searchsorted(a.co.step, sb)), 0
    if sb < sa:
        return 0, int(np.searchsorted(b.co.step, sa))
    return 0, 0


def diff_collectives(a: Side, b: Side, intern: Interner) -> dict[str, Any]:
    oa, ob = align_start(a, b)
    ca, cb = a.co, b.co
    n = min(len(ca) - oa, len(cb) - ob)
    ia, ib = np.arange(oa, oa + n), np.arange(ob, ob + n)

    def g(names: list[str], codes: np.ndarray, prefix: str) -> np.ndarray:
        return intern.lut([prefix + x for x in names])[codes]

    pga = [a.pgn.get(i, str(i)) for i in range(max(a.pgn, default=-1) + 1)]
    pgb = [b.pgn.get(i, str(i)) for i in range(max(b.pgn, default=-1) + 1)]
    struct = (
        (g(a.ops, ca.op[ia], "op:") != g(b.ops, cb.op[ib], "op:"))
        | (g(pga, ca.pg[ia], "pg:") != g(pgb, cb.pg[ib], "pg:"))
        | (
            g(a.r.names("reduce_op"), ca.reduce_op[ia], "r:")
            != g(b.r.names("reduce_op"), cb.reduce_op[ib], "r:")
        )
        | (ca.tensor_count[ia] != cb.tensor_count[ib])
        | (ca.step[ia] != cb.step[ib])
        | (ca.micro[ia] != cb.micro[ib])
    )
    s_idx = first_true(struct)
    m = n if s_idx is None else s_idx  # tensors align up to the first structural difference
    ta, tb = a.r.tensors, b.r.tensors
    rows_a = expand(ca.tensor_start[oa : oa + m], ca.tensor_count[oa : oa + m])
    rows_b = expand(cb.tensor_start[ob : ob + m], cb.tensor_count[ob : ob + m])
    owner = np.repeat(np.arange(m), ca.tensor_count[oa : oa + m].astype(np.int64))
    t_struct = np.zeros(len(rows_a), dtype=bool)
    t_value = np.zeros(len(rows_a), dtype=bool)
    if len(rows_a):
        ra_role, rb_role = ta["role"][rows_a], tb["role"][rows_b]
        t_struct = (
            (ra_role != rb_role)
            | (g(a.dtypes, ta["dtype"][rows_a], "dt:") != g(b.dtypes, tb["dtype"][rows_b], "dt:"))
            | (ta["ndim"][rows_a] != tb["ndim"][rows_b])
            | (ta["nbytes"][rows_a] != tb["nbytes"][rows_b])
            | (
                shape_hashes(a.r, ta["shape_start"][rows_a], ta["ndim"][rows_a])
                != shape_hashes(b.r, tb["shape_start"][rows_b], tb["ndim"][rows_b])
            )
        )
        t_value = (ta["fp"][rows_a] != tb["fp"][rows_b]) | (
            g(a.algos, ta["algo"][rows_a], "al:") != g(b.algos, tb["algo"][rows_b], "al:")
        )
    bad = t_struct | t_value
    if len(rows_a):
        positions = np.arange(oa, oa + m)
        bad &= ~(not_data(a, rows_a, owner, positions) | not_data(b, rows_b, owner, np.arange(ob, ob + m)))
    k = first_true(bad)
    out: dict[str, Any] = {"compared": n, "a_total": len(ca), "b_total": len(cb), "offset": [oa, ob]}
    # the first differing input per (step, micro), for placing the losses
    first_input: dict[tuple[int, int], int] = {}
    if len(rows_a):
        ins = np.flatnonzero(bad & (ta["role"][rows_a] == ROLE_INPUT))
        for q in np.unique(owner[ins]).tolist()[:64]:
            key = (int(ca.step[oa + q]), int(ca.micro[oa + q]))
            first_input.setdefault(key, int(ca.rel[oa + q]))
    out["first_input_rel"] = first_input
    if k is None and s_idx is None:
        out["first"] = None
        return out
    if k is not None and (s_idx is None or int(owner[k]) < s_idx):
        q = int(owner[k])
        pa, pb = oa + q, ob + q
        row_a, row_b = int(rows_a[k]), int(rows_b[k])
        role = int(ta["role"][row_a])
        start = int(ca.tensor_start[pa])
        idx = int((ta["role"][start:row_a] == role).sum())
        info = coll_info(a, pa)
        dt = name_of(a.dtypes, int(ta["dtype"][row_a]))
        ev: dict[str, Any] = {
            "kind": "collective" if not t_struct[k] else "collective tensor shape/dtype",
            "step": info["step"],
            "micro": info["micro"],
            "seq": info["seq"],
            "seq_b": int(cb.seq[pb]),
            "op": info["op"],
            "pg": info["pg"],
            "role": ROLE_NAMES.get(role, "?"),
            "tensor_index": idx,
            "dtype": dt,
            "shape": list(a.r.shape(int(ta["shape_start"][row_a]), int(ta["ndim"][row_a]))),
            "fp_a": hex64(ta["fp"][row_a]),
            "fp_b": hex64(tb["fp"][row_b]),
            "algo": name_of(a.algos, int(ta["algo"][row_a])),
            "rel": int(ca.rel[pa]),
            "_rows": (row_a, row_b),
        }
        if t_struct[k]:
            ev["a"], ev["b"] = info, coll_info(b, pb)
        out["first"] = ev
    else:
        assert s_idx is not None
        pa, pb = oa + s_idx, ob + s_idx
        ia_, ib_ = coll_info(a, pa), coll_info(b, pb)
        out["first"] = {
            "kind": "collective sequence",
            "step": min(ia_["step"], ib_["step"]),
            "micro": ia_["micro"] if ia_["step"] <= ib_["step"] else ib_["micro"],
            "seq": ia_["seq"],
            "seq_b": ib_["seq"],
            "op": ia_["op"],
            "pg": ia_["pg"],
            "role": None,
            "tensor_index": None,
            "a": ia_,
            "b": ib_,
            "rel": int(ca.rel[pa]),
        }
    return out


def diff_steps(a: Side, b: Side) -> dict[str, Any]:
    sa, sb = a.r.steps, b.r.steps
    stp_a, stp_b = sa["step"], sb["step"]
    # align on the first common step number (a replay may start later)
    oa = int(np.searchsorted(stp_a, stp_b[0])) if len(stp_a) and len(stp_b) and stp_b[0] > stp_a[0] else 0
    ob = int(np.searchsorted(stp_b, stp_a[0])) if len(stp_a) and len(stp_b) and stp_a[0] > stp_b[0] else 0
    m = min(len(stp_a) - oa, len(stp_b) - ob)
    ia, ib = np.arange(oa, oa + m), np.arange(ob, ob + m)
    struct = (
        (stp_a[ia] != stp_b[ib])
        | (sa["param_count"][ia] != sb["param_count"][ib])
        | (sa["loss_count"][ia] != sb["loss_count"][ib])
    )
    s_idx = first_true(struct)
    mm = m if s_idx is None else s_idx
    steps = stp_a[oa : oa + mm]
    out: dict[str, Any] = {"compared": m, "a_total": len(stp_a), "b_total": len(stp_b)}
    # parameters
    pa = expand(sa["param_start"][oa : oa + mm], sa["param_count"][oa : oa + mm])
    pb = expand(sb["param_start"][ob : ob + mm], sb["param_count"][ob : ob + mm])
    owner = np.repeat(np.arange(mm), sa["param_count"][oa : oa + mm].astype(np.int64))
    pdiff = np.zeros(len(pa), dtype=bool)
    if len(pa):
        fa, fb = a.r.table("step_params"), b.r.table("step_params")
        pdiff = (fa["fp"][pa] != fb["fp"][pb]) | (fa["algo"][pa] != fb["algo"][pb])
    params_differing = np.bincount(owner[pdiff], minlength=mm) if mm else np.zeros(0, dtype=np.int64)
    # losses
    la = expand(sa["loss_start"][oa : oa + mm], sa["loss_count"][oa : oa + mm])
    lb = expand(sb["loss_start"][ob : ob + mm], sb["loss_count"][ob : ob + mm])
    lowner = np.repeat(np.arange(mm), sa["loss_count"][oa : oa + mm].astype(np.int64))
    va = a.r.table("losses")["value"][la] if len(la) else np.zeros(0)
    vb = b.r.table("losses")["value"][lb] if len(lb) else np.zeros(0)
    ldiff = ~((va == vb) | (np.isnan(va) & np.isnan(vb)))
    with np.errstate(all="ignore"):
        suma = np.bincount(lowner, weights=va, minlength=mm) if mm else np.zeros(0)
        sumb = np.bincount(lowner, weights=vb, minlength=mm) if mm else np.zeros(0)
        loss_abs = np.abs(suma - sumb)
    if mm:
        loss_abs[np.bincount(lowner[ldiff], minlength=mm) == 0] = 0.0  # equal (NaN == NaN too)
    out["drift"] = {
        "step": steps.tolist(),
        "params_differing": params_differing.tolist(),
        "params_total": sa["param_count"][oa : oa + mm].tolist(),
        "loss_abs_diff": [float(x) for x in loss_abs],
    }
    firsts: list[dict[str, Any]] = []
    k = first_true(ldiff)
    if k is not None:
        q = int(lowner[k])
        micro = int(la[k] - sa["loss_start"][oa + q])
        x, y = float(va[k]), float(vb[k])
        with np.errstate(all="ignore"):
            rel = abs(x - y) / max(abs(x), abs(y)) if max(abs(x), abs(y)) > 0 else None
        firsts.append(
            {
                "kind": "loss",
                "step": int(steps[q]),
                "micro": micro,
                "seq": None,
                "op": None,
                "pg": None,
                "role": None,
                "tensor_index": micro,
                "loss_a": x,
                "loss_b": y,
                "magnitude": {"abs_diff": abs(x - y), "rel_diff": rel},
            }
        )
    k = first_true(pdiff)
    if k is not None:
        q = int(owner[k])
        idx = int(pa[k] - sa["param_start"][oa + q])
        fa, fb = a.r.table("step_params"), b.r.table("step_params")
        firsts.append(
            {
                "kind": "parameters after step",
                "step": int(steps[q]),
                "micro": None,
                "seq": None,
                "op": None,
                "pg": None,
                "role": None,
                "tensor_index": idx,
                "param_name": param_name(a.r, idx),
                "params_differing": int(params_differing[q]),
                "fp_a": hex64(fa["fp"][pa[k]]),
                "fp_b": hex64(fb["fp"][pb[k]]),
            }
        )
    if s_idx is not None:
        q = s_idx
        firsts.append(
            {
                "kind": "step structure",
                "step": int(min(stp_a[oa + q], stp_b[ob + q])),
                "micro": None,
                "seq": None,
                "op": None,
                "pg": None,
                "role": None,
                "tensor_index": None,
                "a": {
                    "step": int(stp_a[oa + q]),
                    "params": int(sa["param_count"][oa + q]),
                    "losses": int(sa["loss_count"][oa + q]),
                },
                "b": {
                    "step": int(stp_b[ob + q]),
                    "params": int(sb["param_count"][ob + q]),
                    "losses": int(sb["loss_count"][ob + q]),
                },
            }
        )
    out["firsts"] = firsts
    return out


def diff_batches(a: Side, b: Side) -> dict[str, Any]:
    ba, bb = a.r.batches, b.r.batches
    m = min(len(ba), len(bb))
    out: dict[str, Any] = {"compared": m, "a_total": len(ba), "b_total": len(bb), "first": None}
    if not m:
        return out
    struct = (
        (ba["step"][:m] != bb["step"][:m])
        | (ba["micro"][:m] != bb["micro"][:m])
        | (ba["tensor_count"][:m] != bb["tensor_count"][:m])
    )
    s_idx = first_true(struct)
    mm = m if s_idx is None else s_idx
    ra = expand(ba["tensor_start"][:mm], ba["tensor_count"][:mm])
    rb = expand(bb["tensor_start"][:mm], bb["tensor_count"][:mm])
    owner = np.repeat(np.arange(mm), ba["tensor_count"][:mm].astype(np.int64))
    k = None
    if len(ra):
        ta, tb = a.r.batch_tensors, b.r.batch_tensors
        k = first_true((ta["fp"][ra] != tb["fp"][rb]) | (ta["nbytes"][ra] != tb["nbytes"][rb]))
    q = int(owner[k]) if k is not None else s_idx
    if q is None:
        return out
    ev: dict[str, Any] = {
        "kind": "batch",
        "step": int(ba["step"][q]),
        "micro": int(ba["micro"][q]),
        "seq": None,
        "op": None,
        "pg": None,
        "role": None,
        "tensor_index": None if k is None else int(ra[k] - ba["tensor_start"][q]),
        "batch_index": int(ba["index"][q]),
        "loader": int(ba["loader"][q]),
    }
    if k is not None:
        ta, tb = a.r.batch_tensors, b.r.batch_tensors
        ev.update({"fp_a": hex64(ta["fp"][ra[k]]), "fp_b": hex64(tb["fp"][rb[k]])})
        ev["_payloads"] = (int(ta["payload"][ra[k]]), int(tb["payload"][rb[k]]))
        ev["dtype"] = name_of(a.dtypes, int(ta["dtype"][ra[k]]))
    else:
        ev["kind"] = "batch structure"
    out["first"] = ev
    return out


def event_key(
    ev: dict[str, Any], first_input_rel: dict[tuple[int, int], int], n_in_micro: Any
) -> tuple[float, ...]:
    kind = ev["kind"]
    s = int(ev["step"])
    if kind.startswith("parameters") or kind == "step structure":
        return (s, AFTER_ALL_MICRO, 0.0, 0)
    m = int(ev["micro"])
    if kind.startswith("batch"):
        return (s, m, -1.0, 0)
    if kind == "loss":
        rel = first_input_rel.get((s, m))
        return (s, m, rel - 0.5 if rel is not None else float(n_in_micro(s, m)), 0)
    return (s, m, float(ev["rel"]), 1 if ev.get("role") == "input" else 2)


def attach_magnitude(ev: dict[str, Any], a: Side, b: Side) -> None:
    rows = ev.pop("_rows", None)
    pls = ev.pop("_payloads", None)
    if "magnitude" in ev:
        return
    if rows is not None:
        pls = (int(a.r.tensors["payload"][rows[0]]), int(b.r.tensors["payload"][rows[1]]))
    if pls is None:
        return
    if pls[0] < 0 or pls[1] < 0:
        ev["magnitude"] = None
        which = " and ".join(n for n, p in zip("AB", pls, strict=True) if p < 0)
        ev["magnitude_note"] = f"no payload stored in trace {which}"
        return
    data_a, data_b = a.r.payload(pls[0]), b.r.payload(pls[1])
    ev["magnitude"] = magnitude(data_a, data_b, str(ev.get("dtype")))
