"""Record a training job, build its trace, replay one rank, analyse it, inject recording into pods.

Subcommands: ``record | collect | inspect | replay | diff | nan | desync | webhook | inject |
sidecar``.

Every option is also an environment variable (``FSDP_REPLAY_<OPTION>``), so a pod spec can
configure it without arguments. Exit codes: 0 success, 1 divergence found, 2 usage error,
3 unusable input (missing, truncated or foreign trace); ``record`` returns its command's code.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fsdp_replay import __version__
from fsdp_replay.errors import (
    ConfigError,
    ExitCode,
    FsdpReplayError,
    TraceFormatError,
    TraceNotFoundError,
)
from fsdp_replay.trace.layout import REPORT_JSON, REPORT_TXT, RUN_JSON, atomic_write

EXIT_OK = ExitCode.OK
EXIT_DIVERGED = ExitCode.FOUND
EXIT_USAGE = ExitCode.USAGE
EXIT_BAD_INPUT = ExitCode.UNUSABLE
ENV_PREFIX = "FSDP_REPLAY_"


def _env_default(name: str, default: Any) -> Any:
    return os.environ.get(ENV_PREFIX + name.upper().replace("-", "_"), default)


def _env_flag(name: str) -> bool:
    return str(_env_default(name, "0")).lower() in ("1", "true", "yes", "on")


def resolve_trace(path: str) -> str:
    """A run folder (holding trace.zarr) or the trace itself."""
    from fsdp_replay.trace import schema

    inner = Path(path) / schema.TRACE_DIR
    if "://" not in path and inner.is_dir():
        return str(inner)
    if "://" not in path and inner.exists():
        raise TraceFormatError("not a trace: a file where the trace folder should be", path=str(inner))
    return path


# -- record -----------------------------------------------------------------------------------
def _wants_cxx_kernel(args: argparse.Namespace) -> bool:
    """--cxx-kernel / --no-cxx-kernel, else FSDP_REPLAY_CXX_KERNEL=1/0, else: for runs that store
    no payloads (the C++ kernel records none)."""
    if args.cxx_kernel is not None:
        return bool(args.cxx_kernel)
    if ENV_PREFIX + "CXX_KERNEL" in os.environ:
        return _env_flag("cxx_kernel")
    from fsdp_replay.agent.config import StepSet

    return StepSet.parse(args.payloads).empty and not args.payload_inputs


def _cxx_kernel() -> str:
    """The C++ kernel's library, built first if needed; empty (with a note) where it cannot be."""
    from fsdp_replay.agent import kernel

    try:
        if not kernel.library_path().exists():
            print("fsdp-replay: building the C++ kernel for this torch (once)", file=sys.stderr)
        return str(kernel.build())
    except (kernel.KernelError, OSError) as e:
        print(f"fsdp-replay: C++ kernel not used: {e}", file=sys.stderr)
        return ""


def cmd_record(args: argparse.Namespace) -> int:
    from fsdp_replay.agent.config import AgentConfig, StepSet
    from fsdp_replay.launch import agent_env, run_command
    from fsdp_replay.trace import schema
    from fsdp_replay.trace.redact import redact_argv

    command = list(args.command)
    if not command:
        raise ConfigError(
            "nothing to record: give the command after --, e.g. "
            "fsdp-replay record --out run1 -- torchrun --nproc_per_node 2 train.py"
        )
    out = Path(args.out or f"fsdp-replay-runs/{time.strftime('%Y%m%d-%H%M%S')}").absolute()
    spool_dir = out / schema.SPOOL_DIR
    if spool_dir.exists() and any(spool_dir.iterdir()):
        raise ConfigError(f"{out} already holds a recording; choose another --out (runs are never mixed)")
    out.mkdir(parents=True, exist_ok=True)
    config = AgentConfig(
        mode="record",
        out=str(out),
        payloads=StepSet.parse(args.payloads),
        payload_inputs=args.payload_inputs,
        module_fingerprints=StepSet.parse(args.module_fingerprints),
        snapshot_every=int(args.snapshot_every),
        sync_steps=not args.no_sync_steps,
        reserve_bytes=int(args.reserve_bytes),
        cxx_kernel=_cxx_kernel() if _wants_cxx_kernel(args) else "",
    )
    env = agent_env(out, config.to_env())
    print(f"fsdp-replay: recording into {out}", file=sys.stderr)
    run: dict[str, Any] = {"command": redact_argv(command), "exit_code": None, "fsdp_replay": __version__}
    _write_run(out, run)  # before the run too: a record process killed mid-run still leaves it
    code, info = run_command(command, env)
    run.update(exit_code=code, **info)
    _write_run(out, run)
    if args.no_collect:
        return code
    if not spool_dir.exists():
        print(
            f"fsdp-replay: the command recorded nothing (exit code {code}): no Python process of it "
            "imported torch with the agent enabled",
            file=sys.stderr,
        )
        return code if code else EXIT_BAD_INPUT
    try:
        report = _collect(out, run)
    except OSError as e:
        # The recording itself is whole in the spools: say where the trace could not be written
        # and how to write it elsewhere; the command's own exit code stays the exit code.
        where = e.filename or (out / schema.TRACE_DIR)
        print(
            f"fsdp-replay: could not write the trace ({e.strerror or e}: {where}); every record is kept "
            f"in {spool_dir}. Build the trace elsewhere with: fsdp-replay collect {out} --trace OTHER",
            file=sys.stderr,
        )
        return code
    except TraceFormatError as e:
        print(f"fsdp-replay: the recording could not be collected: {e}", file=sys.stderr)
        return code
    _print_collect(report)
    if not report.damaged and not args.keep_spool:
        import shutil

        shutil.rmtree(spool_dir)  # the trace now holds every record; a damaged spool is kept
    if code:
        print(
            f"fsdp-replay: the command exited with code {code}; the trace holds everything it wrote "
            "before that",
            file=sys.stderr,
        )
    return code


def _write_run(out: Path, run: dict[str, Any]) -> None:
    """run.json, atomically; on a full disk, say so and go on (the spools matter more)."""
    try:
        atomic_write(out / RUN_JSON, json.dumps(run, indent=2) + "\n")
    except OSError as e:
        print(f"fsdp-replay: could not write {out / RUN_JSON}: {e.strerror}", file=sys.stderr)


def _collect(
    out: Path, run: dict[str, Any] | None = None, strict: bool = False, trace: str | None = None
) -> Any:
    from fsdp_replay.trace import schema
    from fsdp_replay.trace.collect import collect

    if run is None and (out / RUN_JSON).is_file():
        try:
            run = json.loads((out / RUN_JSON).read_text())
        except ValueError as e:
            print(f"fsdp-replay: ignoring an unreadable {out / RUN_JSON}: {e}", file=sys.stderr)
    return collect(
        out / schema.SPOOL_DIR,
        trace or out / schema.TRACE_DIR,
        run=run,
        strict=strict,
        on_wait=lambda msg: print(f"fsdp-replay: {msg}", file=sys.stderr),
    )


def _print_collect(report: Any) -> None:
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
            print(
                f"  rank {r.rank}: {r.payloads_dropped} payloads dropped while recording (disk full or memory "
                "bound); every event was kept",
                file=sys.stderr,
            )
    print(f"fsdp-replay: trace written to {report.trace} in {report.seconds:.1f}s", file=sys.stderr)


# -- collect ----------------------------------------------------------------------------------
def cmd_collect(args: argparse.Namespace) -> int:
    out = Path(args.run)
    report = _collect(out, strict=args.strict, trace=args.trace)
    _print_collect(report)
    return EXIT_BAD_INPUT if report.damaged else EXIT_OK


# -- inspect ----------------------------------------------------------------------------------
def cmd_inspect(args: argparse.Namespace) -> int:
    from fsdp_replay.analysis.summary import summarize
    from fsdp_replay.trace.reader import Trace

    trace = Trace.open(resolve_trace(args.trace))
    ranks = [args.rank] if args.rank is not None else None
    summary = summarize(trace, ranks)
    if args.verify:
        from fsdp_replay.trace.scrub import scrub

        checked = scrub(trace, ranks)
        summary["verify"] = {
            "arrays": checked.arrays,
            "blobs": checked.blobs,
            "blob_bytes": checked.blob_bytes,
            "problems": checked.problems,
        }
    if args.json:
        json.dump(summary, sys.stdout, indent=2, default=str)
        print()
    else:
        from fsdp_replay.render import print_summary

        print_summary(summary, verbose=args.verbose)
    if args.verify:
        v = summary["verify"]
        for problem in v["problems"]:
            print(f"fsdp-replay: DAMAGED: {problem}", file=sys.stderr)
        print(
            f"fsdp-replay: verified {v['arrays']} arrays and {v['blobs']} blobs ({v['blob_bytes'] / 1e6:.1f} MB): "
            + (f"{len(v['problems'])} damaged" if v["problems"] else "every one matches"),
            file=sys.stderr,
        )
        if v["problems"]:
            return EXIT_BAD_INPUT
    return EXIT_OK


# -- replay -----------------------------------------------------------------------------------
def cmd_replay(args: argparse.Namespace) -> int:
    from fsdp_replay.agent.config import AgentConfig
    from fsdp_replay.launch import agent_env, run_command
    from fsdp_replay.replayer import launch

    trace_url = resolve_trace(args.trace)
    trace, meta = launch.open_rank(trace_url, args.rank)
    override = list(args.command)
    command, cwd = launch.replay_command(meta, override)
    if not args.force:
        launch.check_script(meta, command, cwd)
        launch.check_torch(meta)
    world = int(meta.get("world_size") or trace.world_size or 1)
    who = "all ranks" if args.all_ranks else f"rank {args.rank}"
    out = Path(args.report) if args.report else launch.report_dir(trace_url, who, args.from_step)
    out.mkdir(parents=True, exist_ok=True)
    config = AgentConfig(
        mode="replay",
        trace=str(Path(trace_url).absolute()) if "://" not in trace_url else trace_url,
        rank=args.rank,
        from_step=args.from_step,
        to_step=args.to_step,
        report=str(out.absolute()),
        live=args.all_ranks,
    )
    notes: list[str] = []
    env = launch.replay_env(meta, args.rank, world, args.device, notes)
    for n in notes:
        print(f"fsdp-replay: note: {n}", file=sys.stderr)
    if args.all_ranks:
        if override:
            raise ConfigError(
                "--all-ranks runs the recorded command under torchrun; it takes no command after --"
            )
        command = launch.all_ranks_command(command, world)
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
    if args.force:
        env["FSDP_REPLAY_FORCE"] = "1"
    env = agent_env(out, config.to_env(), env)
    print(
        f"fsdp-replay: replaying {who} of {world} from step {args.from_step}: {' '.join(command)}",
        file=sys.stderr,
    )
    code, _info = run_command(command, env, cwd=cwd)
    if args.all_ranks:
        return _finish_all_ranks(out, world, code, notes)
    return _finish_report(out / REPORT_JSON, code, notes)


def _finish_report(report_path: Path, code: int, notes: list[str]) -> int:
    from fsdp_replay.analysis.plots import plot_replay as plot
    from fsdp_replay.replayer.report import render_text

    if not report_path.is_file():
        print(
            f"fsdp-replay: the replayed program exited with code {code} before the replay could report "
            "(see its output above)",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    report = json.loads(report_path.read_text())
    report["program_exit_code"] = code
    report["notes"] = [*notes, *report.get("notes", [])]
    atomic_write(report_path, json.dumps(report, indent=2, default=str) + "\n")
    text = render_text(report)
    atomic_write(report_path.parent / REPORT_TXT, text)
    plotted = plot(report, report_path.parent / "replay.png")
    print(text, end="")
    print(
        f"report: {report_path.parent}" + (" (report.json, report.txt, replay.png)" if plotted else ""),
        file=sys.stderr,
    )
    return {"bit-exact": EXIT_OK, "diverged": EXIT_DIVERGED}.get(str(report.get("status")), EXIT_BAD_INPUT)


def _finish_all_ranks(out: Path, world: int, code: int, notes: list[str]) -> int:
    from fsdp_replay.replayer.report import merge_reports
    from fsdp_replay.trace.layout import RANK_REPORT_FMT

    reports = []
    for rank in range(world):
        path = out / RANK_REPORT_FMT.format(rank=rank) / REPORT_JSON
        if path.is_file():
            reports.append(json.loads(path.read_text()))
        else:
            print(
                f"fsdp-replay: rank {rank} wrote no report (the run exited with code {code})", file=sys.stderr
            )
    merged = merge_reports(reports, world)
    atomic_write(out / REPORT_JSON, json.dumps(merged, indent=2, default=str) + "\n")
    results = [
        _finish_report(out / RANK_REPORT_FMT.format(rank=r["rank"]) / REPORT_JSON, code, notes)
        for r in reports
    ]
    print(
        f"all ranks: {merged['status'].upper()}"
        + (
            f"; first divergence on rank {merged['first_divergence']['rank']}"
            f" at step {merged['first_divergence']['step']}"
            if merged.get("first_divergence")
            else ""
        )
    )
    if len(reports) < world:
        return EXIT_BAD_INPUT
    return max(results) if results else EXIT_BAD_INPUT


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fsdp-replay", description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--version", action="version", version=f"fsdp-replay {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser(
        "record",
        help="run a command with recording on, then build its trace",
        description="Record a training command without changing it, like `nsys profile`. "
        "Example: fsdp-replay record --out run1 -- torchrun --nproc_per_node 2 train.py",
    )
    r.add_argument(
        "--out",
        default=_env_default("out", None),
        help="run folder (env FSDP_REPLAY_OUT; default fsdp-replay-runs/<time>)",
    )
    r.add_argument(
        "--payloads",
        default=_env_default("payloads", "all"),
        help="steps whose collective outputs and batches are stored: none, all, steps:0-3,10 "
        "(env FSDP_REPLAY_PAYLOADS; default all)",
    )
    r.add_argument(
        "--payload-inputs",
        action="store_true",
        default=_env_flag("payload_inputs"),
        help="also store collective inputs (env FSDP_REPLAY_PAYLOAD_INPUTS)",
    )
    r.add_argument(
        "--module-fingerprints",
        default=_env_default("module_fingerprints", "none"),
        help="steps whose module outputs and gradients are fingerprinted, so a replay can name the module "
        "where a divergence starts: none, all, steps:SPEC (env FSDP_REPLAY_MODULE_FINGERPRINTS)",
    )
    r.add_argument(
        "--reserve-bytes",
        type=int,
        default=int(_env_default("reserve_bytes", 16 << 20)),
        help="disk space each rank holds back for metadata, released when payloads fill the disk "
        "(env FSDP_REPLAY_RESERVE_BYTES; default 16 MiB)",
    )
    r.add_argument(
        "--snapshot-every",
        type=int,
        default=int(_env_default("snapshot_every", 0)),
        help="snapshot each rank's state every N steps; step 0 always (env FSDP_REPLAY_SNAPSHOT_EVERY)",
    )
    r.add_argument(
        "--no-sync-steps",
        action="store_true",
        default=not _env_flag("sync_steps") if ENV_PREFIX + "SYNC_STEPS" in os.environ else False,
        help="do not wait for each step's records at the step end (faster, weaker crash guarantee)",
    )
    r.add_argument(
        "--cxx-kernel",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="record the hot CPU collectives with the C++ kernel, built against the installed torch "
        "on first use (needs gcc and g++); default: on with --payloads none, whose runs it can "
        "record, off otherwise (env FSDP_REPLAY_CXX_KERNEL=1/0)",
    )
    r.add_argument(
        "--no-collect",
        action="store_true",
        help="leave the spools; build the trace later with `fsdp-replay collect`",
    )
    r.add_argument(
        "--keep-spool",
        action="store_true",
        help="keep the spool folder after building the trace (it is always kept when any record was damaged)",
    )
    r.set_defaults(func=cmd_record)

    c = sub.add_parser("collect", help="build (or rebuild) a run's trace from its spools")
    c.add_argument("run", help="the run folder given to record --out")
    c.add_argument("--strict", action="store_true", help="fail at the first damaged record")
    c.add_argument(
        "--trace",
        default=_env_default("trace", None),
        help="where to write the trace: a folder or an fsspec URL such as s3://bucket/run1 (default RUN/trace.zarr)",
    )
    c.set_defaults(func=cmd_collect)

    rp = sub.add_parser(
        "replay",
        help="replay one rank alone and verify it bit for bit",
        description="Run the recorded command as rank R alone: collectives are answered from the "
        "trace, and every fingerprint is checked. Exit 0 when bit-exact, 1 on divergence, 3 when "
        "the trace or the program cannot be replayed.",
    )
    rp.add_argument("trace", help="a trace (or the run folder holding trace.zarr)")
    rp.add_argument(
        "--rank", type=int, default=int(_env_default("replay_rank", 0)), help="the rank to replay"
    )
    rp.add_argument(
        "--from-step",
        type=int,
        default=int(_env_default("from_step", 0)),
        help="verify from this step, restoring the latest snapshot at or before it",
    )
    rp.add_argument(
        "--to-step",
        type=int,
        default=int(_env_default("to_step", -1)),
        help="stop after this step (default: run to the program's end)",
    )
    rp.add_argument(
        "--device",
        default=_env_default("device", None),
        help="cpu or cuda[:N]: where the replayed rank runs (default: as the program decides)",
    )
    rp.add_argument(
        "--report",
        default=_env_default("report", None),
        help="report folder (default: replays/rank-R-... beside the trace)",
    )
    rp.add_argument(
        "--all-ranks",
        action="store_true",
        help="run every rank again under torchrun with live collectives, comparing every fingerprint with the "
        "record (for traces recorded without payloads)",
    )
    rp.add_argument("--force", action="store_true", help="replay even if the script or torch version differ")
    rp.set_defaults(func=cmd_replay)

    from fsdp_replay.cli_analysis import register
    from fsdp_replay.injector.cli import register as register_injector
    from fsdp_replay.sidecar.cli import register as register_sidecar

    register(sub)
    register_injector(sub)
    register_sidecar(sub)

    i = sub.add_parser("inspect", help="summarize a trace")
    i.add_argument("trace", help="a trace (or the run folder holding trace.zarr)")
    i.add_argument("--rank", type=int, default=None, help="only this rank")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.add_argument("-v", "--verbose", action="store_true", help="also show environment details")
    i.add_argument(
        "--verify",
        action="store_true",
        help="read every array and payload blob and check it against the trace's digests (exit 3 if any is damaged)",
    )
    i.set_defaults(func=cmd_inspect)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in argv:  # everything after -- is the program's command line, untouched
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1 :]
    parser = build_parser()
    args = parser.parse_args(argv)
    args.command = command
    # Exit codes by error class (docs/exit-codes.md). Anything else is a bug and keeps its traceback.
    try:
        return int(args.func(args))
    except ConfigError as e:
        print(f"fsdp-replay: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (TraceNotFoundError, TraceFormatError) as e:
        print(f"fsdp-replay: unusable trace: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except FsdpReplayError as e:
        print(f"fsdp-replay: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:  # a full disk, a permission problem: a clear line, not a traceback
        where = f" ({e.filename})" if e.filename else ""
        print(f"fsdp-replay: {e.strerror or e}{where}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
