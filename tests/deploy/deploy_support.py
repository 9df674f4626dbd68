"""Helpers of the deploy tests: the chart rendered by the real Helm, object validation, Docker.

No API server can run here (docs/kubernetes.md, "Tested how"), so the chart is checked the way an
API server would take it: every object that ``helm template`` renders goes through
``kubernetes-validate --strict`` for the Kubernetes version it was rendered for, and the CRD kinds
it does not know (cert-manager, the Prometheus operator) through ``schemas/crd-subset.json``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import ssl
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from http.client import HTTPSConnection
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CHART = REPO / "helm" / "fsdp-replay"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
SCRIPTS = REPO / "scripts"
HELM_DEST = REPO / ".venv" / "cache" / "helm"
"""Where scripts/install-helm.sh puts helm: under the virtualenv's folder, outside its Python."""
INJECTOR_FIXTURES = REPO / "tests" / "injector" / "fixtures"
CRD_SCHEMAS = json.loads((HERE / "schemas" / "crd-subset.json").read_text())
KUBE_VERSIONS = ("1.28", "1.33")
"""1.28: native sidecars off by default (the injector adds a plain container); 1.33: native, GA."""
RELEASE = "fsdp-replay"
NAMESPACE = "fsdp-replay"
MONITORING_API = "monitoring.coreos.com/v1"
ARGS_DIRECTIVE = re.compile(r"^# helm-template-args:(.*)$", re.MULTILINE)
DOCKER = "/usr/bin/docker"
"""Debian's client, which has BuildKit; another docker earlier on PATH may lack buildx."""


# -- Helm ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Helm:
    """The real helm binary, with its cache, config and data folders in a temporary folder."""

    binary: Path
    env: Mapping[str, str]

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(self.binary), *args], env=dict(self.env), capture_output=True, text=True, timeout=120
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"helm {shlex.join(args)} exited {proc.returncode}:\n{proc.stderr}{proc.stdout}"
            )
        return proc

    def template(
        self,
        values: Path | None = None,
        kube_version: str = KUBE_VERSIONS[-1],
        *extra: str,
        chart: Path = CHART,
        check: bool = True,
    ) -> list[dict[str, Any]]:
        """The objects ``helm template`` renders (hooks and tests included), for ``kube_version``."""
        args = ["template", RELEASE, str(chart), "--namespace", NAMESPACE, "--kube-version", kube_version]
        if values is not None:
            args += ["-f", str(values), *scenario_args(values)]
        proc = self.run(*args, *extra, check=check)
        return [d for d in yaml.safe_load_all(proc.stdout) if d]


def scenario_args(values: Path) -> list[str]:
    """Extra ``helm template`` arguments a scenario asks for in a ``# helm-template-args:`` line
    (e.g. ``--api-versions monitoring.coreos.com/v1``: a cluster with the Prometheus operator)."""
    return [a for m in ARGS_DIRECTIVE.finditer(values.read_text()) for a in shlex.split(m.group(1))]


def scenario_id(values: Path) -> str:
    return values.name.removesuffix("-values.yaml")


def find(objects: Iterable[Mapping[str, Any]], kind: str, name: str | None = None) -> list[Mapping[str, Any]]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects: Iterable[Mapping[str, Any]], kind: str, name: str | None = None) -> Mapping[str, Any]:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def hook_events(obj: Mapping[str, Any]) -> set[str]:
    annotations = obj["metadata"].get("annotations") or {}
    return {e.strip() for e in annotations.get("helm.sh/hook", "").split(",") if e.strip()}


def container_env(container: Mapping[str, Any]) -> dict[str, str]:
    """A container's literal ``env`` values (``valueFrom`` entries left out)."""
    return {e["name"]: e["value"] for e in container.get("env") or [] if "value" in e}


def webhook_container(objects: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    deployment = one(objects, "Deployment")
    containers: list[Mapping[str, Any]] = deployment["spec"]["template"]["spec"]["containers"]
    (container,) = containers
    return container


# -- validation ---------------------------------------------------------------------------------
def validate(obj: Mapping[str, Any], kube_version: str) -> None:
    """``kubernetes-validate --strict`` for built-in kinds; our CRD subset for the others."""
    key = f"{obj['apiVersion']}/{obj['kind']}"
    where = f"{obj['kind']} {obj['metadata'].get('name')}"
    if key in CRD_SCHEMAS:
        try:
            jsonschema.validate(obj, CRD_SCHEMAS[key])
        except jsonschema.ValidationError as e:
            path = ".".join(str(p) for p in e.absolute_path)
            raise AssertionError(f"{where}: not a valid {key}: {path}: {e.message}") from None
        return
    try:
        kubernetes_validate.validate(dict(obj), kube_version, strict=True)
    except kubernetes_validate.SchemaNotFoundError:
        raise AssertionError(
            f"{where}: {key} is neither a Kubernetes {kube_version} kind nor in crd-subset.json"
        ) from None
    except kubernetes_validate.ValidationError as e:
        path = ".".join(str(p) for p in e.path)
        raise AssertionError(
            f"{where}: not valid for Kubernetes {kube_version}: {path}: {e.message}"
        ) from None


def restricted_violations(pod_spec: Mapping[str, Any]) -> list[str]:
    """What in a pod spec breaks the Pod Security Standards' "restricted" profile (the checks of the
    profile that a pod of this chart could fail: host namespaces and paths, privilege, capabilities,
    non-root, privilege escalation, seccomp)."""
    bad: list[str] = []
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod_spec.get(key):
            bad.append(key)
    bad += [f"hostPath volume {v['name']}" for v in pod_spec.get("volumes") or [] if "hostPath" in v]
    pod_sc = pod_spec.get("securityContext") or {}
    for c in [*(pod_spec.get("initContainers") or []), *pod_spec["containers"]]:
        sc = c.get("securityContext") or {}
        name = c["name"]
        if sc.get("privileged"):
            bad.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{name}: allowPrivilegeEscalation is not false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            bad.append(f"{name}: capabilities do not drop ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            bad.append(f"{name}: adds capabilities {caps['add']}")
        if not (sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))):
            bad.append(f"{name}: runAsNonRoot is not true")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            bad.append(f"{name}: runs as uid 0")
        seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            bad.append(f"{name}: seccompProfile is {seccomp}")
    return bad


def pod_specs(objects: Iterable[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """Every pod spec the chart runs: the Deployment's and Jobs' templates and the test Pods."""
    specs: dict[str, Mapping[str, Any]] = {}
    for o in objects:
        if o["kind"] in ("Deployment", "Job"):
            specs[f"{o['kind']} {o['metadata']['name']}"] = o["spec"]["template"]["spec"]
        elif o["kind"] == "Pod":
            specs[f"Pod {o['metadata']['name']}"] = o["spec"]
    return specs


# -- TLS client ---------------------------------------------------------------------------------
class ServiceConnection(HTTPSConnection):
    """HTTPS to 127.0.0.1:port, verifying the certificate for the Service's DNS name, as the API
    server does when it calls ``clientConfig.service``."""

    def __init__(self, service_host: str, port: int, context: ssl.SSLContext, timeout: float = 10.0) -> None:
        super().__init__(service_host, port, context=context, timeout=timeout)
        self._tls = context

    def connect(self) -> None:
        raw = socket.create_connection(("127.0.0.1", self.port), self.timeout)
        self.sock = self._tls.wrap_socket(raw, server_hostname=self.host)


def https(
    service_host: str, port: int, ca: Path, method: str, path: str, body: bytes | None = None
) -> tuple[int, bytes]:
    context = ssl.create_default_context(cafile=str(ca))
    conn = ServiceConnection(service_host, port, context)
    try:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def admission_review(pod: Mapping[str, Any], uid: str, namespace: str) -> dict[str, Any]:
    """An AdmissionReview v1 request for creating ``pod``, as the API server sends it."""
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "name": pod["metadata"]["name"],
            "namespace": namespace,
            "operation": "CREATE",
            "userInfo": {"username": "system:serviceaccount:kube-system:job-controller", "groups": []},
            "object": pod,
            "oldObject": None,
            "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }


# -- Docker -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Images:
    """The tags the ``images`` fixture built."""

    webhook: str
    sidecar: str
    agent: str
    agent_py313: str
    """The payload built on Debian trixie (Python 3.13), for a host whose Python is 3.11."""


def docker(
    *args: str, check: bool = True, timeout: float = 300, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DOCKER_BUILDKIT": "1"}
    proc = subprocess.run(
        [DOCKER, *args], env=env, capture_output=True, text=True, timeout=timeout, input=input
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"docker {shlex.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def wait_for(predicate: Any, timeout_s: float, what: str, interval_s: float = 0.1) -> None:
    deadline = time.monotonic() + timeout_s
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (OSError, ssl.SSLError) as e:
            last = e
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what} (last error: {last})")
