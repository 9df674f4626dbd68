"""The first divergence between two traces of the same job (two runs, or a run and its replay).

Per rank, the collectives are walked in issue order and compared column by column with numpy
(op, process group, reduce op, step and micro-batch, tensor count, then each tensor's role,
dtype, shape, fingerprint algorithm and fingerprint, inputs before outputs); so are the batches,
each step's parameter fingerprints and its losses. Events are ordered as in
``analysis`` (step, micro-batch, position in the sequence; a loss just before the first
collective whose input differs). Where both traces hold the bytes of the first divergent tensor,
its magnitude is computed by decoding them with numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from fsdp_replay.replayer.analysis import (
    AFTER_ALL_MICRO,
    ROLE_INPUT,
    ROLE_NAMES,
    Colls,
    Interner,
    checked_ranks,
    issue_order,
    name_of,
    param_name,
    pg_names,
    record_notes,
    shape_hashes,
)
from fsdp_replay.trace import dtypes
from fsdp_replay.trace.reader import RankTrace, Trace


def _hex(x: int) -> str:
    return f"{int(x):016x}"


def _expand(start: np.ndarray, count: np.ndarray) -> np.ndarray:
    """Rows start[i] .. start[i]+count[i]-1 for every i, concatenated."""
    count = count.astype(np.int64)
    total = int(count.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    off = np.arange(total) - np.repeat(np.cumsum(count) - count, count)
    return np.repeat(start.astype(np.int64), count) + off


def _first(mask: np.ndarray) -> int | None:
    hit = np.flatnonzero(mask)
    return int(hit[0]) if hit.size else None


# -- payload decoding ---------------------------------------------------------------------------
def decode(data: bytes, dtype: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(values as float64/complex/int64, raw element bit patterns) of a payload, or None."""
    if dtype == "bfloat16":
        raw = np.frombuffer(data, "<u2")
        return (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64), raw
    if dtype.startswith("float8"):
        raw = np.frombuffer(data, "u1")
        try:
            import ml_dtypes  # optional

            vals = raw.view(getattr(ml_dtypes, dtype)).astype(np.float64)
        except (ImportError, AttributeError):
            vals = raw.astype(np.float64)  # bytes compared, values not decoded
        return vals, raw
    code = dtypes.numpy_code(dtype)
    if code is None:
        return None
    arr = np.frombuffer(data, code)
    raw = arr.view(f"u{arr.dtype.itemsize}") if arr.dtype.itemsize in (1, 2, 4, 8) else arr.view("u1")
    if arr.dtype.kind == "c":
        return arr.astype(np.complex128), raw.reshape(len(arr), -1) if raw.size != arr.size else raw
    if arr.dtype.kind == "f":
        return arr.astype(np.float64), raw
    return arr.astype(np.int64), raw


def magnitude(a: bytes, b: bytes, dtype: str) -> dict[str, Any] | None:
    """How much two payloads of one tensor differ: ``numel``, ``n_differing`` (elements whose
    bits differ), ``first_index`` (flat), ``a_value``/``b_value`` there, ``max_abs_diff`` and
    ``max_rel_diff`` over the elements finite in both (None when there are none), and
    ``nonfinite_a``/``nonfinite_b`` counts. None when the dtype cannot be decoded."""
    if len(a) != len(b):
        return {"numel": None, "n_differing": None, "note": f"sizes differ ({len(a)} vs {len(b)} bytes)"}
    da, db = decode(a, dtype), decode(b, dtype)
    if da is None or db is None:
        return None
    (va, ra), (vb, rb) = da, db
    bits = ra != rb
    if bits.ndim > 1:
        bits = bits.any(axis=1)
    n_diff = int(bits.sum())
    first = int(np.argmax(bits)) if n_diff else None
    fin_a, fin_b = np.isfinite(va), np.isfinite(vb)
    both = fin_a & fin_b
    max_abs = max_rel = None
    if both.any():
        with np.errstate(all="ignore"):
            absd = np.abs(va[both] - vb[both])
            den = np.maximum(np.abs(va[both]), np.abs(vb[both]))
            rel = np.where(den > 0, absd / np.where(den > 0, den, 1), 0.0)
        max_abs, max_rel = float(absd.max()), float(rel.max())

    def scalar(x: Any) -> Any:
        if isinstance(x, complex | np.complexfloating):
            return str(complex(x))
        return float(x) if isinstance(x, float | np.floating) else int(x)

    return {
        "numel": len(va),
        "n_differing": n_diff,
        "first_index": first,
        "a_value": None if first is None else scalar(va[first]),
        "b_value": None if first is None else scalar(vb[first]),
        "max_abs_diff": max_abs,
        "max_rel_diff": max_rel,
        "nonfinite_a": int((~fin_a).sum()),
        "nonfinite_b": int((~fin_b).sum()),
    }


# -- per-rank comparison ------------------------------------------------------------------------
@dataclass
class _Side:
    r: RankTrace
    co: Colls
    pgn: dict[int, str]
    ops: list[str]
    dtypes: list[str]
    algos: list[str]


def _side(r: RankTrace) -> _Side:
    return _Side(r, issue_order(r), pg_names(r), r.names("op"), r.names("dtype"), r.names("algo"))


def _coll_info(s: _Side, p: int) -> dict[str, Any]:
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


def _align_start(a: _Side, b: _Side) -> tuple[int, int]:
    """Skip the leading collectives of the trace that starts at an earlier step (a partial replay)."""
    if not len(a.co) or not len(b.co):
        return 0, 0
    sa, sb = int(a.co.step[0]), int(b.co.step[0])
    if sa < sb:
        return int(np.searchsorted(a.co.step, sb)), 0
    if sb < sa:
        return 0, int(np.searchsorted(b.co.step, sa))
    return 0, 0


def _diff_collectives(a: _Side, b: _Side, intern: Interner) -> dict[str, Any]:
    oa, ob = _align_start(a, b)
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
    s_idx = _first(struct)
    m = n if s_idx is None else s_idx  # tensors align up to the first structural difference
    ta, tb = a.r.tensors, b.r.tensors
    rows_a = _expand(ca.tensor_start[oa : oa + m], ca.tensor_count[oa : oa + m])
    rows_b = _expand(cb.tensor_start[ob : ob + m], cb.tensor_count[ob : ob + m])
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
    k = _first(bad)
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
        info = _coll_info(a, pa)
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
            "fp_a": _hex(ta["fp"][row_a]),
            "fp_b": _hex(tb["fp"][row_b]),
            "algo": name_of(a.algos, int(ta["algo"][row_a])),
            "rel": int(ca.rel[pa]),
            "_rows": (row_a, row_b),
        }
        if t_struct[k]:
            ev["a"], ev["b"] = info, _coll_info(b, pb)
        out["first"] = ev
    else:
        assert s_idx is not None
        pa, pb = oa + s_idx, ob + s_idx
        ia_, ib_ = _coll_info(a, pa), _coll_info(b, pb)
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


def _diff_steps(a: _Side, b: _Side) -> dict[str, Any]:
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
    s_idx = _first(struct)
    mm = m if s_idx is None else s_idx
    steps = stp_a[oa : oa + mm]
    out: dict[str, Any] = {"compared": m, "a_total": len(stp_a), "b_total": len(stp_b)}
    # parameters
    pa = _expand(sa["param_start"][oa : oa + mm], sa["param_count"][oa : oa + mm])
    pb = _expand(sb["param_start"][ob : ob + mm], sb["param_count"][ob : ob + mm])
    owner = np.repeat(np.arange(mm), sa["param_count"][oa : oa + mm].astype(np.int64))
    pdiff = np.zeros(len(pa), dtype=bool)
    if len(pa):
        fa, fb = a.r.table("step_params"), b.r.table("step_params")
        pdiff = (fa["fp"][pa] != fb["fp"][pb]) | (fa["algo"][pa] != fb["algo"][pb])
    params_differing = np.bincount(owner[pdiff], minlength=mm) if mm else np.zeros(0, dtype=np.int64)
    # losses
    la = _expand(sa["loss_start"][oa : oa + mm], sa["loss_count"][oa : oa + mm])
    lb = _expand(sb["loss_start"][ob : ob + mm], sb["loss_count"][ob : ob + mm])
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
    k = _first(ldiff)
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
    k = _first(pdiff)
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
                "fp_a": _hex(fa["fp"][pa[k]]),
                "fp_b": _hex(fb["fp"][pb[k]]),
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


def _diff_batches(a: _Side, b: _Side) -> dict[str, Any]:
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
    s_idx = _first(struct)
    mm = m if s_idx is None else s_idx
    ra = _expand(ba["tensor_start"][:mm], ba["tensor_count"][:mm])
    rb = _expand(bb["tensor_start"][:mm], bb["tensor_count"][:mm])
    owner = np.repeat(np.arange(mm), ba["tensor_count"][:mm].astype(np.int64))
    k = None
    if len(ra):
        ta, tb = a.r.batch_tensors, b.r.batch_tensors
        k = _first((ta["fp"][ra] != tb["fp"][rb]) | (ta["nbytes"][ra] != tb["nbytes"][rb]))
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
    }
    if k is not None:
        ta, tb = a.r.batch_tensors, b.r.batch_tensors
        ev.update({"fp_a": _hex(ta["fp"][ra[k]]), "fp_b": _hex(tb["fp"][rb[k]])})
        ev["_payloads"] = (int(ta["payload"][ra[k]]), int(tb["payload"][rb[k]]))
        ev["dtype"] = name_of(a.dtypes, int(ta["dtype"][ra[k]]))
    else:
        ev["kind"] = "batch structure"
    out["first"] = ev
    return out


def _key(
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


def _attach_magnitude(ev: dict[str, Any], a: _Side, b: _Side) -> None:
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


def _rank_diff(ra: RankTrace, rb: RankTrace, intern: Interner, with_magnitude: bool) -> dict[str, Any]:
    a, b = _side(ra), _side(rb)
    colls = _diff_collectives(a, b, intern)
    steps = _diff_steps(a, b)
    batches = _diff_batches(a, b)
    co = a.co

    def n_in_micro(s: int, m: int) -> int:
        return int(((co.step == s) & (co.micro == m)).sum())

    # A divergence counts only where both records are whole: past a lost record the sequences no
    # longer line up. (A record that only ends early, a kill, is compared as far as it goes.)
    ends = [(side, r.completeness) for side, r in (("A", ra), ("B", rb)) if not r.completeness["prefix"]]
    limit = min((int(c["through_step"]) for _, c in ends), default=None)
    for d in (colls, batches):
        if d["first"] is not None and limit is not None and int(d["first"]["step"]) > limit:
            d["first"] = None
    steps["firsts"] = [e for e in steps["firsts"] if e is None or limit is None or int(e["step"]) <= limit]
    cands = [e for e in [colls["first"], batches["first"], *steps["firsts"]] if e is not None]
    first = min(cands, key=lambda e: _key(e, colls["first_input_rel"], n_in_micro)) if cands else None
    order = None if first is None else _key(first, colls["first_input_rel"], n_in_micro)
    first_coll = colls["first"]
    for ev in {id(e): e for e in [first, first_coll] if e is not None}.values():
        if with_magnitude:
            _attach_magnitude(ev, a, b)
        else:
            ev.pop("_rows", None)
            ev.pop("_payloads", None)
    for e in cands:
        e.pop("_rows", None)
        e.pop("_payloads", None)
        e.pop("rel", None)
    nc, ns = colls["compared"], steps["compared"]
    longer = []
    for side in ("a", "b"):
        more = [
            f"{d[side + '_total'] - d['compared']} more {what if d[side + '_total'] - d['compared'] > 1 else what[:-1]}"
            for what, d in (("collectives", colls), ("steps", steps))
            if d[side + "_total"] > d["compared"]
        ]
        if more:
            longer.append(f"{side.upper()} has " + " and ".join(more))
    if first is None:
        message = f"identical over {nc} collectives and {ns} steps"
        if limit is not None:
            message = f"identical through step {limit}, where the record of " + " and ".join(
                f"{side} ends ({'; '.join(c['reasons'])})" for side, c in ends
            )
    else:
        message = "first divergence: " + describe(first)
    if longer:
        message += " (" + ", ".join(longer) + ")"
    return {
        "rank": ra.rank,
        "identical": first is None,
        "first": first,
        "first_collective": first_coll,
        "compared": {"collectives": nc, "steps": ns, "batches": batches["compared"]},
        "lengths": {
            "a": {"collectives": colls["a_total"], "steps": steps["a_total"], "batches": batches["a_total"]},
            "b": {"collectives": colls["b_total"], "steps": steps["b_total"], "batches": batches["b_total"]},
        },
        "same_length": not longer,
        "complete_through": limit,
        "drift": steps["drift"],
        "message": message,
        "_order": order,
    }


def describe(ev: dict[str, Any]) -> str:
    kind = ev["kind"]
    where = f"step {ev['step']}" + (f" micro-batch {ev['micro']}" if ev.get("micro") is not None else "")
    if kind == "loss":
        return f"loss of {where}: {ev['loss_a']!r} vs {ev['loss_b']!r}"
    if kind == "parameters after step":
        name = ev.get("param_name")
        return (
            f"parameters after step {ev['step']}: {ev['params_differing']} differ, first #{ev['tensor_index']}"
            + (f" ({name})" if name else "")
        )
    if kind == "step structure":
        return f"steps differ in structure at {where}: A {ev['a']} vs B {ev['b']}"
    if kind.startswith("batch"):
        return f"batch {ev.get('batch_index')} of {where}" + (
            f", tensor {ev['tensor_index']}" if ev.get("tensor_index") is not None else " (structure)"
        )
    if kind == "collective sequence":
        return f"collective #{ev['seq']} at {where}: A issued {ev['a']['op']} on pg {ev['a']['pg']}, B issued {ev['b']['op']} on pg {ev['b']['pg']}"
    text = f"{ev['op']} (seq {ev['seq']}, pg {ev['pg']}) at {where}, {ev['role']} {ev['tensor_index']}"
    if kind != "collective":
        text += f" ({kind}: A {ev['a']['tensors']} vs B {ev['b']['tensors']})"
    else:
        text += f" {ev['dtype']}{ev['shape']}: fp {ev['fp_a']} vs {ev['fp_b']}"
    mag = ev.get("magnitude")
    if mag and mag.get("n_differing") is not None:
        text += f"; {mag['n_differing']}/{mag['numel']} elements differ"
        if mag.get("max_abs_diff") is not None:
            text += f", max abs {mag['max_abs_diff']:.3g}, max rel {mag['max_rel_diff']:.3g}"
    return text


def _notes(a: Trace, b: Trace, chosen: list[int]) -> list[str]:
    """Differences in what was run (script contents, arguments) that explain a divergence."""
    if not chosen:
        return []
    ma, mb = a.rank(chosen[0]).meta, b.rank(chosen[0]).meta
    notes = []
    sa, sb = ma.get("script") or {}, mb.get("script") or {}
    if sa.get("sha256") != sb.get("sha256"):
        ha, hb = (str(x.get("sha256"))[:12] for x in (sa, sb))
        notes.append(
            f"the script differs: A ran {sa.get('path')} (sha256 {ha}), B ran {sb.get('path')} (sha256 {hb})"
        )
    argv_a, argv_b = list(ma.get("argv") or []), list(mb.get("argv") or [])
    if argv_a[1:] != argv_b[1:]:
        import difflib

        xa, xb = argv_a[1:], argv_b[1:]
        parts = []
        for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=xa, b=xb, autojunk=False).get_opcodes():
            if tag == "equal":
                continue
            # show the option name in front of a changed value
            if i1 > 0 and j1 > 0 and xa[i1 - 1] == xb[j1 - 1] and xa[i1 - 1].startswith("-"):
                i1, j1 = i1 - 1, j1 - 1
            sa_, sb_ = " ".join(xa[i1:i2]), " ".join(xb[j1:j2])
            parts.append(f"A {f'`{sa_}`' if sa_ else 'nothing'} vs B {f'`{sb_}`' if sb_ else 'nothing'}")
        notes.append("the arguments differ: " + "; ".join(parts))
    return notes


def diff_traces(
    a: Trace, b: Trace, ranks: list[int] | None = None, *, with_magnitude: bool = True
) -> dict[str, Any]:
    """Compare two traces of the same job rank by rank.

    Keys: ``a``, ``b`` (urls), ``ranks``: ``[{"rank", "identical", "first", "first_collective",
    "compared" ({"collectives", "steps", "batches"}), "lengths" ({"a": {...}, "b": {...}}),
    "same_length", "drift" ({"step", "params_differing", "params_total", "loss_abs_diff"}: one
    entry per compared step), "message"}]``, ``missing_ranks`` ({"a": [...], "b": [...]}: ranks
    present in only one trace), ``first`` (the earliest divergence over all ranks, with its
    ``rank``, or None), ``diverged``, ``notes`` and ``message``.

    A divergence event (``first``, ``first_collective``) has ``kind`` ("collective", "collective
    tensor shape/dtype", "collective sequence", "loss", "parameters after step", "step structure",
    "batch", "batch structure"), ``step``, ``micro``, ``seq`` (and ``seq_b``), ``op``, ``pg``
    (the group's name), ``role`` ("input"/"output"), ``tensor_index`` (among that role's tensors;
    the parameter index; the micro-batch of a loss), and by kind ``dtype``, ``shape``, ``fp_a``,
    ``fp_b``, ``algo``, ``loss_a``, ``loss_b``, ``params_differing``, ``param_name``, ``a``/``b``
    (both sides of a structural difference), ``magnitude`` (see ``magnitude()``; for losses
    ``{"abs_diff", "rel_diff"}``; None with ``magnitude_note`` when a payload is missing).
    """
    in_a, in_b = set(a.ranks), set(b.ranks)
    chosen = sorted(in_a & in_b) if ranks is None else [r for r in ranks if r in in_a and r in in_b]
    intern = Interner()
    ra, rb = checked_ranks(a, chosen), checked_ranks(b, chosen)
    per_rank = [_rank_diff(ra[r], rb[r], intern, with_magnitude) for r in chosen]
    notes = [*_notes(a, b, chosen), *record_notes(a, chosen, "A"), *record_notes(b, chosen, "B")]
    if a.world_size != b.world_size:
        notes.append(f"world sizes differ: {a.world_size} vs {b.world_size}")
    diverged = [pr for pr in per_rank if pr["first"] is not None]
    order = {pr["rank"]: pr.pop("_order") for pr in per_rank}
    first = None
    if diverged:
        best = min(diverged, key=lambda pr: (order[pr["rank"]], pr["rank"]))
        first = {"rank": best["rank"], **best["first"]}
        message = f"rank {best['rank']} diverged first: {describe(best['first'])}"
        others = [pr["rank"] for pr in diverged if pr is not best]
        if others:
            message += f"; also diverged: ranks {others}"
    elif per_rank:
        message = f"identical: no divergence on ranks {chosen}"
        short = [pr["rank"] for pr in per_rank if not pr["same_length"]]
        if short:
            message += f" (over the events both hold: the traces differ in length on ranks {short})"
    else:
        message = "no rank in common"
    return {
        "a": a.url,
        "b": b.url,
        "ranks": per_rank,
        "missing_ranks": {"a": sorted(in_b - in_a), "b": sorted(in_a - in_b)},
        "first": first,
        "diverged": bool(diverged),
        "notes": notes,
        "message": message,
    }


def plot_drift(result: dict[str, Any], path_png: str) -> str:
    """Draw, per rank and step, the number of differing parameter fingerprints and |loss_a - loss_b|."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, sharex=True, figsize=(8, 5.5), constrained_layout=True)
    for pr in result.get("ranks", []):
        d = pr["drift"]
        steps = d["step"]
        marker = "." if len(steps) <= 200 else None
        ax1.plot(steps, d["params_differing"], marker=marker, label=f"rank {pr['rank']}")
        loss = [x if (x is not None and math.isfinite(x)) else float("nan") for x in d["loss_abs_diff"]]
        ax2.plot(steps, loss, marker=marker, label=f"rank {pr['rank']}")
        first = pr.get("first")
        if first is not None:
            for ax in (ax1, ax2):
                ax.axvline(first["step"], linestyle=":", linewidth=1, color="grey")
    ax1.set_ylabel("parameters differing")
    ax2.set_ylabel("|loss A - loss B|")
    ax2.set_xlabel("step")
    if any(
        x and math.isfinite(x) and x > 0
        for pr in result.get("ranks", [])
        for x in pr["drift"]["loss_abs_diff"]
    ):
        ax2.set_yscale("symlog", linthresh=1e-9)
        ax2.set_ylim(bottom=0)
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        if result.get("ranks"):
            ax.legend(loc="upper left", fontsize="small")
    ax1.set_title("drift between traces", fontsize="medium")
    fig.savefig(path_png, dpi=100)
    plt.close(fig)
    return path_png
