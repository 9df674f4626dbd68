"""The benchmarks' record of what ran (``bench/benchlib.py``): a copy whose git metadata is stale
(the GPU machine's) still names the commit that ran, by its working tree's id."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCHLIB = Path(__file__).resolve().parents[1] / "bench" / "benchlib.py"


def _git(repo: Path, *args: str) -> str:
    cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args]
    return subprocess.run(cmd, cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def test_a_changed_working_tree_is_named_by_the_tree_its_commit_will_have(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = importlib.util.spec_from_file_location("benchlib_under_test", BENCHLIB)
    assert spec and spec.loader
    benchlib = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, benchlib)  # its dataclasses look it up there
    spec.loader.exec_module(benchlib)
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    (repo / ".gitignore").write_text("ignored/\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "one")
    monkeypatch.setattr(benchlib, "REPO", repo)
    head = _git(repo, "rev-parse", "HEAD")
    assert benchlib.git_commit() == head  # clean: the commit alone
    (repo / "a.py").write_text("x = 2\n")
    (repo / "new.py").write_text("y = 1\n")
    (repo / "ignored").mkdir()
    (repo / "ignored" / "big.bin").write_bytes(b"\0" * 100)
    named = benchlib.git_commit()
    assert named.startswith(f"{head} with uncommitted changes (working tree ")
    tree = named.rsplit(" ", 1)[1].rstrip(")")
    assert _git(repo, "diff", "--cached", "--name-only") == ""  # the repository's index untouched
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "two")
    assert _git(repo, "rev-parse", "HEAD^{tree}") == tree
