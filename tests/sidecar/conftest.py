"""Fixtures for the sidecar: the real libnccl of the nvidia-nccl-cu13 wheel, the C load generator,
and a check that bcc can really compile and load a program here.

Tests that need root and bcc carry the ``ebpf`` marker (skipped by tests/conftest.py, with the
reason, where either is missing). A missing wheel or compiler skips with the command that
installs it; bcc present but unable to compile (no kernel headers, no tracefs) fails, because
that is a broken setup rather than a missing capability.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sidecar_support import INSTALL_HINT, build_nccl_loop, find_libnccl, find_libtorch_cpu


@pytest.fixture(scope="session")
def libnccl() -> Path:
    lib = find_libnccl()
    if lib is None:
        pytest.skip(f"the nvidia-nccl-cu13 wheel (real libnccl.so.2) is not installed: {INSTALL_HINT}")
    return lib


@pytest.fixture(scope="session")
def libtorch_cpu() -> Path:
    lib = find_libtorch_cpu()
    if lib is None:
        pytest.skip("torch is not installed (libtorch_cpu.so holds gloo)")
    return lib


@pytest.fixture(scope="session")
def nccl_loop(tmp_path_factory: pytest.TempPathFactory, libnccl: Path) -> Path:
    """The C load generator (helpers/nccl_loop.c), compiled now."""
    try:
        return build_nccl_loop(tmp_path_factory.mktemp("nccl_loop"))
    except FileNotFoundError:
        pytest.skip(f"no gcc to build the C load generator: {INSTALL_HINT}")


@pytest.fixture(scope="session")
def bcc_works() -> None:
    """bcc compiles and loads a trivial uprobe program (kernel headers, tracefs in place)."""
    from fsdp_replay.sidecar.ebpf import nccl
    from fsdp_replay.sidecar.ebpf.probe import Probe, ProbeError

    try:
        Probe(nccl.by_name("ncclGroupStart")).close()
    except ProbeError as e:
        pytest.fail(f"bcc is importable but cannot load a program ({e}); run {INSTALL_HINT}")
