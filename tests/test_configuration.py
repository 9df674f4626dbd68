"""docs/configuration.md names every variable that any config field or command option reads."""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from fsdp_replay import options
from fsdp_replay.agent.config import RecordConfig
from fsdp_replay.cli.main import build_parser
from fsdp_replay.cli.replay import _check_report_dir
from fsdp_replay.errors import ConfigError
from fsdp_replay.replayer.config import ReplayConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def _variables() -> set[str]:
    found = {options.env_var(f.name) for cls in (RecordConfig, ReplayConfig) for f in fields(cls)}
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command in sub.choices.values():
        for action in command._actions:
            found |= set(re.findall(r"\(env (FSDP_REPLAY_[A-Z0-9_]+)", action.help or ""))
    return found | set(options.PROCESS_SWITCHES)


def test_every_variable_is_documented() -> None:
    doc = DOC.read_text()
    variables = _variables()
    assert len(variables) > 60  # the commands' and components' options were all found
    missing = sorted(v for v in variables if f"`{v}`" not in doc)
    assert not missing, f"docs/configuration.md does not name: {missing}"


def test_every_command_option_is_an_environment_variable() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    bare = []
    for name, command in sub.choices.items():
        for action in command._actions:
            shown = action.option_strings and action.help != argparse.SUPPRESS
            if (
                shown
                and not isinstance(action, argparse._HelpAction)
                and "(env FSDP_REPLAY_" not in (action.help or "")
            ):
                bare.append(f"{name} {action.option_strings[-1]}")
    assert not bare, f"options without an environment variable: {bare}"


def test_snapshots_come_every_n_steps_and_at_the_start_of_each_payload_range() -> None:
    from fsdp_replay.agent.config import RecordConfig, StepSet

    def steps(**kw: object) -> list[int]:
        config = RecordConfig(out="x", **kw)  # type: ignore[arg-type]
        return [s for s in range(1, 30) if config.snapshot_step(s)]

    assert steps(snapshot_every=10) == [10, 20]
    assert steps(snapshot_every=10, payloads=StepSet.parse("steps:6-8,15,22-")) == [6, 10, 15, 20, 22]
    assert steps(payloads=StepSet.parse("steps:6-8")) == [6]
    assert steps(payloads=StepSet.parse("all")) == []
    assert steps(payloads=StepSet.parse("window:4")) == [4, 8, 12, 16, 20, 24, 28]


def test_negative_counts_are_refused_however_the_config_is_made() -> None:
    import pytest

    from fsdp_replay.agent.config import RecordConfig
    from fsdp_replay.errors import ConfigError

    for name in ("snapshot_every", "reserve_bytes", "payload_ring_bytes"):
        with pytest.raises(ConfigError, match=f"FSDP_REPLAY_{name.upper()}=-3 must be >= 0"):
            RecordConfig(out="x", **{name: -3})  # type: ignore[arg-type]


def test_a_payload_range_is_kept_through_the_end_of_its_unbroken_run() -> None:
    """Where a replay from a step finds the record's payloads ending (replayer/reach.py)."""
    from fsdp_replay.agent.config import StepSet

    spec = StepSet.parse("steps:2-3,4-6,9,12-")
    assert [spec.kept_through(s) for s in (2, 5, 7, 9, 12)] == [6, 6, 6, 9, None]
    assert spec.kept_through(0) == -1  # not kept: the run ends before it
    assert StepSet.parse("all").kept_through(5) is None and StepSet.parse("window:3").kept_through(5) is None
    assert StepSet.parse("none").kept_through(0) == -1


def test_an_unusable_record_out_is_a_bad_option_said_before_anything_runs(tmp_path: Path) -> None:
    from harness import CLI, child_env, run

    a_file = tmp_path / "train.py"
    a_file.write_text("print(1)\n")
    marker = tmp_path / "ran"
    command = ["--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    for out, said in (
        (a_file, f"--out {a_file} is a file: give a folder"),
        (Path("/proc/no-such-run"), "--out /proc/no-such-run: the folder cannot be made there"),
    ):
        proc = run([*CLI, "record", "--out", str(out), *command], check=False, env=child_env(), timeout=60)
        assert proc.returncode == 2 and said in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and not marker.exists()
        # a replay's --report likewise, before the replay starts
        with pytest.raises(ConfigError, match=re.escape(said.replace("--out", "--report"))):
            _check_report_dir(out, str(tmp_path / "trace.zarr"))
    assert a_file.read_text() == "print(1)\n"


def _no_fsdp_replay_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for k in [k for k in os.environ if k.startswith(options.ENV_PREFIX)]:
        monkeypatch.delenv(k)


def test_a_bad_payload_policy_names_its_variable_and_every_form(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from fsdp_replay.cli.main import main

    forms = ("none", "all", "steps:SPEC", "window:N")
    with pytest.raises(ConfigError) as caught:  # as the agent reads it in each training process
        RecordConfig.from_env({"FSDP_REPLAY_OUT": "x", "FSDP_REPLAY_PAYLOADS": "most"})
    assert str(caught.value).startswith("FSDP_REPLAY_PAYLOADS: 'most'") and all(
        f in str(caught.value) for f in forms
    )
    _no_fsdp_replay_env(monkeypatch)
    monkeypatch.setenv("FSDP_REPLAY_PAYLOADS", "most")  # as `record` reads it, before anything runs
    assert main(["record", "--out", str(tmp_path / "run"), "--", "true"]) == 2
    err = capsys.readouterr().err
    assert "--payloads (FSDP_REPLAY_PAYLOADS): 'most'" in err and all(f in err for f in forms), err
    assert not (tmp_path / "run").exists()
    monkeypatch.delenv("FSDP_REPLAY_PAYLOADS")
    assert main(["record", "--out", str(tmp_path / "run"), "--op-fingerprints", "5-2", "--", "true"]) == 2
    err = capsys.readouterr().err
    assert (
        "--op-fingerprints (FSDP_REPLAY_OP_FINGERPRINTS): bad step range '5-2'" in err and "window" not in err
    )


def test_record_takes_its_command_with_or_without_dashes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As with `nsys profile`, the command starts at record's first positional word; a `--` before
    it is optional, and one after it (or an option named like record's) belongs to the command."""
    import json

    from fsdp_replay.cli.main import main

    _no_fsdp_replay_env(monkeypatch)
    for name, tail, command in (
        ("bare", ["sh", "-c", "exit 0", "--out", "x"], ["sh", "-c", "exit 0", "--out", "x"]),
        ("dashed", ["--", "sh", "-c", "exit 0"], ["sh", "-c", "exit 0"]),
        (
            "inner",
            ["sh", "-c", "exit 0", "--", "--payloads", "none"],
            ["sh", "-c", "exit 0", "--", "--payloads", "none"],
        ),
    ):
        out = tmp_path / name
        assert main(["record", "--out", str(out), "--no-tape", *tail]) == 3, name  # it recorded nothing
        assert json.loads((out / "run.json").read_text())["command"] == command, name
    assert main(["record", "--out", str(tmp_path / "none")]) == 2
    assert "nothing to record" in capsys.readouterr().err


def test_auto_payloads_follow_the_cuda_devices_a_process_here_would_see(tmp_path: Path) -> None:
    from fsdp_replay.agent.config import AUTO_GPU_POLICY, auto_payloads, cuda_devices_visible

    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidiactl").touch()
    assert not cuda_devices_visible({}, str(dev))  # the control node alone is no device
    (dev / "nvidia0").touch()
    assert cuda_devices_visible({}, str(dev))
    assert not cuda_devices_visible({"CUDA_VISIBLE_DEVICES": ""}, str(dev))
    assert not cuda_devices_visible({"CUDA_VISIBLE_DEVICES": "-1"}, str(dev))
    assert cuda_devices_visible({"CUDA_VISIBLE_DEVICES": "0"}, str(dev))
    assert auto_payloads(True) == AUTO_GPU_POLICY and auto_payloads(False) == "all"
