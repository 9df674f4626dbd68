"""Capability markers and the fingerprint-implementation fixtures (process helpers: harness.py).

Markers skip only where the capability is missing, with the reason: ``gpu`` (a CUDA device),
``ebpf`` (root and the bcc bindings), ``docker`` (a running engine), ``k8s`` (opt-in: KUBECONFIG
and FSDP_REPLAY_TEST_K8S=1).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest


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
        reasons["ebpf"] = (
            "the bcc Python bindings (Debian python3-bpfcc) are not importable: "
            "scripts/install-ebpf.sh .venv installs them (make test does, as root)"
        )
    else:
        reasons["ebpf"] = None
    # Debian's client (BuildKit, buildx); another client earlier on PATH may lack buildx.
    docker = "/usr/bin/docker" if os.path.exists("/usr/bin/docker") else shutil.which("docker")
    ok = docker is not None and subprocess.run([docker, "info"], capture_output=True).returncode == 0
    reasons["docker"] = (
        None if ok else "no running Docker engine (as root: scripts/install-docker.sh start; make test does)"
    )
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


def _use_fp_impl(impl: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    from fsdp_replay.agent.fingerprint import native

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
