"""The replayed rank's command line and environment (``replayer/launch.py``), without running it."""

from __future__ import annotations

import os
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


def test_variables_that_load_code_come_from_a_trace_only_when_trusted(
    shell: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    loads = {"LD_AUDIT": "/tmp/x.so", "CUDA_INJECTION64_PATH": "/tmp/y.so", "PYTHONBREAKPOINT": "evil.hook"}
    for k in loads:
        monkeypatch.delenv(k, raising=False)
    meta = {"env": {**RECORDED, **loads, "MY_FLAG": "1"}, "local_rank": 1}
    notes: list[str] = []
    env = launch.replay_env(meta, 1, 2, "cpu", notes)
    assert not set(loads) & set(env) and env["MY_FLAG"] == "1"
    assert any(
        "CUDA_INJECTION64_PATH, LD_AUDIT, PYTHONBREAKPOINT" in n and "--trust-trace" in n for n in notes
    ), notes
    env = launch.replay_env(meta, 1, 2, "cpu", [], trusted=True)
    assert all(env[k] == v for k, v in loads.items())


def _script_meta(tmp_path: Path, **script: object) -> dict[str, object]:
    (tmp_path / "train.py").write_text("print('train')\n")
    (tmp_path / "wrap.py").write_text("print('wrap')\n")
    import hashlib

    def sha(name: str) -> str:
        return hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()

    return {
        "executable": "/bin/sh",
        "orig_argv": ["/bin/sh", "wrap.py", "--lr", "1"],
        "cwd": str(tmp_path),
        "script": {
            "path": str(tmp_path / "train.py"),
            "sha256": sha("train.py"),
            **{
                k: (dict(v, sha256=sha(Path(str(v["path"])).name)) if isinstance(v, dict) else v)
                for k, v in script.items()
            },
        },
    }


def test_a_wrapper_runs_when_the_record_identifies_it(tmp_path: Path) -> None:
    import sys

    from fsdp_replay.errors import ReplayMismatchError

    meta = _script_meta(tmp_path, started={"path": str(tmp_path / "wrap.py")})
    notes: list[str] = []
    cmd, cwd = launch.replay_command(meta, [], notes=notes)
    assert cmd == [sys.executable, "wrap.py", "--lr", "1"] and cwd == str(tmp_path)
    assert any("not a Python interpreter" in n for n in notes)
    launch.check_script(meta, cmd, cwd)
    (tmp_path / "wrap.py").write_text("import os\n")
    with pytest.raises(ReplayMismatchError, match=r"wrap\.py is not the script that was recorded"):
        launch.check_script(meta, cmd, cwd)
    unnamed = _script_meta(tmp_path)
    with pytest.raises(ReplayMismatchError, match=r"which the record does not identify.*--trust-trace"):
        launch.check_script(unnamed, cmd, cwd)
    launch.check_script(unnamed, cmd, cwd, trusted=True, force=True)
    anonymous = {**unnamed, "script": {"path": None, "sha256": None}}
    with pytest.raises(ReplayMismatchError, match="no sha256"):
        launch.check_script(anonymous, cmd, cwd, force=True)


def test_a_module_or_installed_file_the_record_does_not_name_is_refused(tmp_path: Path) -> None:
    """``python -m pip install ...`` with the sha256 of an innocent local script as its record, or
    an installed module's file recorded with its own sha256: neither runs untrusted."""
    import sys

    import pip

    from fsdp_replay.errors import ReplayMismatchError

    meta = _script_meta(tmp_path)
    pip_cmd = [sys.executable, "-m", "pip", "install", "something"]
    with pytest.raises(ReplayMismatchError, match="runs module pip, which is not its recorded script"):
        launch.check_script(meta, pip_cmd, str(tmp_path))
    installed = Path(pip.__file__).with_name("__main__.py")
    import hashlib

    meta["script"] = {"path": str(installed), "sha256": hashlib.sha256(installed.read_bytes()).hexdigest()}
    with pytest.raises(ReplayMismatchError, match=r"a module installed with this interpreter.*--trust-trace"):
        launch.check_script(meta, pip_cmd, str(tmp_path))
    launch.check_script(meta, pip_cmd, str(tmp_path), trusted=True)
    own = tmp_path / "pkg"
    own.mkdir()
    (own / "train.py").write_text("print(1)\n")
    meta["script"] = {"path": str(own / "train.py"), "sha256": hashlib.sha256(b"print(1)\n").hexdigest()}
    launch.check_script(meta, [sys.executable, "-m", "pkg.train"], str(tmp_path))  # the program's own module


def _trace_of_ranks(run: Path, ranks: tuple[int, ...], world_size: int) -> Path:
    """A run folder whose trace holds only the start records of ``ranks`` of a job of
    ``world_size`` (written as the agent writes them, then collected; no torch)."""
    from fsdp_replay.trace import schema, spool
    from fsdp_replay.trace.collect import collect

    for rank in ranks:
        w = spool.SpoolWriter(spool.rank_dir(run / schema.SPOOL_DIR, rank), rank)
        start = {"type": "rank_start", "format_version": schema.FORMAT_VERSION, "rank": rank}
        start.update(world_size=world_size, local_rank=rank, pid=1, host="node0", argv=["train.py"])
        start.update(orig_argv=["python", "train.py"], executable="/usr/bin/python", cwd="/work", env={})
        start.update(versions={"python": "3.11.7", "torch": "2.13.0+cpu"}, threads={}, determinism={})
        start.update(policy={"payloads": "all"}, start_ns=1, fingerprint_algos={"cpu": "zlib64"})
        start.update(script={"path": "/work/train.py", "sha256": "ab" * 32})
        w.append(schema.KIND_EVENT, start)
        w.close()
    collect(run / schema.SPOOL_DIR, run / schema.TRACE_DIR)
    return run


def test_a_rank_the_job_did_not_have_is_a_usage_error_that_lists_the_traces_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from fsdp_replay.cli.main import main

    for k in [k for k in os.environ if k.startswith("FSDP_REPLAY_")]:
        monkeypatch.delenv(k)
    run = _trace_of_ranks(tmp_path / "two", (0, 1), 2)
    for rank in ("7", "-1"):
        assert main(["replay", str(run), "--rank", rank]) == 2
        err = capsys.readouterr().err
        assert (
            f"--rank {rank}: the recorded job had 2 ranks and the trace holds ranks 0, 1; choose one" in err
        )
        assert "unusable" not in err and not (run / "replays").exists()
    # A rank the job had and the trace lacks (its spool was lost): the trace is what falls short.
    run = _trace_of_ranks(tmp_path / "lost", (0, 1), 3)
    assert main(["replay", str(run), "--rank", "2"]) == 3
    assert "rank 2 is not in this trace (ranks: [0, 1])" in capsys.readouterr().err


# A replay's start-up, as `replay` runs it (cli/launch.py run_command with the agent's environment):
# the program prints "ready" and waits, before it imports torch (so before the replay has started).
_STARTING = """
import sys
import os
from pathlib import Path
from fsdp_replay.cli.launch import agent_env, run_command
from fsdp_replay.replayer.config import ReplayConfig
report = Path(sys.argv[1])
config = ReplayConfig(trace=str(report / "trace.zarr"), report=str(report))
program = "import time; print('ready', flush=True); time.sleep(60)"
code, info = run_command([sys.executable, "-c", program], agent_env(report, config.to_env()))
print("exit", code, info["signals_forwarded"], flush=True)
"""


def test_ctrl_c_while_a_replay_starts_stops_it_without_a_traceback(tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys

    from harness import child_env

    proc = subprocess.Popen(
        [sys.executable, "-c", _STARTING, str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
        start_new_session=True,  # its own group, which the test's Ctrl-C goes to as a terminal's would
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert f"exit 130 [{int(signal.SIGINT)}]" in out, out + err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def test_ctrl_c_is_the_programs_again_once_the_replay_has_started() -> None:
    import signal

    from fsdp_replay.boot import attach

    def own(_signum: int, _frame: object) -> None:
        pass

    before = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        attach._quiet_start_up()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
        attach._end_quiet_start_up()  # as attach() does once the replay agent is in place
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        attach._quiet_start_up()
        signal.signal(signal.SIGINT, own)  # the program's own handler, set while it started: kept
        attach._end_quiet_start_up()
        assert signal.getsignal(signal.SIGINT) is own
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a background job's: never quieted nor changed
        attach._quiet_start_up()
        attach._end_quiet_start_up()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
