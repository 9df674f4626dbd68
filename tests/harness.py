"""Running the example and the CLI as real processes: what the multi-process tests share.

A module of its own (not ``conftest.py``): the test folders each have a conftest, and Python knows
only one module named ``conftest`` at a time. ``pyproject.toml`` puts ``tests/`` on the path.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_fsdp.py"
BIN = Path(sys.executable).parent
TORCHRUN = str(BIN / "torchrun")
CLI = [sys.executable, "-m", "fsdp_replay"]
# A hang guard for each process a test runs, not a speed requirement: scripts/compat-torch.sh raises
# it (a CUDA build of an older torch on a shared 2-core machine is slower than CI's CPU wheel).
RUN_TIMEOUT_S = int(os.environ.get("FSDP_REPLAY_TEST_TIMEOUT_S", "300"))


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_REPLAY_")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def run(
    cmd: Sequence[str],
    *,
    env: dict[str, str] | None = None,
    timeout: float = RUN_TIMEOUT_S,
    check: bool = True,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        list(cmd), env=env or child_env(), capture_output=True, text=True, timeout=timeout, cwd=cwd or REPO
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
            f"\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def torchrun_cmd(nproc: int, script: Path | str, *args: str) -> list[str]:
    return [TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", str(script), *args]


def train(tmp: Path, nproc: int = 2, *args: str, **env: str) -> Path:
    """Run the example unrecorded; returns the folder with params-<rank>.pt."""
    out = tmp / "plain"
    run(
        torchrun_cmd(nproc, EXAMPLE, "--save-params", str(out / "params-{rank}.pt"), *args),
        env=child_env(**env),
    )
    return out


def record(
    tmp: Path,
    nproc: int = 2,
    *args: str,
    record_args: Sequence[str] = (),
    name: str = "rec",
    check: bool = True,
    script: Sequence[str] = (),
    **env: str,
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """Record the example (or ``script``: a wrapper and its arguments, given the example's after
    them); returns (run folder, process). Params go to RUN/params-<rank>.pt."""
    out = tmp / name
    proc = run(
        [
            *CLI,
            "record",
            "--out",
            str(out),
            *record_args,
            "--",
            *torchrun_cmd(
                nproc, *(script or (str(EXAMPLE),)), "--save-params", str(out / "params-{rank}.pt"), *args
            ),
        ],
        env=child_env(**env),
        check=check,
    )
    return out, proc


def load_params(folder: Path, rank: int) -> dict[str, Any]:
    import torch

    return torch.load(folder / f"params-{rank}.pt", map_location="cpu")


def assert_same_params(a: Path, b: Path, nproc: int) -> None:
    import torch

    for r in range(nproc):
        pa, pb = load_params(a, r), load_params(b, r)
        assert pa.keys() == pb.keys()
        for k in pa:
            assert torch.equal(pa[k], pb[k]), f"rank {r} parameter {k} differs"


def training_ranks(root: Any) -> list[Any]:
    """The training ranks below a process (a ``psutil.Process``): torchrun sets RANK for them
    only; the ranks' DataLoader workers are left out."""
    import psutil

    found = []
    for p in root.children(recursive=True):
        try:
            if "RANK" in p.environ() and "train_fsdp.py" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            continue
    pids = {p.pid for p in found}
    return [p for p in found if p.ppid() not in pids]


@contextlib.contextmanager
def small_tmpfs(mnt: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (mount's syntax: "3m", "256k") at ``mnt``: a disk that fills up.
    Skips the test where it cannot be mounted (not root, or no mount here)."""
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    mnt.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("mounting a tmpfs failed here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
