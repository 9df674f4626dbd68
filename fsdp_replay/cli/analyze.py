"""``fsdp-replay nan | desync | diff``: post-mortem analysis subcommands.

``register(subparsers)`` adds them to the main parser. Exit codes: 0 nothing found (finite,
consistent, identical), 1 found (a non-finite value, ranks that disagree, a divergence), 3
unusable input (the reader's errors propagate to ``fsdp_replay.cli.main``).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from fsdp_replay.cli.render import console, dump_json, escape
from fsdp_replay.errors import ExitCode
from fsdp_replay.options import env_option
from fsdp_replay.trace.layout import output_file, resolve_trace
from fsdp_replay.trace.redact import scrub_doc

if TYPE_CHECKING:
    from fsdp_replay.trace.reader import Trace


def _open(path: str) -> Trace:
    from fsdp_replay.trace.reader import Trace  # zarr and numpy: only once a trace is opened

    return Trace.open(resolve_trace(path))


EXIT_OK = ExitCode.OK
EXIT_FOUND = ExitCode.FOUND


# -- nan ---------------------------------------------------------------------------------------
def cmd_nan(args: argparse.Namespace) -> int:
    from fsdp_replay.analysis.columns import record_notes
    from fsdp_replay.analysis.nonfinite import describe_nonfinite, nonfinite_origin

    trace = _open(args.trace)
    origin, notes = scrub_doc([nonfinite_origin(trace), record_notes(trace)])
    if args.json:
        dump_json({"trace": trace.url, "found": origin is not None, "origin": origin, "notes": notes})
        return EXIT_FOUND if origin else EXIT_OK
    con = console()
    if origin is None:
        con.print(f"[green]no non-finite value[/green] in {escape(trace.url)} (ranks {escape(trace.ranks)})")
        _print_notes(con, notes)
        return EXIT_OK
    con.print(f"[bold red]{escape(origin['message'])}[/bold red]")
    con.print(f"cause: {escape(origin['cause'])}")
    con.print("first non-finite event per rank:")
    for row in origin["per_rank"]:
        ev = row["event"]
        text = "[green]stayed finite[/green]" if ev is None else escape(describe_nonfinite(ev))
        con.print(f"  rank {row['rank']}: {text}")
    _print_notes(con, notes)
    return EXIT_FOUND


def _print_notes(con: Any, notes: list[str]) -> None:
    for n in notes:
        con.print(f"[yellow]note: {escape(n)}[/yellow]")


# -- desync ------------------------------------------------------------------------------------
def _entry(e: dict[str, Any] | None) -> str:
    if e is None:
        return "-"
    return f"{e['op']} pg {e['pg']} (step {e['step']}, seq {e['seq']})"


def cmd_desync(args: argparse.Namespace) -> int:
    from fsdp_replay.analysis.desync import desync_report

    trace = _open(args.trace)
    rep = scrub_doc(desync_report(trace))
    if args.json:
        dump_json(rep)
        return EXIT_OK if rep["consistent"] else EXIT_FOUND
    from rich.table import Table

    con = console()
    style = "green" if rep["consistent"] else "bold red"
    con.print(f"[{style}]{escape(rep['message'])}[/{style}]")
    t = Table(title="where each rank stopped")
    for col in ("rank", "steps done", "end", "collectives", "last completed", "in flight"):
        t.add_column(col)
    for pr in rep["ranks"]:
        end = pr["end"] or "[red]none (killed?)[/red]"
        t.add_row(
            str(pr["rank"]),
            str(pr["steps_done"]),
            end if pr["end"] is None else escape(end),
            str(pr["collectives"]),
            escape(_entry(pr["last_completed"])),
            escape(_entry(pr["in_flight"])),
        )
    con.print(t)
    if rep["missing_ranks"]:
        con.print(f"[red]ranks without any data: {escape(rep['missing_ranks'])}[/red]")
    others = [g for g in rep["groups"] if g["mismatch"] and g["mismatch"] is not rep["first_mismatch"]]
    for g in others:
        con.print(f"also: {escape(g['mismatch']['message'])}")
    for u in rep["unrecorded"]:
        con.print(f"[yellow]not a disagreement: {escape(u['message'])}[/yellow]")
    if rep["states"]:
        con.print("[bold]what each rank was doing when asked (dump request)[/bold]")
        for line in rep["states"]:
            con.print(f"  {escape(line)}")
    _print_notes(con, rep["notes"])
    return EXIT_OK if rep["consistent"] else EXIT_FOUND


# -- diff --------------------------------------------------------------------------------------
def _mag(ev: dict[str, Any] | None) -> str:
    if ev is None:
        return ""
    m = ev.get("magnitude")
    if m is None:
        return ev.get("magnitude_note", "") or ""
    if "abs_diff" in m:
        return f"|diff| {m['abs_diff']:.3g}"
    if m.get("n_differing") is None:
        return m.get("note", "")
    out = f"{m['n_differing']}/{m['numel']} differ"
    if m.get("max_abs_diff") is not None:
        out += f", max abs {m['max_abs_diff']:.3g}, max rel {m['max_rel_diff']:.3g}"
    if m.get("first_index") is not None:
        out += f", first at [{m['first_index']}]"
    return out


def _event_lines(ev: dict[str, Any]) -> list[str]:
    where = f"step {ev['step']}" + (f" micro {ev['micro']}" if ev.get("micro") is not None else "")
    kind = ev["kind"]
    if kind == "loss":
        return [f"{where}: loss {ev['loss_a']!r} vs {ev['loss_b']!r} ({_mag(ev)})"]
    if kind == "parameters after step":
        name = f" ({ev['param_name']})" if ev.get("param_name") else ""
        return [
            f"after step {ev['step']}: {ev['params_differing']} parameter shards differ, "
            f"first #{ev['tensor_index']}{name}: fp {ev['fp_a']} vs {ev['fp_b']}"
        ]
    if kind.startswith("batch"):
        from fsdp_replay.analysis.columns import batch_name

        what = f"tensor {ev['tensor_index']}" if ev.get("tensor_index") is not None else "its structure"
        return [f"{where}: {batch_name(ev)} differs ({what})"]
    if "a" in ev and "b" in ev and isinstance(ev["a"], dict):
        return [f"{where}, seq {ev['seq']}: {kind}", f"  A: {ev['a']}", f"  B: {ev['b']}"]
    lines = [
        f"{where}, seq {ev['seq']}: {ev['op']} (pg {ev['pg']}) {ev['role']} {ev['tensor_index']} "
        f"{ev.get('dtype')}{ev.get('shape')}",
        f"  fp {ev['fp_a']} vs {ev['fp_b']}" + (f"; {_mag(ev)}" if _mag(ev) else ""),
    ]
    return lines


def cmd_diff(args: argparse.Namespace) -> int:
    from fsdp_replay.analysis.diff import diff_traces
    from fsdp_replay.analysis.plots import PLOT_SUFFIXES, plot_drift

    if args.plot:
        output_file(args.plot, "--plot", (args.trace_a, args.trace_b), PLOT_SUFFIXES)
    a, b = _open(args.trace_a), _open(args.trace_b)
    res = scrub_doc(diff_traces(a, b, [args.rank] if args.rank is not None else None))
    if args.plot:
        plot_drift(res, args.plot)
    code = EXIT_FOUND if res["diverged"] else EXIT_OK
    if args.json:
        dump_json(res)
        return code
    con = console()
    con.print(f"A = {escape(a.url)}\nB = {escape(b.url)}")
    style = "bold red" if res["diverged"] else "green"
    con.print(f"[{style}]{escape(res['message'])}[/{style}]")
    for note in res["notes"]:
        con.print(f"[yellow]note: {escape(note)}[/yellow]")
    for side, missing in res["missing_ranks"].items():
        if missing:
            con.print(f"[yellow]ranks {escape(missing)} are missing from trace {side.upper()}[/yellow]")
    for pr in res["ranks"]:
        ev = pr["first"]
        if ev is None:
            con.print(f"rank {pr['rank']}: [green]{escape(pr['message'])}[/green]")
            continue
        lines = _event_lines(ev)
        con.print(f"rank {pr['rank']}: [red]diverged[/red] at {escape(lines[0])}")
        for line in lines[1:]:
            con.print(f"        {escape(line)}")
        fc = pr.get("first_collective")
        if fc is not None and fc != ev:
            fl = _event_lines(fc)
            con.print(f"        first divergent collective: {escape(fl[0])}")
            for line in fl[1:]:
                con.print(f"        {escape(line)}")
        if not pr["same_length"]:
            con.print(f"        {escape(pr['message'][pr['message'].rfind('(') :])}")
    if args.plot:
        con.print(f"drift plot written to {escape(args.plot)}")
    return code


def register(subparsers: Any) -> None:
    """Add ``nan``, ``desync`` and ``diff`` to the CLI's subparsers."""
    n = subparsers.add_parser(
        "nan",
        help="find the first step, rank and collective where a NaN/Inf appeared",
        description="From the trace alone: the first (step, rank, collective) with a non-finite value. "
        "Exit code 1 when one was found, 0 when everything stayed finite.",
    )
    n.add_argument("trace", help="a trace (or the run folder holding trace.zarr)")
    env_option(n, "--json", kind="flag", help="machine-readable output")
    n.set_defaults(func=cmd_nan)

    d = subparsers.add_parser(
        "desync",
        help="for a hang: where each rank stopped, and the collective at which ranks disagree",
        description="Compare the ranks' collective sequences per process group. "
        "Exit code 1 when ranks disagree, 0 when they agree.",
    )
    d.add_argument("trace", help="a trace (or the run folder holding trace.zarr)")
    env_option(d, "--json", kind="flag", help="machine-readable output")
    d.set_defaults(func=cmd_desync)

    f = subparsers.add_parser(
        "diff",
        help="the first divergence between two traces of the same job (two runs, or a run and its replay)",
        description="Per rank, the first collective, loss, parameter or batch fingerprint that differs. "
        "Exit code 1 when a divergence was found, 0 when identical.",
    )
    f.add_argument("trace_a", metavar="TRACE_A", help="a trace (or run folder)")
    f.add_argument("trace_b", metavar="TRACE_B", help="a trace (or run folder)")
    env_option(f, "--rank", kind="int", help="only this rank")
    env_option(f, "--plot", metavar="PNG", help="draw the per-step drift into this PNG (or .svg, .pdf)")
    env_option(f, "--json", kind="flag", help="machine-readable output")
    f.set_defaults(func=cmd_diff)
