"""A replay as a Kubernetes Job: a recorded rank's metadata and the options in, a ``batch/v1`` Job out.

Pure (no I/O, no clock): ``fsdp-replay job`` (``cli.py``) reads the trace and runs ``kubectl``.
The Job's pod is the recorded container again, with a replay in place of the training:

- **the recorded image** (``identity.py`` recorded it), its pull Secrets and service account;
- **an init container** from the replay payload image (Dockerfile target ``replay-payload``) that
  copies the package and, built for the recorded CPython version, the libraries a replay reads the
  trace with (zarr, numcodecs, numpy, fsspec, s3fs, psutil) into an emptyDir. ``PYTHONPATH`` puts
  the package in front by the injector's rule (``boot.pythonpath``); ``FSDP_REPLAY_DEPS`` names
  the libraries' folder, which our ``sitecustomize`` puts *after* the image's site-packages, so the
  program's own numpy (or anything else) is the one it recorded with, and ours only fill what the
  image lacks;
- **the command** ``<recorded python> -m fsdp_replay job-run TRACE ...`` (``cli/job_run.py``):
  ``fsdp-replay replay`` of the rank, which takes the recorded command line, working directory
  and environment from the trace, then the report copied to the store. The Job holds no recorded
  value: the trace is the one source, and nothing secret is in the manifest;
- **credentials by reference**: a variable the recording redacted gets the recorded container's
  ``valueFrom`` (a Secret's key), never a value; its ``envFrom`` sources and the store's Secret
  come along. A redacted variable without a known source is named in a warning;
- **one GPU** (``nvidia.com/gpu: 1``), or none with ``--device cpu``;
- ``<prefix>/record: "false"`` on the pod, so a namespace that records every pod does not record
  the replay.

``--all-ranks`` makes an Indexed Job: one pod per rank, each replaying the rank of its completion
index *alone*, from the trace's payloads, as ``--rank`` does. Not ``replay --all-ranks`` (every
rank live under one torchrun): pods that replay alone need no network between them, no gang
scheduling and one GPU each, and a rank that diverges does not stop the others. A trace recorded
without payloads cannot be replayed so; the warning says to run ``replay --all-ranks`` instead.

A replay's outcome is deterministic, so exit codes 1 (diverged), 2 and 3 (unusable) are not
retried (``podFailurePolicy``); an Indexed Job fails each such rank alone (``backoffLimitPerIndex``,
from Kubernetes 1.29; before, the first such rank fails the Job). An eviction is not counted.
"""

from __future__ import annotations

import posixpath
import re
import shlex
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fsdp_replay.boot.pythonpath import agent_pythonpath
from fsdp_replay.errors import ConfigError, ExitCode, TraceFormatError
from fsdp_replay.injector import containers
from fsdp_replay.injector.config import InjectorConfig
from fsdp_replay.injector.identity import RecordedPod, recorded_pod
from fsdp_replay.injector.job_config import MAX_NAME_CHARS, JobConfig
from fsdp_replay.trace import command, schema, signing
from fsdp_replay.trace.layout import REPLAYS_DIR
from fsdp_replay.trace.redact import scrub_doc, scrub_text

REPLAY_CONTAINER = "replay"
PAYLOAD_CONTAINER = "fsdp-replay-payload"
PAYLOAD_VOLUME = "fsdp-replay-payload"
WORK_VOLUME = "fsdp-replay-work"
RUN_MODULE = ("-m", "fsdp_replay", "job-run")
# The replay payload image holds /fsdp-replay/lib (the package) and /fsdp-replay/deps/cp311, cp312,
# ... (the libraries per CPython, Dockerfile): the init container copies the package and the
# recorded Python's folder, <mount>/lib and <mount>/cp311, and FSDP_REPLAY_DEPS names <mount>.
DEPS_DIR = "deps"
ENV_DEPS = "FSDP_REPLAY_DEPS"
OLDEST_REPLAY_PYTHON = (3, 11)  # zarr 3's
ENV_RANK = "FSDP_REPLAY_RANK"  # job-run's --rank, as every option is also a variable
COMPLETION_INDEX_FIELD = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
WORK_REPORT = "report"  # the report's folder in the scratch emptyDir, before it is stored
# What a replay does not carry over from the recording (replayer/launch.py's _DROP_ENV, restated:
# the injector must not import the replayer; tests/injector/test_job.py checks they agree): the old
# launch's rendezvous and error file, the device choice, the agent's own variables, PYTHONPATH.
NOT_REPLAYED = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_USE_AGENT_STORE",
    "CUDA_VISIBLE_DEVICES",
    "FSDP_REPLAY_",
    "PYTHONPATH",
)
# The replay's verdicts that a second try would repeat (docs/exit-codes.md).
DETERMINISTIC_EXIT_CODES = [int(ExitCode.FOUND), int(ExitCode.USAGE), int(ExitCode.UNUSABLE)]
RETRIES = 1  # another exit (an OOM kill, a crashed node) is tried once more
LABELS = {"app.kubernetes.io/name": "fsdp-replay", "app.kubernetes.io/component": "replay"}
# Annotations of the Job (after the prefix): what `kubectl fsdp-replay report` and a reader need.
ANN_TRACE = "trace"
ANN_RANK = "rank"
ANN_REPORT = "report"
ANN_REPLAY_OF = "replay-of"
ANN_COMMAND = "command"
ALL_RANKS = "all"


@dataclass(frozen=True, kw_only=True, slots=True)
class RenderedJob:
    manifest: dict[str, Any]
    warnings: list[str]
    name: str
    namespace: str
    report: str
    """The report's location: a folder URL (or path) for one rank; per rank ``rank-NNNNN`` below it."""


def render(meta: Mapping[str, Any], trace_url: str, world: int, config: JobConfig) -> RenderedJob:
    """The Job that replays ``config.rank`` (or every rank) of the trace at ``trace_url``.

    ``meta`` is the replayed rank's ``rank_start`` record (any rank's, for ``--all-ranks``: they
    share image, command and Secrets); ``world`` the trace's world size. Raises ``ConfigError``
    for options the trace contradicts, ``TraceFormatError`` when the trace lacks what a Job needs.
    """
    if config.rank is None and not config.all_ranks:
        raise ConfigError(
            "give --rank R (a Job of one pod) or --all-ranks (an Indexed Job, one pod per rank)"
        )
    if config.rank is not None and config.rank >= world:
        raise ConfigError(f"--rank {config.rank}: the trace's world has {world} ranks (0..{world - 1})")
    env = meta.get("env") or {}
    pod = recorded_pod(env)
    image = config.image or pod.image
    namespace = config.namespace or pod.namespace
    if not (image and namespace):
        missing = [f for f, v in (("--image", image), ("--namespace", namespace)) if not v]
        raise TraceFormatError(
            "the trace does not say where the rank ran (it was not recorded in a pod the injector "
            f"prepared, or its image was redacted): give {' and '.join(missing)}"
        )
    executable = command.interpreter(meta.get("executable"))
    if executable is None:
        raise TraceFormatError(
            "the trace does not record the rank's Python interpreter (its executable is "
            f"{str(meta.get('executable'))[:80]!r}): the Job runs only a Python interpreter of the image"
        )
    parsed = command.parse(command.recorded_argv(meta))
    if parsed.problems and not config.trust_trace:
        raise TraceFormatError(command.refusal(parsed.problems))
    warnings: list[str] = []
    name = config.name or default_name(pod.name, config)
    report = config.report or default_report(trace_url, name)
    who = ALL_RANKS if config.all_ranks else str(config.rank)

    container = _replay_container(config, image, executable, env, pod, trace_url, report, warnings)
    spec: dict[str, Any] = {"restartPolicy": "Never"}
    if account := config.service_account or pod.service_account:
        spec["serviceAccountName"] = account
    if pod.pull_secrets:
        spec["imagePullSecrets"] = [{"name": s} for s in pod.pull_secrets]
    python = _python_tag(meta, warnings)
    spec["initContainers"] = [_payload_container(config, python)]
    spec["containers"] = [container]
    spec["volumes"] = [
        {"name": PAYLOAD_VOLUME, "emptyDir": {}},
        {"name": WORK_VOLUME, "emptyDir": {}},
        *({"name": f"claim-{i}", "persistentVolumeClaim": {"claimName": c.partition(":")[0]}}
          for i, c in enumerate(config.volume_claims)),
        *([containers.signing_volume(config.signing_key_secret)] if config.signing_key_secret else []),
    ]  # fmt: skip
    template = {
        "metadata": {
            "labels": dict(LABELS),
            "annotations": {f"{config.annotation_prefix}/record": "false"},
        },
        "spec": spec,
    }
    job_spec: dict[str, Any] = {}
    exit_rule: dict[str, Any] = {
        "action": "FailIndex" if config.all_ranks and config.per_index_failure else "FailJob",
        "onExitCodes": {
            "containerName": REPLAY_CONTAINER,
            "operator": "In",
            "values": list(DETERMINISTIC_EXIT_CODES),
        },
        "onPodConditions": [],  # required by the schema before 1.29; empty: exit codes only
    }
    if config.all_ranks:
        job_spec.update(
            completionMode="Indexed",
            completions=world,
            parallelism=min(config.parallelism or world, world),
        )
    if config.all_ranks and config.per_index_failure:
        job_spec["backoffLimitPerIndex"] = RETRIES
    else:
        job_spec["backoffLimit"] = RETRIES
    job_spec["podFailurePolicy"] = {
        "rules": [
            exit_rule,
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        ]
    }
    job_spec["template"] = template

    prefix = config.annotation_prefix
    annotations = {
        f"{prefix}/{ANN_TRACE}": trace_url,
        f"{prefix}/{ANN_RANK}": who,
        f"{prefix}/{ANN_REPORT}": report,
        f"{prefix}/{ANN_COMMAND}": shlex.join(_recorded_command(meta, executable)),
    }
    if pod.name and pod.namespace:
        annotations[f"{prefix}/{ANN_REPLAY_OF}"] = f"{pod.namespace}/{pod.name}"
    manifest = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": dict(LABELS),
            "annotations": annotations,
        },
        "spec": job_spec,
    }
    warnings += _policy_warnings(meta, world)
    warnings += _path_warnings(trace_url, report, config)
    # the manifest holds no recorded value by design; the command annotation and the warnings quote
    # the trace, which the recording redacted: this is the last check before a reviewer reads it
    return RenderedJob(
        manifest=scrub_doc(manifest),
        warnings=[scrub_text(w) for w in warnings],
        name=name,
        namespace=namespace,
        report=report,
    )


# -- the containers -----------------------------------------------------------------------------
def _payload_container(config: JobConfig, python: str | None) -> dict[str, Any]:
    """The injector's copy container (unprivileged, read-only) with the replay payload image,
    copying the package and the recorded Python's libraries only (every version's when unknown)."""
    copier = containers.copy_container(
        InjectorConfig(agent_image=config.payload_image, image_pull_policy=config.image_pull_policy)
    )
    source = containers.PAYLOAD_SOURCE
    deps = posixpath.join(source, DEPS_DIR, python) if python else posixpath.join(source, DEPS_DIR, ".")
    copier["name"] = PAYLOAD_CONTAINER
    copier["command"] = [
        "cp", "-R", posixpath.join(source, containers.PAYLOAD_LIB), deps, f"{containers.COPY_TARGET}/",
    ]  # fmt: skip
    copier["volumeMounts"] = [{"name": PAYLOAD_VOLUME, "mountPath": containers.COPY_TARGET}]
    return copier


def _python_tag(meta: Mapping[str, Any], warnings: list[str]) -> str | None:
    """``cp312`` for the recorded interpreter (``versions.python``), or None when unknown."""
    version = str((meta.get("versions") or {}).get("python") or "")
    m = re.fullmatch(r"(\d+)\.(\d+)(?:\..*)?", version)
    if not m:
        return None
    major, minor = int(m.group(1)), int(m.group(2))
    if (major, minor) < OLDEST_REPLAY_PYTHON:
        oldest = ".".join(map(str, OLDEST_REPLAY_PYTHON))
        warnings.append(
            f"fsdp-replay: the rank ran Python {version}: a replay reads the trace with zarr 3, which "
            f"needs Python {oldest} or later, so this replay will stop with exit 3 in that image"
        )
    return f"cp{major}{minor}"


def _replay_container(
    config: JobConfig,
    image: str,
    executable: str,
    env: Mapping[str, str],
    pod: RecordedPod,
    trace_url: str,
    report: str,
    warnings: list[str],
) -> dict[str, Any]:
    args = [trace_url]
    args += [] if config.all_ranks else ["--rank", str(config.rank)]
    args += ["--from-step", str(config.from_step), "--to-step", str(config.to_step)]
    args += ["--device", "cuda:0" if config.device == "cuda" else "cpu"]
    args += ["--report", report, "--work-dir", posixpath.join(config.work_path, WORK_REPORT)]
    args += ["--per-rank"] if config.all_ranks else []
    args += ["--force"] if config.force else []
    args += [command.TRUST_FLAG] if config.trust_trace else []

    site, lib = containers.agent_dirs(config.mount_path)
    variables: list[dict[str, Any]] = [
        {"name": "PYTHONPATH", "value": agent_pythonpath(site, lib, user_pythonpath(env), sep=":")},
        {"name": ENV_DEPS, "value": config.mount_path},
    ]
    if config.all_ranks:
        variables.append({"name": ENV_RANK, "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX_FIELD}}})
    variables += _credentials(env, pod, warnings)
    if config.signing_key_secret:
        variables.append({"name": signing.KEY_FILE_ENV, "value": containers.SIGNING_KEY_FILE})
    container: dict[str, Any] = {
        "name": REPLAY_CONTAINER,
        "image": image,
        "imagePullPolicy": config.image_pull_policy,
        "command": [executable, *RUN_MODULE],
        "args": args,
        "env": variables,
    }
    sources = [dict(s) for s in pod.env_from]
    if secret := config.store_secret or pod.store_secret:
        sources.append({"secretRef": {"name": secret}})
    if sources:
        container["envFrom"] = sources
    resources: dict[str, Any] = {}
    if requests := {k: v for k, v in (("cpu", config.cpu), ("memory", config.memory)) if v}:
        resources["requests"] = requests
    if config.device == "cuda":
        resources["limits"] = {config.gpu_resource: 1}
    if resources:
        container["resources"] = resources
    container["volumeMounts"] = [
        {"name": PAYLOAD_VOLUME, "mountPath": config.mount_path, "readOnly": True},
        {"name": WORK_VOLUME, "mountPath": config.work_path},
        *(
            {"name": f"claim-{i}", "mountPath": c.partition(":")[2]}
            for i, c in enumerate(config.volume_claims)
        ),
        *([dict(containers.SIGNING_MOUNT)] if config.signing_key_secret else []),
    ]
    # The log's end is the replay's verdict: `kubectl describe` shows it without `logs`.
    container["terminationMessagePolicy"] = "FallbackToLogsOnError"
    return container


def _credentials(env: Mapping[str, str], pod: RecordedPod, warnings: list[str]) -> list[dict[str, Any]]:
    """The recorded container's source of each variable the recording redacted: never a value."""
    redacted = sorted(k for k, v in env.items() if schema.has_redacted(v) and _replayed(k))
    found: list[dict[str, Any]] = []
    unknown: list[str] = []
    for variable in redacted:
        source = pod.env_refs.get(variable)
        if source is None:
            unknown.append(variable)
            continue
        source = dict(source)
        if isinstance(source.get("resourceFieldRef"), Mapping):  # its container is the replay's now
            source["resourceFieldRef"] = {
                k: v for k, v in source["resourceFieldRef"].items() if k != "containerName"
            }
        found.append({"name": variable, "valueFrom": source})
    if unknown:
        names = ", ".join(unknown)
        if pod.env_from:
            origins = ", ".join(_describe_source(s) for s in pod.env_from)
            warnings.append(
                f"fsdp-replay: the recording redacted {names} and the recorded container set them from "
                f"no Secret key: the Job has its envFrom sources ({origins}), so they are set if they "
                "came from there; otherwise the replayed program runs without them"
            )
        else:
            warnings.append(
                f"fsdp-replay: the recording redacted {names} and does not know their source (no Secret "
                "or ConfigMap reference): the replayed program runs without them; add them to the Job "
                "(from a Secret) before applying it if it reads them"
            )
    return found


def _replayed(variable: str) -> bool:
    """Whether a replay sets ``variable`` as recorded: not one it drops, nor the machine's and the
    shell's (``schema.ENV_MACHINE``), which a replay leaves to where it runs."""
    return not (
        variable.startswith(NOT_REPLAYED)
        or variable in schema.ENV_MACHINE
        or variable.startswith(schema.ENV_MACHINE_PREFIXES)
    )


def _describe_source(source: Mapping[str, Any]) -> str:
    for kind in ("secretRef", "configMapRef"):
        if isinstance(source.get(kind), Mapping):
            return f"{kind.removesuffix('Ref')} {source[kind].get('name', '?')}"
    return "?"


# -- names and places ---------------------------------------------------------------------------
def default_name(pod_name: str | None, config: JobConfig) -> str:
    """``replay-<pod>-rank-<R>[-from-<S>][-to-<E>]`` (``-all-ranks``), a DNS label of at most 52
    characters; a long pod name is cut and a hash of the whole name keeps it unique."""
    who = "all-ranks" if config.all_ranks else f"rank-{config.rank}"
    tail = f"{who}" + (f"-from-{config.from_step}" if config.from_step else "")
    tail += f"-to-{config.to_step}" if config.to_step >= 0 else ""
    base = re.sub(r"[^a-z0-9-]+", "-", (pod_name or "trace").lower()).strip("-") or "trace"
    name = f"replay-{base}-{tail}"
    if len(name) <= MAX_NAME_CHARS:
        return name
    digest = f"{zlib.crc32(name.encode()):08x}"[:6]
    room = MAX_NAME_CHARS - len(f"replay--{digest}-{tail}")
    return f"replay-{base[: max(room, 1)].rstrip('-')}-{digest}-{tail}"


def default_report(trace_url: str, name: str) -> str:
    """``replays/<job name>`` beside the trace: in the same store, next to the local replays'."""
    trimmed = trace_url.rstrip("/")
    scheme, sep, path = trimmed.partition("://") if "://" in trimmed else ("", "", trimmed)
    # a trace at a bucket's root (s3://bucket): its replays go in the same bucket
    parent = posixpath.dirname(path) if "/" in path else path
    return f"{scheme}{sep}{parent.rstrip('/')}/{REPLAYS_DIR}/{name}"


def user_pythonpath(env: Mapping[str, str]) -> str | None:
    """The recorded ``PYTHONPATH`` less the agent's two folders, which the recording put first."""
    recorded = env.get("PYTHONPATH")
    if not recorded or schema.has_redacted(recorded):
        return None
    parts = recorded.split(":")
    if parts and parts[0].rstrip("/").endswith(str(containers.SITE_IN_LIB)):
        parts = parts[2:]
    return ":".join(parts) or None


def _recorded_command(meta: Mapping[str, Any], executable: str) -> list[str]:
    """The recorded command line as the replay runs it (``replayer/launch.py``): for the reader."""
    return [executable, *command.recorded_argv(meta)]


def _policy_warnings(meta: Mapping[str, Any], world: int) -> list[str]:
    policy = meta.get("policy") or {}
    if policy.get("payloads") != "none":
        return []
    return [
        "fsdp-replay: the trace holds no payloads (recorded with --payloads none): a rank cannot be "
        "replayed alone, so this Job's replays will stop with exit 3. Replay every rank live instead, "
        f"on a machine with {world} devices: fsdp-replay replay TRACE --all-ranks"
    ]


def _path_warnings(trace_url: str, report: str, config: JobConfig) -> list[str]:
    mounts = [c.partition(":")[2] for c in config.volume_claims]
    warnings = []
    for what, where in (("trace", trace_url), ("report", report)):
        if "://" in where or any(where == m or where.startswith(m + "/") for m in mounts):
            continue
        warnings.append(
            f"fsdp-replay: the {what} {where} is a local path: the Job's pod sees it only on a volume "
            "(--volume-claims CLAIM:/path) or in its image"
        )
    return warnings
