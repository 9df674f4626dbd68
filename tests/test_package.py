"""The package users install: the wheel and the sdist built from this tree hold every source the
agent compiles at run time and the sitecustomize (a wheel without them made an installed agent fall
back, silently, to the slow Python tape and CUPTI reader)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NEEDED_SUFFIXES = (".c", ".cpp", ".h")


def _needed() -> set[str]:
    """What an installed package must hold beyond its modules: paths relative to the repository."""
    found = {p for p in (REPO / "fsdp_replay").rglob("*") if p.suffix in NEEDED_SUFFIXES}
    found |= set((REPO / "fsdp_replay" / "boot" / "site").glob("*.py"))
    found.add(REPO / "fsdp_replay" / "py.typed")
    return {p.relative_to(REPO).as_posix() for p in found}


def _tree(dest: Path) -> Path:
    """The files git has here (tracked, and new ones it does not ignore): what a clone builds from."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    for name in listed:
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.mark.slow
def test_the_wheel_and_the_sdist_hold_every_native_source(tmp_path: Path) -> None:
    needed = _needed()
    assert {"fsdp_replay/agent/cxx/_tape.cpp", "fsdp_replay/agent/cupti/_records.cpp"} <= needed
    src = _tree(tmp_path / "src")
    dist = tmp_path / "dist"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "build",
            "--no-isolation",
            "--skip-dependency-check",
            "--sdist",
            "--wheel",
            "--outdir",
            str(dist),
            str(src),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = dist.glob("*.whl")
    in_wheel = set(zipfile.ZipFile(wheel).namelist())
    assert not needed - in_wheel, f"the wheel lacks {sorted(needed - in_wheel)}"
    (sdist,) = dist.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        in_sdist = {n.partition("/")[2] for n in tar.getnames()}
    assert not needed - in_sdist, f"the sdist lacks {sorted(needed - in_sdist)}"


def test_the_project_metadata_is_read_without_a_setuptools_warning() -> None:
    """Every install reads pyproject.toml, three times in `make demo`'s: the license is an SPDX
    expression (a TOML table is deprecated, and was printed each time), which setuptools reads
    from 77 on, the version the build requires. In a process of its own: setuptools replaces
    distutils where it is imported."""
    import tomllib

    check = (
        "import sys; from setuptools.config.pyprojecttoml import apply_configuration; "
        "from setuptools.dist import Distribution; "
        "print(apply_configuration(Distribution(), sys.argv[1]).metadata.license_expression)"
    )
    proc = subprocess.run(
        [sys.executable, "-W", "error", "-c", check, str(REPO / "pyproject.toml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "Apache-2.0", proc.stderr[-3000:]
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    assert "setuptools>=77" in requires


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on PATH")
def test_the_install_says_what_it_installs_and_how_big_before_pip_runs() -> None:
    """`make demo` on a fresh clone: one line before the long quiet pip run, with torch's size."""
    proc = subprocess.run(
        ["make", "-n", "-B", ".venv/.installed"], cwd=REPO, capture_output=True, text=True, check=True
    )
    lines = proc.stdout.splitlines()
    first_pip = next(i for i, line in enumerate(lines) if "pip install" in line)
    said = [line for line in lines[:first_pip] if line.startswith("echo ")]
    assert len(said) == 1 and "torch==" in said[0] and "(the CPU wheel: about" in said[0], lines
