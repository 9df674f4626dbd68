"""What each rank was doing when a dump request asked (the ``state_dumps`` rank attribute).

A dump (``docs/trace-format.md``, the ``state`` event) holds the position, the collective in
flight and the Python stacks. For a rank not in a collective, the place that matters is where its
main thread is: the innermost frame, and where that frame is in a library (``time.sleep`` is C,
but ``threading.Event.wait`` is Python), also the innermost frame of the program's own code. For
a rank in a collective: which one, and how long it had waited.
"""

from __future__ import annotations

import os
from typing import Any


def latest(attrs: dict[str, Any]) -> dict[str, Any] | None:
    """The rank's last dump (the highest request id), or None (absent in older traces: none)."""
    dumps = [d for d in attrs.get("state_dumps") or [] if isinstance(d, dict)]
    return max(dumps, key=lambda d: (int(d.get("id", 0)), int(d.get("t_ns", 0)))) if dumps else None


def _show_path(path: str, cwd: str) -> str:
    if cwd and path.startswith(cwd.rstrip("/") + "/"):
        return os.path.relpath(path, cwd)
    return path


def _frame(row: list[Any], cwd: str) -> dict[str, Any]:
    file, line, func, source = row[0], row[1], row[2], row[3]
    lib = bool(row[4]) if len(row) > 4 else False
    return {
        "file": _show_path(str(file), cwd),
        "line": int(line),
        "function": func,
        "source": source,
        "lib": lib,
    }


def _where(f: dict[str, Any]) -> str:
    text = f"{f['file']}:{f['line']} in {f['function']}"
    return text + (f" ({f['source']})" if f["source"] else "")


def where(dump: dict[str, Any], cwd: str = "") -> dict[str, Any]:
    """``{"id", "step", "seq", "inflight", "main": {"frame", "program_frame"} or None, "threads",
    "recording"}``: the main thread's innermost frame and its innermost frame of the program's
    code (None when the innermost is the program's, or none is)."""
    threads = [t for t in dump.get("threads") or [] if isinstance(t, dict)]
    main = next((t for t in threads if t.get("main")), None)
    spot = None
    if main is not None and main.get("frames"):
        frames = [_frame(r, cwd) for r in main["frames"]]
        inner = frames[-1]
        program = next((f for f in reversed(frames) if not f["lib"]), None)
        spot = {"frame": inner, "program_frame": None if program is inner else program}
    return {
        "id": dump.get("id"),
        "reason": dump.get("reason"),
        "step": dump.get("step"),
        "seq": dump.get("seq"),
        "recording": dump.get("recording", True),
        "inflight": dump.get("inflight"),
        "main": spot,
        "threads": len(threads) + int(dump.get("threads_dropped") or 0),
        "agent_threads": sum(1 for t in threads if t.get("agent")),
    }


def describe(rank: int, dump: dict[str, Any], cwd: str = "") -> str:
    """One line: where rank ``rank`` was when it answered ``dump``."""
    w = where(dump, cwd)
    spot = w["main"]
    at = ""
    if spot is not None:
        inner, program = spot["frame"], spot["program_frame"]
        at = f"its main thread is at {_where(inner)}"
        if program is not None:
            at += f", called from {_where(program)}"
    inflight = w["inflight"]
    if inflight:
        text = (
            f"rank {rank} waits in collective #{inflight.get('seq')} {inflight.get('op')} "
            f"(step {inflight.get('step')}, pg {inflight.get('pg')}) for "
            f"{int(inflight.get('waited_ns') or 0) / 1e9:.1f} s"
        )
        if spot is not None and spot["program_frame"] is not None:
            text += f", issued at {_where(spot['program_frame'])}"
    else:
        text = f"rank {rank} is not in a collective (step {w['step']}, next collective #{w['seq']})"
        text += f": {at}" if at else ": no stack of its main thread"
    if not w["recording"]:
        text += " (its agent had stopped recording)"
    return text


def rank_states(ranks: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """``{rank: {"where": where(...), "message": describe(...)}}`` for the ranks (``rank ->
    attrs``) that answered a dump request; the rest are left out."""
    out: dict[int, dict[str, Any]] = {}
    for rank, attrs in sorted(ranks.items()):
        dump = latest(attrs)
        if dump is None:
            continue
        cwd = str((attrs.get("rank_start") or {}).get("cwd") or "")
        out[rank] = {"where": where(dump, cwd), "message": describe(rank, dump, cwd)}
    return out
