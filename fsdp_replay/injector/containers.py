"""What the injection adds to a pod: the payload copy, the sidecar, the volumes and the mounts.

Pure builders from the config and the pod's settings; ``mutate.py`` decides where they go.

Least privilege:

- The copy init container runs as an unprivileged user with every capability dropped, a read-only
  root filesystem and the runtime's seccomp profile: it only copies files into an emptyDir (created
  world-writable by the kubelet) and the copies stay world-readable, so any trainer user can import them.
- The sidecar needs CAP_BPF + CAP_PERFMON (eBPF uprobes on libnccl) and CAP_SYS_PTRACE (the trainers'
  ``/proc/<pid>/root`` and maps, under ``shareProcessNamespace``), nothing else: every other capability is
  dropped, it is never privileged and cannot gain privileges. It runs as uid 0 because Kubernetes gives
  added capabilities to root only (no ambient capabilities for other users). CAP_SYS_ADMIN is added only
  when the config says the nodes' kernels predate 5.8, where CAP_BPF and CAP_PERFMON do not exist; the
  API server then forbids ``allowPrivilegeEscalation: false``, so that field is left out.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence
from pathlib import PurePosixPath
from typing import Any

from fsdp_replay.boot.pythonpath import PACKAGE_DIR, SITE_DIR
from fsdp_replay.injector import validate
from fsdp_replay.injector.annotations import ENV_OUT, PodSettings
from fsdp_replay.injector.config import InjectorConfig

COPY_CONTAINER = "fsdp-replay-agent"
SIDECAR_CONTAINER = "fsdp-replay-sidecar"
OUR_CONTAINERS = frozenset({COPY_CONTAINER, SIDECAR_CONTAINER})
AGENT_VOLUME = "fsdp-replay-agent"
SPOOL_VOLUME = "fsdp-replay-spool"
SIDECAR_TMP_VOLUME = "fsdp-replay-tmp"
SIGNING_VOLUME = "fsdp-replay-signing-key"
OUR_VOLUMES = frozenset({AGENT_VOLUME, SPOOL_VOLUME, SIDECAR_TMP_VOLUME, SIGNING_VOLUME})
# The signing key Secret's item, and where the sidecar (and a replay Job) read it.
SIGNING_KEY_ITEM = "key"
SIGNING_KEY_DIR = "/var/run/fsdp-replay-signing"
SIGNING_KEY_FILE = f"{SIGNING_KEY_DIR}/{SIGNING_KEY_ITEM}"

# The agent payload image: `pip install --no-deps --target /fsdp-replay/lib .`
PAYLOAD_SOURCE = "/fsdp-replay"
PAYLOAD_LIB = "lib"
# In the copy container the emptyDir is mounted apart from the source, whatever mount_path is.
COPY_TARGET = "/fsdp-replay-target"
# Where our sitecustomize sits inside an installed package (fsdp_replay/boot/site), from the real tree.
SITE_IN_LIB = PurePosixPath(SITE_DIR.relative_to(PACKAGE_DIR.parent).as_posix())
SIDECAR_COMMAND = ("fsdp-replay", "sidecar")
SIDECAR_TMP = "/tmp"
METRICS_PORT_NAME = "fsdpr-metrics"  # an IANA service name: at most 15 characters
HEALTH_PATH = "/healthz"
SIDECAR_CAPABILITIES = ("BPF", "PERFMON", "SYS_PTRACE")
OLD_KERNEL_CAPABILITY = "SYS_ADMIN"
COPY_UID = 65532
# Requests equal limits, so a Guaranteed pod stays Guaranteed; copying a few MB needs no more.
COPY_RESOURCES = {"cpu": "100m", "memory": "64Mi"}

# The sidecar's environment (the contract with `fsdp-replay sidecar`).
SIDECAR_ENV_STORE = "FSDP_REPLAY_SIDECAR_STORE"
SIDECAR_ENV_METRICS_PORT = "FSDP_REPLAY_SIDECAR_METRICS_PORT"
SIDECAR_ENV_MODE = "FSDP_REPLAY_SIDECAR_MODE"
SIDECAR_ENV_CONTAINERS = "FSDP_REPLAY_SIDECAR_CONTAINERS"
SIDECAR_ENV_SIGNING_KEY = "FSDP_REPLAY_SIDECAR_SIGNING_KEY"
SIDECAR_ENV_FIELDS = (
    ("FSDP_REPLAY_SIDECAR_POD_NAME", "metadata.name"),
    ("FSDP_REPLAY_SIDECAR_POD_NAMESPACE", "metadata.namespace"),
    ("FSDP_REPLAY_SIDECAR_POD_UID", "metadata.uid"),
    ("FSDP_REPLAY_SIDECAR_NODE_NAME", "spec.nodeName"),
)


def agent_dirs(mount_path: str) -> tuple[str, str]:
    """(site dir, lib dir) of the copied payload, as ``boot.pythonpath.agent_pythonpath`` takes them."""
    lib = posixpath.join(mount_path, PAYLOAD_LIB)
    return posixpath.join(lib, str(SITE_IN_LIB)), lib


def volumes(config: InjectorConfig) -> list[dict[str, Any]]:
    """The emptyDirs: the agent payload, the spool (the run folder) and the sidecar's /tmp; and
    with a signing key, its Secret.

    No ``sizeLimit`` on the spool: exceeding one evicts the pod, which would kill the training run,
    while on a full disk the agent drops payloads first and keeps recording metadata.
    """
    out = [{"name": name, "emptyDir": {}} for name in (AGENT_VOLUME, SPOOL_VOLUME, SIDECAR_TMP_VOLUME)]
    if config.signing_key_secret:
        out.append(signing_volume(config.signing_key_secret))
    return out


def signing_volume(secret: str) -> dict[str, Any]:
    """The signing key's Secret as a volume. Optional: a missing Secret must not hold the pod back
    (the sidecar then collects unsigned traces and says so in its log)."""
    return {
        "name": SIGNING_VOLUME,
        "secret": {
            "secretName": secret,
            "items": [{"key": SIGNING_KEY_ITEM, "path": SIGNING_KEY_ITEM}],
            "defaultMode": 0o440,
            "optional": True,
        },
    }


SIGNING_MOUNT: dict[str, Any] = {"name": SIGNING_VOLUME, "mountPath": SIGNING_KEY_DIR, "readOnly": True}


def trainer_mounts(config: InjectorConfig) -> list[dict[str, Any]]:
    """Mounts for a recorded container: the payload (read-only, so nothing can change our code) and the spool."""
    return [
        {"name": AGENT_VOLUME, "mountPath": config.mount_path, "readOnly": True},
        {"name": SPOOL_VOLUME, "mountPath": config.spool_path},
    ]


def copy_container(config: InjectorConfig) -> dict[str, Any]:
    """The init container that copies the agent payload into the emptyDir."""
    return {
        "name": COPY_CONTAINER,
        "image": config.agent_image,
        "imagePullPolicy": config.image_pull_policy,
        # Without -p: the copies belong to the copying user and keep world-readable modes.
        "command": ["cp", "-R", f"{PAYLOAD_SOURCE}/.", f"{COPY_TARGET}/"],
        "volumeMounts": [{"name": AGENT_VOLUME, "mountPath": COPY_TARGET}],
        "resources": {"requests": dict(COPY_RESOURCES), "limits": dict(COPY_RESOURCES)},
        "securityContext": {
            "privileged": False,
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "runAsUser": COPY_UID,
            "runAsGroup": COPY_UID,
            "capabilities": {"drop": ["ALL"]},
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def sidecar_security_context(config: InjectorConfig) -> dict[str, Any]:
    add = [*SIDECAR_CAPABILITIES, *([OLD_KERNEL_CAPABILITY] if config.add_sys_admin else [])]
    context: dict[str, Any] = {"privileged": False}
    if not config.add_sys_admin:
        context["allowPrivilegeEscalation"] = False
    context.update(
        readOnlyRootFilesystem=True,
        runAsUser=0,
        runAsNonRoot=False,
        capabilities={"drop": ["ALL"], "add": add},
    )
    return context


def sidecar_resources(config: InjectorConfig, guaranteed: bool) -> dict[str, Any]:
    """Requests and limits from the config; in a Guaranteed pod both equal the limit (else the request).

    A Guaranteed pod would otherwise drop to Burstable, losing the exclusive CPUs that the kubelet's
    static CPU manager gives it: recording must not change how the trainer runs.
    """
    requests = {"cpu": config.sidecar_cpu_request, "memory": config.sidecar_memory_request}
    limits = {"cpu": config.sidecar_cpu_limit, "memory": config.sidecar_memory_limit}
    if guaranteed:
        both = {k: limits[k] or requests[k] or COPY_RESOURCES[k] for k in ("cpu", "memory")}
        return {"requests": both, "limits": dict(both)}
    resources = {
        key: {k: v for k, v in values.items() if v}
        for key, values in (("requests", requests), ("limits", limits))
    }
    return {k: v for k, v in resources.items() if v}


def sidecar_container(
    config: InjectorConfig, settings: PodSettings, recorded: Sequence[str], *, guaranteed: bool
) -> dict[str, Any]:
    """The sidecar: spool -> trace, eBPF on libnccl, ``/metrics`` and ``/healthz`` on ``settings.metrics_port``."""
    native = config.native_sidecar
    env: list[dict[str, Any]] = [
        {"name": ENV_OUT, "value": config.spool_path},
        {"name": SIDECAR_ENV_METRICS_PORT, "value": str(settings.metrics_port)},
        # container: nothing stops a plain sidecar when the trainers end, so it must exit by itself
        # once the recorded containers' processes are gone, or a Job's pod never completes.
        {"name": SIDECAR_ENV_MODE, "value": "native" if native else "container"},
        {"name": SIDECAR_ENV_CONTAINERS, "value": ",".join(recorded)},
    ]
    if settings.store:
        env.append({"name": SIDECAR_ENV_STORE, "value": settings.store})
    if config.signing_key_secret:
        env.append({"name": SIDECAR_ENV_SIGNING_KEY, "value": SIGNING_KEY_FILE})
    env += [{"name": n, "valueFrom": {"fieldRef": {"fieldPath": p}}} for n, p in SIDECAR_ENV_FIELDS]

    def probe(**timing: int) -> dict[str, Any]:  # a fresh dict each: no shared objects in the pod
        return {"httpGet": {"path": HEALTH_PATH, "port": METRICS_PORT_NAME}, "timeoutSeconds": 5, **timing}

    container: dict[str, Any] = {
        "name": SIDECAR_CONTAINER,
        "image": config.sidecar_image,
        "imagePullPolicy": config.image_pull_policy,
        "command": list(SIDECAR_COMMAND),
    }
    if native:
        container["restartPolicy"] = "Always"
    container["env"] = env
    if settings.store_secret:
        # The credentials stay in their Secret; optional, so a missing Secret cannot block the pod's
        # start (a native sidecar that cannot be created holds back every container after it).
        container["envFrom"] = [{"secretRef": {"name": settings.store_secret, "optional": True}}]
    container.update(
        ports=[{"name": METRICS_PORT_NAME, "containerPort": settings.metrics_port, "protocol": "TCP"}],
        readinessProbe=probe(periodSeconds=10, failureThreshold=3),
        livenessProbe=probe(initialDelaySeconds=10, periodSeconds=20, failureThreshold=6),
        resources=sidecar_resources(config, guaranteed),
        volumeMounts=[
            {"name": SPOOL_VOLUME, "mountPath": config.spool_path},
            {"name": SIDECAR_TMP_VOLUME, "mountPath": SIDECAR_TMP},
            *([dict(SIGNING_MOUNT)] if config.signing_key_secret else []),
        ],
        securityContext=sidecar_security_context(config),
        terminationMessagePolicy="FallbackToLogsOnError",
    )
    return container


def is_guaranteed(spec: Mapping[str, Any]) -> bool:
    """Whether the pod's QoS class is Guaranteed: every container, init ones included, has CPU and
    memory limits, and requests (which default to the limits) equal to them."""
    everything = [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]
    for container in everything:
        resources = (container.get("resources") if isinstance(container, Mapping) else None) or {}
        limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
        for kind in ("cpu", "memory"):
            limit = validate.parse_quantity(limits.get(kind))
            if limit is None or validate.parse_quantity(requests.get(kind, limits[kind])) != limit:
                return False
    return bool(everything)
