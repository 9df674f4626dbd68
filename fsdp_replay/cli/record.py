"""``fsdp-replay record`` and ``collect``: run a command with recording on, and build its trace."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from fsdp_replay import __version__
from fsdp_replay.cli.render import print_collect
from fsdp_replay.errors import ConfigError, ExitCode, TraceFormatError, TraceNotFoundError
from fsdp_replay.options import env_option, env_var, usage_with_command
from fsdp_replay.trace import schema, signing, spool
from fsdp_replay.trace.attach_markers import empty_run, nothing_recorded
from fsdp_replay.trace.layout import ATTACHED_DIR, RUN_JSON, atomic_write, attached_dir, output_folder


def _wants_cxx_kernel(args: argparse.Namespace, payloads: Any) -> bool:
    """--cxx-kernel / --no-cxx-kernel (or FSDP_REPLAY_CXX_KERNEL=1/0), else: for runs that store
    no payloads (``payloads``, a StepSet: the C++ kernel records none)."""
    if args.cxx_kernel is not None:
        return bool(args.cxx_kernel)
    return bool(payloads.empty) and not args.payload_inputs


def _option(flag: str) -> str:
    """How a bad value names its option: the flag and its variable (either may have set it)."""
    return f"{flag} ({env_var(flag)})"


def _cxx_kernel() -> str:
    """The C++ kernel's library, built first if needed; empty (with a note) where it cannot be."""
    from fsdp_replay.agent.cxx import kernel

    try:
        if not kernel.library_path().exists():
            print("fsdp-replay: building the C++ kernel for this torch (once)", file=sys.stderr)
        return str(kernel.build())
    except (kernel.KernelError, OSError) as e:
        print(f"fsdp-replay: C++ kernel not used: {e}", file=sys.stderr)
        return ""


def _wants_cxx_tape(args: argparse.Namespace) -> bool:
    """--cxx-tape / --no-cxx-tape (or FSDP_REPLAY_CXX_TAPE=1/0), else: with the tape, where it has
    something to take (a CUDA device, or ops of the user's own)."""
    if not args.tape:
        return False
    if args.cxx_tape is not None:
        return bool(args.cxx_tape)
    import torch

    return bool(args.tape_ops) or torch.cuda.is_available()


def _cxx_tape() -> str:
    """The C++ tape hook's library, built first if needed; empty (with a note) where it cannot be."""
    from fsdp_replay.agent.cxx import tape

    try:
        if not tape.library_path().exists():
            print("fsdp-replay: building the C++ tape hook for this torch (once)", file=sys.stderr)
        return str(tape.build())
    except (tape.TapeError, OSError) as e:
        print(
            f"fsdp-replay: C++ tape hook not used (the Python tape records every call): {e}", file=sys.stderr
        )
        return ""


def cmd_record(args: argparse.Namespace) -> int:
    from fsdp_replay.agent.config import (
        AUTO,
        RecordConfig,
        StepSet,
        parse_alloc_history,
        parse_cupti,
        parse_payloads,
        parse_steps,
    )
    from fsdp_replay.cli.launch import agent_env, run_command
    from fsdp_replay.trace import redact_key
    from fsdp_replay.trace.redact import redact_argv

    command = list(args.command)
    if not command:
        raise ConfigError(
            "nothing to record: give the command after the options (or after --), e.g. "
            "fsdp-replay record --out run1 -- torchrun --nproc_per_node 2 train.py"
        )
    # bad values are said before the run folder is made
    payloads = parse_payloads(_option("--payloads"), args.payloads)
    if args.payloads.strip() == AUTO and payloads.window:
        print(
            f"fsdp-replay: --payloads auto: {payloads} (CUDA devices are visible: the flight recorder, which "
            "writes the last steps' payloads when the run fails; --payloads all keeps every step's)",
            file=sys.stderr,
        )
    steps = {
        name: parse_steps(_option("--" + name.replace("_", "-")), value)
        for name in ("module_fingerprints", "op_fingerprints", "tape_payloads")
        if (value := getattr(args, name))
    }
    alloc_history = parse_alloc_history(_option("--alloc-history"), args.alloc_history)
    cupti = parse_cupti(_option("--cupti"), args.cupti)
    out = Path(args.out or f"fsdp-replay-runs/{time.strftime('%Y%m%d-%H%M%S')}").absolute()
    spool_dir = out / schema.SPOOL_DIR
    if (spool_dir.exists() and any(p.name != ATTACHED_DIR for p in spool_dir.iterdir())) or (
        out / schema.TRACE_DIR
    ).exists():
        raise ConfigError(
            f"{out} already holds a recording; choose another --out (runs are never mixed, nor written over)"
        )
    output_folder(out, "--out")  # before the agent's libraries are built: a bad folder says so at once
    signing_key = signing.key_of_option(args.signing_key)  # a bad key file too
    # a run that recorded nothing there before left only its processes' attach markers: not theirs now
    shutil.rmtree(attached_dir(out), ignore_errors=True)
    redaction_key = redact_key.for_run(out)  # RUN/redact.key, beside the trace, never in it
    config = RecordConfig(
        out=str(out),
        payloads=payloads,
        payload_inputs=args.payload_inputs,
        module_fingerprints=steps.get("module_fingerprints", StepSet()),
        op_fingerprints=steps.get("op_fingerprints", StepSet()),
        snapshot_every=args.snapshot_every,
        sync_steps=args.sync_steps,
        max_pending_bytes=args.max_pending_bytes,
        when_full=args.when_full,
        window_bytes=args.window_bytes,
        reserve_bytes=args.reserve_bytes,
        payload_ring_bytes=args.payload_ring_bytes,
        tape=args.tape,
        tape_ops=args.tape_ops,
        tape_payloads=steps.get("tape_payloads"),
        alloc_history=alloc_history,
        alloc_stacks=args.alloc_stacks,
        cupti=cupti,
        cxx_kernel_lib=_cxx_kernel() if _wants_cxx_kernel(args, payloads) else "",
        cxx_tape_lib=_cxx_tape() if _wants_cxx_tape(args) else "",
        redact_key=redaction_key,
    )
    env = agent_env(out, config.to_env())
    print(f"fsdp-replay: recording into {out}", file=sys.stderr)
    run: dict[str, Any] = {
        "command": redact_argv(command, redaction_key),
        "exit_code": None,
        "fsdp_replay": __version__,
    }
    _write_run(out, run)  # before the run too: a record process killed mid-run still leaves it
    code, info = run_command(
        command, env, orphan_note=f"Its spools are kept: build the trace with `fsdp-replay collect {out}`"
    )
    run.update(exit_code=code, **info)
    _write_run(out, run)
    if info.get("error"):
        print(f"fsdp-replay: {info['error']}", file=sys.stderr)
    if args.no_collect:
        return code
    if not spool.spool_ranks(spool_dir):
        print(f"fsdp-replay: {nothing_recorded(out, code)}", file=sys.stderr)
        return code if code else ExitCode.UNUSABLE
    try:
        report = collect_run(out, run, signing_key=signing_key)
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
    print_collect(report)
    if not report.damaged and not args.keep_spool:
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


def collect_run(
    out: Path,
    run: dict[str, Any] | None = None,
    strict: bool = False,
    trace: str | None = None,
    signing_key: signing.SigningKey | None = None,
) -> Any:
    """Build the trace of run folder ``out`` (``trace``: elsewhere), saying so if it must wait."""
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
        signing_key=signing_key,
    )


def cmd_collect(args: argparse.Namespace) -> int:
    out = Path(args.run)
    if not out.is_dir():
        raise TraceNotFoundError(f"no run folder {out} (collect takes the folder given to record --out)")
    built = out / schema.TRACE_DIR
    if not spool.spool_ranks(out / schema.SPOOL_DIR) and built.is_dir():
        # record removes the spools once the trace is written: the trace is all there is
        if args.trace:
            print(
                f"fsdp-replay: nothing to collect in {out}: its trace is built ({built}) and its spools were "
                f"removed when it was; copy that folder to {args.trace} instead",
                file=sys.stderr,
            )
            return ExitCode.UNUSABLE
        print(f"fsdp-replay: {out}: the trace is already built ({built}); nothing to collect")
        return ExitCode.OK
    if (why := empty_run(out)) is not None:
        print(f"fsdp-replay: nothing to collect in {out}: {why}", file=sys.stderr)
        return ExitCode.UNUSABLE
    report = collect_run(
        out, strict=args.strict, trace=args.trace, signing_key=signing.key_of_option(args.signing_key)
    )
    print_collect(report)
    return ExitCode.UNUSABLE if report.damaged else ExitCode.OK


_SIGNING_KEY_HELP = (
    "a file holding a key (16+ random bytes) that signs the trace, so inspect and replay given the same key "
    "can tell it was not changed since"
)


def register(sub: Any) -> None:
    from fsdp_replay.agent.config import AUTO, AUTO_GPU_POLICY, WHEN_FULL, RecordConfig

    defaults = RecordConfig(out="-")
    r = sub.add_parser(
        "record",
        help="run a command with recording on, then build its trace",
        description="Record a training command without changing it, like `nsys profile`. "
        "Example: fsdp-replay record --out run1 -- torchrun --nproc_per_node 2 train.py. "
        "Every option is also an environment variable (shown with each).",
    )
    env_option(r, "--out", help="run folder (default fsdp-replay-runs/<time>)")
    env_option(
        r,
        "--payloads",
        default=AUTO,
        help="steps whose collective outputs, batches and taped results are stored: none, all, steps:0-3,10, "
        "window:N (the flight recorder: the last N steps' payloads held in memory, written only if the run "
        f"fails), or auto (the default: {AUTO_GPU_POLICY} where CUDA devices are visible, all on a CPU)",
    )
    env_option(r, "--payload-inputs", kind="flag", help="also store collective inputs")
    env_option(
        r,
        "--module-fingerprints",
        default=str(defaults.module_fingerprints),
        help="steps whose module outputs and gradients are fingerprinted, so a replay can name the module "
        "where a divergence starts: none, all, steps:SPEC",
    )
    env_option(
        r,
        "--op-fingerprints",
        default=str(defaults.op_fingerprints),
        help="steps whose every op's inputs and outputs are fingerprinted (slow: for a short window), so a "
        "replay names the first op that computed another result from the same inputs: none, all, steps:SPEC",
    )
    env_option(
        r,
        "--max-pending-bytes",
        kind="int",
        default=defaults.max_pending_bytes,
        help="payload bytes each rank lets wait for its writer; past it a new payload waits for room (or, with "
        "--when-full drop, is dropped and counted)",
    )
    env_option(
        r,
        "--when-full",
        default=defaults.when_full,
        choices=WHEN_FULL,
        help="when the writer, --max-pending-bytes or a GPU's payload ring is full: wait (the default: the training "
        "waits for room, the wait counted per step and reported; nothing a replay needs is lost) or drop "
        "(payloads are dropped and counted; a replay stops where it needs one)",
    )
    env_option(
        r,
        "--window-bytes",
        kind="int",
        default=defaults.window_bytes,
        help="with --payloads window:N: payload bytes each rank's flight recorder holds in memory; past it the "
        "window starts at a later snapshot; a step that still does not fit restarts the window at the next "
        "snapshot (a window is never written with holes); 0: a quarter of the available "
        "memory (the host's, or what a container's memory limit leaves) divided by its ranks (LOCAL_WORLD_SIZE), "
        "at least --max-pending-bytes",
    )
    env_option(
        r,
        "--payload-ring-bytes",
        kind="int",
        default=defaults.payload_ring_bytes,
        help="CUDA: bytes of each GPU's payload ring (a device and a pinned host buffer): stored device "
        "payloads reach the writer off the training stream; one that finds no room waits for it (see "
        "--when-full); 0: copy them on the training stream",
    )
    env_option(
        r,
        "--reserve-bytes",
        kind="int",
        default=defaults.reserve_bytes,
        help="disk space each rank holds back for metadata, released when payloads fill the disk",
    )
    env_option(
        r,
        "--snapshot-every",
        kind="int",
        default=defaults.snapshot_every,
        help="snapshot each rank's state every N steps; step 0 always, and the first step of each "
        "--payloads steps: range (with --payloads window:N: every N steps by default, held in memory)",
    )
    env_option(
        r,
        "--sync-steps",
        kind="bool",
        default=defaults.sync_steps,
        help="wait at each step end until the step's records are written (--no-sync-steps: faster, a weaker "
        "crash guarantee)",
    )
    env_option(
        r,
        "--cxx-kernel",
        kind="bool",
        help="record the hot CPU collectives with the C++ kernel, built against the installed torch on "
        "first use (needs gcc and g++); default: on with --payloads none, whose runs it can record",
    )
    env_option(
        r,
        "--tape",
        kind="bool",
        default=defaults.tape,
        help="fingerprint (and with the payloads, keep) what the ops with nondeterministic CUDA kernels computed, "
        "so a replay can inject it (--no-tape: off)",
    )
    env_option(
        r,
        "--cxx-tape",
        kind="bool",
        help="record the taped calls of steps that store no payloads in C++ (one driver launch and an event a "
        "call), built against the installed torch on first use (needs gcc and g++); default: on with the tape, "
        "where CUDA is available or --tape-ops names ops",
    )
    env_option(
        r,
        "--tape-ops",
        default=defaults.tape_ops,
        help="more ops to tape, on CPU and CUDA: ns::op,ns2::other (your own kernels registered with torch.library)",
    )
    env_option(
        r,
        "--tape-payloads",
        help="steps whose taped results are stored: none, all, steps:SPEC (default: as --payloads; none keeps "
        "fingerprints only, and a replay then names the kernel where it differs)",
    )
    env_option(
        r,
        "--alloc-history",
        default=str(defaults.alloc_history),
        help="CUDA: steps whose caching-allocator actions (allocations, frees, segments, with sizes, streams "
        "and addresses) go into the trace, from torch's allocator history: off, always, steps:SPEC (a few ms "
        "at each such step's end on a large model); counters per step and an OOM's snapshot are always kept",
    )
    env_option(
        r,
        "--alloc-stacks",
        kind="flag",
        help="CUDA: also record each allocation's Python stack in those steps (~2 us per allocation), so "
        "that each allocation names the program line that made it",
    )
    env_option(
        r,
        "--cupti",
        default=str(defaults.cupti),
        help="CUDA: steps whose kernels and copies CUPTI captures into the trace (needs the gpu extra, "
        "cupti-python): off, always, steps:SPEC, or snapshots (step 1 and the step before each periodic "
        "snapshot); it stands aside, saying so, while torch.profiler or another CUPTI tool traces",
    )
    env_option(r, "--no-collect", kind="flag", help="leave the spools; build the trace later with `collect`")
    env_option(
        r,
        "--keep-spool",
        kind="flag",
        help="keep the spool folder after building the trace (always kept when any record was damaged)",
    )
    env_option(r, "--signing-key", help=_SIGNING_KEY_HELP)
    usage_with_command(r, "[--] COMMAND [ARG ...]")  # before the positional, which argparse shows as ...
    # Everything from the first word that is not one of ours is the command, as with `nsys profile`
    # (main() takes what follows a `--` apart before parsing, and joins the two).
    r.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="[--] COMMAND [ARG ...]",
        help="the command to record, with its arguments: after --, or from the first word that is not an "
        "option of record",
    )
    r.set_defaults(func=cmd_record)

    c = sub.add_parser("collect", help="build (or rebuild) a run's trace from its spools")
    c.add_argument("run", help="the run folder given to record --out")
    env_option(c, "--strict", kind="flag", help="fail at the first damaged record")
    env_option(
        c,
        "--trace",
        help="where to write the trace: a folder or an fsspec URL such as s3://bucket/run1 (default "
        f"RUN/{schema.TRACE_DIR})",
    )
    env_option(c, "--signing-key", help=_SIGNING_KEY_HELP)
    c.set_defaults(func=cmd_collect)
