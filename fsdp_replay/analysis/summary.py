"""What ``fsdp-replay inspect`` shows: a JSON-able summary of a trace."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from fsdp_replay.analysis.kernels import cupti_summary
from fsdp_replay.analysis.memory import memory_summary
from fsdp_replay.errors import TraceFormatError
from fsdp_replay.trace import schema
from fsdp_replay.trace.reader import RankTrace, Trace


def _ranges(steps: list[int]) -> str:
    """[0,1,2,5,7,8] -> '0-2,5,7-8'."""
    if not steps:
        return "none"
    out: list[str] = []
    start = prev = steps[0]
    for s in [*steps[1:], None]:
        if s is not None and s == prev + 1:
            prev = s
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if s is not None:
            start = prev = s
    return ",".join(out)


def rank_summary(r: RankTrace) -> dict[str, Any]:
    c, t, s = r.collectives, r.tensors, r.steps
    ops = r.names("op")
    n = len(c)
    by_op: Counter[tuple[str, int]] = Counter()
    bytes_by_op: Counter[str] = Counter()
    if n:
        op_codes, pgs = c["op"], c["pg"]
        for code, pg in zip(op_codes.tolist(), pgs.tolist(), strict=True):
            by_op[(ops[code], pg)] += 1
        role, coll, nbytes = t["role"], t["coll"], t["nbytes"]
        out_mask = role == schema.ROLE_OUTPUT
        for code in np.unique(op_codes).tolist():
            mask = out_mask & (op_codes[coll] == code)
            bytes_by_op[ops[code]] = int(nbytes[mask].sum())
    outs = t["role"] == schema.ROLE_OUTPUT if n else np.zeros(0, dtype=bool)
    with_payload = outs & (t["payload"] >= 0) if n else outs
    # Steps where every collective output has its payload (what a single-rank replay needs), and
    # steps with only some (the small tensors every step keeps, a window's dumped part)
    some = set(c["step"][t["coll"][with_payload]].tolist()) if n else set()
    lacking = set(c["step"][t["coll"][outs & ~with_payload]].tolist()) if n else set()
    payload_steps = sorted(some - lacking)
    partial_steps = sorted(some & lacking)
    losses = r.table("losses")["value"]
    end = r.attrs.get("end")
    meta = r.meta
    return {
        "rank": r.rank,
        "steps": len(s),
        "micro_steps": int(s["micro_steps"].sum()) if len(s) else 0,
        "collectives": n,
        "by_op": [{"op": op, "pg": pg, "count": k} for (op, pg), k in sorted(by_op.items())],
        "output_bytes_by_op": dict(bytes_by_op),
        "process_groups": r.attrs.get("process_groups", []),
        "payload_coverage": {
            "outputs": int(outs.sum()),
            "with_payload": int(with_payload.sum()),
            "steps": _ranges(payload_steps),
            "partial_steps": _ranges(partial_steps),
        },
        "payload_bytes": int(r.payloads["nbytes"].sum()) if len(r.payloads) else 0,
        "tape": tape_summary(r),
        "cupti": cupti_summary(r),
        "compiled": compiled_summary(r.attrs.get("compiled")),
        "batches": len(r.batches),
        "snapshots": [sn["step"] for sn in r.attrs.get("snapshots", [])],
        "nonfinite_steps": s["step"][s["nonfinite"]].tolist() if len(s) else [],
        "first_loss": float(losses[0]) if len(losses) else None,
        "last_loss": float(losses[-1]) if len(losses) else None,
        "end": end,
        "complete": end is not None,
        "agent_errors": r.attrs.get("agent_errors", []),
        "damage": r.attrs.get("damage", []),
        "unread_events": r.attrs.get("unread_events", {}),
        "payload_missing": r.attrs.get("payload_missing", 0),
        "attempts": r.attrs.get("attempts", 0),
        "flight_recorder": {  # --payloads window:N (agent/flight.py)
            "dumps": r.attrs.get("flight_dumps", []),
            "unwritten": r.attrs.get("flight_unwritten", 0),
        },
        "recording_cost": recording_cost(r),
        "recording_waits": recording_waits(r),
        "memory": memory_summary(r),
        "environment": {
            "argv": meta.get("argv"),
            "cwd": meta.get("cwd"),
            "versions": meta.get("versions"),
            "threads": meta.get("threads"),
            "determinism": meta.get("determinism"),
            "numerics": meta.get("numerics"),
            "script": meta.get("script"),
            "policy": meta.get("policy"),
            "env": meta.get("env"),
            "fingerprint_algos": meta.get("fingerprint_algos"),
        },
    }


def compiled_summary(ran: dict[str, Any] | None) -> dict[str, Any] | None:
    """The Inductor graphs a rank ran (attrs ``compiled``), or None when it ran none."""
    if not ran or not ran.get("calls"):
        return None
    steps = sorted({int(step) for step, _, _ in ran["calls"]})
    return {
        "steps": steps,
        "calls": sum(int(n) for _, _, n in ran["calls"]),
        "graphs": [g["graph"] for g in ran["graphs"]],
        "devices": sorted({d for g in ran["graphs"] for d in g.get("devices", [])}),
        "generated_kernels": sum(int(g.get("n_kernels", 0)) for g in ran["graphs"]),
        "nondeterministic": sorted({k for g in ran["graphs"] for k in g.get("nondeterministic", [])}),
        "modules": list(ran.get("modules") or []),
        "errors": list(ran.get("errors") or []),
    }


def compiled_text(c: dict[str, Any]) -> list[str]:
    """What ``compiled_summary`` means for a replay's verdict, in lines (inspect and replay)."""
    steps = c["steps"]
    span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}..{steps[-1]}"
    where = f" in {', '.join(c['modules'][:6])}" if c["modules"] else ""
    lines = [
        f"compiled: {span} ran {c['calls']} calls of {len(c['graphs'])} Inductor graphs{where} "
        f"({c['generated_kernels']} generated kernels); ops inside generated kernels are neither taped nor "
        "op-fingerprinted (those Inductor calls back into aten, such as matmuls and attention, are)"
    ]
    if c["nondeterministic"]:
        lines.append(
            f"  generated kernels that do the work of nondeterministic ops: {', '.join(c['nondeterministic'][:6])}: "
            "their atomics can give other bits in every run, which no replay can inject; record with "
            "torch.use_deterministic_algorithms(True) (Inductor then falls back to aten for accumulating index "
            "writes) or leave those modules uncompiled"
        )
    return lines


def tape_summary(r: RankTrace) -> dict[str, Any]:
    """The nondeterministic-kernel tape: calls by op, and how many results' bytes are stored."""
    if not r.has_table("tape"):
        return {"calls": 0, "by_op": {}, "outputs": 0, "with_payload": 0}
    k, kt = r.table("tape"), r.table("tape_tensors")
    ops = r.names("op")
    by_op = Counter(ops[code] for code in k["op"].tolist())
    return {
        "calls": len(k),
        "by_op": dict(sorted(by_op.items())),
        "outputs": len(kt),
        "with_payload": int((kt["payload"] >= 0).sum()) if len(kt) else 0,
    }


def recording_cost(r: RankTrace, skip_steps: int = 0) -> dict[str, Any] | None:
    """What recording cost this rank per step, from the cumulative ``steps.agent_cpu_ns`` and
    ``writer_cpu_ns``: the median increment after step ``skip_steps`` (step 0 carries start-up
    and the step-0 snapshot), in ms; with ``agent_cpu_parts_ms`` the same statistic of each part of
    the hooks' time (``steps.cpu_<part>_ns``, where the trace has them). None for traces without
    those columns or with too few steps."""
    st = r.steps
    if len(st) - skip_steps < max(2, 3 - skip_steps):
        return None
    try:
        hooks, writer = st["agent_cpu_ns"][skip_steps:], st["writer_cpu_ns"][skip_steps:]
    except TraceFormatError:  # a version-1 trace
        return None
    if hooks.min() < 0 or writer.min() < 0:
        return None
    out: dict[str, Any] = {
        "agent_cpu_ms_per_step": float(np.median(np.diff(hooks))) / 1e6,
        "writer_cpu_ms_per_step": float(np.median(np.diff(writer))) / 1e6,
    }
    parts = {}
    for part in schema.AGENT_CPU_PARTS:
        if st.has(f"cpu_{part}_ns"):
            ns = st[f"cpu_{part}_ns"][skip_steps:]
            if ns.min() >= 0:  # -1: an agent that did not count it
                parts[part] = float(np.median(np.diff(ns))) / 1e6
    if parts:
        out["agent_cpu_parts_ms"] = parts
    return out


def recording_waits(r: RankTrace) -> dict[str, Any] | None:
    """How long the training waited for room for payloads (``--when-full wait``), from the
    cumulative ``steps.payload_wait_ns``: in all, the steps that waited, the step that waited
    most, and the writer's rate (``steps.blob_bytes`` over ``blob_write_ns``). None where the
    trace has no such columns or nothing waited."""
    st = r.steps
    if not len(st) or not st.has("payload_wait_ns"):
        return None
    waits = st["payload_wait_ns"]
    if waits.min() < 0 or waits[-1] <= 0:
        return None
    per_step = np.diff(waits, prepend=0)
    worst = int(np.argmax(per_step))
    nbytes, write_ns = int(st["blob_bytes"][-1]), int(st["blob_write_ns"][-1])
    return {
        "total_ms": float(waits[-1]) / 1e6,
        "steps": int((per_step > 0).sum()),
        "worst_step": int(st["step"][worst]),
        "worst_ms": float(per_step[worst]) / 1e6,
        "writer_gb_per_s": nbytes / write_ns if nbytes > 0 and write_ns > 0 else None,
    }


def summarize(trace: Trace, ranks: list[int] | None = None) -> dict[str, Any]:
    present = trace.ranks
    chosen = present if ranks is None else [r for r in ranks if r in present]
    per_rank = [rank_summary(trace.rank(r)) for r in chosen]
    ws = trace.world_size
    missing = sorted(set(range(ws)) - set(present)) if ws else []
    totals: Counter[str] = Counter()
    for rs in per_rank:
        for row in rs["by_op"]:
            totals[row["op"]] += row["count"]
    return {
        "trace": trace.url,
        "format_version": trace.meta.get("format_version"),
        "world_size": ws,
        "ranks": present,
        "missing_ranks": missing,
        "run": trace.meta.get("run"),
        "collectives_by_op": dict(sorted(totals.items())),
        "per_rank": per_rank,
    }
