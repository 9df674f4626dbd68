"""``fsdp-replay export``: a trace in another tool's format.

- ``--perfetto TRACE -o FILE``: the timeline (``analysis/perfetto.py``) as trace-event JSON, which
  ui.perfetto.dev and chrome://tracing open; gzip-compressed when FILE ends in ``.gz``.
- ``--memory-snapshot TRACE -o FILE``: the CUDA allocator snapshot an out-of-memory error left
  (``--rank``, ``--oom``), as the pickle ``torch.cuda.memory._dump_snapshot`` writes, which
  pytorch.org/memory_viz opens.

Exit codes (``docs/exit-codes.md``): 0 written, 2 bad options, 3 the trace cannot be read or holds
no such snapshot.
"""

from __future__ import annotations

import argparse
import gzip
import json
import pickle
import sys
from typing import Any

from fsdp_replay.errors import ConfigError, ExitCode, TraceNotFoundError
from fsdp_replay.options import env_option
from fsdp_replay.trace.layout import atomic_write, output_file, resolve_trace

# torch's own snapshot pickles (Python <= 3.13's default); memory_viz's unpickler reads it
SNAPSHOT_PICKLE_PROTOCOL = 4


def cmd_export(args: argparse.Namespace) -> int:
    if bool(args.perfetto) == bool(args.memory_snapshot):
        raise ConfigError("export what? give one of --perfetto TRACE or --memory-snapshot TRACE")
    if not args.output:
        raise ConfigError("give the file to write with -o FILE")
    from fsdp_replay.trace.reader import Trace

    output_file(
        args.output,
        "-o",
        (args.perfetto or args.memory_snapshot,),
        (".json", ".json.gz") if args.perfetto else (),
    )
    if args.perfetto:
        from fsdp_replay.analysis.perfetto import export

        trace = Trace.open(resolve_trace(args.perfetto))
        doc = export(trace, None if args.rank is None else [args.rank])
        data = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
        if args.output.endswith(".gz"):
            data = gzip.compress(data, mtime=0)
        atomic_write(args.output, data)
        n = len(doc["traceEvents"])
        print(f"fsdp-replay: wrote {n} trace events of ranks {doc['otherData']['ranks']} to {args.output}")
        for note in doc["otherData"]["notes"]:
            print(f"fsdp-replay: note: {note}", file=sys.stderr)
        return ExitCode.OK
    trace = Trace.open(resolve_trace(args.memory_snapshot))
    rank, snapshot = _oom_snapshot(trace, args.rank, args.oom)
    atomic_write(args.output, pickle.dumps(snapshot, protocol=SNAPSHOT_PICKLE_PROTOCOL))
    print(
        f"fsdp-replay: wrote rank {rank}'s allocator snapshot to {args.output} (open it at pytorch.org/memory_viz)"
    )
    return ExitCode.OK


def _oom_snapshot(trace: Any, rank: int | None, index: int) -> tuple[int, dict[str, Any]]:
    """The snapshot of OOM ``index`` of ``rank`` (default: the first rank with one)."""
    ranks = trace.ranks if rank is None else [rank]
    for rk in ranks:
        r = trace.rank(rk)
        ooms = r.attrs.get("ooms") or []
        if rank is None and not ooms:
            continue
        if not 0 <= index < len(ooms):
            raise TraceNotFoundError(
                f"{trace.url}: rank {rk} recorded {len(ooms)} out-of-memory errors; no --oom {index}"
            )
        row = int(ooms[index].get("payload", -1))
        if row < 0:
            raise TraceNotFoundError(
                f"{trace.url}: rank {rk}'s out-of-memory error {index} has no snapshot (a process keeps the first few)"
            )
        return rk, json.loads(r.payload(row))
    raise TraceNotFoundError(f"{trace.url}: no rank recorded an out-of-memory error")


def register(sub: Any) -> None:
    e = sub.add_parser(
        "export",
        help="write a trace in another tool's format: a Perfetto timeline, an OOM's allocator snapshot",
        description="Examples: fsdp-replay export --perfetto run1 -o run1.json (open it at ui.perfetto.dev); "
        "fsdp-replay export --memory-snapshot run1 --rank 3 -o oom.pickle (open it at pytorch.org/memory_viz).",
    )
    env_option(
        e,
        "--perfetto",
        metavar="TRACE",
        help="a trace (its run folder, or a URL): its timeline for ui.perfetto.dev",
    )
    env_option(
        e,
        "--memory-snapshot",
        metavar="TRACE",
        help="a trace: the CUDA allocator snapshot of an out-of-memory error, for pytorch.org/memory_viz",
    )
    env_option(
        e, "-o", "--output", metavar="FILE", help="the file to write (.json, or .json.gz for --perfetto)"
    )
    env_option(
        e, "--rank", kind="int", help="only this rank (--memory-snapshot: default the first with an OOM)"
    )
    env_option(e, "--oom", kind="int", default=0, help="which of the rank's out-of-memory errors (from 0)")
    e.set_defaults(func=cmd_export)
