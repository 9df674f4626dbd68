"""Why a run folder holds no trace: what its processes' attach markers (``boot/attach.py``) say.

Each process that imports torch with the agent recording leaves a marker before it records
anything (``RUN/spool/attached/<pid>-<host>.json``); a rank's spool starts only with its first
collective. A run whose spool has markers and no rank folder recorded nothing, and the markers
say why: no process imported torch, only torchrun's launcher did, the ranks were started by
``mp.spawn``, or none reached its first collective. ``record``, ``collect`` and every command
that opens a run folder (``layout.resolve_trace``) say it the same way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fsdp_replay.trace import schema, spool
from fsdp_replay.trace.layout import RUN_JSON, SPAWNED_RANK, attached_dir


def attach_markers(out: Path) -> list[dict[str, Any]]:
    """The attach markers the run's processes left (``boot/attach.mark_attached``); unreadable
    ones (a process killed mid-write leaves only a ``.tmp``) are skipped."""
    found = []
    folder = attached_dir(out)
    for p in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            doc = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict):
            found.append(doc)
    return found


def _is_launcher(marker: dict[str, Any]) -> bool:
    """torchrun's launcher (or ``python -m torch.distributed.run/launch``): it imports torch too,
    and records nothing of its own."""
    argv = marker.get("argv") or [""]
    first = str(argv[0]).replace("\\", "/")
    return first.rsplit("/", 1)[-1] == "torchrun" or first.endswith(
        ("torch/distributed/run.py", "torch/distributed/launch.py")
    )


def nothing_recorded(out: Path, code: int | None, *, output_above: bool = True) -> str:
    """Why run folder ``out`` holds no rank spool, from its processes' attach markers: how many
    processes imported torch with the agent, their ranks, and the command's exit code ``code``."""
    markers = attach_markers(out)
    exited = "" if code is None else f"the command exited with code {code}"
    if exited and output_above:
        exited += " (see its output above)"
    if not markers:
        return (
            f"the command recorded nothing{f' (exit code {code})' if code is not None else ''}: "
            "no Python process of it imported torch with the agent enabled"
        )
    spawned = [m for m in markers if m.get("error") == SPAWNED_RANK]
    if spawned:
        return (
            f"the command recorded nothing: its ranks ({len(spawned)} processes) were started by "
            "torch.multiprocessing (mp.spawn), which fsdp-replay does not record (a single-rank replay "
            "could not start one of them alone); launch them with torchrun (`torchrun --nproc_per_node N "
            "script.py`, each rank reading RANK, WORLD_SIZE and LOCAL_RANK from its environment)"
            + (f"; {exited}" if exited else "")
        )
    programs = [m for m in markers if not _is_launcher(m)]
    if not programs:
        msg = (
            "the command recorded nothing: only its launcher (torchrun) imported torch with the agent, "
            "none of its workers"
        )
        return msg + (f"; {exited}" if exited else "")
    ranked = [m for m in programs if isinstance(m.get("rank"), int)]
    others = len(programs) - len(ranked)
    ranks = sorted({int(m["rank"]) for m in ranked})

    def processes(n: int) -> str:
        return f"{n} process{'es' if n != 1 else ''}"

    if ranked:
        who = f"{processes(len(ranked))} imported torch with the agent (rank{'s' if len(ranks) != 1 else ''} "
        who += ", ".join(map(str, ranks)) + ")"
        if others:
            who += f" and {processes(others)} without a RANK"
    else:
        who = f"{processes(others)} imported torch with the agent (no RANK set)"
    none = (
        "none reached its first collective" if len(programs) > 1 else "it never reached its first collective"
    )
    msg = f"the command recorded nothing: {who}, but {none}"
    failed = [m for m in markers if m.get("error")]
    if failed:
        msg += f"; the agent failed to attach in {processes(len(failed))}: {failed[0]['error']}"
    return msg + (f"; {exited}" if exited else "")


def recorded_exit_code(out: Path) -> int | None:
    """The command's exit code from ``RUN/run.json``; None while it runs, or when unreadable."""
    try:
        run = json.loads((out / RUN_JSON).read_text())
    except (OSError, ValueError):
        return None
    code = run.get("exit_code") if isinstance(run, dict) else None
    return code if isinstance(code, int) else None


def empty_run(out: Path) -> str | None:
    """Why run folder ``out`` has no trace when it recorded nothing: a ``record`` that ran (its
    ``run.json`` or attach markers are there) and left no rank spool and no trace. None for
    anything else (a run with spools to collect, a trace, a folder that is no run)."""
    if (out / schema.TRACE_DIR).exists() or spool.spool_ranks(out / schema.SPOOL_DIR):
        return None
    if not (out / RUN_JSON).is_file() and not attach_markers(out):
        return None
    code = recorded_exit_code(out)
    why = nothing_recorded(out, code, output_above=False)
    if code is None:
        why += " (so far: the command may still be starting, or its record process was killed)"
    return why
