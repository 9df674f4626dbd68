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
from typing import Any

from fsdp_replay import options
from fsdp_replay.errors import ConfigError
from fsdp_replay.sidecar.config import ENV_NAMES, ENV_PREFIX, SidecarConfig

EXIT_OK = 0
EXIT_USAGE = 2
DESCRIPTION = (
    "Follow the agents' spools under OUT/spool, probe the trainers' libnccl with eBPF uprobes "
    "(when root and bcc allow), and serve Prometheus /metrics and /healthz. Every option is also an "
    "environment variable (shown with each)."
)


def add_config_options(parser: argparse.ArgumentParser) -> None:
    """``--name`` for each SidecarConfig field, also read from its variable (the flag wins)."""
    options.add_config_options(parser, SidecarConfig, ENV_PREFIX, names=ENV_NAMES)
    parser.add_argument("--print-bpf", action="store_true", help=argparse.SUPPRESS)


def option_env(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with every option given as a flag written over it, under its variable's name."""
    return options.option_env(args, environ, ENV_PREFIX, names=ENV_NAMES)


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
