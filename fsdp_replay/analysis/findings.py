"""What ``inspect`` leads with: how the run ended and what in it needs a look, each with the
command to run next.

A finding is ``{"kind", "severity", "rank", "step", "seq", "op", "message", "next"}``: ``kind``
one of "ended", "nonfinite", "desync", "hang", "payloads_dropped", "agent_error", "damage", "flight",
"restarted", "compiled", "oom", "state" (a rank's answer to a dump request), "ok"; ``severity``
"problem" (the run failed there), "warning" (the record or a replay is weaker for it) or "info"; ``rank``/``step``/``seq``/``op`` where they
apply (None otherwise); ``next`` the command line to run, with ``RUN`` as the user named it.
Problems come first, in the order they happened. A rank that died of a peer's end (gloo's
"Connection closed by peer", NCCL's aborted communicator) while another rank ended for a reason of
its own is a warning naming that rank: one crash in a 512-rank job is one problem, not 512.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

import fsdp_replay
from fsdp_replay.analysis.desync import desync_report
from fsdp_replay.analysis.memory import oom_message
from fsdp_replay.analysis.nonfinite import nonfinite_origin
from fsdp_replay.analysis.state_dumps import rank_states
from fsdp_replay.trace.completeness import exception_text
from fsdp_replay.trace.reader import Trace

PROBLEM, WARNING, INFO = "problem", "warning", "info"

# An exception a rank meets because a peer's process ended (gloo's and NCCL's words for it): when
# another rank ended otherwise, that rank's end is the cause and this one a consequence.
PEER_ENDED = re.compile(
    r"connection closed by peer|connection reset by peer|remote worker crash|remote process exited"
    r"|communicator was aborted|broken pipe",
    re.IGNORECASE,
)


def _peer_ended(r: dict[str, Any]) -> bool:
    """Rank summary ``r`` ended with an exception raised because a peer's process ended."""
    return bool(PEER_ENDED.search(str((r.get("end") or {}).get("exception") or "")))


def _stopped(r: dict[str, Any]) -> bool:
    """Rank summary ``r`` was stopped by a signal (SIGTERM: a launcher tearing the job down)."""
    return (r.get("end") or {}).get("reason") not in (None, "exit")


def _causes(per_rank: list[dict[str, Any]]) -> list[int]:
    """The ranks whose records end badly for a reason of their own (an exception other than a
    peer's end, or no end at all: killed or crashed), the candidates for what the others' ends
    followed from; where there is none, the ranks stopped by a signal (a preemption)."""
    own = [
        r["rank"]
        for r in per_rank
        if r.get("end") is None or (r["end"].get("exception") and not _peer_ended(r))
    ]
    return own or [r["rank"] for r in per_rank if _stopped(r)]


def _caused_by(r: dict[str, Any], causes: list[int], per_rank: list[dict[str, Any]]) -> list[int]:
    """The ranks whose end rank summary ``r``'s followed from: a peer's end it died of, or the
    launcher's SIGTERM after another rank failed on its own (torchrun stops the rest)."""
    others = [rk for rk in causes if rk != r["rank"]]
    if _peer_ended(r):
        return others
    failed_alone = any(p["rank"] in others and not _stopped(p) for p in per_rank)
    return others if _stopped(r) and failed_alone else []


def state_findings(trace: Trace, ranks: list[int] | None, q: str) -> list[dict[str, Any]]:
    """A finding per rank that answered a dump request (``state_dumps``): a problem for a rank
    outside any collective while another waits in one (what the others wait for), else
    information."""
    chosen = trace.ranks if ranks is None else [r for r in ranks if r in trace.ranks]
    states = rank_states({rk: trace.rank(rk).attrs for rk in chosen})
    waiting = any(st["where"]["inflight"] for st in states.values())
    out = []
    for rank, st in states.items():
        w = st["where"]
        inflight = w["inflight"] or {}
        outside = not inflight and waiting
        out.append(
            finding(
                "state",
                PROBLEM if outside else INFO,
                st["message"] + ("; the ranks in a collective wait for it" if outside else ""),
                f"fsdp-replay desync {q}",
                rank=rank,
                step=inflight.get("step", w["step"]),
                seq=inflight.get("seq", w["seq"]),
                op=inflight.get("op"),
            )
        )
    return out


def finding(
    kind: str, severity: str, message: str, next_cmd: str | None = None, **where: Any
) -> dict[str, Any]:
    out = {"kind": kind, "severity": severity, "rank": None, "step": None, "seq": None, "op": None}
    out.update(where)
    out["message"] = message
    out["next"] = next_cmd
    return out


def findings(
    trace: Trace, summary: dict[str, Any], run: str, ranks: list[int] | None = None
) -> list[dict[str, Any]]:
    """The findings of a trace; ``summary`` is ``summarize``'s, ``run`` how the user named it."""
    q = shlex.quote(run)
    out: list[dict[str, Any]] = []
    origin = nonfinite_origin(trace, ranks)
    if origin is not None:
        out.append(
            finding(
                "nonfinite",
                PROBLEM,
                origin["message"],
                f"fsdp-replay nan {q}; "
                + replay_through(
                    next(
                        (r for r in summary["per_rank"] if r["rank"] == origin["rank"]),
                        {"rank": origin["rank"]},
                    ),
                    int(origin["step"]),
                    q,
                ),
                rank=origin["rank"],
                step=origin["step"],
                seq=origin.get("seq"),
                op=origin.get("op"),
            )
        )
    if (ranks is None or len(ranks) > 1) and (len(trace.ranks) > 1 or summary.get("missing_ranks")):
        # (one rank chosen with --rank: its peers' records are not looked at, so no desync is claimed)
        rep = desync_report(trace, ranks)
        mm = rep["first_mismatch"]
        if mm is not None:
            entry = next((e for e in mm["entries"].values() if e), None) or {}
            suspects = mm.get("suspects") or []
            out.append(
                finding(
                    "desync",
                    PROBLEM,
                    mm["message"],
                    f"fsdp-replay desync {q}",
                    rank=suspects[0] if suspects else None,
                    step=entry.get("step"),
                    seq=entry.get("seq"),
                    op=entry.get("op"),
                )
            )
        elif rep["stuck"]:
            stuck = [pr for pr in rep["ranks"] if pr["in_flight"]]
            first = stuck[0]["in_flight"]
            out.append(
                finding(
                    "hang",
                    PROBLEM,
                    rep["message"],
                    f"fsdp-replay desync {q}",
                    rank=stuck[0]["rank"],
                    step=first.get("step"),
                    seq=first.get("seq"),
                    op=first.get("op"),
                )
            )
    out += state_findings(trace, ranks, q)
    causes = _causes(summary["per_rank"])
    for r in summary["per_rank"]:
        out += _rank_findings(r, q, _caused_by(r, causes, summary["per_rank"]))
    out += flight_findings(summary["per_rank"], q)
    code = (summary.get("run") or {}).get("exit_code")
    if code not in (None, 0) and not any(f["kind"] == "ended" and f["severity"] == PROBLEM for f in out):
        out.append(
            finding(
                "ended",
                PROBLEM,
                f"the recorded command exited with code {code}, although every rank's record ends cleanly",
                f"fsdp-replay inspect {q} --verbose",
            )
        )
    if summary.get("missing_ranks"):
        out.append(
            finding(
                "ended",
                PROBLEM,
                f"ranks {summary['missing_ranks']} of the world of {summary['world_size']} left no record "
                "(never started recording, or their spools were lost)",
                f"fsdp-replay inspect {q} --verbose",
            )
        )
    if not any(f["severity"] == PROBLEM for f in out):
        done = ", ".join(f"rank {r['rank']}: {r['steps']} steps" for r in summary["per_rank"][:8])
        out.insert(
            0,
            finding(
                "ok",
                INFO,
                f"every rank finished recording cleanly ({done}); no non-finite value, desync or hang",
                rank_replay(summary["per_rank"][0], q) if summary["per_rank"] else None,
            ),
        )
    order = {PROBLEM: 0, WARNING: 1, INFO: 2}
    out.sort(key=lambda f: (order[f["severity"]], f["step"] if f["step"] is not None else 1 << 62))
    return out


def _whole_steps(r: dict[str, Any]) -> set[int] | None:
    """The steps of rank summary ``r`` whose every collective output is stored; None when it has
    no collective output (nothing needs a payload)."""
    cov = r.get("payload_coverage") or {}
    if not cov.get("outputs"):
        return None
    out: set[int] = set()
    for part in str(cov.get("steps", "none")).split(","):
        if part and part != "none":
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def replay_through(r: dict[str, Any], step: int, q: str) -> str:
    """The replay that verifies ``step`` of rank summary ``r``: that rank alone when its payloads
    cover the steps from its latest snapshot at or before ``step``, else every rank again, live."""
    whole = _whole_steps(r)
    start = max([int(s) for s in r.get("snapshots") or [] if int(s) <= step], default=0)
    if whole is not None and not whole.issuperset(range(start, step + 1)):
        return (
            f"fsdp-replay replay {q} --all-ranks --to-step {step}  # the payloads of steps {start}..{step} "
            "are not all stored: every rank again, live"
        )
    return f"fsdp-replay replay {q} --rank {r['rank']} --from-step {step} --to-step {step}"


def rank_replay(r: dict[str, Any], q: str) -> str:
    """The replay of rank summary ``r`` that its payloads allow: alone over its first run of steps
    whose every collective output is stored (from a snapshot at or before it), else every rank
    again with live collectives."""
    whole = _whole_steps(r)
    cmd = f"fsdp-replay replay {q} --rank {r['rank']}"
    if whole is None:  # no collective output to answer: nothing needs a payload
        return cmd
    if not whole:
        return f"fsdp-replay replay {q} --all-ranks  # no step with every payload: every rank again, live"
    lo = hi = min(whole)
    while hi + 1 in whole:
        hi += 1
    if lo > 0:
        cmd += f" --from-step {lo}"
    if hi < int(r.get("steps", 0)) - 1:
        cmd += f" --to-step {hi}"
    return cmd


def _rank_findings(r: dict[str, Any], q: str, caused_by: list[int] | None = None) -> list[dict[str, Any]]:
    """``caused_by``: the ranks whose end this rank's connection error followed from (then its end
    is a warning that names them, not a problem of its own)."""
    rank = r["rank"]
    out = []
    end = r.get("end")
    last_line = exception_text(str((end or {}).get("exception") or ""))
    ended: tuple[str, str] | None = None  # how the rank ended, if not well; what to run next
    if end is None:
        ended = (f"did not finish recording (killed or crashed) after {r['steps']} steps", rank_replay(r, q))
    elif last_line.startswith("KeyboardInterrupt"):  # Ctrl-C (SIGINT): often a job that hung
        ended = (
            f"was interrupted (SIGINT: KeyboardInterrupt) after {r['steps']} steps",
            f"fsdp-replay desync {q}",
        )
    elif end.get("exception"):
        ended = (
            f"ended with an uncaught exception after {r['steps']} steps: {last_line}",
            rank_replay(r, q),
        )
    elif end.get("reason") not in (None, "exit"):
        ended = (f"was stopped by {end['reason']} after {r['steps']} steps", f"fsdp-replay desync {q}")
    if ended is not None:
        severity, message = PROBLEM, f"rank {rank} {ended[0]}"
        if caused_by and end is not None:
            who = f"rank {caused_by[0]}'s" if len(caused_by) == 1 else f"ranks {caused_by}'"
            how = "a peer's process ended under it" if end.get("exception") else "the launcher stopped it"
            severity = WARNING
            message += f": {how}, most likely a consequence of {who} end (above)"
        out.append(finding("ended", severity, message, ended[1], rank=rank, step=max(r["steps"] - 1, 0)))
    for i, oom in enumerate((r.get("memory") or {}).get("ooms") or []):
        out.append(
            finding(
                "oom",
                PROBLEM,
                oom_message(rank, oom),
                f"fsdp-replay export --memory-snapshot {q} --rank {rank} --oom {i} -o oom-{rank}.pickle "
                f"(drag it onto pytorch.org/memory_viz); fsdp-replay export --perfetto {q} -o timeline.json",
                rank=rank,
                step=oom.get("step"),
            )
        )
    counters = (end or {}).get("counters") or {}
    if counters.get("tape_graph_captured"):
        out.append(
            finding(
                "tape_graph_captured",
                WARNING,
                f"rank {rank}: {counters['tape_graph_captured']} calls of taped (nondeterministic) ops were made "
                "while a CUDA graph was captured; the graph runs their kernels at each launch, outside the tape, "
                "so what they computed is not recorded and a replay cannot inject it",
                "a replay that diverges after a graph launch: record with torch.use_deterministic_algorithms(True) "
                "around the capture, or without CUDA graphs",
                rank=rank,
            )
        )
    if counters.get("blobs_dropped"):
        ring = int(counters.get("ring_full_drops", 0))
        window = "flight_blobs_dropped" in counters  # --payloads window:N: the flight recorder's bound
        why = "disk full or the flight recorder's memory bound" if window else "disk full or the memory bound"
        if ring:
            why = f"{ring} of them because the GPU payload ring was full; the others: {why}"
        out.append(
            finding(
                "payloads_dropped",
                WARNING,
                f"rank {rank}: {counters['blobs_dropped']} payloads were dropped while recording ({why}); "
                "a replay of the steps that need them stops there and says so",
                f"record again with a larger {'--window-bytes' if window else '--max-pending-bytes'}"
                + (" and --payload-ring-bytes" if ring else "")
                + ", or fewer --payloads / --tape-payloads steps",
                rank=rank,
            )
        )
    waits = r.get("recording_waits")
    if waits:
        rate = waits.get("writer_gb_per_s")
        out.append(
            finding(
                "recording_waited",
                INFO,
                f"rank {rank}: recording waited {waits['total_ms'] / 1e3:.2f} s for room for payloads in "
                f"{waits['steps']} of {r['steps']} steps (the most: step {waits['worst_step']}, "
                f"{waits['worst_ms']:.0f} ms) for its writer, --max-pending-bytes or the GPU's payload ring"
                + (f"; the writer wrote payloads at {rate:.2f} GB/s" if rate else "")
                + "; nothing was dropped for room (--when-full wait)",
                "to record with less waiting: fewer --payloads steps (steps:SPEC), the flight recorder "
                "(--payloads window:N), a faster disk, or a larger --max-pending-bytes / --payload-ring-bytes",
                rank=rank,
                step=waits["worst_step"],
            )
        )
    for e in r.get("agent_errors") or []:
        out.append(
            finding(
                "agent_error",
                WARNING,
                f"rank {rank}: the agent stopped recording at {e.get('where')}: {e.get('message')}; the record "
                "ends there",
                None,
                rank=rank,
            )
        )
    for d in r.get("damage") or []:
        out.append(
            finding(
                "damage",
                WARNING,
                f"rank {rank}: damaged spool skipped when collected: {d}",
                f"fsdp-replay inspect {q} --verify",
                rank=rank,
            )
        )
    unread = r.get("unread_events") or {}
    if unread:
        wrote = ((r.get("environment") or {}).get("versions") or {}).get("fsdp_replay", "?")
        kinds = ", ".join(f"{k} ({n})" for k, n in sorted(unread.items()))
        out.append(
            finding(
                "unread_events",
                WARNING,
                f"rank {rank}: {sum(unread.values())} events of types this fsdp-replay ({fsdp_replay.__version__}) "
                f"cannot read were written by the agent of fsdp-replay {wrote}: {kinds}; the record counts as "
                "incomplete from the first of them",
                f"collect and read the run with fsdp-replay {wrote} or newer: fsdp-replay collect {q}",
                rank=rank,
            )
        )
    if (r.get("attempts") or 0) > 1:
        out.append(
            finding(
                "restarted",
                INFO,
                f"rank {rank} started recording {r['attempts']} times (a launcher restarted it); the record holds every attempt",
                None,
                rank=rank,
            )
        )
    compiled = r.get("compiled")
    if compiled and compiled.get("nondeterministic"):
        out.append(
            finding(
                "compiled",
                INFO,
                f"rank {rank} ran Inductor kernels doing nondeterministic ops' work "
                f"({', '.join(compiled['nondeterministic'][:3])}): a replay cannot inject their results",
                None,
                rank=rank,
            )
        )
    return out


def window_bound_text(r: dict[str, Any]) -> str:
    """The flight recorder's bound as a rank's policy recorded it (``rank_start.policy``):
    ``": 1073.7 MB, sized from memory"``, or empty in traces from before it was recorded."""
    policy = (r.get("environment") or {}).get("policy") or {}
    if "window_bytes" not in policy:
        return ""
    how = "sized from memory" if policy.get("window_bytes_auto") else "given"
    return f": {int(policy['window_bytes']) / 1e6:.1f} MB, {how}"


def flight_findings(per_rank: list[dict[str, Any]], q: str) -> list[dict[str, Any]]:
    """What the payload flight recorder (``--payloads window:N``) wrote, per rank: the steps a
    failure's dumps cover together, why, and the replay of them; or that it wrote nothing."""
    out = []
    for r in per_rank:
        everything = sorted((r.get("flight_recorder") or {}).get("dumps") or [], key=lambda d: d["t_ns"])
        dumps = [d for d in everything if d["first_step"] <= d["last_step"]]
        rank = r["rank"]
        for d in everything:
            if d["first_step"] > d["last_step"]:  # the failure found no complete window held
                out.append(
                    finding(
                        "flight",
                        WARNING,
                        f"rank {rank}: the flight recorder caught a failure at step {d['last_step']} "
                        f"({d['reason']}: {d['detail']}) but held no complete window to write",
                        "record again with a larger --window-bytes or --snapshot-every closer to the "
                        "window; every rank can be replayed together with live collectives: "
                        f"fsdp-replay replay {q} --all-ranks",
                        rank=rank,
                        step=int(d["last_step"]),
                    )
                )
        groups: list[dict[str, Any]] = []  # dumps whose steps join up: one replay covers them
        for d in dumps:
            g = groups[-1] if groups else None
            if g is not None and d["first_step"] <= g["last"] + 1 and d["last_step"] >= g["first"]:
                g["last"] = max(g["last"], d["last_step"])
                g["reasons"].append(d)
            else:
                groups.append({"first": d["first_step"], "last": d["last_step"], "reasons": [d]})
        for g in groups:
            first, to = g["first"], min(g["last"], r["steps"] - 1)  # a step in progress is partial
            why = "; then ".join(f"{d['reason']} ({d['detail']})" for d in g["reasons"])
            written = sum(int(d["blobs"]) for d in g["reasons"])
            mb = sum(int(d["nbytes"]) for d in g["reasons"]) / 1e6
            dropped = sum(int(d["dropped"]) for d in g["reasons"])
            snap = g["reasons"][0]["snapshot_step"]
            msg = (
                f"rank {rank}: the flight recorder wrote the payloads of steps {first}..{g['last']}"
                + (f" and the snapshot of step {snap}" if snap >= 0 else "")
                + f" ({written} blobs, {mb:.1f} MB) when the run failed: {why}"
                + (
                    f"; {dropped} of their payloads had been dropped at the memory bound "
                    f"(--window-bytes{window_bound_text(r)})"
                    if dropped
                    else ""
                )
            )
            replay = f"fsdp-replay replay {q} --rank {rank} --from-step {first}"
            out.append(
                finding(
                    "flight",
                    WARNING if dropped else INFO,
                    msg,
                    replay + (f" --to-step {to}" if to >= first else ""),
                    rank=rank,
                    step=first,
                )
            )
    windows = {
        str(((r.get("environment") or {}).get("policy") or {}).get("payloads", ""))
        for r in per_rank
        if not (r.get("flight_recorder") or {}).get("dumps")
    }
    held = sorted(w for w in windows if w.startswith("window:"))
    if held and not out:
        killed = [r["rank"] for r in per_rank if r.get("end") is None]
        why = (
            f"no failure it catches happened; rank{'s' if len(killed) > 1 else ''} "
            f"{', '.join(map(str, killed))} ended without closing {'their' if len(killed) > 1 else 'its'} "
            "record (a SIGKILL or the kernel's OOM killer leaves no time to write)"
            if killed
            else "no rank failed"
        )
        out.append(
            finding(
                "flight",
                INFO,
                f"the flight recorder ({held[0]}) wrote no payloads: {why}. A replay of one rank "
                "needs payloads; every rank can be replayed together with live collectives",
                f"fsdp-replay replay {q} --all-ranks",
            )
        )
    return out
