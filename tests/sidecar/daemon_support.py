"""Helpers of the daemon tests: run the real sidecar as a process, scrape it, wait for values."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from prometheus_client.parser import text_string_to_metric_families
from sidecar_support import HERE

SIDECAR = [sys.executable, "-m", "fsdp_replay.sidecar.main"]
SPOOL_TRAINER = HERE / "helpers" / "spool_trainer.py"
POD = HERE / "helpers" / "pod.py"
T = TypeVar("T")

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sidecar_cmd(out: Path, port: int, *args: str) -> list[str]:
    return [*SIDECAR, "--out", str(out), "--metrics-address", "127.0.0.1", "--metrics-port", str(port), *args]


def sidecar_env() -> dict[str, str]:
    """The test's environment without FSDP_REPLAY_* (the sidecar is not a trainer)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_REPLAY_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def scrape(port: int) -> Samples | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return parse(r.read().decode())
    except OSError:
        return None


def get(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum over the series of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= lab)


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 60.0, every: float = 0.2) -> T:
    deadline = time.monotonic() + timeout
    while True:
        got = probe()
        if got is not None and got is not False:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def wait_metrics(port: int, what: str, ok: Callable[[Samples], bool], timeout: float = 60.0) -> Samples:
    """The first scrape of the sidecar on ``port`` for which ``ok`` holds."""

    def probe() -> Samples | None:
        s = scrape(port)
        return s if s is not None and ok(s) else None

    return wait_for(what, probe, timeout)


def wait_healthy(port: int, proc: subprocess.Popen[str], timeout: float = 60.0) -> None:
    def ok() -> bool | None:
        if proc.poll() is not None:
            raise AssertionError(f"the sidecar exited {proc.returncode} before serving")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                return r.status == 200
        except OSError:
            return None

    wait_for("/healthz", ok, timeout)


def can_isolate() -> str | None:
    """Why a private PID namespace (the pod's view of processes) cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (unshare --pid)"
    if shutil.which("unshare") is None:
        return "no unshare (util-linux)"
    return None
