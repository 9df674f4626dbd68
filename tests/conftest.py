"""Shared fixtures: run the example under torchrun, recorded or not, and capability markers.

Markers skip only where the capability is missing, with the reason: ``gpu`` (a CUDA device),
``ebpf`` (root and the bcc bindings), ``docker`` (a running engine), ``k8s`` (opt-in: KUBECONFIG
and FSDP_REPLAY_TEST_K8S=1).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_fsdp.py"
BIN = Path(sys.executable).parent
TORCHRUN = str(BIN / "torchrun")
CLI = [sys.executable, "-m", "fsdp_replay"]
RUN_TIMEOUT_S = 300


def _capabilities() -> dict[str, str | None]:
    """marker -> reason it is unavailable (None when available)."""
    reasons: dict[str, str | None] = {}
    try:
        import torch

        reasons["gpu"] = None if torch.cuda.is_available() else "no CUDA device"
    except ImportError:
        reasons["gpu"] = "torch is not installed"
    if os.geteuid() != 0:
        reasons["ebpf"] = "needs root"
    elif importlib.util.find_spec("bcc") is None:
        reasons["ebpf"] = "the bcc Python bindings (Debian python3-bpfcc) are not importable"
    else:
        reasons["ebpf"] = None
    docker = shutil.which("docker")
    ok = docker is not None and subprocess.run([docker, "info"], capture_output=True).returncode == 0
    reasons["docker"] = None if ok else "no running Docker engine"
    try:
        import torch

        headers = Path(torch.__file__).parent / "include" / "torch" / "csrc" / "distributed" / "c10d"
        missing = [c for c in ("gcc", "g++") if shutil.which(c) is None]
        if missing:
            reasons["cxx"] = f"no {' or '.join(missing)} on PATH"
        else:
            reasons["cxx"] = (
                None if headers.is_dir() else f"torch's C++ headers are not installed ({headers})"
            )
    except ImportError:
        reasons["cxx"] = "torch is not installed"
    k8s = os.environ.get("KUBECONFIG") and os.environ.get("FSDP_REPLAY_TEST_K8S") == "1"
    reasons["k8s"] = None if k8s else "opt-in: set KUBECONFIG and FSDP_REPLAY_TEST_K8S=1"
    return reasons


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    caps = _capabilities()
    for item in items:
        for marker, reason in caps.items():
            if reason is not None and marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=f"{marker}: {reason}"))


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
    **env: str,
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """Record the example; returns (run folder, process). Params go to RUN/params-<rank>.pt."""
    out = tmp / name
    proc = run(
        [
            *CLI,
            "record",
            "--out",
            str(out),
            *record_args,
            "--",
            *torchrun_cmd(nproc, EXAMPLE, "--save-params", str(out / "params-{rank}.pt"), *args),
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


def _use_fp_impl(impl: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    from fsdp_replay.agent import native

    if impl == "torch":
        monkeypatch.setenv(native.ENV_DISABLE, "0")
    else:
        monkeypatch.delenv(native.ENV_DISABLE, raising=False)
    native.reload()
    if impl == "native" and not native.available():
        pytest.fail(
            "the native fingerprint core is not built: `pip install -e .` builds it (needs a C compiler)"
        )
    yield impl
    monkeypatch.undo()
    native.reload()


@pytest.fixture(params=["native", "torch"])
def fp_impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Runs a test with the agent's native fingerprint core and again with its torch path.

    The native core is built by ``pip install -e .`` (``make test`` does it); a missing build
    fails rather than skips, so that CI always exercises it."""
    yield from _use_fp_impl(request.param, monkeypatch)


@pytest.fixture
def native_core(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The native fingerprint core, enabled (fails where it is not built, see ``fp_impl``)."""
    yield from _use_fp_impl("native", monkeypatch)


@pytest.fixture
def torch_fp(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The agent's torch fingerprint path (the native core disabled)."""
    yield from _use_fp_impl("torch", monkeypatch)
