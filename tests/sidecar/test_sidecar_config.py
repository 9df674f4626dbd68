"""SidecarConfig from the environment and the ``sidecar`` command's flags (no root, no bcc)."""

from __future__ import annotations

import argparse
import contextlib
import io
import subprocess
import sys
from dataclasses import fields
from typing import Any

import pytest

from fsdp_replay.errors import ConfigError
from fsdp_replay.sidecar import cli
from fsdp_replay.sidecar.config import SidecarConfig, env_name
from fsdp_replay.sidecar.ebpf import programs

# A value other than the default for every field: (variable text, parsed value).
EVERY_FIELD: dict[str, tuple[str, Any]] = {
    "out": ("/data/run-7", "/data/run-7"),
    "store": ("s3://bucket/prefix", "s3://bucket/prefix"),
    "signing_key": ("/var/run/fsdp-replay-signing/key", "/var/run/fsdp-replay-signing/key"),
    "collect_interval_s": ("120", 120.0),
    "keep_spools": ("1", True),
    "proc_root": ("/host/proc", "/host/proc"),
    "metrics_address": ("127.0.0.1", "127.0.0.1"),
    "metrics_port": ("9470", 9470),
    "ebpf": ("0", False),
    "probe_scope": ("process", "process"),
    "poll_interval_s": ("0.25", 0.25),
    "mode": ("container", "container"),
    "containers": ("trainer, side-2,", ("trainer", "side-2")),
    "exit_when_trainers_end": ("no", False),
    "exit_quiet_s": ("2.5", 2.5),
    "hang_dump_wait_s": ("0", 0.0),
    "cost_skip_steps": ("2", 2),
    "max_comm_labels": ("16", 16),
    "pod_name": ("job-0-abc", "job-0-abc"),
    "pod_namespace": ("ml", "ml"),
    "pod_uid": ("0f8e-11", "0f8e-11"),
    "node_name": ("gpu-node-3", "gpu-node-3"),
    "log_level": ("DEBUG", "DEBUG"),
}


def test_every_field_from_its_variable() -> None:
    assert set(EVERY_FIELD) == {f.name for f in fields(SidecarConfig)}, "a field without a case here"
    env = {env_name(k): text for k, (text, _) in EVERY_FIELD.items()}
    config = SidecarConfig.from_env(env)
    for name, (_, parsed) in EVERY_FIELD.items():
        assert getattr(config, name) == parsed, name
    assert SidecarConfig.from_env({}) == SidecarConfig()
    # Unrelated and empty non-text variables keep the defaults.
    assert (
        SidecarConfig.from_env({"FSDP_REPLAY_SIDECAR_METRICS_PORT": " ", "PATH": "/bin"}) == SidecarConfig()
    )


def test_variable_names_are_the_injectors_contract() -> None:
    from fsdp_replay.injector import containers
    from fsdp_replay.injector.annotations import PodSettings
    from fsdp_replay.injector.config import InjectorConfig

    assert env_name("out") == "FSDP_REPLAY_OUT"
    assert env_name("metrics_port") == "FSDP_REPLAY_SIDECAR_METRICS_PORT"
    settings = PodSettings(
        containers=("trainer",), agent_env=(), store="s3://b/p", store_secret="", metrics_port=9470
    )
    injector = InjectorConfig(signing_key_secret="trace-signing")
    sidecar = containers.sidecar_container(injector, settings, ["trainer"], guaranteed=False)
    env = {e["name"]: e.get("value", "from-the-downward-api") for e in sidecar["env"]}
    ours = {env_name(f.name) for f in fields(SidecarConfig)}
    assert set(env) <= ours, set(env) - ours  # every variable the injector sets is read
    config = SidecarConfig.from_env(env)
    assert (config.out, config.store, config.metrics_port) == ("/var/lib/fsdp-replay", "s3://b/p", 9470)
    assert config.containers == ("trainer",) and config.pod_name == "from-the-downward-api"
    assert config.signing_key == containers.SIGNING_KEY_FILE
    assert config.mode in ("native", "container")


@pytest.mark.parametrize(
    ("field", "text", "message"),
    [
        ("metrics_port", "http", "is not an integer"),
        ("metrics_port", "70000", "a port is 0..65535"),
        ("poll_interval_s", "fast", "is not a number"),
        ("poll_interval_s", "0", "0.01..3600"),
        ("poll_interval_s", "nan", "0.01..3600"),
        ("exit_quiet_s", "-1", "0..86400"),
        ("hang_dump_wait_s", "-1", "0..3600"),
        ("hang_dump_wait_s", "inf", "0..3600"),
        ("ebpf", "maybe", "is not a boolean"),
        ("exit_when_trainers_end", "2", "is not a boolean"),
        ("probe_scope", "node", "expected one of file, process"),
        ("mode", "sidecar", "expected one of native, container"),
        ("log_level", "trace", "expected one of"),
        ("cost_skip_steps", "-3", ">= 0"),
        ("max_comm_labels", "0", "at least 1"),
        ("containers", "Trainer_1", "is not a container name"),
        ("store", "s3://a b", "a URL has no spaces"),
        ("out", " ", "give a folder"),
        ("metrics_address", "a b", "give an address"),
    ],
)
def test_bad_values_name_their_variable(field: str, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        SidecarConfig.from_env({env_name(field): text})
    assert env_name(field) in str(e.value)
    assert isinstance(e.value, ValueError)


def test_exit_when_trainers_end_defaults_to_container_mode() -> None:
    assert not SidecarConfig().exits_when_trainers_end
    assert SidecarConfig(mode="container").exits_when_trainers_end
    assert not SidecarConfig(mode="container", exit_when_trainers_end=False).exits_when_trainers_end
    assert SidecarConfig(exit_when_trainers_end=True).exits_when_trainers_end


def test_flags_override_the_environment() -> None:
    args = cli.build_parser().parse_args(["--metrics-port", "9999", "--no-ebpf", "--containers", "a,b"])
    env = {
        "FSDP_REPLAY_SIDECAR_METRICS_PORT": "9470",
        "FSDP_REPLAY_SIDECAR_POD_NAME": "p",
        "FSDP_REPLAY_OUT": "/o",
    }
    config = cli.config_from_args(args, env)
    assert (config.metrics_port, config.ebpf, config.containers) == (9999, False, ("a", "b"))
    assert (config.pod_name, config.out) == ("p", "/o")  # not given as flags: the environment's


def test_every_field_is_a_flag_with_its_variable_in_the_help() -> None:
    parser = cli.build_parser()
    text = parser.format_help()
    for f in fields(SidecarConfig):
        assert "--" + f.name.replace("_", "-") in text, f.name
        assert env_name(f.name) in text.replace("\n", " ").replace("  ", ""), f.name
    assert "--print-bpf" not in text  # hidden
    sub = argparse.ArgumentParser().add_subparsers()
    cli.register(sub)
    assert "sidecar" in sub.choices


def test_bad_flag_value_is_a_usage_error_naming_the_variable() -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert cli.main(["--metrics-port", "x"]) == cli.EXIT_USAGE
    assert "FSDP_REPLAY_SIDECAR_METRICS_PORT='x' is not an integer" in err.getvalue()


def test_print_bpf_prints_the_program_and_exits() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["--print-bpf"]) == 0
    expected = io.StringIO()
    programs.print_bpf(out=expected)
    assert out.getvalue() == expected.getvalue() and "int fr_entry_0" in out.getvalue()
    # And as its own process, through the module's __main__ guard, importing neither torch nor bcc.
    code = (
        "import sys, runpy\n"
        "sys.argv = ['fsdp-replay sidecar', '--print-bpf']\n"
        "try:\n    runpy.run_module('fsdp_replay.sidecar.main', run_name='__main__')\n"
        "except SystemExit as e:\n    assert e.code == 0, e.code\n"
        "bad = [m for m in ('torch', 'bcc') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected.getvalue()


def test_the_daemon_modules_import_neither_torch_nor_bcc() -> None:
    code = (
        "import sys\n"
        "import fsdp_replay.sidecar.main, fsdp_replay.sidecar.cli, fsdp_replay.sidecar.metrics\n"
        "import fsdp_replay.sidecar.server, fsdp_replay.trace.follow\n"
        "bad = [m for m in ('bcc', 'torch', 'zarr', 'numpy') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
