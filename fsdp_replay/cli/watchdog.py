"""Stop a job whose ``fsdp-replay record`` (or ``replay``) died: ``python -m fsdp_replay.cli.watchdog``.

``launch.run_command`` starts this in a session of its own, with a pipe on stdin whose write end
only the fsdp-replay command holds. It reads the job's pid from the pipe, then waits. If the pipe
then gives the "done" byte, the command ended normally and so does the watchdog. If it closes
without it, the command was killed (SIGKILL to it or its process group, an OOM kill): the job
would go on training unsupervised (torchrun starts each worker in a session of its own, so a
process-group kill misses them), so the watchdog stops every process of the job's tree, the way
`nsys` and `torchrun` treat their children: SIGTERM first, so that each rank's agent closes its
spool, then SIGKILL after a grace period. The spools are kept for ``fsdp-replay collect``.

The tree is remembered while the job runs, so workers whose launcher died first are still found.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
from collections.abc import Sequence

import psutil

DONE = b"x"
POLL_S = 2.0
GRACE_S = 10.0


def _tree(root: psutil.Process) -> list[psutil.Process]:
    try:
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def stop_tree(procs: Sequence[psutil.Process], grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM every process still running (the same process, not a reused pid), then SIGKILL
    what is left after ``grace_s``. Returns the pids signalled."""
    alive = [p for p in procs if p.is_running()]
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGTERM)
    _, left = psutil.wait_procs(alive, timeout=grace_s)
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    return [p.pid for p in alive]


def watch(fd: int, poll_s: float = POLL_S, grace_s: float = GRACE_S, note: str = "") -> int:
    """Stop the job whose pid comes first on ``fd`` once ``fd`` closes without DONE; ``note``:
    what to say after the stop (where the stopped job's data is)."""
    line = b""
    while not line.endswith(b"\n"):
        chunk = _read(fd, None)
        if not chunk:
            return 0  # the command died before it started the job: nothing to stop
        line += chunk
    try:
        root = psutil.Process(int(line))
    except psutil.Error:
        return 0  # the job is already gone
    seen: dict[int, psutil.Process] = {}
    while True:
        for p in _tree(root):
            seen.setdefault(p.pid, p)
        data = _read(fd, poll_s)
        if data is None:
            continue  # still running
        if data == DONE:
            return 0
        for p in _tree(root):
            seen.setdefault(p.pid, p)
        pids = stop_tree(list(seen.values()), grace_s)
        if pids:
            sys.stderr.write(
                f"fsdp-replay: the fsdp-replay command died; stopped its job (pids {sorted(set(pids))})."
                + (f" {note}" if note else "")
                + "\n"
            )
        return 0


def _read(fd: int, timeout: float | None) -> bytes | None:
    """Up to a line's worth of bytes; b"" at end of file; None when ``timeout`` passed first."""
    ready, _, _ = select.select([fd], [], [], timeout)
    if not ready:
        return None
    return os.read(fd, 64)


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the pipe tells this process what to do
    return watch(sys.stdin.fileno(), note=" ".join(sys.argv[1:]))


if __name__ == "__main__":
    sys.exit(main())
