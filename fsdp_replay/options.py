"""Options from the environment, the same way everywhere: every flag is also a variable.

Each component has one frozen config dataclass (``agent.config.RecordConfig``,
``replayer.config.ReplayConfig``, ``sidecar.config.SidecarConfig``, ``injector.config.InjectorConfig``)
read once at start-up from ``FSDP_REPLAY_*`` variables; its command-line flags are generated from
the same fields (``add_config_options``) and written over the environment before the config is read
(``option_env``), so flags win and there is one parser. Command options that are not a component's
config (``--json``, ``--plot``) get their variable from their flag's name (``env_option``).
A bad value is a ``ConfigError`` naming the variable. kopf's ``auto_envvar_prefix`` is the model.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import itertools
import os
from collections.abc import Callable, Mapping
from dataclasses import MISSING, fields
from typing import Any

from fsdp_replay.errors import ConfigError

ENV_PREFIX = "FSDP_REPLAY_"
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")
_DEST = "config_"  # argparse dest prefix of generated config flags


def env_var(name: str, prefix: str = ENV_PREFIX) -> str:
    """``snapshot_every`` / ``--snapshot-every`` -> ``FSDP_REPLAY_SNAPSHOT_EVERY``."""
    return prefix + name.lstrip("-").replace("-", "_").upper()


def parse_bool(var: str, raw: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off``; anything else is a ConfigError naming ``var``."""
    value = raw.strip().lower()
    if value in TRUE:
        return True
    if value in FALSE:
        return False
    raise ConfigError(f"{var}={raw!r} is not a boolean (use 1 or 0)")


def parse_int(var: str, raw: str, minimum: int | None = None) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"{var}={raw!r} is not an integer") from None
    if minimum is not None and value < minimum:
        raise ConfigError(f"{var}={value} must be >= {minimum}")
    return value


def parse_float(var: str, raw: str) -> float:
    try:
        return float(raw.strip())
    except ValueError:
        raise ConfigError(f"{var}={raw!r} is not a number") from None


def parse_kind(var: str, kind: str, raw: str) -> Any:
    """A variable's text as a field of type ``kind`` (the annotation as written)."""
    if kind in ("int", "int | None"):
        return parse_int(var, raw)
    if kind == "float":
        return parse_float(var, raw)
    if kind in ("bool", "bool | None"):
        return parse_bool(var, raw)
    if kind == "tuple[str, ...]":
        return tuple(item.strip() for item in raw.split(",") if item.strip())
    return raw.strip()


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass, from its source (the flags' help texts)."""
    try:
        body = ast.parse(inspect.getsource(cls)).body[0]
    except (OSError, TypeError, IndexError):
        return {}  # no source (a frozen build): help without descriptions
    docs: dict[str, str] = {}
    statements = body.body if isinstance(body, ast.ClassDef) else []
    for stmt, after in itertools.pairwise(statements):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(after.value.value.replace("``", "").split())
    return docs


def _var(name: str, prefix: str, names: Mapping[str, str] | None) -> str:
    return (names or {}).get(name) or env_var(name, prefix)


def from_env(
    cls: type,
    prefix: str,
    env: Mapping[str, str] | None = None,
    parsers: Mapping[str, Callable[[str, str], Any]] | None = None,
    names: Mapping[str, str] | None = None,
) -> Any:
    """``cls(**values)`` from its variables (``prefix`` + field name, or ``names[field]``); unset
    ones, and empty ones of non-text fields, keep their defaults. ``parsers`` maps a field to
    ``(var, raw) -> value``."""
    env = os.environ if env is None else env
    parsers = parsers or {}
    values: dict[str, Any] = {}
    for f in fields(cls):
        var = _var(f.name, prefix, names)
        raw = env.get(var)
        if raw is None or (raw.strip() == "" and str(f.type) != "str"):
            continue
        parse = parsers.get(f.name)
        values[f.name] = parse(var, raw) if parse is not None else parse_kind(var, str(f.type), raw)
    return cls(**values)


def add_config_options(
    parser: argparse.ArgumentParser,
    cls: type,
    prefix: str,
    *,
    only: frozenset[str] | None = None,
    skip: frozenset[str] = frozenset(),
    names: Mapping[str, str] | None = None,
) -> None:
    """A ``--field-name`` flag for each field of ``cls`` (``only`` those, less ``skip``), its help
    the field's docstring and its variable. Flags stay None when not given (see ``option_env``)."""
    docs = field_docs(cls)
    for f in fields(cls):
        if f.name in skip or (only is not None and f.name not in only):
            continue
        default = f.default if f.default is not MISSING else None
        shown = ",".join(default) if isinstance(default, tuple) else default
        text = f"{docs.get(f.name, '')} (env {_var(f.name, prefix, names)}"
        text += ("" if shown in (None, "") else f"; default {shown}") + ")"
        flag = "--" + f.name.replace("_", "-")
        if str(f.type) in ("bool", "bool | None"):
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, dest=_DEST + f.name, help=text
            )
        else:  # parsed by from_env, so a bad value names the variable either way
            parser.add_argument(
                flag, type=str, default=None, dest=_DEST + f.name, metavar=f.name.upper(), help=text
            )


def option_env(
    args: argparse.Namespace, environ: Mapping[str, str], prefix: str, names: Mapping[str, str] | None = None
) -> dict[str, str]:
    """``environ`` with every config flag given on the command line written over it."""
    env = dict(environ)
    for key, value in vars(args).items():
        if key.startswith(_DEST) and value is not None:
            var = _var(key.removeprefix(_DEST), prefix, names)
            env[var] = ("1" if value else "0") if isinstance(value, bool) else str(value)
    return env


# Process-wide switches, not options of one component: read where they act, through these two
# functions (docs/configuration.md lists them with every other variable).
PROCESS_SWITCHES = {
    "FSDP_REPLAY_NATIVE": "0 turns the native fingerprint core off (the torch path gives the same values)",
    "FSDP_REPLAY_CACHE": "where the C++ kernel is built and cached (default ~/.cache/fsdp-replay)",
    "FSDP_REPLAY_TRITON": "0 turns the one-launch Triton fingerprint of taped CUDA outputs off "
    "(torch ops give the same values)",
    "FSDP_REPLAY_CUPTI_NATIVE": "0 reads CUPTI's buffers with cupti-python's per-record callback instead of "
    "the native reader (agent/cupti/native.py; the same rows, more Python per record)",
    "FSDP_REPLAY_SM_COPY": "1 makes the device-to-device copies of payloads on the program's stream (the payload "
    "ring's slot copy, the tape's C++ hook's kept outputs) an elementwise kernel on the SMs instead of a "
    "memcpy, which may queue on a copy engine behind the side stream's host copies; off by default (on an H200 "
    "no resolved difference: the flight recorder's cost is on the CPU)",
    "FSDP_REPLAY_SNAPSHOT_ASYNC": "0 copies snapshots on the program's stream (pinned per tensor) instead of into "
    "a pinned slab on a side stream settled at the next optimizer.step() (agent/snapshots.py)",
    "FSDP_REPLAY_CUPTI_DETACH": "0 keeps CUPTI attached after each capture window; by default it is finalized "
    "(cuptiFinalize) so that the steps between windows do not pass every CUDA call through it",
}


def process_switch(var: str, default: bool) -> bool:
    """A process-wide on/off switch (``PROCESS_SWITCHES``); a bad value counts as the default."""
    raw = os.environ.get(var)
    if raw is None or raw.strip() == "":
        return default
    try:
        return parse_bool(var, raw)
    except ConfigError:
        return default  # read inside a training process: never raise into it


def process_setting(var: str) -> str:
    """A process-wide setting (``PROCESS_SWITCHES``), or empty."""
    return os.environ.get(var, "").strip()


def env_option(
    parser: argparse.ArgumentParser,
    *flags: str,
    kind: str = "str",
    default: Any = None,
    help: str = "",
    env: Mapping[str, str] | None = None,
    prefix: str = ENV_PREFIX,
    **kwargs: Any,
) -> None:
    """One command option whose default comes from ``FSDP_REPLAY_<FLAG>`` (the long flag's name).

    ``kind``: ``str``, ``int``, ``flag`` (``--x``; the variable 1/0), ``bool`` (``--x/--no-x``).
    The variable is parsed here, strictly: a bad one is a ConfigError naming it.
    """
    env = os.environ if env is None else env
    long = next(f for f in flags if f.startswith("--"))
    var = env_var(long, prefix)
    raw = env.get(var)
    value = default
    if raw is not None and raw.strip() != "":
        value = parse_kind(var, {"flag": "bool", "bool": "bool"}.get(kind, kind), raw)
    text = f"{help} (env {var}" + ("" if default in (None, "", False) else f"; default {default}") + ")"
    if kind == "flag":
        parser.add_argument(*flags, action="store_true", default=bool(value), help=text, **kwargs)
    elif kind == "bool":
        parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=value, help=text, **kwargs)
    else:
        parser.add_argument(*flags, type=int if kind == "int" else str, default=value, help=text, **kwargs)


def usage_with_command(parser: argparse.ArgumentParser, command: str) -> None:
    """Show ``command`` (the program's command line after ``--``) at the end of the usage line:
    argparse cannot, since everything after ``--`` is taken apart before parsing (and it shows a
    positional that takes the rest, as ``record``'s does, as ``...``)."""
    text = parser.format_usage().removeprefix("usage: ").rstrip()
    parser.usage = f"{text} {command}".replace("%", "%%")
