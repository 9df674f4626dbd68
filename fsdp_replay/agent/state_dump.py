"""Answering dump requests: this process's state as a ``state`` event, from the writer thread.

A rank hung outside a collective (a deadlock, a data loader that never returns, a rank that
skipped a collective) writes nothing that says where it is. The sidecar at a hang, or
``fsdp-replay dump``, writes ``RUN/spool/dump-request`` (``trace/dump_request.py``); the writer
thread, which runs its idle callback about once a second even while the program's main thread is
blocked (``liveness.Liveness.on_idle``), calls ``StateDump.poll``: one ``os.stat`` of that file when
nothing changed, and, on a request id this process has not answered, one ``state`` event with the
position, the collective in flight and the Python stacks of the process's threads (the main thread
first; the agent's own threads marked ``agent``). A thread that holds the GIL in C code (a kernel,
a blocking C call that does not release it) blocks the writer too: then no answer comes.

A request older than this process (its ``t_wall_ns`` before the agent started: an earlier
attempt's, left in the run folder) is not answered. A malformed request file is logged once and
otherwise ignored: it must not stop the recording.
"""

from __future__ import annotations

import logging
import os
import sys
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from fsdp_replay.errors import TraceFormatError
from fsdp_replay.trace import schema
from fsdp_replay.trace.dump_request import DumpRequest, parse_request
from fsdp_replay.trace.layout import dump_request_path
from fsdp_replay.trace.redact import scrub_text

log = logging.getLogger(__name__)
AGENT_THREAD_PREFIX = "fsdp-replay"
"""Threads of ours are named so (the writer: ``fsdp-replay-writer``)."""
MAX_SOURCE_CHARS = 160
MAX_ANSWERED = 64  # request ids remembered (ids only grow: the oldest are forgotten)


def _library_roots() -> tuple[str, ...]:
    """Folders whose files are not the program's: the standard library, site-packages, ours."""
    roots = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            roots.add(os.path.realpath(path))
    roots.add(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))  # fsdp_replay/
    return tuple(sorted(r.rstrip(os.sep) + os.sep for r in roots))


class StateDump:
    """Watches run folder ``out``'s dump request; ``poll`` returns the ``state`` event to write."""

    def __init__(self, out: str, born_wall_ns: int | None = None, redact_key: str = "") -> None:
        self.path = dump_request_path(out) if out else None
        self.born_wall_ns = time.time_ns() if born_wall_ns is None else born_wall_ns
        self.answered: list[int] = []
        self.requests = 0  # requests answered (a counter for tests and the end event's readers)
        self._seen: tuple[int, int, int] | None = None  # (inode, size, mtime ns) of the file last read
        self._lib = _library_roots()
        self.redact_key = redact_key  # each source line is redacted (a literal credential in code)

    def poll(self, position: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
        """The ``state`` event answering a new request, or None (one ``stat`` when nothing changed).
        ``position()`` gives the event's step, micro, seq, t_ns, recording and inflight."""
        req = self._new_request()
        if req is None:
            return None
        self.answered = [*self.answered[-(MAX_ANSWERED - 1) :], req.id]
        self.requests += 1
        threads, dropped = self.stacks()
        return {
            "type": schema.EV_STATE,
            "id": req.id,
            "reason": req.reason,
            **position(),
            "t_wall_ns": time.time_ns(),
            "threads": threads,
            "threads_dropped": dropped,
        }

    def _new_request(self) -> DumpRequest | None:
        if self.path is None:
            return None
        try:
            st = os.stat(self.path)
        except OSError:
            return None  # no request (or the folder is gone): nothing to answer
        seen = (st.st_ino, st.st_size, st.st_mtime_ns)
        if seen == self._seen:
            return None
        self._seen = seen
        try:
            with open(self.path, "rb") as f:
                raw = f.read(1 << 16)
            req = parse_request(raw, self.path)
        except FileNotFoundError:
            return None
        except (OSError, TraceFormatError) as e:
            log.warning("fsdp-replay: ignoring the dump request: %s", e)
            return None
        if req.id in self.answered or req.t_wall_ns < self.born_wall_ns:
            return None
        return req

    def stacks(self) -> tuple[list[dict[str, Any]], int]:
        """The Python threads' stacks, the main thread first, then by name; bounded."""
        frames = sys._current_frames()
        by_ident = {t.ident: t for t in threading.enumerate()}
        main = threading.main_thread().ident
        me = threading.get_ident()
        threads = []
        for ident, frame in frames.items():
            t = by_ident.get(ident)
            name = t.name if t is not None else f"<unknown {ident}>"
            agent = ident == me or name.startswith(AGENT_THREAD_PREFIX)
            threads.append((ident != main, agent, name, ident, frame))
        threads.sort(key=lambda x: x[:3])
        out = [
            self._thread(name, ident, ident == main, agent, frame) for _, agent, name, ident, frame in threads
        ]
        del frames, threads
        keep = schema.STATE_MAX_THREADS
        return out[:keep], max(0, len(out) - keep)

    def _thread(self, name: str, ident: int, main: bool, agent: bool, frame: Any) -> dict[str, Any]:
        depth, f = 0, frame
        while f is not None:
            depth += 1
            f = f.f_back
        summary = traceback.extract_stack(frame, limit=schema.STATE_MAX_FRAMES)
        rows = []
        for fs in summary:
            file = os.path.realpath(fs.filename) if not fs.filename.startswith("<") else fs.filename
            lib = file.startswith(self._lib) or file.startswith("<")
            line = scrub_text((fs.line or "").strip(), self.redact_key)[:MAX_SOURCE_CHARS]
            rows.append([fs.filename, fs.lineno or 0, fs.name, line, lib])
        return {
            "name": name,
            "ident": ident,
            "main": main,
            "agent": agent,
            "frames": rows,
            "frames_dropped": max(0, depth - len(rows)),
        }
