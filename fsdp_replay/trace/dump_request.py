"""Dump requests: asking every rank's agent to write what its process is doing now.

A hung job's ranks write nothing that says where they are when they are not in a collective (a
deadlock, a data loader that never returns, a rank that skipped a collective). The requester (the
sidecar at a hang, ``fsdp-replay dump``) writes one file for all ranks, ``RUN/spool/dump-request``
(``layout.DUMP_REQUEST``), holding ``{"id": N, "t_wall_ns": ..., "reason": "..."}``, atomically;
each agent's writer thread looks at it about once a second (``agent/state_dump.py``) and answers
each id once with a ``state`` event in its spool. ``AnswerWatch`` follows the spools for the
answers. Stdlib only: the agent reads requests with it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from fsdp_replay.errors import TraceFormatError, TraceNotFoundError
from fsdp_replay.trace import schema, spool
from fsdp_replay.trace.follow import SpoolFollower
from fsdp_replay.trace.layout import atomic_write, dump_request_path

MAX_REQUEST_BYTES = 4096
MAX_REASON_CHARS = 200


@dataclass(frozen=True, slots=True)
class DumpRequest:
    id: int
    t_wall_ns: int
    reason: str


def parse_request(raw: bytes, path: str | os.PathLike[str] = "") -> DumpRequest:
    """A request file's bytes; a ``TraceFormatError`` naming the problem when they are not one."""
    where = str(path) or None
    if len(raw) > MAX_REQUEST_BYTES:
        raise TraceFormatError(
            f"a dump request is at most {MAX_REQUEST_BYTES} bytes, not {len(raw)}", path=where
        )
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise TraceFormatError(f"a dump request is a JSON object: {e}", path=where) from None
    if not isinstance(doc, dict):
        raise TraceFormatError("a dump request is a JSON object", path=where)
    rid, t_wall, reason = doc.get("id"), doc.get("t_wall_ns"), doc.get("reason", "")
    if isinstance(rid, bool) or not isinstance(rid, int) or rid < 1:
        raise TraceFormatError(f"a dump request's id is an integer >= 1, not {rid!r}", path=where)
    if isinstance(t_wall, bool) or not isinstance(t_wall, int) or t_wall < 0:
        raise TraceFormatError(f"a dump request's t_wall_ns is an integer >= 0, not {t_wall!r}", path=where)
    if not isinstance(reason, str):
        raise TraceFormatError(f"a dump request's reason is a string, not {reason!r}", path=where)
    return DumpRequest(rid, t_wall, reason[:MAX_REASON_CHARS])


def read_request(run: str | os.PathLike[str]) -> DumpRequest | None:
    """The run folder's current request; None where there is none."""
    path = dump_request_path(run)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    return parse_request(raw, path)


def write_request(run: str | os.PathLike[str], reason: str) -> DumpRequest:
    """Write a new request (the last id + 1) into run folder ``run``, atomically. A run folder
    without a spool folder is refused (``TraceNotFoundError``); an unreadable earlier request is
    replaced by one whose id (the time in seconds) is above any the agents answered."""
    spool_root = Path(run) / schema.SPOOL_DIR
    if not spool_root.is_dir():
        raise TraceNotFoundError(f"no spool folder: {spool_root} (is {run} the run folder of a recording?)")
    try:
        last = read_request(run)
        rid = 1 if last is None else last.id + 1
    except TraceFormatError:
        rid = int(time.time())
    req = DumpRequest(rid, time.time_ns(), reason[:MAX_REASON_CHARS])
    doc = {"id": req.id, "t_wall_ns": req.t_wall_ns, "reason": req.reason}
    atomic_write(dump_request_path(run), json.dumps(doc) + "\n")
    return req


class AnswerWatch:
    """The answers to request ``rid`` in every rank's spool of run folder ``run``.

    Each rank folder is read from its last segment at the time the watch starts (a request's
    answer comes after it; an ``end`` is its process's last record), so a long spool is not read
    again. A rank is live unless its spool's last attempt wrote ``end``; ``answers`` maps a rank to
    its ``state`` event for ``rid``.
    """

    def __init__(self, run: str | os.PathLike[str], rid: int) -> None:
        self.spool_root = Path(run) / schema.SPOOL_DIR
        if not self.spool_root.is_dir():
            raise TraceNotFoundError(f"no spool folder: {self.spool_root}")
        self.rid = rid
        self.followers: dict[int, SpoolFollower] = {}
        self.answers: dict[int, dict[str, object]] = {}
        self.ended: set[int] = set()
        self.poll()

    def poll(self) -> None:
        for rank, folder in spool.spool_ranks(self.spool_root).items():
            if rank not in self.followers:
                try:
                    segs = spool.segments(folder)
                except TraceFormatError:  # removed meanwhile (a collector that held it whole)
                    continue
                last = schema.SEGMENT_RE.match(segs[-1].name) if segs else None
                start = (int(last.group(1)), 0) if last is not None else None
                self.followers[rank] = SpoolFollower(folder, start=start)
        for rank, follower in self.followers.items():
            try:
                records = follower.poll()
            except TraceFormatError:
                continue  # a segment of another format version: no answer can be read from it
            for rec in records:
                ev = rec.obj if rec.kind == schema.KIND_EVENT else None
                if not isinstance(ev, dict):
                    continue
                kind = ev.get("type")
                if kind == schema.EV_STATE and ev.get("id") == self.rid:
                    self.answers[rank] = ev
                elif kind == schema.EV_END:
                    self.ended.add(rank)
                elif kind == schema.EV_RANK_START:
                    self.ended.discard(rank)

    @property
    def ranks(self) -> list[int]:
        return sorted(self.followers)

    def waiting(self) -> list[int]:
        """Live ranks that have not answered."""
        return [r for r in self.ranks if r not in self.answers and r not in self.ended]

    def close(self) -> None:
        for f in self.followers.values():
            f.close()
