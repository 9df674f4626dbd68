"""Where the pod templates are in the workload kinds ``inject -f`` understands.

A template has a pod's shape (``metadata`` and ``spec``), so the injection of a Deployment, a Job or a
Kubeflow PyTorchJob is the injection of each of its templates. Kinds are matched with their API group,
so another project's CRD that happens to be called ``Job`` is left alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Tokens = tuple[str | int, ...]

# (API group, kind) -> the template's path in the object ("" is the core group).
_FIXED: dict[tuple[str, str], Tokens] = {
    ("", "Pod"): (),
    ("", "PodTemplate"): ("template",),
    ("", "ReplicationController"): ("spec", "template"),
    ("apps", "Deployment"): ("spec", "template"),
    ("apps", "StatefulSet"): ("spec", "template"),
    ("apps", "DaemonSet"): ("spec", "template"),
    ("apps", "ReplicaSet"): ("spec", "template"),
    ("batch", "Job"): ("spec", "template"),
    ("batch", "CronJob"): ("spec", "jobTemplate", "spec", "template"),
}
# Kubeflow training operators: spec.<replica specs>.<role>.template
_KUBEFLOW_REPLICA_SPECS = {"PyTorchJob": "pytorchReplicaSpecs", "MPIJob": "mpiReplicaSpecs"}
KUBEFLOW_GROUP = "kubeflow.org"
JOBSET_GROUP = "jobset.x-k8s.io"


def group_of(doc: Mapping[str, Any]) -> str:
    api_version = str(doc.get("apiVersion", ""))
    return api_version.split("/", 1)[0] if "/" in api_version else ""


def is_list(doc: Mapping[str, Any]) -> bool:
    """A ``v1 List`` or any ``<Kind>List`` as ``kubectl get -o yaml`` prints it."""
    return str(doc.get("kind", "")).endswith("List") and isinstance(doc.get("items"), list)


def pod_templates(doc: Any) -> list[Tokens]:
    """The paths (as tokens) of every pod template in ``doc``; empty for kinds without one."""
    if not isinstance(doc, Mapping):
        return []
    if is_list(doc):
        return [("items", i, *t) for i, item in enumerate(doc["items"]) for t in pod_templates(item)]
    group, kind = group_of(doc), str(doc.get("kind", ""))
    if (group, kind) in _FIXED:
        tokens = _FIXED[(group, kind)]
        return [tokens] if _is_template(_resolve(doc, tokens)) else []
    spec = doc.get("spec")
    if not isinstance(spec, Mapping):
        return []
    found: list[Tokens] = []
    if group == KUBEFLOW_GROUP and kind in _KUBEFLOW_REPLICA_SPECS:
        field = _KUBEFLOW_REPLICA_SPECS[kind]
        replicas = spec.get(field)
        if isinstance(replicas, Mapping):
            found = [("spec", field, role, "template") for role in replicas]
    elif group == JOBSET_GROUP and kind == "JobSet":
        jobs = spec.get("replicatedJobs")
        if isinstance(jobs, list):
            found = [("spec", "replicatedJobs", i, "template", "spec", "template") for i in range(len(jobs))]
    return [t for t in found if _is_template(_resolve(doc, t))]


def resolve(doc: Any, tokens: Tokens) -> Any:
    """The value at ``tokens`` (which ``pod_templates`` returned for ``doc``)."""
    value = _resolve(doc, tokens)
    assert value is not None, f"no template at {tokens}"
    return value


def _resolve(doc: Any, tokens: Tokens) -> Any:
    for t in tokens:
        if isinstance(t, int):
            if not isinstance(doc, list) or t >= len(doc):
                return None
        elif not isinstance(doc, Mapping) or t not in doc:
            return None
        doc = doc[t]
    return doc


def _is_template(value: Any) -> bool:
    return isinstance(value, Mapping) and isinstance(value.get("spec"), Mapping)
