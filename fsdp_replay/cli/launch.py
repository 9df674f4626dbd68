"""Run a command with the agent enabled: what ``fsdp-replay record`` (and later ``replay``) do.

The agent reaches the program's Python processes through PYTHONPATH: our ``sitecustomize``
first, then a folder holding only the ``fsdp_replay`` package (never a whole site-packages,
which would reorder the program's own imports). The program's own PYTHONPATH is kept after ours.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from fsdp_replay.boot.pythonpath import PACKAGE_DIR, SITE_DIR
from fsdp_replay.boot.pythonpath import agent_pythonpath as _pythonpath_rule
from fsdp_replay.cli.watchdog import DONE

AGENT_PATH_DIR = ".agent-path"


def agent_pythonpath(run_dir: Path, existing: str | None) -> str:
    """The rule of ``boot.pythonpath``, with a run-folder link standing for the package folder."""
    link_root = run_dir / AGENT_PATH_DIR
    link_root.mkdir(parents=True, exist_ok=True)
    link = link_root / "fsdp_replay"
    if not link.exists():
        link.symlink_to(PACKAGE_DIR, target_is_directory=True)
    return _pythonpath_rule(str(SITE_DIR), str(link_root), existing)


def agent_env(
    run_dir: Path, settings: Mapping[str, str], base: Mapping[str, str] | None = None
) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update(settings)
    env["PYTHONPATH"] = agent_pythonpath(run_dir, env.get("PYTHONPATH"))
    return env


def run_command(
    command: Sequence[str], env: Mapping[str, str], cwd: str | None = None, orphan_note: str = ""
) -> tuple[int, dict[str, Any]]:
    """Run ``command`` in its own process group; forward SIGINT/SIGTERM; return (exit code, info).

    The exit code follows the shell's convention (128 + N when killed by signal N). A watchdog
    (``fsdp_replay.cli.watchdog``) stops the command's whole process tree if this process dies first.
    ``orphan_note``: what the watchdog says after such a stop (where the data is).
    """
    t0 = time.time()
    forwarded: list[int] = []
    early: list[int] = []  # those that came before the command existed, passed on once it does
    proc: subprocess.Popen[bytes] | None = None

    def forward(signum: int, _frame: Any) -> None:
        forwarded.append(signum)
        if proc is None:
            early.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signum)

    # From before the command starts: a Ctrl-C while it starts reaches it as soon as it exists,
    # never a KeyboardInterrupt here that would leave it running (in a session of its own).
    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    watchdog: subprocess.Popen[bytes] | None = None
    try:
        watchdog = subprocess.Popen(
            [sys.executable, "-m", "fsdp_replay.cli.watchdog", *([orphan_note] if orphan_note else [])],
            stdin=subprocess.PIPE,
            start_new_session=True,
        )
        assert watchdog.stdin is not None
        try:
            proc = subprocess.Popen(list(command), env=dict(env), cwd=cwd, start_new_session=True)
        except FileNotFoundError:
            return 127, {"error": f"command not found: {command[0]}", "start": t0, "end": time.time()}
        watchdog.stdin.write(f"{proc.pid}\n".encode())
        watchdog.stdin.flush()
        for signum in early[:1]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signum)
        rc = proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if watchdog is not None and watchdog.stdin is not None:
            with contextlib.suppress(OSError):
                if proc is not None and proc.returncode is not None:  # it ended: nothing to stop
                    watchdog.stdin.write(DONE)
                watchdog.stdin.close()
            watchdog.wait()
    code = 128 - rc if rc < 0 else rc
    return code, {"start": t0, "end": time.time(), "returncode": rc, "signals_forwarded": forwarded}
