"""The recorded command line read as data: what a replay runs untrusted, and what it refuses."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from fsdp_replay.trace import command


@pytest.mark.parametrize(
    ("argv", "options", "script", "module", "args"),
    [
        (["train.py", "--lr", "1"], [], "train.py", None, ["--lr", "1"]),
        (["-u", "-X", "dev", "-Wignore", "train.py"], ["-u", "-X", "dev", "-Wignore"], "train.py", None, []),
        (["-uB", "-m", "pkg.train", "--x"], ["-uB"], None, "pkg.train", ["--x"]),
        (
            ["--check-hash-based-pycs", "never", "t.py"],
            ["--check-hash-based-pycs", "never"],
            "t.py",
            None,
            [],
        ),
        (["-u", "--", "t.py", "-c"], ["-u"], "t.py", None, ["-c"]),
    ],
)
def test_what_a_replay_runs(
    argv: list[str], options: list[str], script: str | None, module: str | None, args: list[str]
) -> None:
    parsed = command.parse(argv)
    assert (parsed.options, parsed.script, parsed.module, parsed.args, parsed.problems) == (
        options,
        script,
        module,
        args,
        [],
    )
    assert parsed.argv == [a for a in argv if a != "--"]


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["-c", "import os"], "-c"),
        (["-uc", "import os"], "-c"),
        (["-i", "t.py"], "'-i'"),
        (["--help-all"], "'--help-all'"),
        (["-m", "os; rm"], "-m without a module name"),
        ([], "standard input"),
        (["-"], "standard input"),
        (["-X"], "without its value"),
    ],
)
def test_what_a_replay_refuses_untrusted(argv: list[str], problem: str) -> None:
    problems = command.parse(argv).problems
    assert problems and problem in problems[0], problems
    assert "--trust-trace" in command.refusal(problems)


def test_only_a_python_interpreter_is_one(tmp_path: Path) -> None:
    assert command.interpreter(sys.executable) == sys.executable
    assert command.interpreter("/usr/bin/python3.12") == "/usr/bin/python3.12"
    for bad in ("/bin/sh", "python3", "/tmp/python3\x00x", None, 7, "/usr/bin/env"):
        assert command.interpreter(bad) is None, bad
    link = tmp_path / "python3"
    link.symlink_to("/bin/sh")  # named like an interpreter, pointing elsewhere
    assert command.interpreter(str(link)) is None
    venv = tmp_path / "python"
    venv.symlink_to(os.path.realpath(sys.executable))  # a virtualenv's bin/python
    assert command.interpreter(str(venv)) == str(venv)


def test_the_recorded_argv_prefers_the_interpreters_own() -> None:
    assert command.recorded_argv({"orig_argv": ["py", "-u", "t.py"], "argv": ["t.py"]}) == ["-u", "t.py"]
    assert command.recorded_argv({"argv": ["t.py", "--x"]}) == ["t.py", "--x"]
    assert command.recorded_argv({"orig_argv": "python -c x"}) == []
