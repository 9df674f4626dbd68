"""The injection itself: a pod in, JSON Patch operations and warnings out. Pure: no I/O, no clock.

For a pod that opts in (``annotations.py``), the patch adds

1. the copy init container (``containers.copy_container``). It goes after the user's init containers,
   so their order and behaviour stay as written, unless one of them is recorded: then it goes right
   before the first recorded one, which needs the payload when it starts;
2. the emptyDirs: agent payload, spool, sidecar /tmp;
3. in every recorded container: the two mounts, ``PYTHONPATH`` by ``boot.pythonpath.agent_pythonpath``
   (the user's value kept after ours), the ``FSDP_REPLAY_*`` variables the user has not set
   (the user's own values win), and the container's identity for replay Jobs (``identity.py``);
4. the sidecar, as a native sidecar (last init container, ``restartPolicy: Always``) or a plain container;
5. ``shareProcessNamespace: true``, so the sidecar sees the trainers' processes;
6. the Prometheus scrape annotations (unless the pod has its own) and the status annotations.

Operations on the user's existing entries come first, by their original index; insertions follow,
so no index moves under an operation that uses it. A pod that is already injected (status annotation
or one of our containers present) gets no operation, so injecting twice equals injecting once.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from fsdp_replay import __version__
from fsdp_replay.boot.pythonpath import agent_pythonpath
from fsdp_replay.injector import annotations as ann
from fsdp_replay.injector import containers as ours
from fsdp_replay.injector import patch, templates, validate
from fsdp_replay.injector.config import InjectorConfig
from fsdp_replay.injector.errors import InjectionError
from fsdp_replay.injector.identity import identity_env
from fsdp_replay.injector.patch import Op

PYTHONPATH = "PYTHONPATH"
POD_PATH_SEP = ":"  # pods are Linux: the webhook's own os.pathsep is irrelevant
PREFIX = "fsdp-replay: "  # of every warning, as kubectl shows them among others


def mutate(
    pod: Mapping[str, Any], namespace: str, config: InjectorConfig, *, namespace_default: bool = False
) -> tuple[list[Op], list[str]]:
    """The JSON Patch that injects recording into ``pod``, and warnings for the user.

    ``namespace_default``: the pod's namespace opted in (the label), so a pod without the annotation
    is recorded too. Raises :class:`InjectionError` for a pod whose shape it cannot patch.
    """
    where = _describe(pod, namespace)
    keys = ann.Keys(config.annotation_prefix)
    metadata = _mapping(pod.get("metadata"), "metadata", where)
    annotations = _mapping(metadata.get("annotations"), "metadata.annotations", where)
    record, warning = ann.opt_in(annotations, keys, namespace_default)
    warnings = [warning] if warning else []
    if not record:
        return [], warnings
    spec = _mapping(pod.get("spec"), "spec", where)
    regular = _containers(spec, "containers", where)
    inits = _containers(spec, "initContainers", where)
    if keys(ann.INJECTED) in annotations or any(c["name"] in ours.OUR_CONTAINERS for c in regular + inits):
        return [], warnings
    settings, more = ann.pod_settings(annotations, keys, config)
    warnings += more
    selected = _select(settings, regular, inits, warnings)
    if not selected:
        return [], [*warnings, "fsdp-replay: no container to record; pod left unchanged"]
    if (conflict := _conflict(spec, selected, regular + inits, config, settings)) is not None:
        return [], [*warnings, f"fsdp-replay: not injected: {conflict}"]

    ops: list[Op] = []
    for field, index, container in selected:
        identity = identity_env(spec, container, settings.store_secret)
        ops += _container_ops(
            patch.pointer("spec", field, index), container, config, settings, identity, warnings
        )
    ops += _appended(spec, "volumes", ours.volumes(config))
    recorded = [c["name"] for _, _, c in selected]
    sidecar = ours.sidecar_container(config, settings, recorded, guaranteed=ours.is_guaranteed(spec))
    first_recorded_init = min((i for f, i, _ in selected if f == "initContainers"), default=None)
    copier = ours.copy_container(config)
    if "initContainers" not in spec or spec["initContainers"] is None:
        ops.append(patch.add("/spec/initContainers", [copier, *([sidecar] if config.native_sidecar else [])]))
    else:
        at = "-" if first_recorded_init is None else first_recorded_init
        ops.append(patch.add(patch.pointer("spec", "initContainers", at), copier))
        if config.native_sidecar:
            ops.append(patch.add("/spec/initContainers/-", sidecar))
    if not config.native_sidecar:
        ops.append(patch.add("/spec/containers/-", sidecar))
    ops += _process_namespace_ops(spec, warnings)
    ops += _annotation_ops(pod, annotations, keys, config, settings, recorded, warnings)
    return ops, warnings


def mutate_template(
    obj: Mapping[str, Any], config: InjectorConfig, *, namespace_default: bool = False
) -> tuple[Any, list[str]]:
    """A copy of a manifest (Pod, Deployment, StatefulSet, DaemonSet, Job, CronJob, PyTorchJob, MPIJob,
    JobSet, or a List of them) with every pod template injected, and the warnings.

    A template that cannot be injected is left as it was, with a warning (as the webhook would).
    Other kinds come back unchanged.
    """
    doc = copy.deepcopy(obj)
    warnings: list[str] = []
    for tokens in templates.pod_templates(doc):
        template = templates.resolve(doc, tokens)
        in_list = tokens[:1] == ("items",)
        owner = templates.resolve(doc, tokens[:2]) if in_list else doc
        meta = _mapping(owner.get("metadata"), "metadata", "?")
        inner = tokens[2:] if in_list else tokens
        label = f"{owner.get('kind', '?')}/{meta.get('name', '?')}" + (
            f" {patch.pointer(*inner)}" if inner else ""
        )
        try:
            namespace = str(meta.get("namespace", ""))
            ops, found = mutate(template, namespace, config, namespace_default=namespace_default)
        except InjectionError as e:
            warnings.append(f"{PREFIX}{label}: not injected: {e}")
            continue
        patch.apply(template, ops)
        warnings += [f"{PREFIX}{label}: {w.removeprefix(PREFIX)}" for w in found]
    return doc, warnings


# -- one recorded container ---------------------------------------------------------------------
def _container_ops(
    path: str,
    container: Mapping[str, Any],
    config: InjectorConfig,
    settings: ann.PodSettings,
    identity: Sequence[dict[str, Any]],
    warnings: list[str],
) -> list[Op]:
    name = container["name"]
    env = container.get("env")
    if env is not None and not isinstance(env, list):
        raise InjectionError(f"container {name}: env is not a list")
    defined: dict[str, tuple[int, Mapping[str, Any]]] = {}  # the last definition is the effective one
    for i, entry in enumerate(env or []):
        if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
            raise InjectionError(f"container {name}: env[{i}] has no name")
        defined[entry["name"]] = (i, entry)

    ops: list[Op] = []
    added: list[dict[str, Any]] = []
    for variable, value in settings.agent_env:
        if variable == ann.ENV_PAYLOADS:
            value = validate.pod_payloads(value, container)
        if variable not in defined:
            added.append({"name": variable, "value": value})
            continue
        theirs = defined[variable][1]
        if "valueFrom" in theirs:
            continue
        if variable == ann.ENV_MODE and theirs.get("value") != "record":
            warnings.append(
                f"fsdp-replay: container {name} sets {variable}={theirs.get('value')!r}: not recorded"
            )
        if variable == ann.ENV_OUT and theirs.get("value") != config.spool_path:
            warnings.append(
                f"fsdp-replay: container {name} sets {variable}={theirs.get('value')!r}, outside the "
                "spool volume: the sidecar will not collect it"
            )
    site_dir, lib_dir = ours.agent_dirs(config.mount_path)
    if PYTHONPATH not in defined:
        added.append(
            {"name": PYTHONPATH, "value": agent_pythonpath(site_dir, lib_dir, None, sep=POD_PATH_SEP)}
        )
    else:
        index, theirs = defined[PYTHONPATH]
        if "valueFrom" in theirs:
            # Unreadable at admission: keep it as it is rather than guess.
            warnings.append(
                f"fsdp-replay: container {name}: PYTHONPATH from valueFrom kept; the agent loads "
                f"only if it starts with {site_dir}{POD_PATH_SEP}{lib_dir}"
            )
        else:
            current = str(theirs.get("value") or "")
            value = agent_pythonpath(site_dir, lib_dir, current, sep=POD_PATH_SEP)
            if value != current:
                ops.append(patch.add(f"{path}/env/{index}/value", value))
    # Where the container runs, for a replay Job made from its trace (identity.py); a value the
    # user set is theirs, as for the agent's variables.
    added += [entry for entry in identity if entry["name"] not in defined]
    if container.get("envFrom"):
        warnings.append(
            f"fsdp-replay: container {name} uses envFrom: a PYTHONPATH or FSDP_REPLAY_* there is "
            "overridden by the injected env"
        )
    ops += _appended(container, "env", added, path)
    mounts = container.get("volumeMounts")
    if mounts is not None and not isinstance(mounts, list):
        raise InjectionError(f"container {name}: volumeMounts is not a list")
    ops += _appended(container, "volumeMounts", ours.trainer_mounts(config), path)
    return ops


# -- which containers, and whether the pod leaves room for ours ---------------------------------
def _select(
    settings: ann.PodSettings,
    regular: Sequence[Mapping[str, Any]],
    inits: Sequence[Mapping[str, Any]],
    warnings: list[str],
) -> list[tuple[str, int, Mapping[str, Any]]]:
    """(field, index, container) of each recorded container: the named ones, else every regular one."""
    everything = [("containers", i, c) for i, c in enumerate(regular)]
    everything += [("initContainers", i, c) for i, c in enumerate(inits)]
    if settings.containers is None:
        return [item for item in everything if item[0] == "containers"]
    known = {c["name"] for _, _, c in everything}
    if missing := [n for n in settings.containers if n not in known]:
        warnings.append(f"fsdp-replay: no container named {', '.join(missing)} in the pod")
    return [item for item in everything if item[2]["name"] in settings.containers]


def _conflict(
    spec: Mapping[str, Any],
    selected: Sequence[tuple[str, int, Mapping[str, Any]]],
    everything: Sequence[Mapping[str, Any]],
    config: InjectorConfig,
    settings: ann.PodSettings,
) -> str | None:
    """Why the injection would make the pod invalid or break it, or None."""
    volumes = spec.get("volumes") or []
    if not isinstance(volumes, list):
        raise InjectionError("spec.volumes is not a list")
    taken = {str(v.get("name")) for v in volumes if isinstance(v, Mapping)} & ours.OUR_VOLUMES
    if taken:
        return f"the pod already has a volume named {', '.join(sorted(taken))}"
    our_paths = {config.mount_path, config.spool_path}
    for _, _, container in selected:
        for mount in container.get("volumeMounts") or []:
            if isinstance(mount, Mapping) and str(mount.get("mountPath", "")).rstrip("/") in our_paths:
                return f"container {container['name']} already mounts something at {mount['mountPath']}"
    for container in everything:
        for port in container.get("ports") or []:
            if isinstance(port, Mapping) and port.get("containerPort") == settings.metrics_port:
                return (
                    f"container {container['name']} uses port {settings.metrics_port}; choose the sidecar's "
                    f"with the annotation {config.annotation_prefix}/{ann.METRICS_PORT}"
                )
    return None


# -- pod-level fields ---------------------------------------------------------------------------
def _process_namespace_ops(spec: Mapping[str, Any], warnings: list[str]) -> list[Op]:
    if spec.get("hostPID") is True:
        return []  # the API forbids both; with hostPID the sidecar sees the node's processes anyway
    share = spec.get("shareProcessNamespace")
    if share is None:
        return [patch.add("/spec/shareProcessNamespace", True)]
    if share is False:
        warnings.append(
            "fsdp-replay: shareProcessNamespace: false is kept; the sidecar cannot see the trainers' "
            "processes (no eBPF, no process metrics)"
        )
    return []


def _annotation_ops(
    pod: Mapping[str, Any],
    annotations: Mapping[str, Any],
    keys: ann.Keys,
    config: InjectorConfig,
    settings: ann.PodSettings,
    recorded: Sequence[str],
    warnings: list[str],
) -> list[Op]:
    new: dict[str, str] = {}
    if any(str(k).startswith(ann.PROMETHEUS_PREFIX) for k in annotations):
        warnings.append(
            "fsdp-replay: the pod's own prometheus.io annotations are kept; scrape the sidecar on "
            f"its port {ours.METRICS_PORT_NAME} (e.g. with a PodMonitor)"
        )
    else:
        new[ann.PROMETHEUS_SCRAPE] = "true"
        new[ann.PROMETHEUS_PORT] = str(settings.metrics_port)
        new[ann.PROMETHEUS_PATH] = ann.METRICS_PATH
    new[keys(ann.INJECTED)] = __version__
    new[keys(ann.INJECTED_CONTAINERS)] = ",".join(recorded)
    new[keys(ann.SIDECAR_MODE)] = "native" if config.native_sidecar else "container"
    if pod.get("metadata") is None:
        return [patch.add("/metadata", {"annotations": new})]
    if pod["metadata"].get("annotations") is None:
        return [patch.add("/metadata/annotations", new)]
    return [patch.add(patch.pointer("metadata", "annotations", k), v) for k, v in new.items()]


# -- shapes -------------------------------------------------------------------------------------
def _appended(owner: Mapping[str, Any], field: str, items: Sequence[Any], path: str = "/spec") -> list[Op]:
    """Add ``items`` at the end of ``owner[field]``, creating the list when it is missing (or null)."""
    if not items:
        return []
    if owner.get(field) is None:
        return [patch.add(f"{path}/{field}", list(items))]
    return [patch.add(f"{path}/{field}/-", item) for item in items]


def _mapping(value: Any, what: str, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InjectionError(f"{where}: {what} is not an object")
    return value


def _containers(spec: Mapping[str, Any], field: str, where: str) -> list[Mapping[str, Any]]:
    value = spec.get(field)
    if value is None:
        if field == "containers":
            raise InjectionError(f"{where}: spec.containers is missing")
        return []
    if not isinstance(value, list):
        raise InjectionError(f"{where}: spec.{field} is not a list")
    for i, c in enumerate(value):
        if not isinstance(c, Mapping) or not isinstance(c.get("name"), str):
            raise InjectionError(f"{where}: spec.{field}[{i}] is not a container with a name")
    return value


def _describe(pod: Mapping[str, Any], namespace: str) -> str:
    meta = pod.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    name = meta.get("name") or (f"{meta['generateName']}*" if meta.get("generateName") else "(unnamed)")
    return f"pod {namespace}/{name}" if namespace else f"pod {name}"
