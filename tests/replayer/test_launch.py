"""The replayed rank's command line and environment (``replayer/launch.py``), without running it."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_replay.replayer import launch

RECORDED = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "0",
    "ROLE_RANK": "1",
    "TORCHELASTIC_RUN_ID": "abc",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_ERROR_FILE": "/tmp/torchelastic_x/error.json",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "MASTER_ADDR": "node-7",
    "MASTER_PORT": "1234",
    "SLURM_PROCID": "1",
    "CUDA_VISIBLE_DEVICES": "0,1",
    "FSDP_REPLAY_OUT": "/runs/x",
}
META = {"env": RECORDED, "local_rank": 1, "versions": {"cuda": "13.0"}}


@pytest.fixture
def shell(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(RECORDED):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "the-shells-own")  # a replay started inside a job
    monkeypatch.setenv("LOCAL_RANK", "5")


def test_the_recorded_launcher_environment_is_carried(shell: None) -> None:
    notes: list[str] = []
    env = launch.replay_env(META, 1, 2, "cpu", notes)
    for k in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "ROLE_RANK",
        "SLURM_PROCID",
    ):
        assert env[k] == RECORDED[k], k
    assert env["TORCHELASTIC_RUN_ID"] == "abc" and env["TORCHELASTIC_RESTART_COUNT"] == "0"
    # what would reach the old job's files or rendezvous is not carried
    assert "TORCHELASTIC_ERROR_FILE" not in env and "TORCHELASTIC_USE_AGENT_STORE" not in env
    assert env["MASTER_ADDR"] == "127.0.0.1" and "FSDP_REPLAY_OUT" not in env
    assert env["CUDA_VISIBLE_DEVICES"] == "" and not notes


def test_on_one_gpu_the_local_rank_is_that_gpus(shell: None) -> None:
    notes: list[str] = []
    env = launch.replay_env(META, 1, 2, "cuda:3", notes)
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and env["LOCAL_RANK"] == "0" and env["RANK"] == "1"
    assert any("LOCAL_RANK=0 (recorded 1)" in n for n in notes), notes
    notes = []
    env = launch.replay_env(META, 1, 2, None, notes)
    assert env["LOCAL_RANK"] == "1" and any("--device cuda:0" in n for n in notes), notes


def test_a_plain_launch_gets_rank_and_world_from_the_trace(shell: None) -> None:
    env = launch.replay_env({"env": {}, "local_rank": 0}, 3, 4, "cpu")
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("3", "4", "0")
    assert "TORCHELASTIC_RUN_ID" not in env  # the shell's own launch is not the recorded one


def test_the_interpreters_recorded_command_line_is_replayed(tmp_path: object) -> None:
    meta = {
        "orig_argv": ["python3", "-u", "-m", "pkg.train", "--lr", "1"],
        "argv": ["/x/pkg/train.py", "--lr", "1"],
    }
    command, _cwd = launch.replay_command({**meta, "executable": "/nonexistent/python"}, [])
    assert command[1:] == ["-u", "-m", "pkg.train", "--lr", "1"]


def test_an_all_rank_replay_keeps_the_interpreters_options_for_the_interpreter() -> None:
    cmd = launch.all_ranks_command(["py", "-u", "-X", "dev", "train.py", "--lr", "1"], 2)
    assert cmd == [
        "py",
        "-u",
        "-X",
        "dev",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "train.py",
        "--lr",
        "1",
    ]
    cmd = launch.all_ranks_command(["py", "-u", "-m", "pkg.train"], 4)
    assert cmd[-3:] == ["--nproc_per_node=4", "-m", "pkg.train"] and cmd[:2] == ["py", "-u"]


def test_cuda_n_counts_the_gpus_this_shell_sees(shell: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert launch.replay_env(META, 1, 2, "cuda:1")["CUDA_VISIBLE_DEVICES"] == "3"
    assert launch.replay_env(META, 1, 2, "cuda")["CUDA_VISIBLE_DEVICES"] == "2"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert launch.replay_env(META, 1, 2, "cuda:1")["CUDA_VISIBLE_DEVICES"] == "1"


def test_the_recorded_working_directory_maps_to_cwd_which_must_exist(tmp_path: Path) -> None:
    from fsdp_replay.errors import ConfigError

    meta = {"cwd": "/job/work"}
    assert launch.path_map(meta, str(tmp_path), "/data=/mnt/data") == [
        ("/job/work", str(tmp_path)),
        ("/data", "/mnt/data"),
    ]
    with pytest.raises(ConfigError, match=r"--cwd .*/gone: no such folder here"):
        launch.path_map(meta, str(tmp_path / "gone"), None)
    with pytest.raises(ConfigError, match="give OLD=NEW"):
        launch.path_map(meta, None, "relative=/x")
