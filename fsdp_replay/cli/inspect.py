"""``fsdp-replay inspect``: what a trace holds, and with ``--verify`` whether all of it is whole."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import fsdp_replay
from fsdp_replay.errors import ExitCode
from fsdp_replay.options import env_option
from fsdp_replay.trace import signing
from fsdp_replay.trace.layout import resolve_trace
from fsdp_replay.trace.redact import scrub_doc


def cmd_inspect(args: argparse.Namespace) -> int:
    from fsdp_replay.analysis.summary import summarize
    from fsdp_replay.trace.reader import Trace

    key = signing.key_of_option(args.signing_key)
    trace = Trace.open(resolve_trace(args.trace))
    ranks = [args.rank] if args.rank is not None else None
    summary = summarize(trace, ranks)
    if newer := trace.newer_writer():
        print(
            f"fsdp-replay: note: the trace was written by fsdp-replay {newer}, newer than this one "
            f"({fsdp_replay.__version__}): what it added beyond trace format {trace.meta.get('format_version')} is not read",
            file=sys.stderr,
        )
    signature, forged = trace.signature(key, ranks)
    summary["signature"] = {"text": signature, "bad": forged}
    from fsdp_replay.analysis.findings import finding, findings

    try:
        summary["findings"] = findings(trace, summary, args.trace, ranks)
    except Exception as e:  # the summary stands on its own: a trace the analyses cannot read still gets it
        why = f"the NaN, desync and hang analyses could not run on this trace: {e}"
        summary["findings"] = [
            finding("analysis_error", "warning", why, f"fsdp-replay inspect {args.trace} --verify")
        ]
    if args.verify:
        from fsdp_replay.trace.scrub import scrub

        checked = scrub(trace, ranks)
        summary["verify"] = {
            "arrays": checked.arrays,
            "blobs": checked.blobs,
            "blob_bytes": checked.blob_bytes,
            "problems": checked.problems,
        }
    summary = scrub_doc(summary)  # what a trace holds is redacted already; this is the last check
    if args.json:
        json.dump(summary, sys.stdout, indent=2, default=str)
        print()
    else:
        from fsdp_replay.cli.render import print_summary

        print_summary(summary, verbose=args.verbose)
        print(f"signature: {signature}")
    if forged:
        print(f"fsdp-replay: SIGNATURE: {signature}", file=sys.stderr)
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
            return ExitCode.UNUSABLE
    return ExitCode.UNUSABLE if forged else ExitCode.OK


def register(sub: Any) -> None:
    i = sub.add_parser("inspect", help="summarize a trace")
    i.add_argument("trace", help="a trace (or the run folder holding trace.zarr)")
    env_option(i, "--rank", kind="int", help="only this rank")
    env_option(i, "--json", kind="flag", help="machine-readable output")
    env_option(i, "-v", "--verbose", kind="flag", help="also show environment details")
    env_option(
        i,
        "--verify",
        kind="flag",
        help="read every array and payload blob and check it against the trace's digests (exit 3 if any is damaged)",
    )
    env_option(
        i,
        "--signing-key",
        help="a file holding the key the trace was signed with: check its signature (exit 3 if it does not "
        "match, or the trace is not signed)",
    )
    i.set_defaults(func=cmd_inspect)
