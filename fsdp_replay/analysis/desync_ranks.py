"""One rank as ``desync`` sees it: its collectives' signatures, where it stopped, and whether its
record can show that it never issued a collective (or ends too early to tell)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fsdp_replay.analysis.columns import (
    Colls,
    Interner,
    fmt_shape,
    issue_order,
    last_seen_wall_ns,
    mix64,
    name_of,
    pg_names,
    shape_hashes,
)
from fsdp_replay.trace import schema
from fsdp_replay.trace.ops import SAME_SHAPE_OPS
from fsdp_replay.trace.reader import RankTrace
from fsdp_replay.trace.schema import ROLE_INPUT, ROLE_OBJECTS

# A rooted collective's side that only its root has: gather's outputs, scatter's inputs.
ROOT_ONLY = {"gather_": schema.ROLE_OUTPUT, "scatter_": schema.ROLE_INPUT}


def signatures(
    r: RankTrace, co: Colls, op_gid: np.ndarray, red_gid: np.ndarray, dt_lut: np.ndarray
) -> np.ndarray:
    """A uint64 per collective (issue order) over op, reduce op, tensor count, roles, dtypes, and
    the shapes of ops whose shapes agree across the group. Never what is each rank's own: the
    shape of an object collective's ``objects sent`` row (a broadcast's receivers send none, an
    ``all_gather_object``'s ranks each their own objects), or the side of a gather or scatter
    that only its root has (``ROOT_ONLY``)."""
    n = len(co)
    t = r.tensors
    sig = np.zeros(n, dtype=np.uint64)
    count = np.zeros(n, dtype=np.int64)
    if n and len(t):
        names = r.names("op")
        strict = np.array([o in SAME_SHAPE_OPS for o in names] + [False], dtype=bool)
        root_role = np.array([ROOT_ONLY.get(o, -1) for o in names] + [-1], dtype=np.int16)
        pos = co.pos_of_row[t["coll"]]
        rows = np.flatnonzero(pos >= 0)  # not tensors of collectives left out (a record cut short)
        pos = pos[rows]
        role = t["role"][rows].astype(np.int16)
        kept = role != root_role[co.op[pos]]
        rows, pos, role = rows[kept], pos[kept], role[kept]
        order = np.lexsort((rows, pos))  # each collective's rows together, in their order
        rows, pos, role = rows[order], pos[order], role[order]
        count = np.bincount(pos, minlength=n)
        first = np.concatenate(([0], np.cumsum(count)[:-1]))
        idx = np.arange(len(pos)) - first[pos]  # the row's place among its collective's kept rows
        th = mix64(role.astype(np.uint64) * np.uint64(7919) + dt_lut[t["dtype"][rows]].astype(np.uint64))
        sh = shape_hashes(r, t["shape_start"][rows], t["ndim"][rows])
        th = np.where(strict[co.op[pos]] & (role != ROLE_OBJECTS), th ^ sh, th)
        np.add.at(sig, pos, mix64(th ^ mix64(idx.astype(np.uint64))))
    head = (
        op_gid.astype(np.uint64) * np.uint64(0x100000001B3)
        ^ (red_gid + 1).astype(np.uint64) * np.uint64(0x9E3779B1)
        ^ count.astype(np.uint64)
    )
    return mix64(sig ^ mix64(head))


@dataclass
class RankCtx:
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
            role = {ROLE_INPUT: "i", ROLE_OBJECTS: "j"}.get(int(t["role"][row]), "o")
            parts.append(
                f"{role}:{name_of(dts, int(t['dtype'][row]))}{fmt_shape(r, t['shape_start'][row], t['ndim'][row])}"
            )
        red = name_of(r.names("reduce_op"), int(co.reduce_op[p]))
        return f"{name_of(self.ops, int(co.op[p]))}{f'({red})' if red else ''} [{', '.join(parts)}]"

    @property
    def final(self) -> dict[str, Any] | None:
        if self.inflight is not None:
            return self.inflight
        return self.entry(len(self.co) - 1) if len(self.co) else None


def rank_ctx(rk: int, r: RankTrace, intern: Interner) -> RankCtx:
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
    sig = signatures(r, co, op_gid, red, intern.lut(["dtype:" + x for x in r.names("dtype")]))
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
    return RankCtx(
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


def deviation(ctx: RankCtx, intern: Interner) -> dict[str, Any] | None:
    """Where the rank's last step departs from its previous step's (op, pg) pattern.

    Used to tell which side of a two-rank disagreement is odd. Compared only when the previous
    step is not step 0 (step 0 has no preceding optimizer step, so its pattern differs).
    """
    co = ctx.co
    steps = co.step.tolist()
    pat = list(zip(steps, ctx.op_gid.tolist(), co.pg.tolist(), co.seq.tolist(), strict=True))
    if ctx.inflight is not None:
        pat.append((ctx.inflight["step"], ctx.inflight_gid, ctx.inflight_pg, ctx.inflight["seq"]))
    if not pat:
        return None
    last = pat[-1][0]
    if last - 1 < 1:
        return None
    cur = [(o, g, q) for s, o, g, q in pat if s == last]
    prev = [(o, g) for s, o, g, _ in pat if s == last - 1]
    if not prev:
        return None
    names = {v: k for k, v in intern.ids.items()}
    for i, (o, g, q) in enumerate(cur):
        if i >= len(prev) or prev[i] != (o, g):
            exp = None if i >= len(prev) else {"op": names.get(prev[i][0]), "pg": ctx.pgn.get(prev[i][1])}
            return {
                "step": last,
                "index": i,
                "seq": int(q),
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


def unrecorded_reason(ctx: RankCtx, issued_ns: int | None) -> str | None:
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
