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

from fsdp_replay.errors import TraceFormatError
from fsdp_replay.trace.schema import TRACE_DIR

RUN_JSON: Final = "run.json"
REPORT_JSON: Final = "report.json"
REPORT_TXT: Final = "report.txt"
REPLAY_PNG: Final = "replay.png"
REPLAYS_DIR: Final = "replays"
RANK_REPORT_FMT: Final = "rank-{rank:05d}"
# The collector's lock, beside the spool folder it reads (``RUN/spool.lock``).
COLLECT_LOCK_SUFFIX: Final = ".lock"


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


def resolve_trace(path: str) -> str:
    """A run folder (holding ``trace.zarr``) or the trace itself: the trace's location."""
    inner = os.path.join(path, TRACE_DIR)
    if "://" not in path and os.path.isdir(inner):
        return inner
    if "://" not in path and os.path.exists(inner):
        raise TraceFormatError("not a trace: a file where the trace folder should be", path=inner)
    return path
