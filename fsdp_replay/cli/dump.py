"""``fsdp-replay dump RUN``: ask a running (or hung) job's ranks to write their state, and wait.

Writes the dump request into the run folder (``RUN/spool/dump-request``, ``trace/dump_request.py``;
the sidecar writes the same at a hang) and follows the ranks' spools for their answers (``state``
events), printing where each rank is. ``collect`` afterwards puts the answers into the trace, where
``desync`` and ``inspect`` show them. Exit 0 when every live rank answered, 1 when some did not
within ``--wait`` (its writer thread could not run, or its process is gone), 3 for a folder that is
not a recording's.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from fsdp_replay.errors import ConfigError, ExitCode, TraceNotFoundError
from fsdp_replay.options import env_option

POLL_S = 0.2


def cmd_dump(args: argparse.Namespace) -> int:
    from fsdp_replay.analysis.state_dumps import describe
    from fsdp_replay.trace import schema, spool
    from fsdp_replay.trace.dump_request import AnswerWatch, write_request

    if args.wait < 0:
        raise ConfigError(f"--wait (FSDP_REPLAY_WAIT) {args.wait}: give 0 or more seconds")
    run = Path(args.run)
    if not spool.spool_ranks(run / schema.SPOOL_DIR):
        raise TraceNotFoundError(
            f"{run}: no rank spools under {run / schema.SPOOL_DIR} (not a run being recorded?)"
        )
    req = write_request(run, args.reason)
    watch = AnswerWatch(run, req.id)
    print(f"dump request {req.id} written; waiting up to {args.wait} s for ranks {watch.ranks}", flush=True)
    deadline = time.monotonic() + args.wait
    try:
        shown: set[int] = set()
        while True:
            watch.poll()
            for rank in sorted(set(watch.answers) - shown):
                shown.add(rank)
                print(f"  {describe(rank, watch.answers[rank], _cwd(run, rank))}", flush=True)
            if not watch.waiting() or time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
    finally:
        watch.close()
    ended = sorted(watch.ended - set(watch.answers))
    if ended:
        print(f"ranks {ended} had ended (their end is in the spool): nothing to ask")
    missing = watch.waiting()
    if missing:
        print(
            f"ranks {missing} did not answer within {args.wait} s: their writer thread could not run "
            "(a thread holding the GIL in C code, a stopped process) or the process is gone"
        )
    print(f"answered: {sorted(watch.answers)}; run `fsdp-replay collect {args.run}` to put them in the trace")
    return ExitCode.FOUND if missing else ExitCode.OK


def _cwd(run: Path, rank: int) -> str:
    """The rank's working directory from its first spool event, to show the program's paths short."""
    from fsdp_replay.trace import schema, spool

    try:
        segs = spool.segments(spool.rank_dir(run / schema.SPOOL_DIR, rank))
        for rec in spool.read_segment(segs[0]) if segs else ():
            if rec.kind == schema.KIND_EVENT and isinstance(rec.obj, dict):
                return str(rec.obj.get("cwd") or "")
    except Exception:  # only the paths' display depends on it
        return ""
    return ""


def register(sub: Any) -> None:
    d = sub.add_parser(
        "dump",
        help="ask a running or hung job's ranks to write their state (stacks, the collective in flight)",
        description="Write a dump request into RUN/spool and wait for each live rank's answer: where "
        "its main thread is, or the collective it waits in. `collect` then puts them in the trace.",
    )
    d.add_argument("run", help="the run folder of a recording in progress (record --out, the sidecar's OUT)")
    env_option(d, "--wait", kind="int", default=10, help="seconds to wait for the ranks' answers")
    env_option(d, "--reason", default="fsdp-replay dump", help="the reason written into the request")
    d.set_defaults(func=cmd_dump)
