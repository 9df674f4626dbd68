"""Record a training job, build its trace, replay one rank, analyse it, inject recording into pods.

Subcommands: ``record | collect | dump | inspect | replay | diff | nan | desync | export | webhook |
inject | job | job-run | sidecar``. Every option is also an environment variable: ``FSDP_REPLAY_<OPTION>`` for the
first eight (``fsdp_replay/options.py``), ``FSDP_REPLAY_INJECTOR_*``, ``FSDP_REPLAY_JOB_*`` and ``FSDP_REPLAY_SIDECAR_*``
for the components' own. Exit codes by error class (``docs/exit-codes.md``): 0 success, 1 a finding, 2 a
usage error, 3 unusable input; ``record`` returns its command's code.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from fsdp_replay import __version__
from fsdp_replay.errors import ConfigError, ExitCode, FsdpReplayError, TraceFormatError, TraceNotFoundError


def build_parser() -> argparse.ArgumentParser:
    from fsdp_replay.cli import analyze, dump, export, inspect, job_run, record, replay
    from fsdp_replay.injector.cli import register as register_injector
    from fsdp_replay.sidecar.cli import register as register_sidecar

    p = argparse.ArgumentParser(prog="fsdp-replay", description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--version", action="version", version=f"fsdp-replay {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    record.register(sub)
    dump.register(sub)
    replay.register(sub)
    analyze.register(sub)
    inspect.register(sub)
    export.register(sub)
    register_injector(sub)
    job_run.register(sub)
    register_sidecar(sub)
    return p


def _not_abandoned_futures(record: logging.LogRecord) -> bool:
    """zarr writes chunks concurrently: when one fails (a full disk), the error reaches us and is
    reported once, clearly; asyncio would also print the sibling writes' abandoned futures."""
    return "exception was never retrieved" not in record.getMessage()


def _join_command(started: list[str], after_dashes: list[str] | None) -> list[str]:
    """The program's command line: ``record`` takes it from its first positional word without a
    ``--`` (``started``); a ``--`` after that word is the program's own, put back where it was."""
    if not started:
        return after_dashes or []
    return started if after_dashes is None else [*started, "--", *after_dashes]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.getLogger("asyncio").addFilter(_not_abandoned_futures)
    command: list[str] | None = None
    if "--" in argv:  # everything after -- is the program's command line, untouched
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1 :]
    # Exit codes by error class (docs/exit-codes.md). Anything else is a bug and keeps its traceback.
    try:
        args = build_parser().parse_args(argv)  # option defaults come from FSDP_REPLAY_*: parsed here
        args.command = _join_command(getattr(args, "command", None) or [], command)
        return int(args.func(args))
    except ConfigError as e:
        print(f"fsdp-replay: {e}", file=sys.stderr)
        return ExitCode.USAGE
    except KeyboardInterrupt:  # Ctrl-C: a line, not a traceback (what was written stays consistent)
        print("fsdp-replay: interrupted (Ctrl-C)", file=sys.stderr)
        return ExitCode.INTERRUPTED
    except (TraceNotFoundError, TraceFormatError) as e:
        print(f"fsdp-replay: unusable trace: {e}", file=sys.stderr)
        return ExitCode.UNUSABLE
    except FsdpReplayError as e:
        print(f"fsdp-replay: {e}", file=sys.stderr)
        return ExitCode.UNUSABLE
    except OSError as e:  # a full disk, a permission problem: a clear line, not a traceback
        where = f" ({e.filename})" if e.filename else ""
        print(f"fsdp-replay: {e.strerror or e}{where}", file=sys.stderr)
        return ExitCode.UNUSABLE


if __name__ == "__main__":
    sys.exit(main())
