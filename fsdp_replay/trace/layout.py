"""The run folder's names, and the one way fsdp-replay publishes a file.

A run folder (``fsdp-replay record --out RUN``) holds ``run.json``, the spools, the trace and the
replays made from it. Every file the tool publishes there is written through ``atomic_write``: a
reader (or a second command) sees the old file or the new one, never half of one, and a process
killed mid-write leaves at most a ``.tmp`` file beside it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Final

from fsdp_replay.errors import ConfigError, TraceFormatError, TraceNotFoundError
from fsdp_replay.trace.schema import SPOOL_DIR, TRACE_DIR

RUN_JSON: Final = "run.json"
REPORT_JSON: Final = "report.json"
REPORT_TXT: Final = "report.txt"
REPLAY_PNG: Final = "replay.png"
REPLAYS_DIR: Final = "replays"
RANK_REPORT_FMT: Final = "rank-{rank:05d}"
# The collector's lock, beside the spool folder it reads (``RUN/spool.lock``).
COLLECT_LOCK_SUFFIX: Final = ".lock"
# What each process that imports torch with the agent recording leaves at attach, before its rank
# is known (its rank spool starts with its first record): ``RUN/spool/attached/<pid>-<host>.json``.
# Not a rank spool: the collector and the sidecar read only ``rank-NNNNN`` folders.
ATTACHED_DIR: Final = "attached"
ATTACHED_FMT: Final = "{pid}-{host}.json"
# A request that every rank's agent write its state (threads' stacks, the collective in flight) as
# a `state` event: one file for all ranks, ``RUN/spool/dump-request``, written by the sidecar at a
# hang or by ``fsdp-replay dump`` (``trace/dump_request.py``). Not a rank spool either.
DUMP_REQUEST: Final = "dump-request"


def attached_dir(run: str | os.PathLike[str]) -> Path:
    """The folder of the attach markers of run folder ``run``."""
    return Path(run) / SPOOL_DIR / ATTACHED_DIR


# An attach marker's error from a multiprocessing child that joined a process group (boot/attach.py).
SPAWNED_RANK = (
    "a rank started by torch.multiprocessing (mp.spawn, or a spawn/forkserver Process) joined a "
    "process group: such ranks are not recorded"
)


def attached_marker(run: str | os.PathLike[str], pid: int, host: str) -> Path:
    """The attach marker of process ``pid`` on ``host`` (the host name reduced to a file name's
    characters: several hosts may share one run folder)."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in host) or "host"
    return attached_dir(run) / ATTACHED_FMT.format(pid=pid, host=safe)


def dump_request_path(run: str | os.PathLike[str]) -> Path:
    """The dump request of run folder ``run``."""
    return Path(run) / SPOOL_DIR / DUMP_REQUEST


def atomic_write(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename.

    On an error (a full disk) the temporary file is removed and the error re-raised; the old
    ``path``, if any, is untouched.
    """
    target = Path(path)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    raw = data.encode() if isinstance(data, str) else data
    try:
        with open(tmp, "wb") as f:
            f.write(raw)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def inside_trace(path: Path, trace_url: str) -> bool:
    """Whether ``path`` is the trace ``trace_url`` (a run folder or the trace) or inside it."""
    if "://" in trace_url:
        return False
    where, trace = path.resolve(), Path(resolve_trace(trace_url)).resolve()
    return where == trace or trace in where.parents


def output_file(path: str, flag: str, traces: tuple[str, ...], suffixes: tuple[str, ...] = ()) -> Path:
    """A file a command writes (an export, a plot), checked before any work: not a folder, not
    inside a trace it reads, with one of ``suffixes`` (when given); its folder is made."""
    target = Path(path)
    if target.is_dir() or path.endswith(os.sep):
        raise ConfigError(f"{flag} {path} is a folder: give the file to write")
    if suffixes and not path.lower().endswith(suffixes):
        names = ", ".join(suffixes[:-1]) + " or " + suffixes[-1] if len(suffixes) > 1 else suffixes[0]
        raise ConfigError(f"{flag} {path}: the file name must end in {names}")
    for t in traces:
        if inside_trace(target, t):
            raise ConfigError(f"{flag} {path} is inside the trace {t}: write it outside")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot make its folder ({e.strerror})") from e
    return target


def output_folder(path: str | os.PathLike[str], flag: str) -> Path:
    """A folder a command writes into (a run, a replay's report), made now, before any work: a
    file there, or a folder that cannot be made, is a bad option that says so."""
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{flag} {path} is a file: give a folder (made if it does not exist)")
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{flag} {path}: the folder cannot be made there ({e.strerror or e})") from e
    return target


def resolve_trace(path: str) -> str:
    """A run folder (holding ``trace.zarr``) or the trace itself: the trace's location."""
    inner = os.path.join(path, TRACE_DIR)
    if "://" not in path and os.path.isdir(inner):
        return inner
    if "://" not in path and os.path.exists(inner):
        raise TraceFormatError("not a trace: a file where the trace folder should be", path=inner)
    if "://" not in path and not os.path.exists(os.path.join(path, "zarr.json")):
        from fsdp_replay.trace.attach_markers import empty_run  # it reads this module's names

        if (why := empty_run(Path(path))) is not None:
            raise TraceNotFoundError(f"{path}: {why}; there is no trace to read, nor spools to collect")
    if (
        "://" not in path
        and os.path.isdir(os.path.join(path, SPOOL_DIR))
        and not os.path.exists(os.path.join(path, "zarr.json"))
    ):
        raise TraceNotFoundError(
            f"{path} holds a recording's spools but no trace yet (record --no-collect, or a run still "
            f"going): build it with `fsdp-replay collect {path}`"
        )
    return path
