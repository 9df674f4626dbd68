"""``fsdp-replay webhook``, ``inject`` and ``job``: the injector's commands.

Every option is a flag and an ``FSDP_REPLAY_INJECTOR_*`` (``job``: ``FSDP_REPLAY_JOB_*``) variable,
wired by one helper from the fields of :class:`InjectorConfig` (:class:`JobConfig`; their docstrings
are the help texts). A flag given on the command line is written over the environment and the
config is read by ``from_env``: one parser, and flags override the environment.

``register(subparsers)`` plugs the commands into the main CLI; ``main(argv)`` runs them alone
(``python -m fsdp_replay.injector.cli``). Exit codes as the main CLI's: 0 success, 2 usage error,
3 unusable input.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, BinaryIO

from fsdp_replay import options
from fsdp_replay.errors import ConfigError, FsdpReplayError
from fsdp_replay.injector.config import ENV_PREFIX, InjectorConfig, env_name, parse_bool
from fsdp_replay.injector.job_config import ENV_PREFIX as JOB_ENV_PREFIX
from fsdp_replay.injector.job_config import JobConfig
from fsdp_replay.injector.job_config import env_name as job_env_name

if TYPE_CHECKING:
    from fsdp_replay.injector.job import RenderedJob

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_BAD_INPUT = 3
# `inject -f` input bounds. Kubernetes objects are at most ~1.5 MiB each; a whole kustomize output
# fits easily. Nodes reached through aliases are counted as if written out, because that is what
# the dump writes (no anchors in the output): a 1 KB "billion laughs" would otherwise run for ever.
MAX_MANIFEST_BYTES = 16 << 20
MAX_ALIASED_NODES = 100_000
MAX_YAML_DEPTH = 100  # PyYAML composes, copies and dumps recursively
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
        data = _read_bounded(sys.stdin.buffer if args.filename == "-" else None, args.filename)
        if len(data) > MAX_MANIFEST_BYTES:
            print(
                f"fsdp-replay: {source} is larger than {MAX_MANIFEST_BYTES} bytes: refused", file=sys.stderr
            )
            return EXIT_BAD_INPUT
        text = data.decode("utf-8")
        documents = [d for d in yaml.load_all(text, Loader=_bounded_loader(yaml, source)) if d is not None]
    except OSError as e:
        print(f"fsdp-replay: cannot read {source}: {e.strerror or e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except UnicodeDecodeError as e:
        print(f"fsdp-replay: {source} is not UTF-8: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ManifestTooLargeError as e:
        print(f"fsdp-replay: {e}", file=sys.stderr)
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


def job_config(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> JobConfig:
    """The ``job`` options: the variables, the flags given over them, the trace given as an argument."""
    env = options.option_env(args, os.environ if environ is None else environ, JOB_ENV_PREFIX)
    if getattr(args, "trace_arg", None):
        env[job_env_name("trace")] = args.trace_arg
    return JobConfig.from_env(env)


def render_job(config: JobConfig) -> RenderedJob:
    """Read the replayed rank's metadata from the trace and render its Job."""
    from fsdp_replay.errors import TraceIncompleteError
    from fsdp_replay.injector.job import render
    from fsdp_replay.trace.layout import resolve_trace
    from fsdp_replay.trace.reader import Trace

    if not config.trace:
        raise ConfigError(f"give the trace: fsdp-replay job TRACE --rank R (or {job_env_name('trace')})")
    if config.rank is None and not config.all_ranks:
        raise ConfigError(
            "give --rank R (a Job of one pod) or --all-ranks (an Indexed Job, one pod per rank)"
        )
    url = resolve_trace(config.trace)
    if "://" not in url:
        url = os.path.abspath(url)  # the pod has another working directory
    trace = Trace.open(url)
    world = trace.world_size or (max(trace.ranks) + 1 if trace.ranks else 0)
    if config.rank is not None and config.rank >= world:
        raise ConfigError(f"--rank {config.rank}: the trace's world has {world} ranks (0..{world - 1})")
    if not trace.ranks:
        raise TraceIncompleteError("the trace holds no rank", path=url)
    # Every rank of a job shares the image, the command and the Secrets: any rank's record says them.
    rank = config.rank if config.rank is not None else trace.ranks[0]
    meta = trace.rank(rank).meta
    if not meta:
        raise TraceIncompleteError(f"rank {rank} has no start record", path=url)
    return render(meta, url, world, config)


def cmd_job(args: argparse.Namespace) -> int:
    from fsdp_replay.errors import ExitCode

    config = job_config(args)
    rendered = render_job(config)
    for warning in rendered.warnings:
        print(warning, file=sys.stderr)
    text = _yaml_text(rendered.manifest)
    where = f"-n {rendered.namespace}"
    follow = (
        f"fsdp-replay: follow it:  kubectl fsdp-replay logs {rendered.name} {where} -f\n"
        f"fsdp-replay: its report: kubectl fsdp-replay report {rendered.name} {where}  ({rendered.report})"
    )
    if config.dry_run:
        sys.stdout.write(text)
        return ExitCode.OK
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        sys.stdout.write(text)
        print(
            "fsdp-replay: kubectl is not on PATH: the Job above was not created (kubectl create -f - does it)",
            file=sys.stderr,
        )
        return ExitCode.UNUSABLE
    # create, not apply: a Job runs once, and applying an unchanged finished one would do nothing
    proc = subprocess.run([kubectl, "create", "-f", "-"], input=text, text=True, check=False)
    if proc.returncode != 0:
        print(
            f"fsdp-replay: kubectl create failed (exit {proc.returncode}); a Job {rendered.name} that exists "
            f"already: kubectl delete job {rendered.name} {where}, or choose another --name",
            file=sys.stderr,
        )
        return ExitCode.UNUSABLE
    print(follow, file=sys.stderr)
    return ExitCode.OK


def _yaml_text(document: Any) -> str:
    try:
        import yaml
    except ImportError:
        raise ConfigError(
            "this command writes YAML: install PyYAML (pip install 'fsdp-replay[injector]')"
        ) from None
    text: str = yaml.dump(document, Dumper=_dumper(yaml), sort_keys=False, default_flow_style=False)
    return text


def _dumper(yaml: Any) -> Any:
    """A safe dumper that writes repeated objects out in full: no &anchors in a manifest for review."""

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    return Dumper


def _read_bounded(stream: BinaryIO | None, path: str) -> bytes:
    """At most one byte more than :data:`MAX_MANIFEST_BYTES` of ``stream``, or of the file at ``path``."""
    if stream is not None:
        return stream.read(MAX_MANIFEST_BYTES + 1)
    with open(path, "rb") as f:
        return f.read(MAX_MANIFEST_BYTES + 1)


class ManifestTooLargeError(FsdpReplayError, ValueError):
    """YAML whose aliases expand past :data:`MAX_ALIASED_NODES`, or nested past :data:`MAX_YAML_DEPTH`."""


def _bounded_loader(yaml: Any, source: str) -> Any:
    """A safe loader that counts the nodes every alias stands for (its anchor's whole subtree, its own
    aliases included) and the nesting depth, and stops past the bounds before anything is built.

    One loader reads one stream: the count runs over all of its documents.
    """

    class Loader(yaml.SafeLoader):
        def __init__(self, stream: Any) -> None:
            super().__init__(stream)
            self._sizes: dict[int, int] = {}  # id(node) -> its node count with aliases written out
            self._aliased = 0
            self._depth = 0

        def compose_document(self) -> Any:
            node = super().compose_document()
            self._sizes.clear()  # the nodes go with the document, and their ids may be reused
            return node

        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                target = self.anchors.get(self.peek_event().anchor)
                if target is not None:  # else: the parser's "undefined alias" error follows
                    if (size := self._sizes.get(id(target))) is None:
                        raise ManifestTooLargeError(
                            f"{source}: the alias *{self.peek_event().anchor} refers to a node that holds it "
                            "(a recursive structure cannot be written out as a manifest)"
                        )
                    self._aliased += size
                    if self._aliased > MAX_ALIASED_NODES:
                        raise ManifestTooLargeError(
                            f"{source}: its aliases stand for more than {MAX_ALIASED_NODES} nodes "
                            "(nested aliases, as in a 'billion laughs'): refused"
                        )
            self._depth += 1
            try:
                if self._depth > MAX_YAML_DEPTH:
                    raise ManifestTooLargeError(
                        f"{source}: nested deeper than {MAX_YAML_DEPTH} levels: refused"
                    )
                node = super().compose_node(parent, index)
            finally:
                self._depth -= 1
            if id(node) not in self._sizes:
                children = node.value if isinstance(node.value, list) else []
                self._sizes[id(node)] = 1 + sum(
                    self._sizes[id(n)]
                    for child in children
                    for n in (child if isinstance(child, tuple) else (child,))
                )
            return node

    return Loader


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
    register_job(subparsers, "job")


def register_job(subparsers: Any, name: str) -> argparse.ArgumentParser:
    """``fsdp-replay job`` (and ``kubectl fsdp-replay replay``, the same parser under another name)."""
    j = subparsers.add_parser(
        name,
        help="replay a rank (or every rank) as a Kubernetes Job: render it, and create it with kubectl",
        description="Render a batch/v1 Job that replays rank R of a trace alone in the recorded image, with the "
        "recorded pod's Secrets by reference, one GPU, and the report written to the store; --all-ranks: an "
        "Indexed Job, one pod per rank. Without --dry-run it is created with kubectl. docs/kubernetes.md says "
        "what the Job holds and why.",
    )
    j.add_argument(
        "trace_arg", nargs="?", metavar="TRACE", help=f"the trace (or --trace; env {job_env_name('trace')})"
    )
    j.add_argument(
        "-n",
        "--namespace",
        default=None,
        dest="config_namespace",
        help="the Job's namespace; default: the recorded pod's, where its Secrets are "
        f"(env {job_env_name('namespace')})",
    )
    options.add_config_options(j, JobConfig, JOB_ENV_PREFIX, skip=frozenset({"namespace"}))
    j.set_defaults(func=cmd_job)
    return j


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsdp-replay", description="the fsdp-replay injector")
    register(parser.add_subparsers(dest="cmd", required=True))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from fsdp_replay.errors import FsdpReplayError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as e:
        print(f"fsdp-replay: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (FsdpReplayError, OSError) as e:  # `job`: a trace that cannot be read or used
        print(f"fsdp-replay: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
