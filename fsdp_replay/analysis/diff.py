"""The first divergence between two traces of the same job (two runs, or a run and its replay).

Per rank, the collectives are walked in issue order and compared column by column with numpy
(op, process group, reduce op, step and micro-batch, tensor count, then each tensor's role,
dtype, shape, fingerprint algorithm and fingerprint, inputs before outputs); so are the batches,
each step's parameter fingerprints and its losses. Events are ordered as in
``analysis/nonfinite.py`` (step, micro-batch, position in the sequence; a loss just before the first
collective whose input differs). Where both traces hold the bytes of the first divergent tensor,
its magnitude is computed by decoding them with numpy.
"""

from __future__ import annotations

from typing import Any

from fsdp_replay.analysis.columns import Interner, batch_name, checked_ranks, record_notes
from fsdp_replay.analysis.diff_tables import (
    attach_magnitude,
    diff_batches,
    diff_collectives,
    diff_steps,
    event_key,
    side_of,
)
from fsdp_replay.trace import numerics
from fsdp_replay.trace.reader import RankTrace, Trace


def _rank_diff(ra: RankTrace, rb: RankTrace, intern: Interner, with_magnitude: bool) -> dict[str, Any]:
    a, b = side_of(ra), side_of(rb)
    colls = diff_collectives(a, b, intern)
    steps = diff_steps(a, b)
    batches = diff_batches(a, b)
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
    first = min(cands, key=lambda e: event_key(e, colls["first_input_rel"], n_in_micro)) if cands else None
    order = None if first is None else event_key(first, colls["first_input_rel"], n_in_micro)
    first_coll = colls["first"]
    for ev in {id(e): e for e in [first, first_coll] if e is not None}.values():
        if with_magnitude:
            attach_magnitude(ev, a, b)
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
        return f"{batch_name(ev)} at {where}" + (
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
    ka, kb = ma.get("numerics"), mb.get("numerics")
    if ka is not None and kb is not None:  # both runs ran all ranks: NCCL's settings count too
        for m in numerics.compare(ka, kb):
            notes.append(
                f"the runs' replay keys differ: {m.key} is {m.recorded!r} in A and {m.replay!r} in B: {m.meaning}"
            )
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
