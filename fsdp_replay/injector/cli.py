"""``fsdp-replay webhook`` and ``fsdp-replay inject``: the injector's commands.

Every option is a flag and an ``FSDP_REPLAY_INJECTOR_*`` variable, wired by one helper from the
fields of :class:`InjectorConfig` (their docstrings are the help texts). A flag given on the command
line is written over the environment and the config is read by ``InjectorConfig.from_env``: one
parser, and flags override the environment.

``register(subparsers)`` plugs both commands into the main CLI; ``main(argv)`` runs them alone
(``python -m fsdp_replay.injector.cli``). Exit codes as the main CLI's: 0 success, 2 usage error,
3 unusable input.
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
from fsdp_replay.injector.config import ENV_PREFIX, InjectorConfig, env_name, parse_bool

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_BAD_INPUT = 3
SERVER_ONLY = frozenset({"tls_cert_file", "tls_key_file", "listen_address", "port", "log_level"})


def add_config_options(parser: argparse.ArgumentParser, *, server: bool) -> None:
    options.add_config_options(
        parser, InjectorConfig, ENV_PREFIX, skip=frozenset() if server else SERVER_ONLY
    )


def option_env(args: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` with every option given as a flag written over it, under its variable's name."""
    return options.option_env(args, environ, ENV_PREFIX)


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> InjectorConfig:
    return InjectorConfig.from_env(option_env(args, os.environ if environ is None else environ))


def cmd_webhook(args: argparse.Namespace) -> int:
    from fsdp_replay.injector.server import serve

    config = config_from_args(args)
    logging.basicConfig(
        level=config.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    return serve(config)


def cmd_inject(args: argparse.Namespace) -> int:
    from fsdp_replay.injector.mutate import mutate_template

    env = option_env(args, os.environ)
    config = InjectorConfig.from_env(env)
    raw = env.get(env_name("namespace_default"), "")
    namespace_default = parse_bool("namespace_default", raw) if raw else False
    try:
        import yaml
    except ImportError:
        raise ConfigError(
            "inject reads and writes YAML: install PyYAML (pip install 'fsdp-replay[injector]')"
        ) from None
    source = "<stdin>" if args.filename == "-" else args.filename
    try:
        text = sys.stdin.read() if args.filename == "-" else _read(args.filename)
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except OSError as e:
        print(f"fsdp-replay: cannot read {source}: {e.strerror or e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except yaml.YAMLError as e:
        print(f"fsdp-replay: {source} is not YAML: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    out: list[Any] = []
    for document in documents:
        injected, warnings = mutate_template(document, config, namespace_default=namespace_default)
        for warning in warnings:
            print(warning, file=sys.stderr)
        if injected != document:
            meta = document.get("metadata") or {}
            print(f"fsdp-replay: injected {document.get('kind')}/{meta.get('name', '?')}", file=sys.stderr)
        out.append(injected)
    yaml.dump_all(out, sys.stdout, Dumper=_dumper(yaml), sort_keys=False, default_flow_style=False)
    return EXIT_OK


def _dumper(yaml: Any) -> Any:
    """A safe dumper that writes repeated objects out in full: no &anchors in a manifest for review."""

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    return Dumper


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def register(subparsers: Any) -> None:
    """Add ``webhook`` and ``inject`` to the CLI's subparsers."""
    w = subparsers.add_parser(
        "webhook",
        help="serve the Kubernetes mutating admission webhook (HTTPS) that injects recording into pods",
        description="Serve POST /mutate and /mutate/namespace-default (AdmissionReview v1), GET /healthz "
        "and /readyz. It fails open: every error admits the pod unchanged, with a warning.",
    )
    add_config_options(w, server=True)
    w.set_defaults(func=cmd_webhook)

    i = subparsers.add_parser(
        "inject",
        help="print manifests with recording injected, as the webhook would (for GitOps and review)",
        description="Read YAML (several documents, Lists; Pods, Deployments, StatefulSets, DaemonSets, Jobs, "
        "CronJobs, PyTorchJobs, MPIJobs, JobSets) and print it with every annotated pod template "
        "injected. Other documents are printed unchanged; warnings go to stderr.",
    )
    given = os.environ.get(env_name("filename"))
    i.add_argument(
        "-f",
        "--filename",
        required=given is None,
        default=given,
        help=f"the manifest file, or - for stdin (env {env_name('filename')})",
    )
    i.add_argument(
        "--namespace-default",
        action=argparse.BooleanOptionalAction,
        default=None,
        dest="config_namespace_default",
        help="inject pods without the record annotation too, as in a namespace labelled "
        f"<prefix>/record=enabled (env {env_name('namespace_default')})",
    )
    add_config_options(i, server=False)
    i.set_defaults(func=cmd_inject)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsdp-replay", description="the fsdp-replay injector")
    register(parser.add_subparsers(dest="cmd", required=True))
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
