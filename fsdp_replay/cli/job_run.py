"""``fsdp-replay job-run``: what a replay Job's container runs (``injector/job.py`` renders the Job).

It is ``fsdp-replay replay`` of one rank, whose command line, working directory and environment
come from the trace, plus what a pod needs around it:

- the rank may come from the environment (``FSDP_REPLAY_RANK``, which an Indexed Job sets from
  its completion index), and ``--per-rank`` puts its report in ``REPORT/rank-NNNNN``, so that
  the pods of one Job share one report folder;
- the report goes to the store: the replay writes it into a local folder (``--work-dir``, an
  emptyDir), then each file is copied to the report URL (any fsspec URL), ``report.json`` last, so
  a reader that finds it finds the others. A report folder that is a path (a mounted volume) is
  written in place;
- a replay that ended before it could report (the image lacks a library, the program crashed
  first) still leaves a ``report.json`` (status ``unusable``) saying so, so ``kubectl
  fsdp-replay report`` has something to show for every rank.

The exit code is the replay's (``docs/exit-codes.md``: 0 bit-exact, 1 diverged, 2 usage, 3
unusable), or 3 when the report could not be stored.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from fsdp_replay.errors import ConfigError, ExitCode
from fsdp_replay.options import env_option
from fsdp_replay.trace.layout import RANK_REPORT_FMT, REPLAY_PNG, REPORT_JSON, REPORT_TXT, atomic_write

# What a report folder holds, in the order it is stored: report.json last (it is what readers wait for).
STORED = (REPORT_TXT, REPLAY_PNG, REPORT_JSON)


def cmd_job_run(args: argparse.Namespace) -> int:
    from fsdp_replay.cli.main import main

    if args.rank is None:
        raise ConfigError(
            "job-run needs the rank: --rank R, or FSDP_REPLAY_RANK (an Indexed Job sets it from its completion index)"
        )
    if not args.report:
        raise ConfigError("job-run needs --report: the folder or store URL the report goes to")
    target = args.report.rstrip("/")
    if args.per_rank:
        target = f"{target}/{RANK_REPORT_FMT.format(rank=args.rank)}"
    remote = "://" in target
    local = (
        Path(target) if not remote else Path(args.work_dir or tempfile.mkdtemp(prefix="fsdp-replay-report-"))
    )
    for name in STORED:  # a report of an earlier run in the same folder must not pass for this one's
        (local / name).unlink(missing_ok=True)
    argv = [
        "replay", args.trace, "--rank", str(args.rank), "--from-step", str(args.from_step),
        "--to-step", str(args.to_step), "--report", str(local),
    ]  # fmt: skip
    argv += ["--device", args.device] if args.device else []
    argv += ["--force"] if args.force else []
    argv += ["--trust-trace"] if args.trust_trace else []
    code = main(argv)
    if not (local / REPORT_JSON).is_file():
        _unusable_report(local, args.rank, code)
    if not remote:
        return code
    try:
        _store(local, target)
    except Exception as e:  # any store error (credentials, network): said once, clearly
        print(
            f"fsdp-replay: the report could not be stored at {target}: {type(e).__name__}: {e}",
            file=sys.stderr,
        )
        return max(code, ExitCode.UNUSABLE)
    print(f"fsdp-replay: report stored at {target}", file=sys.stderr)
    return code


def _unusable_report(folder: Path, rank: int, code: int) -> None:
    """A report for a replay that ended before it reported: the reason is in the pod's log."""
    folder.mkdir(parents=True, exist_ok=True)
    reason = (
        f"the replay of rank {rank} exited with code {code} before it could report; its log says why "
        "(kubectl fsdp-replay logs JOB)"
    )
    report: dict[str, Any] = {"status": "unusable", "reason": reason, "rank": rank, "program_exit_code": code}
    atomic_write(folder / REPORT_TXT, f"rank {rank}: UNUSABLE: {reason}\n")
    atomic_write(folder / REPORT_JSON, json.dumps(report, indent=2) + "\n")


def _store(local: Path, url: str) -> None:
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    fs.makedirs(root, exist_ok=True)
    for name in STORED:
        if (local / name).is_file():
            fs.put_file(str(local / name), f"{root}/{name}")


def register(sub: Any) -> None:
    p = sub.add_parser(
        "job-run",
        help="inside a replay Job's pod: replay one rank and store its report (fsdp-replay job renders the Job)",
        description="Run `fsdp-replay replay` of one rank into a local folder, then copy its report.txt, "
        "replay.png and report.json to --report (a store URL or a path). Exit code: the replay's, or 3 when "
        "the report cannot be stored.",
    )
    p.add_argument("trace", help="the trace (a store URL, or a path the pod sees)")
    env_option(
        p, "--rank", kind="int", default=None, help="the rank to replay (an Indexed Job sets the variable)"
    )
    env_option(p, "--from-step", kind="int", default=0, help="verify from this step")
    env_option(p, "--to-step", kind="int", default=-1, help="stop after this step (-1: the program's end)")
    env_option(p, "--device", help="cpu or cuda[:N]: where the replayed rank runs")
    env_option(p, "--report", help="where the report goes: a store URL or a folder")
    env_option(
        p,
        "--work-dir",
        help="the local folder the replay writes its report to before it is stored (default: a new temporary one)",
    )
    env_option(
        p, "--per-rank", kind="flag", help="store the report in REPORT/rank-NNNNN (an Indexed Job's pods)"
    )
    env_option(p, "--force", kind="flag", help="replay even if the script or torch version differ")
    env_option(
        p, "--trust-trace", kind="flag", help="only for a trace you made yourself: replay --trust-trace"
    )
    p.set_defaults(func=cmd_job_run)
