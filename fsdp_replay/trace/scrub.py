"""Read every array and blob of a trace and check it: ``fsdp-replay inspect --verify``.

A plain ``inspect`` reads only the metadata it shows; payload blobs are read (and checked against
their names) when a replay needs them. ``scrub`` reads everything now, so damage is found before
a replay runs into it: every column against the rank's array list (format 3) and every blob
(payloads, snapshots, RNG states) against its digest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fsdp_replay.errors import FsdpReplayError
from fsdp_replay.trace.reader import Trace


@dataclass(slots=True)
class ScrubReport:
    arrays: int = 0
    blobs: int = 0
    blob_bytes: int = 0
    problems: list[str] = field(default_factory=list)


def scrub(trace: Trace, ranks: list[int] | None = None) -> ScrubReport:
    report = ScrubReport()
    seen: set[str] = set()
    for rank in trace.ranks if ranks is None else ranks:
        try:
            rt = trace.rank(rank)
            report.arrays += rt.read_all()
            payloads = rt.payloads
            rows = range(len(payloads["nbytes"]))
        except FsdpReplayError as e:
            report.problems.append(str(e))
            continue
        for row in rows:
            digest = rt.payload_digest(row)
            if digest in seen:
                continue
            seen.add(digest)
            try:
                report.blob_bytes += len(rt.payload(row))
                report.blobs += 1
            except FsdpReplayError as e:
                report.problems.append(str(e))
    return report
