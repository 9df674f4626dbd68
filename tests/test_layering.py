"""The layering contracts (``.importlinter``) hold, and each kind of contract catches a violation.

``lint-imports`` runs on the package as it is (``make lint`` runs it too), then on copies of it with
one import planted that breaks a layer, an independence, or a forbidden import (torch where the
trace format lives, zarr in the agent, bcc outside the sidecar's eBPF module).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).parent / "lint-imports"
PLANTS = {
    "layers": ("trace/dtypes.py", "import fsdp_replay.agent.config", "Components are layered"),
    "independence": (
        "agent/batches.py",
        "import fsdp_replay.analysis.columns",
        "are independent of each other",
    ),
    "no-torch": ("trace/dtypes.py", "import torch", "never import torch"),
    "agent-no-zarr": ("agent/writer.py", "import zarr", "no zarr, no compression"),
    "bcc-only-in-ebpf": ("injector/review.py", "import bcc", "Only the sidecar's eBPF module imports bcc"),
}


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root), "COLUMNS": "250"}  # rich wraps at 80 otherwise
    return subprocess.run(
        [str(LINT), "--config", str(REPO / ".importlinter"), "--no-cache"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def copy_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not LINT.exists():
        pytest.fail("lint-imports is not installed (it is in the test extra: pip install -e '.[test]')")
    root = tmp_path_factory.mktemp("layering")
    shutil.copytree(
        REPO / "fsdp_replay", root / "fsdp_replay", ignore=shutil.ignore_patterns("*.so", "__pycache__")
    )
    return root


def test_the_package_keeps_every_contract() -> None:
    proc = _lint(REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


@pytest.mark.parametrize("contract", sorted(PLANTS))
def test_a_planted_violation_is_caught(copy_root: Path, contract: str) -> None:
    module, planted, name = PLANTS[contract]
    path = copy_root / "fsdp_replay" / module
    original = path.read_text()
    path.write_text(original + f"\n{planted}  # planted by tests/test_layering.py\n")
    try:
        proc = _lint(copy_root)
    finally:
        path.write_text(original)
    assert proc.returncode != 0, proc.stdout[-3000:]
    broken = proc.stdout.split("Broken contracts", 1)[-1]
    assert name in broken, proc.stdout[-4000:]
    assert planted.split()[-1] in broken


_BLOCKED_IMPORTS = """
import importlib.abc, sys
class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {"rich", "zarr", "numcodecs", "numpy", "torch", "psutil", "bcc"}:
            raise ImportError(f"{name} is not in the webhook image")
sys.meta_path.insert(0, _Block())
from fsdp_replay.cli.main import build_parser
for cmd in sys.argv[1:]:
    build_parser().parse_args([cmd, "--help"])
"""


@pytest.mark.parametrize("cmd", ["webhook", "inject", "sidecar"])
def test_the_parser_and_the_components_need_no_third_party_package(cmd: str) -> None:
    # The webhook image holds the package on the standard library alone (docker/webhook.Dockerfile):
    # building the parser must not import rich, zarr, numpy, torch or psutil.
    proc = subprocess.run(
        [sys.executable, "-c", _BLOCKED_IMPORTS, cmd], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"fsdp-replay {cmd}" in proc.stdout
