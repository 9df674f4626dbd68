"""A job that dies before its first collective: ``record`` and ``collect`` say what happened.

A rank's spool starts with its first record, so a job whose ranks die in ``init_process_group`` (a
wrong MASTER_ADDR) or right after ``import torch`` leaves no spool. Each process that imports torch
with the agent leaves an attach marker (``RUN/spool/attached/``) instead, and ``record`` counts
them: it must not claim that no process imported torch with the agent.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from harness import CLI, REPO, child_env, run, torchrun_cmd

from fsdp_replay.boot.attach import mark_attached
from fsdp_replay.trace import schema, spool
from fsdp_replay.trace.layout import ATTACHED_DIR, attached_dir

OLD_MESSAGE = "no Python process of it imported torch with the agent enabled"
TOKEN = "hf_" + "xQ7bN2kLmP9vR4sT1wY6zA3cD8eF5gHjK"  # split: secret scanners
TINY = REPO / "tests" / "workloads" / "tiny_train.py"

RAISE_AFTER_IMPORT = """
import sys
import torch
raise SystemExit("the program gave up right after import torch")
"""

BAD_MASTER_ADDR = """
import datetime, os
import torch
import torch.distributed as dist
os.environ["MASTER_ADDR"] = "no-such-host.invalid"  # never resolves: the rendezvous fails
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
"""


def _record(tmp_path: Path, body: str, *args: str) -> tuple[Path, str, int]:
    script = tmp_path / "train.py"
    script.write_text(body)
    out = tmp_path / "run"
    proc = run(
        [*CLI, "record", "--out", str(out), "--", *torchrun_cmd(2, script, *args)], check=False, timeout=120
    )
    return out, proc.stderr, proc.returncode


def _markers(out: Path) -> list[dict[str, object]]:
    return [json.loads(p.read_text()) for p in sorted(attached_dir(out).glob("*.json"))]


def _assert_both_ranks_reported(out: Path, stderr: str, code: int) -> None:
    assert code == 1, stderr[-3000:]  # torchrun's own exit code, as always
    assert OLD_MESSAGE not in stderr, stderr[-3000:]
    want = (
        "the command recorded nothing: 2 processes imported torch with the agent (ranks 0, 1), but none "
        "reached its first collective; the command exited with code 1 (see its output above)"
    )
    assert want in stderr, stderr[-3000:]
    assert spool.spool_ranks(out / schema.SPOOL_DIR) == {}
    ranks = sorted(m["rank"] for m in _markers(out) if m["rank"] is not None)  # type: ignore[type-var]
    assert ranks == [0, 1]
    # `collect` says the same, with the exit code from run.json, and exits 3
    again = run([*CLI, "collect", str(out)], check=False, timeout=60)
    assert again.returncode == 3, again.stderr
    assert "2 processes imported torch with the agent (ranks 0, 1), but none reached" in again.stderr
    assert "the command exited with code 1" in again.stderr and "no rank spools found" not in again.stderr


@pytest.mark.slow
def test_ranks_that_raise_right_after_import_torch(tmp_path: Path) -> None:
    out, stderr, code = _record(tmp_path, RAISE_AFTER_IMPORT, "--hub-token", TOKEN)
    assert "gave up right after import torch" in stderr  # the program's own output is kept
    _assert_both_ranks_reported(out, stderr, code)
    for m in _markers(out):
        # each marker: its pid, host, argv (redacted like the trace's), RANK/LOCAL_RANK, time
        assert set(m) >= {"pid", "host", "argv", "rank", "local_rank", "world_size", "time"}
        assert TOKEN not in json.dumps(m)
        if m["rank"] is not None:
            assert m["argv"][:2] == [str(tmp_path / "train.py"), "--hub-token"] and len(m["argv"]) == 3
            assert schema.is_redacted(m["argv"][2])
            assert m["local_rank"] == m["rank"] and m["world_size"] == 2


@pytest.mark.slow
def test_ranks_whose_rendezvous_fails(tmp_path: Path) -> None:
    out, stderr, code = _record(tmp_path, BAD_MASTER_ADDR)
    assert "no-such-host.invalid" in stderr  # torch's own error, from both ranks
    _assert_both_ranks_reported(out, stderr, code)


@pytest.mark.slow
def test_markers_beside_rank_spools_are_not_spools(tmp_path: Path) -> None:
    """A run that records: its markers stay beside the rank spools and are never taken for one
    (no damage, no extra rank), and a later `record --out` of the same folder is still refused."""
    out = tmp_path / "run"
    run([*CLI, "record", "--out", str(out), "--no-collect", "--", *torchrun_cmd(2, TINY, "--steps", "2")])
    spool_root = out / schema.SPOOL_DIR
    assert sorted(p.name for p in spool_root.iterdir()) == [ATTACHED_DIR, "rank-00000", "rank-00001"]
    assert sorted(m["rank"] for m in _markers(out) if m["rank"] is not None) == [0, 1]  # type: ignore[type-var]
    for cmd in (("inspect", str(out)), ("replay", str(out), "--rank", "0")):  # before its trace is built
        early = run([*CLI, *cmd], check=False)
        assert early.returncode == 3 and f"`fsdp-replay collect {out}`" in early.stderr, early.stderr
    done = run([*CLI, "collect", str(out)], check=False)
    assert done.returncode == 0, done.stderr
    assert "damage" not in done.stdout + done.stderr
    meta = json.loads((out / schema.TRACE_DIR / "zarr.json").read_text())["attributes"][schema.ROOT_ATTR]
    assert meta["ranks"] == [0, 1]
    again = run([*CLI, "record", "--out", str(out), "--", "true"], check=False)
    assert again.returncode == 2 and "already holds a recording" in again.stderr
    # Once the trace is built and the spools gone (as `record` leaves a run), it is refused too,
    # and run.json still describes the recorded command.
    shutil.rmtree(spool_root)
    again = run([*CLI, "record", "--out", str(out), "--", "true"], check=False)
    assert again.returncode == 2 and "already holds a recording" in again.stderr
    assert json.loads((out / "run.json").read_text())["command"][-1] == "2"
    # collect of it: the trace is there, nothing to do (not "nothing was recorded"); elsewhere, say how
    done = run([*CLI, "collect", str(out)], check=False)
    assert done.returncode == 0 and "the trace is already built" in done.stdout, done.stderr
    done = run([*CLI, "collect", str(out), "--trace", str(tmp_path / "other")], check=False)
    assert done.returncode == 3 and "copy that folder to" in done.stderr and not (tmp_path / "other").exists()
    done = run([*CLI, "collect", str(tmp_path / "no-such-run")], check=False)
    assert done.returncode == 3 and "no run folder" in done.stderr and not (tmp_path / "no-such-run").exists()


def test_a_marker_that_cannot_be_written_never_raises(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    mark_attached(str(blocker))  # RUN is a file: nothing written, nothing raised
    mark_attached(str(tmp_path / "ok"), error="RuntimeError('x')")
    (marker,) = _markers(tmp_path / "ok")
    assert marker["error"] == "RuntimeError('x')"


def test_record_of_a_command_without_torch_keeps_the_old_message(tmp_path: Path) -> None:
    proc = run(
        [*CLI, "record", "--out", str(tmp_path / "run"), "--", "sh", "-c", "exit 0"],
        check=False,
        env=child_env(),
    )
    assert proc.returncode == 3 and OLD_MESSAGE in proc.stderr


def test_record_of_a_command_that_is_not_there_says_so(tmp_path: Path) -> None:
    proc = run([*CLI, "record", "--out", str(tmp_path / "run"), "--", "no-such-command-xyz"], check=False)
    assert proc.returncode == 127 and "command not found: no-such-command-xyz" in proc.stderr, proc.stderr


SPAWNED_RANKS = """
import os
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def worker(rank, world, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    t = torch.ones(2)
    dist.all_reduce(t)
    print(f"rank {rank} summed {t.tolist()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(2, int(os.environ["PORT"])), nprocs=2)
"""


@pytest.mark.slow
def test_ranks_started_by_mp_spawn_are_named_as_not_recorded(tmp_path: Path) -> None:
    """Ranks that torch.multiprocessing.spawn starts run unrecorded (the agent leaves
    multiprocessing children alone: most are DataLoader workers); `record` says why nothing was
    recorded and what to launch them with, not that they never reached a collective."""
    import socket
    import sys

    script = tmp_path / "spawned.py"
    script.write_text(SPAWNED_RANKS)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "run"
    proc = run(
        [*CLI, "record", "--out", str(out), "--", sys.executable, str(script)],
        check=False,
        timeout=120,
        env=child_env(PORT=str(port)),
    )
    assert "rank 1 summed [2.0, 2.0]" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "its ranks (2 processes) were started by torch.multiprocessing (mp.spawn)" in proc.stderr
    assert "launch them with torchrun" in proc.stderr and "never reached" not in proc.stderr
    assert spool.spool_ranks(out / schema.SPOOL_DIR) == {}


def test_a_run_that_recorded_nothing_is_named_as_such_by_every_command_not_sent_to_collect(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """After `record` said that the command recorded nothing, `inspect`, `replay` and `collect`
    of its run folder say the same (with the exit code from run.json), and none of them sends the
    user to `collect`, which has nothing to collect."""
    from fsdp_replay.cli.main import main

    out = tmp_path / "run"
    monkeypatch.setenv("RANK", "0")
    mark_attached(str(out))  # as the rank left it, dying before its first collective
    (out / "run.json").write_text(json.dumps({"command": ["torchrun", "train.py"], "exit_code": 1}))
    for cmd in (["inspect", str(out)], ["replay", str(out), "--rank", "0"], ["collect", str(out)]):
        assert main(cmd) == 3, cmd
        err = capsys.readouterr().err
        assert "the command recorded nothing: 1 process imported torch with the agent (rank 0)" in err, err
        assert "the command exited with code 1" in err and "fsdp-replay collect" not in err, err
    # A command that imported no torch with the agent left run.json only (no spool folder).
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "run.json").write_text(json.dumps({"command": ["sh", "-c", "exit 0"], "exit_code": 0}))
    assert main(["inspect", str(bare)]) == 3
    err = capsys.readouterr().err
    assert OLD_MESSAGE in err and "not an fsdp-replay trace" not in err, err
    # While the command runs (run.json has no exit code yet), it may still be starting: said so.
    (out / "run.json").write_text(json.dumps({"command": ["torchrun", "train.py"], "exit_code": None}))
    assert main(["inspect", str(out)]) == 3
    assert "may still be starting" in capsys.readouterr().err
