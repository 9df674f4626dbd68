"""Divergences and the replay report (report.json written by the agent, rendered by the CLI)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from fsdp_replay.analysis.payloads import magnitude as payload_magnitude
from fsdp_replay.analysis.summary import compiled_summary, compiled_text
from fsdp_replay.trace.numerics import DEVICE, LIBRARY, Mismatch, likely_cause
from fsdp_replay.trace.redact import scrub_doc

KIND_TEXT = {
    "collective_input": "a collective's input differs",
    "collective_output": "a collective's result differs",
    "op": "a different collective was issued",
    "process_group": "a collective ran on a different process group",
    "shape": "a collective's tensors have other dtypes or shapes",
    "parameters": "parameters after the optimizer step differ",
    "loss": "the loss differs",
    "rng": "an RNG state differs at a step boundary",
    "micro_steps": "a different number of backward passes in the step",
    "extra_collective": "the replay issued more collectives than the record",
    "extra_step": "the replay made more optimizer steps than the record",
    "ended_early": "the program ended before the recorded rank did",
    "payload_missing": "a payload the replay needs is not in the trace",
    "batch": "a batch differs and its recorded bytes are not stored",
    "module": "a module's output differs",
    "nondeterministic_kernel": "a known nondeterministic kernel computed another result",
    "tape_op": "a different op of the nondeterministic-kernel tape ran",
    "extra_tape_call": "the replay called taped ops more often than the record",
}


@dataclass(slots=True)
class Divergence:
    kind: str
    rank: int
    step: int
    micro: int = 0
    seq: int | None = None
    op: str | None = None
    pg: int | None = None
    tensor: str | None = None
    expected_fp: int | None = None
    actual_fp: int | None = None
    magnitude: dict[str, Any] | None = None
    detail: str = ""
    modules: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["what"] = KIND_TEXT.get(self.kind, self.kind)
        for k in ("expected_fp", "actual_fp"):
            if d[k] is not None:
                d[k] = f"{d[k]:016x}"
        return d


def _count(n: int, noun: str) -> str:
    """``1 step``, ``2 steps``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


def magnitude(expected: Any, actual: Any) -> dict[str, Any] | None:
    """How far the replay's tensor (``actual``) is from the recorded one (``expected``): the one
    ``analysis.payloads.magnitude``, on their bytes (``a`` is the record, ``b`` the replay)."""
    import torch

    def raw(t: Any) -> bytes:
        return bytes(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())

    return payload_magnitude(raw(expected), raw(actual), str(actual.dtype).removeprefix("torch."))


def _writers(by: list[int]) -> str:
    """``rank 0``, ``ranks 0, 3``."""
    return f"rank{'s' if len(by) > 1 else ''} {', '.join(map(str, by))}"


def _late_what(x: dict[str, Any]) -> str:
    by = x.get("written_by") or []
    return f"{x['path']}, written by {_writers(by)} of the recorded job" if by else str(x["path"])


def late_note(late: list[dict[str, Any]]) -> str | None:
    """A note on the files the replay read as they are now although they were modified after the
    recorded run began (``overlay.Overlay.late``); None when it read none."""
    if not late:
        return None
    paths = "; ".join(_late_what(x) for x in late[:3])
    return (
        f"the replay read {_count(len(late), 'file')} last modified after the recorded run began ({paths}"
        f"{' ...' if len(late) > 3 else ''}): the view shows such a file as it is now, not as the recorded "
        "run found it (the trace keeps no file content)"
    )


def file_cause(report: dict[str, Any]) -> str | None:
    """The file a divergence most likely comes from: one the recorded run read that changed since,
    else one the replay read that was modified after the recorded run began; None when neither."""
    files = report.get("files") or {}
    changed = files.get("changed_inputs") or []
    if changed:
        c = changed[0]
        by = c.get("written_by") or []
        during = f"; {_writers(by)} of the recorded job wrote it during the run" if by else ""
        return f"{c['path']} changed since the recording ({c['what']}{during}); the recorded run read it"
    late = files.get("late_reads") or []
    if late:
        x = late[0]
        by = x.get("written_by") or []
        who = (
            f"{_writers(by)} of the recorded job wrote it during the run"
            if by
            else "it was modified after the recorded run began"
        )
        return f"{x['path']} is not as the recorded run found it ({who}); the replay read it as it is now"
    return None


def _collective_where(d: dict[str, Any]) -> str:
    """Where a divergence is, in the collectives: what is known of it, never a None."""
    if d.get("seq") is None:
        return ""
    if d.get("kind") == "ended_early":
        return f", after {_count(int(d['seq']), 'collective')}"
    where = f", collective #{d['seq']}"
    if d.get("op"):
        where += f" {d['op']}"
    if d.get("pg") is not None:
        where += f" on process group {d['pg']}"
    return where


def _key_lines(report: dict[str, Any], status: Any) -> list[str]:
    """The replay key's differences (``replayer/key_check.py``), and the likely cause of a divergence."""
    key = report.get("numerics") or {}
    found = [Mismatch(**m) for m in key.get("mismatches") or []]
    if not found:
        return []
    lines = [
        f"  replay key: {len(found)} setting{'s' if len(found) > 1 else ''} differ from the recording's:"
    ]
    for m in found[:12]:
        lines.append(f"    {m.line()}")
    cause = likely_cause(found)
    if status == "diverged" and cause is not None:
        lines.append(
            f"  likely cause: {cause.key} differs (recorded {cause.recorded!r}, here {cause.replay!r})"
        )
    elif status == "bit-exact" and cause is not None and cause.kind in (DEVICE, LIBRARY):
        lines.append(
            "  (the replay matched although it ran elsewhere: these ops computed the same bits here)"
        )
    return lines


def _fast_forward_lines(report: dict[str, Any]) -> list[str]:
    ff = report.get("fast_forward")
    if not ff:
        return []
    target, computed, skipped = ff["to_step"], ff["computed_steps"], ff["skipped_steps"]
    if ff.get("seconds") is None:
        return [f"  the fast-forward to step {target} did not finish (after {computed + skipped} steps)"]
    how = f"steps 0..{computed - 1} computed" if computed else "no step computed up front"
    if skipped:
        how += (
            f"; {_count(skipped, 'step')} run without kernels ({_count(ff['root_calls_skipped'], 'model call')} "
            "answered with placeholders)"
        )
    late = ff.get("steps_computed_for_new_inputs")
    if late:
        how += f"; {late} computed because the model met inputs of a new shape"
    lines = [f"  reached step {target} in {ff['seconds']:.2f} s: {how}"]
    d = report.get("first_divergence")
    if skipped and d and d.get("step") == target and report.get("status") == "diverged":
        lines.append(
            "  the divergence is in the first step after the fast-forward: state the snapshot does not hold "
            "(kept by the program outside its model, optimizer, schedulers and RNG) was not computed in the "
            f"skipped steps; to rule that out, replay with --fast-forward-warmup {target}"
        )
    return lines


def render_text(report: dict[str, Any]) -> str:
    lines = []
    status = report.get("status")
    rank = report.get("rank")
    steps = report.get("verified_steps") or []
    span = f"{steps[0]}..{steps[-1]}" if steps else "none"
    injected = report.get("injected") or {}
    with_tape = (
        f", with {sum(injected.values())} results of nondeterministic kernels injected ("
        + ", ".join(f"{op}: {n}" for op, n in sorted(injected.items()))
        + ")"
        if injected
        else ""
    )
    if status == "bit-exact" and not steps:
        lines.append(
            f"rank {rank}: BIT-EXACT over {report['collectives_verified']} collectives (no step of the "
            f"record is complete){with_tape}"
        )
    elif status == "bit-exact":
        lines.append(
            f"rank {rank}: BIT-EXACT over steps {span} ({report['collectives_verified']} collectives, "
            f"{_count(len(steps), 'step')}){with_tape}"
        )
    elif status == "diverged":
        lines.append(f"rank {rank}: DIVERGED")
    else:
        lines.append(f"rank {rank}: {str(status).upper()}: {report.get('reason')}")
        if steps and status in ("unusable", "interrupted"):
            lines.append(
                f"  before that, steps {span} matched the record ({report.get('collectives_verified', 0)} "
                "collectives): no verdict is drawn past "
                + ("what the trace holds" if status == "unusable" else "where the replay was stopped")
            )
    if report.get("restored_snapshot") is not None:
        lines.append(f"  restored the snapshot of step {report['restored_snapshot']}")
    lines += _fast_forward_lines(report)
    d = report.get("first_divergence")
    cause = file_cause(report) if status == "diverged" else None
    if d:
        where = f"step {d['step']} micro-step {d['micro']}{_collective_where(d)}"
        lines.append(f"  first divergence: {d['what']} at {where}")
        if d.get("tensor"):
            lines.append(f"    tensor: {d['tensor']}")
        if d.get("expected_fp"):
            lines.append(f"    fingerprint: recorded {d['expected_fp']}, replay {d['actual_fp']}")
        m = d.get("magnitude")
        if m and m.get("n_differing"):
            spread = (
                f"; max abs {m['max_abs_diff']:.3g}, max rel {m['max_rel_diff']:.3g}"
                if m.get("max_abs_diff") is not None
                else ""
            )
            lines.append(
                f"    {m['n_differing']} of {m['numel']} elements differ{spread}; first at index "
                f"{m['first_index']} (recorded {m['a_value']!r}, replay {m['b_value']!r})"
            )
        if d.get("detail"):
            lines.append(f"    {d['detail']}")
        if d.get("modules"):
            lines.append(f"    parameters feeding this collective: {', '.join(d['modules'][:12])}")
        module = next((x for x in report.get("divergences", []) if x["kind"] == "module"), None)
        if module:
            lines.append(
                f"  earliest module that differs: {module['tensor']} at step {module['step']} micro-step "
                f"{module['micro']}"
            )
        elif cause is None and d.get("kind") not in (
            "payload_missing",
            "ended_early",
            "nondeterministic_kernel",
        ):
            lines.append(
                f"  to name the module where it starts: record again with --module-fingerprints "
                f"steps:{d['step']}"
            )
        later = [x for x in report.get("divergences", [])[1:] if x.get("seq") is not None]
        if later and d.get("seq") is None:
            x = later[0]
            what = f" {x['op']}" if x.get("op") else ""
            lines.append(f"  first collective affected: #{x['seq']}{what} at step {x['step']} ({x['what']})")
    lines += _key_lines(report, status)
    if report.get("compiled"):
        lines += [f"  {line}" for line in compiled_text(report["compiled"])]
    det = report.get("determinism") or {}
    if (
        status != "bit-exact"
        and det
        and report.get("recorded_on_cuda")
        and not det.get("use_deterministic_algorithms")
    ):
        lines.append(
            "  note: the recorded run did not enable torch.use_deterministic_algorithms: the taped ops' "
            "results were injected, so a divergence inside compute may come from a nondeterministic kernel "
            "outside the tape (--tape-ops adds one)"
            if report.get("taped")
            else "  note: the recorded run did not enable torch.use_deterministic_algorithms and was recorded "
            "with --no-tape: on CUDA some kernels (atomics) are not bit-reproducible, so a divergence inside "
            "compute may come from them"
        )
    op = report.get("op_finding")
    if op:
        head = {
            "op_result": "earliest op that differs",
            "op_input": "earliest op whose inputs differ",
            "op_sequence": "op check",
        }.get(op["kind"], op["kind"])
        module = f" in {op['module']}" if op.get("module") else ""
        lines.append(
            f"  {head}: {op['op']}{module}, op #{op['idx']} of step {op['step']} micro-step {op['micro']}: "
            f"{op['detail']}"
            + ("" if status == "diverged" else " (nothing the replay verifies depended on it)")
        )
    elif report.get("ops_checked"):
        lines.append(f"  every op of the --op-fingerprints window matched ({report['ops_checked']} ops)")
    if cause is not None:
        lines.append(f"  likely cause: {cause}")
    written = (report.get("files") or {}).get("written") or []
    if written:
        lines.append(
            f"  the replay's writes ({len(written)} path{'s' if len(written) > 1 else ''}, e.g. {written[0]}) went to "
            f"{report['files']['private_folder']}; the recorded job's files are untouched"
        )
    for n in report.get("notes", []):
        lines.append(f"  note: {n}")
    return "\n".join(lines) + "\n"


def merge_reports(reports: list[dict[str, Any]], world: int) -> dict[str, Any]:
    """One result for an all-rank replay: the earliest divergence over all ranks."""
    firsts = [r["first_divergence"] for r in reports if r.get("first_divergence")]
    firsts.sort(key=lambda d: (d["step"], d["micro"], d["seq"] if d.get("seq") is not None else -1))
    statuses = {r.get("status") for r in reports}
    if "interrupted" in statuses:
        status = "interrupted"
    elif len(reports) < world or statuses - {"bit-exact", "diverged"}:
        status = "incomplete"
    else:
        status = "diverged" if "diverged" in statuses else "bit-exact"
    return {
        "status": status,
        "world_size": world,
        "ranks": {r["rank"]: r.get("status") for r in reports},
        "first_divergence": firsts[0] if firsts else None,
        "collectives_verified": sum(r.get("collectives_verified", 0) for r in reports),
    }


def build_report(r: Any, status: str, reason: str) -> dict[str, Any]:
    """``report.json`` of a replayer ``r`` (``replayer/agent.py``), with its verdict; redacted
    (``redact.scrub_doc``): the program's exception, a note or a path may quote a credential."""
    report: dict[str, Any] = {
        "status": status,
        "reason": reason,
        "rank": r.rank,
        "live": r.live,
        "world_size": r.world,
        "trace": r.trace.url,
        "from_step": r.from_step,
        "to_step": r.to_step,
        "restored_snapshot": r.restore_step if r.restored else None,
        "fast_forward": r.ff.summary() if getattr(r, "ff", None) is not None else None,
        "verified_steps": r.verified_steps,
        "collectives_verified": r.verified_colls,
        "collectives_per_step": r.colls_per_step,
        "recorded_steps": len(r.rec.steps),
        "recorded_collectives": len(r.rec.colls),
        "record_complete": r.complete,
        "replayed_collectives": r.seq,
        "first_divergence": r.divergences[0].as_dict() if r.divergences else None,
        "divergences": [d.as_dict() for d in r.divergences[:20]],
        "data_differences": r.data_differences,
        "injected": dict(r.tape.injected) if r.tape is not None else {},
        "tape_calls": r.tape.seq if r.tape is not None else 0,
        "tape_matched": r.tape.matched if r.tape is not None else 0,
        "taped": r.tape is not None,
        "notes": r.notes,
        "op_finding": r.ops.finding if getattr(r, "ops", None) is not None else None,
        "ops_checked": r.ops.checked if getattr(r, "ops", None) is not None else 0,
        "files": {
            "changed_inputs": getattr(r, "changed_inputs", []),
            "written": list(r.files.writes[:100]) if getattr(r, "files", None) is not None else [],
            "late_reads": list(r.files.late[:100]) if getattr(r, "files", None) is not None else [],
            "private_folder": r.files.root if getattr(r, "files", None) is not None else None,
        },
        "determinism": r.rec.meta.get("determinism"),
        "compiled": compiled_summary(r.rec.attrs.get("compiled")),
        "numerics": r.key.as_dict() if getattr(r, "key", None) is not None else None,
        "recorded_on_cuda": "cuda" in r.rec.attrs.get("device_names", []),
        "seconds": time.monotonic() - r.t0,
    }
    return scrub_doc(report)
