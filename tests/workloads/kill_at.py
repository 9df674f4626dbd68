"""Run a training script and SIGKILL this rank at one chosen spool write: a kill at a known moment.

``python kill_at.py SCRIPT ARGS...`` under ``fsdp-replay record``, with ``$CRASH_AT`` a JSON object:

- ``rank``: the rank that kills itself (torchrun then stops the other ranks: SIGTERM);
- ``record``: which spool record: an event type (``rank_start``, ``coll``, ``step``, ...) or
  ``snapshot_blob`` (the bytes of a snapshot: ``agent/snapshot_blob.py``'s ``MAGIC``);
- ``step`` (optional): only records of this step; ``nth`` (default 1): the n-th record that matches;
- ``keep``: the part of that record written before the kill (0.5: a torn record, as a kill in the
  middle of a large write leaves it; 1.0: the whole record, then the kill).

The agent writes its spool on its writer thread while the training thread runs (a collective of the
step, or the step end waiting for the step's records: ``sync_steps``), so the kill lands in that
phase. Before the kill the rank writes ``$CRASH_MARK.rank<R>`` saying where it was, for the test to
check that the point was reached (a point the record never reaches is a failure, not a pass).
Nothing happens outside ``FSDP_REPLAY_MODE=record`` (a replay runs this wrapper again).
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import struct
import sys
from typing import Any


def _records(pieces: list[Any]) -> list[tuple[int, bytes, list[Any]]]:
    """The whole records of one append: (kind, JSON body, their pieces), from
    ``spool.encode_record``'s layout: a header, the JSON, then the raw bytes where the body is
    longer than the JSON."""
    from fsdp_replay.trace import schema

    header = struct.Struct(schema.RECORD_HEADER)
    out: list[tuple[int, bytes, list[Any]]] = []
    i = 0
    while i < len(pieces):
        magic, kind, _flags, length, _crc, jlen = header.unpack(bytes(pieces[i]))
        assert magic == schema.RECORD_MAGIC, "kill_at.py: a spool write it cannot parse"
        n = 3 if length > jlen else 2
        out.append((kind, bytes(pieces[i + 1]), pieces[i : i + n]))
        i += n
    return out


def _install(spec: dict[str, Any], rank: int) -> None:
    from fsdp_replay.trace import schema, spool  # no torch: the agent attaches when the script imports it

    append = spool.SpoolWriter._append_pieces
    seen = 0

    def matches(kind: int, js: bytes, parts: list[Any]) -> bool:
        if spec["record"] == "snapshot_blob":
            from fsdp_replay.agent.snapshot_blob import MAGIC  # torch is imported by now

            return kind == schema.KIND_BLOB and len(parts) == 3 and bytes(parts[2][: len(MAGIC)]) == MAGIC
        if kind != schema.KIND_EVENT:
            return False
        ev = json.loads(js)
        return bool(ev.get("type") == spec["record"] and spec.get("step", ev.get("step")) == ev.get("step"))

    def killing_append(self: Any, pieces: list[Any], records: int) -> int:
        nonlocal seen
        found = _records(pieces)
        for i, (kind, js, parts) in enumerate(found):
            if not matches(kind, js, parts):
                continue
            seen += 1
            if seen < spec.get("nth", 1):
                continue
            if i:
                append(self, [p for r in found[:i] for p in r[2]], i)
            body = b"".join(bytes(p) for p in parts)
            keep = body[: int(len(body) * spec["keep"])]
            if keep:
                append(self, [keep], 0)  # the torn record: its first bytes, where a kill ends a write
            with open(f"{os.environ['CRASH_MARK']}.rank{rank}", "w") as f:
                f.write(f"{spec['record']} #{seen}: {len(keep)} of {len(body)} bytes, then SIGKILL\n")
            os.kill(os.getpid(), signal.SIGKILL)
        return append(self, pieces, records)

    spool.SpoolWriter._append_pieces = killing_append


def main() -> None:
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    spec = json.loads(os.environ.get("CRASH_AT") or "{}")
    rank = int(os.environ.get("RANK", "0"))
    if os.environ.get("FSDP_REPLAY_MODE") == "record" and rank == spec.get("rank"):
        _install(spec, rank)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
