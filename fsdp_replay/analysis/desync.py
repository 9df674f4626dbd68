"""Where ranks disagree, from the trace alone: ``fsdp-replay desync``.

``desync_report(trace)``: for a hang (or any run), where each rank stopped, and the first position
at which the ranks' collective sequences on one process group disagree. A rank whose record ends
early (it was killed, or records were lost) is not blamed for what its record cannot show: the
ranks' wall clocks (``rank_start.t0_wall_ns``) and the writer's ``alive`` marks tell "never issued"
from "not written yet".
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fsdp_replay.analysis.columns import Interner, checked_ranks, pg_ranks, rank_steps_done, record_notes
from fsdp_replay.analysis.desync_ranks import RankCtx, deviation, rank_ctx, unrecorded_reason
from fsdp_replay.analysis.state_dumps import rank_states
from fsdp_replay.trace.ops import P2P_OPS
from fsdp_replay.trace.reader import Trace


def _entry_text(e: dict[str, Any]) -> str:
    what = e.get("signature") or e["op"]
    return f"{what} (step {e['step']}, seq {e['seq']}{', in flight' if e.get('in_flight') else ''})"


def _plural(xs: list[int]) -> str:
    return f"rank {xs[0]}" if len(xs) == 1 else f"ranks {xs}"


def _group_mismatch(
    name: str,
    want: list[int],
    ctxs: dict[int, RankCtx],
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
        unrecorded = {rk: unrecorded_reason(ctxs[rk], first_issue) for rk in never}
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
        if kind == "missing":
            # A step unlike the one before explains the disagreement only where it departs after the
            # group's last agreed collective; before it, the ranks did the same (an evaluation loop's
            # step differs from a training step's for every rank).
            agreed = {
                rk: int(ctxs[rk].co.seq[sels[rk][p - 1]]) if 0 < p <= lens[rk] else -1 for rk in suspects
            }
            devs = [
                deviations[rk] for rk in suspects if rk in deviations and deviations[rk]["seq"] > agreed[rk]
            ]
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
    ``missing_ranks`` (of the world, no data), ``message``; ``states``: a line per rank that
    answered a dump request (``state_dumps.describe``: where its main thread was, or the collective
    it waited in), and each rank's ``state`` (``state_dumps.where`` of its last dump, or None).
    """
    rts = checked_ranks(trace, ranks)
    present = list(rts)
    intern = Interner()
    ctxs = {rk: rank_ctx(rk, r, intern) for rk, r in rts.items()}
    states = rank_states({rk: r.attrs for rk, r in rts.items()})
    deviations: dict[int, dict[str, Any]] = {}
    for rk, ctx in ctxs.items():
        dev = deviation(ctx, intern)
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
            "state": states[rk]["where"] if rk in states else None,
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
        "states": [st["message"] for st in states.values()],
        "message": message,
    }
