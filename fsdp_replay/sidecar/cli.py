"""``fsdp-replay sidecar``: run the sidecar daemon.

Every option is a flag and an environment variable (``FSDP_REPLAY_SIDECAR_*``; the run folder is
the agents' ``FSDP_REPLAY_OUT``), wired from the fields of :class:`SidecarConfig`, whose
docstrings are the help texts. A flag given on the command line is written over the environment
and the config is read by ``SidecarConfig.from_env``: one parser, and flags win. Pod specs need no
arguments (the injector sets the variables).

The same few lines exist in ``injector/cli.py``; components stay independent, so they are not
imported from there (to be unified later).

``register(subparsers)`` plugs the command into the main CLI; ``main(argv)`` runs it alone
(``python -m fsdp_replay.sidecar.cli`` or ``python -m fsdp_replay.sidecar.main``). The hidden
``--print-bpf`` prints the BPF program the sidecar would load and exits (no root, no bcc needed).
Exit codes as the main CLI's: 0 success, 2 usage error.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, fields
from typing import Any

from fsdp_replay.errors import ConfigError
from fsdp_replay.sidecar.config import SidecarConfig, env_name, field_docs

EXIT_OK = 0
EXIT_USAGE = 2
_DEST = "config_"  # argparse dest prefix of the config fields
DESCRIPTION = (
    "Follow the agents' spools under OUT/spool, probe the trainers' libnccl with eBPF uprobes "
    "(when root and bcc allow), and serve Prometheus /metrics and /healthz. Every option is also an "
    "environment variable (shown with each)."
)


def add_config_options(parser: argparse.ArgumentParser) -> None:
    """``--name`` for each SidecarConfig field, also read from its variable (the flag wins)."""
    docs = field_docs(SidecarConfig)
    for f in fields(SidecarConfig):
        kind = str(f.type)
        default = f.default if f.default is not MISSING else None
        shown = ",".join(default) if isinstance(default, tuple) else default
        text = f"{docs.get(f.name, '')} (env {env_name(f.name)}"
        text += "" if shown in (None, "") else f"; default {shown}"
        text += ")"
        flag = "--" + f.name.replace("_", "-")
        if kind in ("bool", "bool | None"):
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, dest=_DEST + f.name, help=text
            )
        else:
            parser.add_argument(
                flag,
                type=str,  # parsed by SidecarConfig.from_env, so errors name the variable either way
                default=None,
                dest=_DEST + f.name,
                metavar=f.name.upper(),
                help=text,
            )
    parser.add_argument("--print-bpf", action="store_true", help=argparse.SUPPRESS)


def option_env(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with every option given as a flag written over it, under its variable's name."""
    env = dict(environ)
    for key, value in vars(args).items():
        if key.startswith(_DEST) and value is not None:
            name = key.removeprefix(_DEST)
            env[env_name(name)] = ("1" if value else "0") if isinstance(value, bool) else str(value)
    return env


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> SidecarConfig:
    return SidecarConfig.from_env(option_env(args, os.environ if environ is None else environ))


def cmd_sidecar(args: argparse.Namespace) -> int:
    if args.print_bpf:
        from fsdp_replay.sidecar.ebpf.programs import print_bpf

        return print_bpf()
    config = config_from_args(args)
    logging.basicConfig(
        level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    from fsdp_replay.sidecar.main import run

    return run(config)


def register(subparsers: Any) -> None:
    """Add ``sidecar`` to the CLI's subparsers."""
    p = subparsers.add_parser(
        "sidecar",
        help="run the sidecar: spools -> metrics, eBPF uprobes on libnccl, Prometheus /metrics",
        description=DESCRIPTION,
    )
    add_config_options(p)
    p.set_defaults(func=cmd_sidecar)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsdp-replay sidecar", description=DESCRIPTION)
    add_config_options(parser)
    parser.set_defaults(func=cmd_sidecar)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as e:
        print(f"fsdp-replay: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
