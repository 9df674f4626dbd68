"""A trace replays where it is moved to, with the program checked out at another path (#16).

The program (a launcher that imports a local module, then runs the example) is recorded in one
folder; the trace and the program are then moved elsewhere and the first folder deleted, as when a
trace is copied to a developer's machine. The replay maps the recorded working directory to where
the program is now, checks the script and its local module there by sha256, and is bit-exact; a
changed local module is refused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from harness import CLI, EXAMPLE, TORCHRUN, child_env, run

pytestmark = pytest.mark.slow

LAUNCHER = """\
import runpy
import sys

import localcfg  # a module of the program's own folder: checked by the replay like the script

sys.argv = ["train_fsdp.py", *localcfg.ARGS, *sys.argv[1:]]
runpy.run_path("train_fsdp.py", run_name="__main__")
"""


def _program(folder: Path, layers: int = 1) -> Path:
    folder.mkdir(parents=True)
    shutil.copy(EXAMPLE, folder / "train_fsdp.py")
    (folder / "launch.py").write_text(LAUNCHER)
    (folder / "localcfg.py").write_text(
        f'ARGS = ["--cpu", "--layers", "{layers}", "--d-model", "32", "--seq-len", "16"]\n'
    )
    return folder


def test_a_moved_trace_replays_where_the_program_now_is(tmp_path: Path) -> None:
    first = _program(tmp_path / "a" / "repo")
    run_dir = tmp_path / "a" / "run"
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", "launch.py", "--steps", "3"]
    run([*CLI, "record", "--out", str(run_dir), "--", *cmd], cwd=first)

    moved = tmp_path / "b" / "moved"
    moved.parent.mkdir()
    shutil.move(run_dir, moved)
    second = tmp_path / "b" / "repo"
    shutil.copytree(first, second)
    shutil.rmtree(tmp_path / "a")

    report = tmp_path / "report"
    proc = run([*CLI, "replay", str(moved), "--rank", "1", "--report", str(report)], cwd=second, check=False)
    out = proc.stdout + proc.stderr[-4000:]
    assert proc.returncode == 0, out
    assert json.loads((report / "report.json").read_text())["status"] == "bit-exact"
    assert f"the recorded run's {first} is {second} here" in out

    # From anywhere else, --cwd says where the program is.
    report2 = tmp_path / "report2"
    proc = run(
        [*CLI, "replay", str(moved), "--rank", "0", "--report", str(report2), "--cwd", str(second)],
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]

    # A local module that is not the recorded one: refused, named, before the program runs.
    (second / "localcfg.py").write_text(
        (second / "localcfg.py").read_text().replace('"--layers", "1"', '"--layers", "2"')
    )
    proc = run(
        [*CLI, "replay", str(moved), "--rank", "1", "--report", str(tmp_path / "r3")],
        cwd=second,
        env=child_env(),
        check=False,
    )
    assert proc.returncode == 3, proc.stdout + proc.stderr[-3000:]
    assert "module localcfg" in proc.stderr and "is not the one the recorded program imported" in proc.stderr
