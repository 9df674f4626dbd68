"""``InjectorConfig``: defaults, the environment, validation, the sidecar mode, and the CLI's option wiring."""

from __future__ import annotations

import argparse
import dataclasses
from decimal import Decimal

import pytest

from fsdp_replay.errors import ConfigError, FsdpReplayError
from fsdp_replay.injector import cli, validate
from fsdp_replay.injector.config import ENV_PREFIX, InjectorConfig, env_name
from fsdp_replay.options import field_docs


def test_defaults_are_valid() -> None:
    config = InjectorConfig()
    assert config.annotation_prefix == "fsdp-replay.io"
    assert (config.mount_path, config.metrics_port, config.sidecar_mode) == ("/opt/fsdp-replay", 9464, "auto")
    assert config == InjectorConfig.from_env({})


def test_frozen_kw_only_slots() -> None:
    params = InjectorConfig.__dataclass_params__  # type: ignore[attr-defined]
    assert params.frozen and hasattr(InjectorConfig, "__slots__")
    with pytest.raises(TypeError):
        InjectorConfig("image")  # type: ignore[call-arg]
    with pytest.raises(dataclasses.FrozenInstanceError):
        InjectorConfig().port = 1  # type: ignore[misc]


def test_every_field_has_a_docstring() -> None:
    docs = field_docs(InjectorConfig)
    missing = [f.name for f in dataclasses.fields(InjectorConfig) if not docs.get(f.name)]
    assert not missing


def test_from_env_reads_every_field() -> None:
    env = {
        "AGENT_IMAGE": "r/agent:1",
        "SIDECAR_IMAGE": "r/sidecar:1",
        "IMAGE_PULL_POLICY": "Always",
        "MOUNT_PATH": "/agent",
        "SPOOL_PATH": "/run/rec",
        "PAYLOADS": "steps:0-9",
        "STORE": "s3://b/p",
        "ANNOTATION_PREFIX": "replay.example.com",
        "SIGNING_KEY_SECRET": "trace-signing",
        "SIDECAR_MODE": "container",
        "KUBERNETES_VERSION": "v1.30.2-eks-1",
        "ADD_SYS_ADMIN": "yes",
        "METRICS_PORT": "9100",
        "SIDECAR_CPU_REQUEST": "250m",
        "SIDECAR_MEMORY_REQUEST": "512Mi",
        "SIDECAR_CPU_LIMIT": "2",
        "SIDECAR_MEMORY_LIMIT": "2Gi",
        "TLS_CERT_FILE": "/tls/tls.crt",
        "TLS_KEY_FILE": "/tls/tls.key",
        "LISTEN_ADDRESS": "::",
        "PORT": "9443",
        "LOG_LEVEL": "DEBUG",
    }
    assert set(env) == {f.name.upper() for f in dataclasses.fields(InjectorConfig)}
    config = InjectorConfig.from_env({ENV_PREFIX + k: v for k, v in env.items()})
    assert config.add_sys_admin is True and config.port == 9443 and config.metrics_port == 9100
    assert config.annotation_prefix == "replay.example.com" and config.spool_path == "/run/rec"
    assert config.native_sidecar is False  # container, whatever the version says
    assert config.signing_key_secret == "trace-signing"
    assert config.signing_key_secret == "trace-signing"


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("AGENT_IMAGE", "has space", "image reference"),
        ("IMAGE_PULL_POLICY", "always", "Always, IfNotPresent, Never"),
        ("MOUNT_PATH", "relative", "absolute"),
        ("MOUNT_PATH", "/opt/x/", "normalized"),
        ("MOUNT_PATH", "/", "other than /"),
        ("SPOOL_PATH", "/opt/fsdp-replay/spool", "one inside the other"),
        ("PAYLOADS", "most", "not none, all"),
        ("ANNOTATION_PREFIX", "Fsdp_Replay", "DNS subdomain"),
        ("SIGNING_KEY_SECRET", "Bad_Name", "DNS subdomain"),
        ("SIDECAR_MODE", "sidecar", "auto, native, container"),
        ("KUBERNETES_VERSION", "latest", "such as 1.29"),
        ("ADD_SYS_ADMIN", "maybe", "not a boolean"),
        ("METRICS_PORT", "0", "1..65535"),
        ("PORT", "http", "not an integer"),
        ("SIDECAR_MEMORY_REQUEST", "lots", "not a Kubernetes quantity"),
        ("SIDECAR_CPU_REQUEST", "3", "exceeds"),
        ("SIDECAR_MEMORY_LIMIT", "128Mi", "exceeds"),
        ("TLS_CERT_FILE", "/tls.crt", "go together"),
        ("LOG_LEVEL", "chatty", "DEBUG, INFO"),
    ],
)
def test_bad_values_name_their_variable(name: str, value: str, message: str) -> None:
    env = {ENV_PREFIX + name: value}
    if name == "SIDECAR_CPU_REQUEST":
        env[ENV_PREFIX + "SIDECAR_CPU_LIMIT"] = "2"
    with pytest.raises(ConfigError, match=message) as info:
        InjectorConfig.from_env(env)
    assert ENV_PREFIX in str(info.value)
    assert isinstance(info.value, FsdpReplayError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("mode", "version", "native"),
    [
        ("auto", "", True),
        ("auto", "1.27", False),
        ("auto", "1.28", False),
        ("auto", "v1.28.15-gke.1", False),
        ("auto", "1.29", True),
        ("auto", "v1.33.0", True),
        ("auto", "2.0", True),
        ("native", "1.25", True),
        ("container", "1.33", False),
    ],
)
def test_sidecar_mode(mode: str, version: str, native: bool) -> None:
    assert InjectorConfig(sidecar_mode=mode, kubernetes_version=version).native_sidecar is native


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("100m", "0.1"),
        ("2", "2"),
        (2, "2"),
        ("1Gi", str(1 << 30)),
        ("1.5G", "1500000000"),
        ("1e3", "1000"),
        ("x", None),
        (True, None),
    ],
)
def test_quantities(text: object, value: str | None) -> None:
    parsed = validate.parse_quantity(text)
    assert parsed == (None if value is None else Decimal(value))


# -- the CLI's one helper -----------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsdp-replay")
    cli.register(parser.add_subparsers(dest="cmd", required=True))
    return parser


def test_every_field_is_a_webhook_flag_and_env_var() -> None:
    parser = _parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    webhook, inject = sub.choices["webhook"], sub.choices["inject"]
    flags = {s for a in webhook._actions for s in a.option_strings}
    for f in dataclasses.fields(InjectorConfig):
        assert "--" + f.name.replace("_", "-") in flags, f.name
        assert env_name(f.name) in webhook.format_help().replace("\n", " ").replace(" ", ""), f.name
    inject_flags = {s for a in inject._actions for s in a.option_strings}
    assert "--tls-cert-file" not in inject_flags and "--port" not in inject_flags
    assert {"-f", "--namespace-default", "--kubernetes-version", "--add-sys-admin"} <= inject_flags


def test_flags_override_the_environment() -> None:
    args = _parser().parse_args(
        ["webhook", "--sidecar-mode", "native", "--port", "9000", "--no-add-sys-admin"]
    )
    env = {
        env_name("sidecar_mode"): "container",
        env_name("add_sys_admin"): "1",
        env_name("metrics_port"): "9100",
    }
    config = cli.config_from_args(args, env)
    assert (config.sidecar_mode, config.port, config.add_sys_admin) == ("native", 9000, False)
    assert config.metrics_port == 9100  # not given as a flag: the environment applies
    assert cli.config_from_args(_parser().parse_args(["webhook"]), {}) == InjectorConfig()


def test_registers_into_the_main_cli() -> None:
    """``register`` plugs into ``fsdp_replay.cli.build_parser()``'s subparsers without a name clash."""
    from fsdp_replay.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if "webhook" not in sub.choices:  # until fsdp_replay/cli.py registers the injector itself
        cli.register(sub)
    args = parser.parse_args(["inject", "-f", "-", "--kubernetes-version", "1.28"])
    assert args.func is cli.cmd_inject
    assert parser.parse_args(["webhook", "--port", "1"]).func is cli.cmd_webhook
