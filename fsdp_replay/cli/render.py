"""What the commands print: rich tables and colours on a terminal, strict JSON with ``--json``."""

from __future__ import annotations

import json
import math
import sys
from typing import TYPE_CHECKING, Any

from fsdp_replay.trace import numerics

if TYPE_CHECKING:  # rich is imported where a table is drawn: the images' parser has no rich
    from rich.console import Console


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def print_summary(summary: dict[str, Any], *, verbose: bool = False, console: Console | None = None) -> None:
    from rich.table import Table

    con = console or _console()
    run = summary.get("run") or {}
    con.print(f"[bold]trace[/bold] {summary['trace']}  (format v{summary['format_version']})")
    con.print(
        f"world size {summary['world_size']}, ranks present {summary['ranks']}"
        + (f", [red]missing {summary['missing_ranks']}[/red]" if summary["missing_ranks"] else "")
    )
    if run:
        con.print(f"command: {' '.join(run.get('command', []))}  (exit code {run.get('exit_code')})")
    _print_findings(con, summary.get("findings") or [])

    t = Table(
        title="ranks",
        caption="payload steps: every collective output stored (a single-rank replay needs them), part: only some; "
        "local loss: what this rank passed to backward, per micro-batch (a program may print an average)",
    )
    for col in (
        "rank",
        "steps",
        "micro",
        "collectives",
        "batches",
        "snapshots",
        "payloads (outputs)",
        "payload steps",
        "stored",
        "local loss first→last",
        "end",
    ):
        t.add_column(col)
    for r in summary["per_rank"]:
        cov = r["payload_coverage"]
        end = r["end"]
        end_s = "[red]none (killed?)[/red]" if end is None else str(end.get("reason"))
        loss = "" if r["first_loss"] is None else f"{r['first_loss']:.4g}→{r['last_loss']:.4g}"
        t.add_row(
            str(r["rank"]),
            str(r["steps"]),
            str(r["micro_steps"]),
            str(r["collectives"]),
            str(r["batches"]),
            ",".join(map(str, r["snapshots"])) or "-",
            f"{cov['with_payload']}/{cov['outputs']}",
            cov["steps"]
            + (f" (part: {cov['partial_steps']})" if cov.get("partial_steps", "none") != "none" else ""),
            _mb(r["payload_bytes"]),
            loss,
            end_s,
        )
    con.print(t)

    ops = Table(title="collectives by op and process group (per rank)")
    for col in ("rank", "op", "pg", "count", "output bytes"):
        ops.add_column(col)
    for r in summary["per_rank"]:
        for row in r["by_op"]:
            ops.add_row(
                str(r["rank"]),
                row["op"],
                str(row["pg"]),
                str(row["count"]),
                _mb(r["output_bytes_by_op"].get(row["op"], 0)),
            )
    con.print(ops)
    taped = [r for r in summary["per_rank"] if (r.get("tape") or {}).get("calls")]
    if taped:
        tape = Table(title="nondeterministic-kernel tape (per rank): calls, results stored")
        for col in ("rank", "op", "calls"):
            tape.add_column(col)
        for r in taped:
            for op, k in r["tape"]["by_op"].items():
                tape.add_row(str(r["rank"]), op, str(k))
            tape.add_row(
                str(r["rank"]),
                "[dim]results stored[/dim]",
                f"{r['tape']['with_payload']}/{r['tape']['outputs']}",
            )
        con.print(tape)
    _print_memory(con, summary["per_rank"])

    for r in summary["per_rank"]:
        for d in r["damage"]:
            con.print(f"[red]rank {r['rank']} damaged spool (skipped):[/red] {d}")
        for e in r["agent_errors"]:
            con.print(
                f"[yellow]rank {r['rank']} agent stopped recording:[/yellow] {e['where']}: {e['message']}"
            )
        if r["payload_missing"]:
            con.print(f"[yellow]rank {r['rank']}: {r['payload_missing']} payloads were dropped[/yellow]")
        if r["nonfinite_steps"]:
            con.print(f"[red]rank {r['rank']}: non-finite values at steps {r['nonfinite_steps'][:10]}[/red]")
        cost = r.get("recording_cost")
        if cost:
            algos = (r.get("environment") or {}).get("fingerprint_algos") or {}
            native = algos.get("native_core")
            how = (
                ""
                if native is None
                else "; CPU fingerprints by the native core"
                if native
                else "; CPU fingerprints by torch (the native core was not built or was disabled)"
            )
            con.print(
                f"rank {r['rank']}: recording cost per step (median after step 0): "
                f"{cost['agent_cpu_ms_per_step']:.2f} ms CPU in the agent's hooks, "
                f"{cost['writer_cpu_ms_per_step']:.2f} ms in its writer thread{how}"
            )
            if parts := cost.get("agent_cpu_parts_ms"):
                con.print(
                    "  the hooks' by part (ms a step; payloads and snapshots inside the others): "
                    + ", ".join(f"{k} {v:.2f}" for k, v in parts.items())
                )
        if r.get("cupti"):
            from fsdp_replay.analysis.kernels import cupti_lines

            for line in cupti_lines(r["rank"], r["cupti"]):
                con.print(line)
        end = r["end"] or {}
        counters = end.get("counters") or {}
        if counters.get("blobs_dropped"):
            con.print(
                f"[yellow]rank {r['rank']}: {counters['blobs_dropped']} payloads dropped "
                f"({_mb(counters['blob_bytes_dropped'])}); metadata kept[/yellow]"
            )

    if summary["per_rank"]:
        env = summary["per_rank"][0]["environment"]
        v = env.get("versions") or {}
        th = env.get("threads") or {}
        det = env.get("determinism") or {}
        con.print(
            f"environment (rank {summary['per_rank'][0]['rank']}): python {v.get('python')}, torch "
            f"{v.get('torch')}, cuda {v.get('cuda')}, nccl {v.get('nccl')}; intra-op threads "
            f"{th.get('intra_op')}; deterministic algorithms {det.get('use_deterministic_algorithms')}"
        )
        if env.get("numerics"):
            con.print(f"replay key: {numerics.summary_line(env['numerics'])}")
        for r in summary["per_rank"][:1]:
            if r.get("compiled"):
                from fsdp_replay.analysis.summary import compiled_text

                con.print("\n".join(compiled_text(r["compiled"])))
        script = env.get("script") or {}
        con.print(
            f"script {script.get('path')} sha256 {str(script.get('sha256'))[:16]}…  policy {env.get('policy')}"
        )
        if verbose:
            con.print("argv:", env.get("argv"))
            con.print("env:", env.get("env"))
            con.print("determinism:", det)
            if env.get("numerics"):
                con.print("replay key:", env["numerics"])


def _print_memory(con: Any, per_rank: list[dict[str, Any]]) -> None:
    """The CUDA caching allocator per step, and the largest allocations recorded (format 4)."""
    from rich.table import Table

    ranks = [r for r in per_rank if r.get("memory") and r["memory"]["steps"]]
    if not ranks:
        return
    t = Table(title="CUDA memory per step: torch's counters at the step's end (peaks since start or reset)")
    for col in ("rank", "step", "allocated", "reserved", "peak alloc.", "peak resv.", "retries", "actions"):
        t.add_column(col)
    for r in ranks:
        rows = r["memory"]["steps"]
        shown = rows if len(rows) <= 12 else [*rows[:6], None, *rows[-5:]]
        for s in shown:
            if s is None:
                t.add_row("", "…", "", "", "", "", "", "")
                continue
            t.add_row(
                str(r["rank"]),
                str(s["step"]),
                _mb(s["allocated_end"]),
                _mb(s["reserved_end"]),
                _mb(s["allocated_peak"]),
                _mb(s["reserved_peak"]),
                str(s["alloc_retries"]),
                "-" if s["history"] < 0 else str(s["history"]),
            )
    con.print(t)
    for r in ranks:
        for a in r["memory"]["largest"][:3]:
            con.print(
                f"rank {r['rank']}: allocation of {_mb(a['bytes'])} at step {a['step']} micro {a['micro']}"
                + (f" ({a['site']})" if a["site"] else "")
            )


_MARK = {"problem": "[red]PROBLEM[/red]", "warning": "[yellow]warning[/yellow]", "info": "[green]ok[/green]"}


def _print_findings(con: Any, found: list[dict[str, Any]]) -> None:
    """The findings (``analysis/findings.py``), first: what happened, and what to run next."""
    if not found:
        return
    from rich.markup import escape

    con.print("[bold]findings[/bold]")
    for f in found:
        plain = (
            f["kind"] in ("compiled", "flight", "state") and f["severity"] == "info"
        )  # facts, not a verdict
        mark = "note" if plain else _MARK.get(f["severity"], f["severity"])
        con.print(f"  {mark} {escape(f['message'])}", soft_wrap=True)
        if f.get("next"):
            con.print(f"      next: {escape(f['next'])}", soft_wrap=True)
    con.print()


def jsonable(x: Any) -> Any:
    """Strict JSON: non-finite floats become the strings "NaN", "Infinity", "-Infinity"."""
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    return x


def dump_json(obj: Any) -> None:
    json.dump(jsonable(obj), sys.stdout, indent=2, allow_nan=False, default=str)
    print()


def console() -> Console:
    return _console(highlight=False)


def _console(**kwargs: Any) -> Console:
    """rich's console; piped into a file or a CI log, as wide as a line needs (rich would cut every
    table to 80 columns and wrap sentences there)."""
    import os

    from rich.console import Console

    if not sys.stdout.isatty() and "COLUMNS" not in os.environ:
        kwargs.setdefault("width", 1000)
        kwargs.setdefault("soft_wrap", True)
    return Console(**kwargs)


def escape(x: Any) -> str:
    from rich.markup import escape as rich_escape

    return rich_escape(str(x))


def print_collect(report: Any) -> None:
    """What ``record`` and ``collect`` say about each rank they collected (stderr)."""
    for r in report.ranks:
        status = "complete" if r.clean_end else "INCOMPLETE (process ended without closing its spool)"
        print(
            f"  rank {r.rank}: {r.steps} steps, {r.collectives} collectives, {r.batches} batches, "
            f"{r.blobs_written} blobs written ({r.blob_bytes / 1e6:.1f} MB), {r.blobs_shared} shared; {status}",
            file=sys.stderr,
        )
        if r.error is not None:
            print(f"  rank {r.rank}: NOT COLLECTED: {r.error}", file=sys.stderr)
            continue
        if r.rebuilt:
            print(
                f"  rank {r.rank}: collected anew from its spool (the trace's copy: {r.rebuilt})",
                file=sys.stderr,
            )
        for d in r.damage:
            print(f"  rank {r.rank}: DAMAGED spool, skipped: {d}", file=sys.stderr)
        c = r.completeness
        if c and not c.get("complete"):
            print(
                f"  rank {r.rank}: record complete through step {c['through_step']}: {'; '.join(c['reasons'])}",
                file=sys.stderr,
            )
        if r.payload_missing:
            print(
                f"  rank {r.rank}: {r.payload_missing} payloads referenced but not stored (dropped)",
                file=sys.stderr,
            )
        if r.payloads_dropped:
            bound = (
                "the flight recorder's memory bound: --window-bytes"
                if r.window
                else "memory bound: --max-pending-bytes"
            )
            why = f"disk full or {bound}"
            if r.ring_full_drops:
                ring = "no room in the GPU's payload ring: --payload-ring-bytes"
                why = (
                    ring
                    if r.ring_full_drops >= r.payloads_dropped
                    else f"{r.ring_full_drops}: {ring}; the rest: {why}"
                )
            print(
                f"  rank {r.rank}: {r.payloads_dropped} payloads dropped while recording ({why}); every event was kept",
                file=sys.stderr,
            )
        if r.payload_waits:
            rate = f"; its writer wrote at {r.writer_rate / 1e9:.2f} GB/s" if r.writer_rate else ""
            print(
                f"  rank {r.rank}: recording waited {r.payload_wait_ns / 1e9:.2f} s in all for room for "
                f"payloads ({r.payload_waits} waits: the writer, --max-pending-bytes or the GPU's payload "
                f"ring was full: --when-full wait waits rather than drops){rate}; `fsdp-replay inspect` names the steps",
                file=sys.stderr,
            )
    print(f"fsdp-replay: trace written to {report.trace} in {report.seconds:.1f}s", file=sys.stderr)
