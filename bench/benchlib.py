"""Helpers shared by the benchmarks: machine facts, the child environment, small statistics.

Each benchmark is still run as a script (``python bench/bench_record.py``); this module sits
beside them and is imported by name.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.metadata
import os
import platform
import statistics
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "train_fsdp.py"


class BenchError(RuntimeError):
    pass


def quantiles(xs: list[float]) -> tuple[float, float, float]:
    """(q1, median, q3); degenerate inputs give the value itself."""
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def cpu_times() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine since boot, from /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return 0.0, 0.0
    v = [int(x) for x in fields] + [0] * 10
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq, steal = v[:8]
    return (user + nice + system + irq + softirq) / hz, steal / hz


def example_defaults() -> dict[str, Any]:
    """The example's Config defaults, read from its source (no torch import)."""
    try:
        tree = ast.parse(EXAMPLE.read_text())
    except (OSError, SyntaxError):
        return {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "Config":
            out: dict[str, Any] = {}
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value:
                    with contextlib.suppress(ValueError):
                        out[stmt.target.id] = ast.literal_eval(stmt.value)
            return out
    return {}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def version_of(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def git_commit() -> str | None:
    try:  # read-only
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def machine_info() -> dict[str, Any]:
    return {
        "nproc": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": version_of("torch"),
        "fsdp_replay": version_of("fsdp-replay"),
        "git_commit": git_commit(),
        "hostname": platform.node(),
    }


def run_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_REPLAY_")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def fmt_bytes(x: float | None) -> str:
    if x is None:
        return "-"
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= k:
            return f"{x / k:.2f} {unit}"
    return f"{x:.0f} B"
