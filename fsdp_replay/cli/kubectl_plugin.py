"""``kubectl fsdp-replay``: replay Jobs through kubectl's plugin convention.

kubectl runs an executable named ``kubectl-<name>`` found on PATH for ``kubectl <name>``, a ``-`` of
the command written ``_`` in the file name: ``pip install fsdp-replay`` installs this module as
``kubectl-fsdp_replay`` (``pyproject.toml``), so ``kubectl fsdp-replay ...`` needs nothing more.

- ``replay ...``: exactly ``fsdp-replay job ...`` (the same parser, options and variables):
  render the Job and create it, or print it with ``--dry-run``;
- ``logs JOB``: ``kubectl logs`` of the Job's replay containers (every rank's, prefixed);
- ``report JOB|URL``: the report the Job stored (the Job's ``<prefix>/report`` annotation says
  where): one rank's ``report.txt``, or for an Indexed Job each rank's verdict and the earliest
  divergence. The exit code follows the verdict, as ``fsdp-replay replay``'s does.

The store is read from this machine, with its credentials (as ``fsdp-replay job`` read the trace).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fsdp_replay.errors import ConfigError, ExitCode, FsdpReplayError, TraceNotFoundError
from fsdp_replay.injector.job import ALL_RANKS, ANN_RANK, ANN_REPORT, REPLAY_CONTAINER
from fsdp_replay.injector.job_config import ENV_PREFIX as JOB_ENV_PREFIX
from fsdp_replay.options import env_option
from fsdp_replay.trace.layout import RANK_REPORT_FMT, REPORT_JSON, REPORT_TXT

PROG = "kubectl fsdp-replay"
JOB_NAME_LABEL = "job-name"  # set by the Job controller on its pods (every Kubernetes version)
VERDICTS = {"bit-exact": ExitCode.OK, "diverged": ExitCode.FOUND}


def _kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        raise ConfigError("kubectl is not on PATH")
    return found


def _namespace(args: argparse.Namespace) -> list[str]:
    return ["-n", args.namespace] if args.namespace else []


def cmd_logs(args: argparse.Namespace) -> int:
    command = [
        _kubectl(), "logs", *_namespace(args), "-l", f"{JOB_NAME_LABEL}={args.job}", "-c", REPLAY_CONTAINER,
        "--prefix", "--tail=-1", f"--max-log-requests={args.max_log_requests}",
    ]  # fmt: skip
    command += ["--follow"] if args.follow else []
    return subprocess.run(command, check=False).returncode


def job_report_location(job: str, namespace: str | None, prefix: str) -> tuple[str, str, int]:
    """(report URL, rank or ``all``, completions) from the Job's annotations."""
    command = [_kubectl(), "get", "job", job, *(["-n", namespace] if namespace else []), "-o", "json"]
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise TraceNotFoundError(f"no Job {job}: {proc.stderr.strip()}")
    obj = json.loads(proc.stdout)
    annotations = obj.get("metadata", {}).get("annotations") or {}
    report = annotations.get(f"{prefix}/{ANN_REPORT}")
    if not report:
        raise ConfigError(
            f"the Job {job} has no {prefix}/{ANN_REPORT} annotation: not made by fsdp-replay job"
        )
    completions = int(obj.get("spec", {}).get("completions") or 1)
    return report, annotations.get(f"{prefix}/{ANN_RANK}", ""), completions


def read_text(location: str) -> str | None:
    """A file at a path or a store URL, or None when it is not there (yet)."""
    if "://" not in location:
        path = Path(location)
        return path.read_text() if path.is_file() else None
    import fsspec

    try:
        with fsspec.open(location, "r") as f:
            text: str = f.read()
            return text
    except FileNotFoundError:
        return None


def cmd_report(args: argparse.Namespace) -> int:
    from fsdp_replay.replayer.report import merge_reports

    target = args.job
    per_rank = args.ranks
    if "/" not in target:  # a Job's name; a report location has a / in it
        target, who, completions = job_report_location(target, args.namespace, args.annotation_prefix)
        per_rank = completions if who == ALL_RANKS else 0
    target = target.rstrip("/")
    if not per_rank:
        raw = read_text(f"{target}/{REPORT_JSON}")
        if raw is None:
            print(
                f"fsdp-replay: no report at {target} yet (is the Job still running? {PROG} logs JOB -f)",
                file=sys.stderr,
            )
            return ExitCode.UNUSABLE
        report = json.loads(raw)
        print(
            json.dumps(report, indent=2) if args.json else read_text(f"{target}/{REPORT_TXT}") or raw, end=""
        )
        return VERDICTS.get(str(report.get("status")), ExitCode.UNUSABLE)
    reports: list[dict[str, Any]] = []
    for rank in range(per_rank):
        raw = read_text(f"{target}/{RANK_REPORT_FMT.format(rank=rank)}/{REPORT_JSON}")
        if raw is None:
            print(f"rank {rank}: no report yet", file=sys.stderr if args.json else sys.stdout)
            continue
        report = json.loads(raw)
        reports.append(report)
        if not args.json:
            print(f"rank {rank}: {str(report.get('status')).upper()}" + _first(report))
    merged = merge_reports(reports, per_rank)
    if args.json:
        print(json.dumps({**merged, "reports": reports}, indent=2))
    else:
        print(f"all ranks: {merged['status'].upper()}" + _first(merged))
    if len(reports) < per_rank:
        return ExitCode.UNUSABLE
    return max(
        (VERDICTS.get(str(r.get("status")), ExitCode.UNUSABLE) for r in reports), default=ExitCode.UNUSABLE
    )


def _first(report: dict[str, Any]) -> str:
    first = report.get("first_divergence")
    if first:
        return (
            f"; first divergence on rank {first.get('rank', report.get('rank'))} at step {first.get('step')}"
        )
    return f" ({report['reason']})" if report.get("status") not in VERDICTS and report.get("reason") else ""


def build_parser() -> argparse.ArgumentParser:
    from fsdp_replay.injector.cli import register_job

    p = argparse.ArgumentParser(
        prog=PROG, description="Replay ranks of an fsdp-replay trace as Kubernetes Jobs."
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    register_job(sub, "replay")
    for name, text in (
        ("logs", "the replay containers' logs, every rank's prefixed"),
        ("report", "the stored report"),
    ):
        q = sub.add_parser(name, help=text)
        q.add_argument(
            "job", help="the Job's name" + (" (or the report's location)" if name == "report" else "")
        )
        env_option(q, "-n", "--namespace", prefix=JOB_ENV_PREFIX, help="the Job's namespace")
        if name == "logs":
            env_option(
                q, "-f", "--follow", kind="flag", prefix=JOB_ENV_PREFIX, help="stream until the pods end"
            )
            env_option(
                q,
                "--max-log-requests",
                kind="int",
                default=64,
                prefix=JOB_ENV_PREFIX,
                help="pods followed at once",
            )
            q.set_defaults(func=cmd_logs)
        else:
            env_option(
                q,
                "--json",
                kind="flag",
                prefix=JOB_ENV_PREFIX,
                help="the report.json (merged: with every rank's)",
            )
            env_option(
                q,
                "--ranks",
                kind="int",
                default=0,
                prefix=JOB_ENV_PREFIX,
                help="for a location of an Indexed Job's reports: its number of ranks",
            )
            env_option(
                q,
                "--annotation-prefix",
                default="fsdp-replay.io",
                prefix=JOB_ENV_PREFIX,
                help="the prefix of the Job's annotations",
            )
            q.set_defaults(func=cmd_report)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["replay"]:  # the same command, parser and error handling as `fsdp-replay job`
        from fsdp_replay.cli.main import main as cli_main

        return cli_main(["job", *argv[1:]])
    try:
        args = build_parser().parse_args(argv)
        return int(args.func(args))
    except ConfigError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return ExitCode.USAGE
    except (FsdpReplayError, OSError, ValueError) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return ExitCode.UNUSABLE


if __name__ == "__main__":
    sys.exit(main())
