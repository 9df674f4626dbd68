"""``fsdp-replay replay``: run the recorded command as one rank alone (or every rank live) and
verify it bit for bit; render its report."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from typing import Any

from fsdp_replay.errors import ConfigError, ExitCode, TraceFormatError
from fsdp_replay.options import env_option, usage_with_command
from fsdp_replay.trace import redact_key, schema, signing
from fsdp_replay.trace.layout import (
    RANK_REPORT_FMT,
    REPLAY_PNG,
    REPORT_JSON,
    REPORT_TXT,
    RUN_JSON,
    atomic_write,
    inside_trace,
    output_folder,
    resolve_trace,
)
from fsdp_replay.trace.redact import scrub_doc, scrub_text


def cmd_replay(args: argparse.Namespace) -> int:
    from fsdp_replay.cli.launch import agent_env, run_command
    from fsdp_replay.replayer import launch
    from fsdp_replay.replayer.config import ReplayConfig
    from fsdp_replay.trace.reader import Trace

    trace_url = resolve_trace(args.trace)
    key = signing.key_of_option(args.signing_key)
    chosen = args.rank is not None
    if not chosen:
        args.rank = 0
    trace = Trace.open(trace_url)
    _check_rank(trace, args.rank)
    meta = launch.rank_meta(trace, args.rank)
    if not chosen and not args.all_ranks and len(trace.ranks) > 1:
        print(
            f"fsdp-replay: no --rank given: replaying rank 0 of the {len(trace.ranks)} recorded (choose one with "
            f"--rank R; `fsdp-replay inspect {args.trace}` leads with the rank to look at)",
            file=sys.stderr,
        )
    override = list(args.command)
    pairs = launch.path_map(meta, args.cwd, args.map)
    notes: list[str] = []
    signature, forged = trace.signature(key, None if args.all_ranks else [args.rank])
    if forged:
        raise TraceFormatError(f"the trace is {signature}", path=trace_url)
    print(f"fsdp-replay: the trace is {signature}", file=sys.stderr)
    if newer := trace.newer_writer():
        notes.append(
            f"the trace was written by fsdp-replay {newer}, newer than this one: what it added is not read"
        )
    command, cwd = launch.replay_command(meta, override, pairs, trusted=args.trust_trace, notes=notes)
    if not override:
        launch.check_script(
            meta,
            command,
            cwd,
            pairs,
            trace.rank(args.rank).attrs.get("modules"),
            force=args.force,
            trusted=args.trust_trace,
        )
    if not args.force:
        launch.check_torch(meta)
    _check_steps(trace, args)
    _check_device(args.device)
    world = int(meta.get("world_size") or trace.world_size or 1)
    who = "all ranks" if args.all_ranks else f"rank {args.rank}"
    out = Path(args.report) if args.report else launch.report_dir(trace_url, who, args.from_step)
    try:
        _check_report_dir(out, trace_url)  # and makes it
    except ConfigError as e:
        if args.report:
            raise
        raise ConfigError(
            f"{e}: the report goes beside the trace by default; give another folder with --report DIR"
        ) from None
    config = ReplayConfig(
        trace=str(Path(trace_url).absolute()) if "://" not in trace_url else trace_url,
        rank=args.rank,
        from_step=args.from_step,
        to_step=args.to_step,
        report=str(out.absolute()),
        live=args.all_ranks,
        force=args.force,
        data=args.data,
        path_map=json.dumps(pairs) if pairs else "",
        fast_forward_warmup=args.fast_forward_warmup,
        trust_trace=args.trust_trace,
        signing_key=str(Path(args.signing_key).absolute()) if args.signing_key else "",
        redacted_env=",".join(
            sorted(k for k, v in (meta.get("env") or {}).items() if schema.has_redacted(v))
        ),
    )
    env = launch.replay_env(
        meta,
        args.rank,
        world,
        args.device,
        notes,
        pairs,
        trusted=args.trust_trace,
        redact_key=redact_key.find(trace_url),
    )
    for old, new in pairs:
        notes.append(f"the recorded run's {old} is {new} here")
    notes[:] = [scrub_text(n) for n in notes]
    for n in notes:
        print(f"fsdp-replay: note: {n}", file=sys.stderr)
    if args.all_ranks:
        if override:
            raise ConfigError(
                "--all-ranks runs the recorded command under torchrun; it takes no command after --"
            )
        command = launch.all_ranks_command(command, world)
        for k in list(env):  # torchrun sets its own launch for each process
            if k in launch.LAUNCHER_ENV or k.startswith(("TORCHELASTIC_", "MASTER_")):
                del env[k]
    env = agent_env(out, config.to_env(), env)
    print(
        f"fsdp-replay: replaying {who} of {world} from step {args.from_step}: {scrub_text(' '.join(command))}",
        file=sys.stderr,
    )
    if args.from_step > 0:
        print(f"fsdp-replay: {_plan(trace, args)}", file=sys.stderr)
    code, info = run_command(command, env, cwd=cwd)
    stopped = (info.get("signals_forwarded") or [None])[0]  # Ctrl-C or SIGTERM, passed to the program
    if args.all_ranks:
        return _finish_all_ranks(out, world, code, notes, stopped)
    return finish_report(out / REPORT_JSON, code, notes, stopped)


def _check_report_dir(out: Path, trace_url: str) -> None:
    """The replay writes its report, and the replayed program its files, into ``out``: never into
    a trace or over a recording."""
    if inside_trace(out, trace_url):
        raise ConfigError(f"--report {out} is inside the trace {trace_url}: choose a folder outside it")
    where = out.resolve()
    if (
        (where / schema.TRACE_DIR).exists()
        or (where / schema.SPOOL_DIR).exists()
        or (where / RUN_JSON).exists()
    ):
        raise ConfigError(
            f"--report {out} holds a recording: choose another folder (a replay never writes over one)"
        )
    output_folder(out, "--report")


def _check_rank(trace: Any, rank: int) -> None:
    """``--rank`` names a rank of the recorded job: a usage error that lists the trace's ranks
    otherwise. A rank of the job that the trace lacks (its spool lost or damaged) is left to the
    reader, which calls the trace unusable for it."""
    ranks, world = list(trace.ranks), trace.world_size
    if not ranks or rank in ranks or (world is not None and 0 <= rank < world):
        return
    held = ", ".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}"
    job = f"the recorded job had {world} rank{'s' if world != 1 else ''} and " if world is not None else ""
    raise ConfigError(
        f"--rank {rank}: {job}the trace holds rank{'s' if len(ranks) != 1 else ''} {held}; choose one of them"
    )


def _check_device(device: str | None) -> None:
    """``--device``: cpu, cuda or cuda:N, and a GPU that is here (the program would otherwise
    run somewhere else than asked, without saying so)."""
    if not device or device == "cpu":
        return
    kind, _, index = device.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise ConfigError(f"--device {device}: use cpu, cuda or cuda:N")
    import torch

    count = torch.cuda.device_count()
    if int(index or 0) >= count:
        raise ConfigError(
            f"--device {device}: this machine has {count} CUDA device{'s' if count != 1 else ''} visible"
            + (" (CUDA_VISIBLE_DEVICES or no GPU)" if not count else "")
        )


def _check_steps(trace: Any, args: argparse.Namespace) -> None:
    """Steps to verify that the record cannot give: said before anything starts (the agent checks
    them again, for a replay started without this command)."""
    if 0 <= args.to_step < args.from_step:
        raise ConfigError(
            f"--to-step {args.to_step} is before --from-step {args.from_step}: nothing to verify"
        )
    for r in trace.ranks if args.all_ranks else [args.rank]:
        done = trace.rank(r).completeness
        if done["complete"] and args.from_step > int(done["through_step"]):
            raise ConfigError(
                f"--from-step {args.from_step}: rank {r}'s record ends with step {done['through_step']}, "
                "so there is nothing to verify from there"
            )


def _plan(trace: Any, args: argparse.Namespace) -> str:
    """What a replay from step S will do before S, said before it starts."""
    snaps = [
        int(s["step"])
        for s in trace.rank(args.rank).attrs.get("snapshots", [])
        if int(s["step"]) <= args.from_step and int(s.get("payload", -1)) >= 0
    ]
    if not snaps or max(snaps) == 0:
        return (
            f"no snapshot after step 0 is at or before step {args.from_step}: every step from 0 is verified"
        )
    at = max(snaps)
    if args.all_ranks:
        return f"each rank restores its snapshot of step {at} after computing the steps before it"
    warm = min(args.fast_forward_warmup, at)

    def steps(a: int, b: int) -> str:
        return f"step {a}" if a == b else f"steps {a}..{b}"

    how = f"{steps(0, warm - 1)} compute" if warm else "no step computes up front"
    if warm < at:
        how += f", {steps(warm, at - 1)} run without kernels (the model skipped)"
    return (
        f"the snapshot of step {at} is restored when the program reaches it; {how}; verified from step {at}"
    )


def finish_report(report_path: Path, code: int, notes: list[str], stopped: int | None = None) -> int:
    """Add what the command line knows to the agent's report.json, write report.txt and the plot,
    print the verdict; the exit code follows the verdict. ``stopped``: the signal this command
    passed on to the program (Ctrl-C, SIGTERM), if any."""
    from fsdp_replay.analysis.plots import plot_replay
    from fsdp_replay.replayer.report import render_text

    if not report_path.is_file() and stopped is not None:
        print(
            f"fsdp-replay: the replay was stopped by {signal.Signals(stopped).name} before it could report "
            f"(the program exited with code {code}): no verdict",
            file=sys.stderr,
        )
        return ExitCode.killed_by(stopped)
    if not report_path.is_file():
        print(
            f"fsdp-replay: the replayed program exited with code {code} before the replay could report "
            "(see its output above)",
            file=sys.stderr,
        )
        return ExitCode.UNUSABLE
    report = json.loads(report_path.read_text())
    report["program_exit_code"] = code
    first = report.get("first_divergence") or {}
    if stopped is not None and report.get("status") == "diverged" and first.get("kind") == "ended_early":
        # the program caught the stop and ended early by itself (a trainer's graceful shutdown)
        report.update(
            status="interrupted",
            reason=f"stopped by {signal.Signals(stopped).name} at step {first.get('step')} after "
            f"{first.get('seq')} collectives (the program ended early when it was stopped): no verdict",
            first_divergence=None,
            divergences=[],
        )
    report["notes"] = [*notes, *report.get("notes", [])]
    report = scrub_doc(report)  # the program's exception and notes may quote a credential
    atomic_write(report_path, json.dumps(report, indent=2, default=str) + "\n")
    text = render_text(report)
    atomic_write(report_path.parent / REPORT_TXT, text)
    plotted = plot_replay(report, report_path.parent / REPLAY_PNG)
    print(text, end="")
    print(
        f"report: {report_path.parent}"
        + (f" ({REPORT_JSON}, {REPORT_TXT}, {REPLAY_PNG})" if plotted else ""),
        file=sys.stderr,
    )
    if report.get("status") == "interrupted":  # the shell's code of the signal passed on (Ctrl-C: 130)
        return ExitCode.killed_by(stopped) if stopped is not None else ExitCode.INTERRUPTED
    verdicts = {"bit-exact": ExitCode.OK, "diverged": ExitCode.FOUND}
    return verdicts.get(str(report.get("status")), ExitCode.UNUSABLE)


def _finish_all_ranks(out: Path, world: int, code: int, notes: list[str], stopped: int | None) -> int:
    from fsdp_replay.replayer.report import merge_reports

    reports = []
    for rank in range(world):
        path = out / RANK_REPORT_FMT.format(rank=rank) / REPORT_JSON
        if path.is_file():
            reports.append(json.loads(path.read_text()))
        else:
            print(
                f"fsdp-replay: rank {rank} wrote no report (the run exited with code {code})", file=sys.stderr
            )
    merged = scrub_doc(merge_reports(reports, world))
    atomic_write(out / REPORT_JSON, json.dumps(merged, indent=2, default=str) + "\n")
    results = [
        finish_report(out / RANK_REPORT_FMT.format(rank=r["rank"]) / REPORT_JSON, code, notes, stopped)
        for r in reports
    ]
    first = merged.get("first_divergence")
    print(
        f"all ranks: {merged['status'].upper()}"
        + (f"; first divergence on rank {first['rank']} at step {first['step']}" if first else "")
    )
    if len(reports) < world:
        return ExitCode.killed_by(stopped) if stopped is not None else ExitCode.UNUSABLE
    return max(results) if results else ExitCode.UNUSABLE


def register(sub: Any) -> None:
    rp = sub.add_parser(
        "replay",
        help="replay one rank alone and verify it bit for bit",
        description="Run the recorded command as rank R alone: collectives are answered from the "
        "trace, and every fingerprint is checked. Exit 0 when bit-exact, 1 on divergence, 3 when "
        "the trace or the program cannot be replayed. Every option is also an environment variable.",
    )
    rp.add_argument("trace", help="a trace (or the run folder holding trace.zarr)")
    env_option(
        rp,
        "--rank",
        kind="int",
        default=None,
        help="the rank to replay (default 0, said when the trace has more)",
    )
    env_option(
        rp,
        "--from-step",
        kind="int",
        default=0,
        help="verify from this step, restoring the latest snapshot at or before it",
    )
    env_option(
        rp,
        "--to-step",
        kind="int",
        default=-1,
        help="stop after this step (default: run to the program's end)",
    )
    env_option(
        rp, "--device", help="cpu or cuda[:N]: where the replayed rank runs (default: as the program decides)"
    )
    env_option(rp, "--report", help="report folder (default: replays/rank-R-... beside the trace)")
    env_option(
        rp,
        "--all-ranks",
        kind="flag",
        help="run every rank again under torchrun with live collectives, comparing every fingerprint with "
        "the record (for traces recorded without payloads)",
    )
    env_option(rp, "--force", kind="flag", help="replay even if the script or torch version differ")
    env_option(
        rp,
        "--signing-key",
        help="a file holding the key the trace was signed with: the replay refuses a trace whose signature "
        "does not match it, or that is not signed",
    )
    env_option(
        rp,
        "--trust-trace",
        kind="flag",
        help="only for a trace you made yourself: run its recorded interpreter and command line as they are "
        "(code given with -c, a script the record does not identify), take the variables that load code "
        "(LD_*, plug-ins) from it, and load an older agent's pickled snapshot as a pickle",
    )
    env_option(
        rp,
        "--cwd",
        help="the folder that stands for the recorded working directory (default: the recorded one if it "
        "exists here, else the current directory); the script and local modules are checked there by sha256",
    )
    env_option(
        rp,
        "--map",
        help="more recorded folders and where they are here: OLD=NEW[,OLD2=NEW2] (paths in the command "
        "line, the environment and the file ledger are mapped)",
    )
    env_option(
        rp,
        "--data",
        default="auto",
        choices=("auto", "recorded", "live"),
        help="where batches come from: recorded (the trace, without the dataset), live (the program's "
        "DataLoader), auto (the trace where it holds them for the verified steps)",
    )
    env_option(
        rp,
        "--fast-forward-warmup",
        kind="int",
        default=2,
        help="with --from-step S: how many steps compute before the rest up to S run without kernels "
        "(default 2: frameworks finish their set-up in the first steps)",
    )
    rp.set_defaults(func=cmd_replay)
    usage_with_command(rp, "[-- COMMAND [ARG ...]]")
