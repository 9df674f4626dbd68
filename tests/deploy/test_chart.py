"""The Helm chart, rendered by the real Helm 3 for every ci/ scenario and Kubernetes 1.28 and 1.33.

Every rendered object is validated strictly for the version it was rendered for; the registration
is compared with the injector's fixture; the webhook's environment is parsed by the injector's own
config class; the certgen script is run for real (openssl) in its dry-run mode.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import fields
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from deploy_support import (
    CHART,
    CI_VALUES,
    INJECTOR_FIXTURES,
    KUBE_VERSIONS,
    MONITORING_API,
    NAMESPACE,
    RELEASE,
    Helm,
    container_env,
    find,
    hook_events,
    one,
    pod_specs,
    restricted_violations,
    scenario_id,
    validate,
    webhook_container,
)

from fsdp_replay.injector.config import InjectorConfig, env_name
from fsdp_replay.injector.server import ROUTES

SCENARIOS = {scenario_id(p): p for p in CI_VALUES}
DEFAULT = CHART / "ci" / "default-values.yaml"
MATRIX = [
    pytest.param(path, v, id=f"{scenario_id(path)}-k8s{v}") for path in CI_VALUES for v in KUBE_VERSIONS
]
SERVICE_DNS = f"{RELEASE}-webhook.{NAMESPACE}.svc"


def test_scenarios_exist() -> None:
    expected = {
        "default", "cert-manager", "cert-manager-issuer", "monitoring", "monitoring-forced",
        "namespace-opt-in", "custom-images", "old-kernels", "pinned-version",
    }  # fmt: skip
    assert expected <= set(SCENARIOS)


@pytest.mark.parametrize(("values", "kube_version"), MATRIX)
def test_lint_strict(helm: Helm, values: Path, kube_version: str) -> None:
    proc = helm.run("lint", "--strict", str(CHART), "-f", str(values), "--kube-version", f"{kube_version}.0")
    assert "0 chart(s) failed" in proc.stdout, proc.stdout


@pytest.mark.parametrize(("values", "kube_version"), MATRIX)
def test_every_rendered_object_is_valid(helm: Helm, values: Path, kube_version: str) -> None:
    objects = helm.template(values, f"{kube_version}.0")
    kinds = Counter(o["kind"] for o in objects)
    assert kinds["Deployment"] == kinds["Service"] == kinds["MutatingWebhookConfiguration"] == 1, kinds
    for obj in objects:
        validate(obj, kube_version)
        labels = obj["metadata"].get("labels") or {}
        assert labels.get("app.kubernetes.io/instance") == RELEASE, obj["metadata"]["name"]
        assert len(obj["metadata"]["name"]) <= 63, obj["metadata"]["name"]
        if obj["kind"] not in ("MutatingWebhookConfiguration", "ClusterRole", "ClusterRoleBinding"):
            assert obj["metadata"]["namespace"] == NAMESPACE, obj["metadata"]["name"]
    names = Counter((o["kind"], o["metadata"]["name"]) for o in objects)
    assert max(names.values()) == 1, names
    # The chart's own pods may run in a namespace that enforces Pod Security "restricted".
    for what, spec in pod_specs(objects).items():
        assert restricted_violations(spec) == [], what


@pytest.mark.parametrize(("values", "kube_version"), MATRIX)
def test_webhook_env_is_every_injector_option_and_parses(helm: Helm, values: Path, kube_version: str) -> None:
    """The Deployment sets every FSDP_REPLAY_INJECTOR_* variable, and the injector accepts them."""
    objects = helm.template(values, f"{kube_version}.0")
    env = container_env(webhook_container(objects))
    assert set(env) == {env_name(f.name) for f in fields(InjectorConfig)}
    config = InjectorConfig.from_env(env)
    scenario = yaml.safe_load(values.read_text()) or {}
    injection = scenario.get("injection", {})
    if "kubernetesVersion" in injection:
        assert config.kubernetes_version == injection["kubernetesVersion"]
    else:  # from .Capabilities.KubeVersion
        assert config.kubernetes_version == f"v{kube_version}.0"
    native = injection.get("sidecarMode", "auto") != "container" and (
        config.kubernetes_version.lstrip("v").split(".")[:2] != ["1", "28"]
    )
    assert config.native_sidecar is native
    container = webhook_container(objects)
    assert config.port == container["ports"][0]["containerPort"]
    assert (config.tls_cert_file, config.tls_key_file) == ("/tls/tls.crt", "/tls/tls.key")
    mount = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mount["tls"] == "/tls"


def test_images_references(helm: Helm) -> None:
    default = container_env(webhook_container(helm.template(DEFAULT)))
    assert default[env_name("agent_image")] == "fsdp-replay/agent:0.1.0"
    assert default[env_name("sidecar_image")] == "fsdp-replay/sidecar:0.1.0"
    objects = helm.template(SCENARIOS["custom-images"])
    env = container_env(webhook_container(objects))
    assert env[env_name("agent_image")] == (
        "registry.example.com/ml-platform/fsdp-replay-agent@sha256:" + "1" * 64
    )  # a digest wins over the tag
    assert (
        env[env_name("sidecar_image")] == "registry.example.com/ml-platform/fsdp-replay-sidecar:0.1.0-custom"
    )
    assert webhook_container(objects)["image"].startswith(
        "registry.example.com/ml-platform/fsdp-replay-webhook@sha256:"
    )
    for job in find(objects, "Job"):
        assert (
            job["spec"]["template"]["spec"]["containers"][0]["image"]
            == "registry.example.com/ml-platform/certgen:3"
        )
    deployment = one(objects, "Deployment")
    assert deployment["spec"]["template"]["spec"]["imagePullSecrets"] == [{"name": "registry-credentials"}]
    assert webhook_container(objects)["resources"]["limits"] == {"cpu": "1", "memory": "256Mi"}
    sidecar_env = container_env(webhook_container(objects))
    assert (sidecar_env[env_name("sidecar_cpu_limit")], sidecar_env[env_name("sidecar_memory_limit")]) == (
        "2",
        "4Gi",
    )


def _without_ca_bundle(entry: dict[str, Any]) -> dict[str, Any]:
    entry = json.loads(json.dumps(entry))
    entry["clientConfig"].pop("caBundle", None)
    return entry


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_registration_is_the_injectors(helm: Helm, kube_version: str) -> None:
    """The two entries of tests/injector/fixtures/webhook-configuration.yaml, failing open, pointing at
    the chart's Service and at routes the server has; the chart adds only a matchCondition."""
    objects = helm.template(DEFAULT, f"{kube_version}.0")
    mwc = one(objects, "MutatingWebhookConfiguration")
    fixture = yaml.safe_load((INJECTOR_FIXTURES / "webhook-configuration.yaml").read_text())
    assert mwc["metadata"]["name"] == fixture["metadata"]["name"]
    rendered = [dict(w) for w in mwc["webhooks"]]
    assert [w["name"] for w in rendered] == [w["name"] for w in fixture["webhooks"]]
    for got, want in zip(rendered, fixture["webhooks"], strict=True):
        assert got["failurePolicy"] == "Ignore" and got["sideEffects"] == "None"
        assert got["admissionReviewVersions"] == ["v1"]
        extra = got.pop("matchConditions", None)
        assert _without_ca_bundle(got) == _without_ca_bundle(want)
        if got["name"] == "pods.fsdp-replay.io":
            assert extra == [
                {
                    "name": "has-record-annotation",
                    "expression": "has(object.metadata.annotations) && "
                    "'fsdp-replay.io/record' in object.metadata.annotations",
                }
            ]
        else:
            assert extra is None  # every pod of a labelled namespace is sent
        assert got["clientConfig"]["service"]["path"] in ROUTES
    service = one(objects, "Service")
    (port,) = service["spec"]["ports"]
    for entry in rendered:
        assert entry["clientConfig"]["service"]["name"] == service["metadata"]["name"]
        assert entry["clientConfig"]["service"]["port"] == port["port"]
    assert port["targetPort"] == webhook_container(objects)["ports"][0]["name"]
    selector = service["spec"]["selector"]
    pod_labels = one(objects, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items()


def test_namespace_opt_in_only(helm: Helm) -> None:
    mwc = one(helm.template(SCENARIOS["namespace-opt-in"]), "MutatingWebhookConfiguration")
    (entry,) = mwc["webhooks"]
    assert entry["clientConfig"]["service"]["path"] == "/mutate/namespace-default"
    expressions = entry["namespaceSelector"]["matchExpressions"]
    assert {"key": "fsdp-replay.io/record", "operator": "In", "values": ["enabled"]} in expressions
    excluded = next(e for e in expressions if e["key"] == "kubernetes.io/metadata.name")
    assert excluded == {
        "key": "kubernetes.io/metadata.name",
        "operator": "NotIn",
        "values": ["kube-system", "kube-public", "monitoring", NAMESPACE],
    }
    assert "matchConditions" not in entry


def test_options_reach_the_registration(helm: Helm) -> None:
    objects = helm.template(
        DEFAULT,
        "1.33.0",
        "--set", "registration.timeoutSeconds=12",
        "--set", "injection.annotationPrefix=ml.example.com",
        "--set-json", 'registration.objectSelector={"matchLabels":{"team":"ml"}}',
        "--set-json", "registration.excludePodSecurityLevels=[]",
    )  # fmt: skip
    for entry in one(objects, "MutatingWebhookConfiguration")["webhooks"]:
        assert entry["timeoutSeconds"] == 12
        assert entry["objectSelector"] == {"matchLabels": {"team": "ml"}}
        keys = [e["key"] for e in entry["namespaceSelector"]["matchExpressions"]]
        assert keys == ["ml.example.com/record", "kubernetes.io/metadata.name"]
        for condition in entry.get("matchConditions", []):
            assert "'ml.example.com/record' in" in condition["expression"]
    assert container_env(webhook_container(objects))[env_name("annotation_prefix")] == "ml.example.com"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set-string", "webhook.port=8443"], "at '/webhook/port': got string, want integer"),
        (["--set", "webhook.replica=2"], "additional properties 'replica' not allowed"),
        (["--set", "injection.agentImage.digest=sha256:abc"], "/injection/agentImage/digest"),
        (["--set", "registration.timeoutSeconds=31"], "/registration/timeoutSeconds"),
        (["--set", "injection.payloads=sometimes"], "/injection/payloads"),
        (["--set", "injection.sidecarMode=always"], "/injection/sidecarMode"),
        (
            ["--set", "injection.sidecarResources.limits.memory=lots"],
            "/injection/sidecarResources/limits/memory",
        ),
        (["--set", "injection.mountPath=relative/path"], "/injection/mountPath"),
        (["--set", "certManager.issuerRef.kind=Vault"], "/certManager/issuerRef/kind"),
        (["--set", "certManager.duration=1year"], "/certManager/duration"),
        (
            ["--set", "registration.excludePodSecurityLevels[0]=strict"],
            "/registration/excludePodSecurityLevels/0",
        ),
        (["--set", "injection.metricsPort=70000"], "/injection/metricsPort"),
    ],
    ids=lambda v: v[1].split("=")[0] if isinstance(v, list) else None,
)
def test_schema_rejects_bad_values(helm: Helm, args: list[str], message: str) -> None:
    proc = helm.run("template", RELEASE, str(CHART), "--kube-version", "1.33.0", *args, check=False)
    assert proc.returncode != 0
    assert "values don't meet the specifications of the schema" in proc.stderr
    assert message in proc.stderr, proc.stderr


def test_every_value_is_in_the_schema_and_commented() -> None:
    """values.yaml and values.schema.json describe the same keys, and every key has a comment."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"

    def walk(value: Any, node: dict[str, Any], path: str) -> None:
        assert "description" in node, f"{path}: no description in the schema"
        if isinstance(value, dict) and node.get("additionalProperties") is False:
            assert set(value) <= set(node["properties"]), f"{path}: {set(value) - set(node['properties'])}"
            for key in node.get("required", []):
                assert key in value, f"{path}.{key}: required by the schema, absent from values.yaml"
            for key, sub in value.items():
                walk(sub, node["properties"][key], f"{path}.{key}")

    walk(values, {"description": "root", **schema}, "values")
    # Every value (a leaf) has a comment above it or above a key that holds it.
    lines = (CHART / "values.yaml").read_text().splitlines()
    keys: list[tuple[int, str, bool, bool]] = []  # (indent, line, commented, holds other keys)
    for i, line in enumerate(lines):
        stripped = line.strip()
        if stripped and not stripped.startswith(("#", "-")) and ":" in stripped:
            commented = i > 0 and lines[i - 1].strip().startswith("#")
            following = next((x.strip() for x in lines[i + 1 :] if x.strip()), "")
            group = stripped.endswith(":") and not following.startswith("-")
            keys.append((len(line) - len(line.lstrip()), stripped, commented, group))
    for n, (indent, line, commented, group) in enumerate(keys):
        if group:
            continue  # a key that holds others: its values are checked
        covered, level = commented, indent
        for up_indent, _, up_commented, _ in reversed(keys[:n]):
            if up_indent < level:
                covered, level = covered or up_commented, up_indent
        assert covered, f"values.yaml: {line!r} has no comment above it or above a key holding it"


def test_template_refusals(helm: Helm) -> None:
    both_off = helm.run(
        "template", RELEASE, str(CHART), "--kube-version", "1.33.0",
        "--set", "registration.podAnnotation=false", "--set", "registration.namespaceDefault=false",
        check=False,
    )  # fmt: skip
    assert both_off.returncode != 0 and "nothing would ever be injected" in both_off.stderr
    renew = helm.run(
        "template", RELEASE, str(CHART), "--kube-version", "1.33.0",
        "--set", "certgen.validityDays=30", "--set", "certgen.renewBeforeDays=30",
        check=False,
    )  # fmt: skip
    assert renew.returncode != 0 and "renewBeforeDays must be less than" in renew.stderr
    old = helm.run("template", RELEASE, str(CHART), "--kube-version", "1.27.9", check=False)
    assert old.returncode != 0 and "kubeVersion" in old.stderr


def test_monitoring_only_with_the_operators_api_or_forced(helm: Helm) -> None:
    def kinds(*args: str) -> set[str]:
        return {o["kind"] for o in helm.template(DEFAULT, "1.33.0", *args)} & {"PodMonitor", "ServiceMonitor"}

    assert kinds() == set()
    assert kinds("--api-versions", MONITORING_API) == {"PodMonitor"}  # the webhook has no /metrics yet
    assert kinds("--api-versions", MONITORING_API, "--set", "monitoring.serviceMonitor=true") == {
        "PodMonitor",
        "ServiceMonitor",
    }
    assert kinds("--set", "monitoring.force=true") == {"PodMonitor"}
    assert kinds("--api-versions", MONITORING_API, "--set", "monitoring.enabled=false") == set()
    objects = helm.template(SCENARIOS["monitoring"])
    pod_monitor = one(objects, "PodMonitor")
    assert pod_monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert pod_monitor["spec"]["namespaceSelector"] == {"any": True}
    (endpoint,) = pod_monitor["spec"]["podMetricsEndpoints"]
    # The port the injector gives the sidecar, by name, and its path.
    from fsdp_replay.injector.containers import METRICS_PORT_NAME

    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == (
        METRICS_PORT_NAME,
        "/metrics",
        "15s",
    )
    service_monitor = one(objects, "ServiceMonitor")
    (endpoint,) = service_monitor["spec"]["endpoints"]
    assert endpoint["scheme"] == "https" and endpoint["tlsConfig"]["serverName"] == SERVICE_DNS
    assert endpoint["tlsConfig"]["ca"]["secret"]["name"] == _tls_secret(objects)


def _tls_secret(objects: list[dict[str, Any]]) -> str:
    volumes = one(objects, "Deployment")["spec"]["template"]["spec"]["volumes"]
    return str(next(v["secret"]["secretName"] for v in volumes if v["name"] == "tls"))


def test_self_signed_tls_wiring(helm: Helm) -> None:
    """The certgen Jobs and their RBAC name exactly the chart's Secret, Deployment and registration."""
    objects = helm.template(DEFAULT)
    secret = _tls_secret(objects)
    jobs = {j["metadata"]["name"]: j for j in find(objects, "Job")}
    assert set(jobs) == {f"{RELEASE}-certgen-create", f"{RELEASE}-certgen-patch"}
    assert hook_events(jobs[f"{RELEASE}-certgen-create"]) == {"pre-install", "pre-upgrade"}
    assert hook_events(jobs[f"{RELEASE}-certgen-patch"]) == {"post-install", "post-upgrade"}
    for job in jobs.values():
        env = container_env(job["spec"]["template"]["spec"]["containers"][0])
        assert env["CERTGEN_SECRET"] == secret
        assert env["CERTGEN_DEPLOYMENT"] == one(objects, "Deployment")["metadata"]["name"]
        assert (
            env["CERTGEN_WEBHOOK_CONFIGURATION"]
            == one(objects, "MutatingWebhookConfiguration")["metadata"]["name"]
        )
        assert SERVICE_DNS in json.loads(env["CERTGEN_DNS_NAMES"])
    for kind in ("ServiceAccount", "ConfigMap", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"):
        support = one(objects, kind, f"{RELEASE}-certgen")
        assert hook_events(support) == {"pre-install", "pre-upgrade", "post-install", "post-upgrade"}
    role = one(objects, "Role", f"{RELEASE}-certgen")
    granted = {
        (r["resources"][0], tuple(r.get("resourceNames", ())), tuple(r["verbs"])) for r in role["rules"]
    }
    assert granted == {
        ("secrets", (), ("create",)),
        ("secrets", (secret,), ("get", "update")),
        ("deployments", (f"{RELEASE}-webhook",), ("patch",)),
    }
    (cluster_rule,) = one(objects, "ClusterRole", f"{RELEASE}-certgen")["rules"]
    assert cluster_rule["resourceNames"] == [RELEASE] and cluster_rule["verbs"] == ["get", "patch"]
    script = one(objects, "ConfigMap", f"{RELEASE}-certgen")["data"]["certgen.py"]
    assert script.strip() == (CHART / "files" / "certgen.py").read_text().strip()
    # The webhook itself needs no API access: no Role names its ServiceAccount, and it mounts no token.
    webhook_sa = one(objects, "ServiceAccount", f"{RELEASE}-webhook")
    assert webhook_sa["automountServiceAccountToken"] is False
    for binding in find(objects, "RoleBinding") + find(objects, "ClusterRoleBinding"):
        assert all(s["name"] != f"{RELEASE}-webhook" for s in binding["subjects"])
    assert not find(objects, "Certificate")


def test_cert_manager_tls_wiring(helm: Helm) -> None:
    objects = helm.template(SCENARIOS["cert-manager"])
    assert not find(objects, "Job") and not find(objects, "ConfigMap")
    certificate = one(objects, "Certificate", f"{RELEASE}-webhook")
    mwc = one(objects, "MutatingWebhookConfiguration")
    inject = mwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
    assert inject == f"{NAMESPACE}/{certificate['metadata']['name']}"
    assert certificate["spec"]["secretName"] == _tls_secret(objects)
    assert SERVICE_DNS in certificate["spec"]["dnsNames"]
    assert (certificate["spec"]["duration"], certificate["spec"]["renewBefore"]) == ("2160h", "360h")
    # The issuer chain is complete: serving cert <- CA Issuer <- CA Certificate <- self-signed Issuer.
    issuer = one(objects, "Issuer", certificate["spec"]["issuerRef"]["name"])
    ca_certificate = one(objects, "Certificate", f"{RELEASE}-ca")
    assert issuer["spec"]["ca"]["secretName"] == ca_certificate["spec"]["secretName"]
    assert ca_certificate["spec"]["isCA"] is True
    assert "selfSigned" in one(objects, "Issuer", ca_certificate["spec"]["issuerRef"]["name"])["spec"]
    external = helm.template(SCENARIOS["cert-manager-issuer"])
    assert not find(external, "Issuer")
    assert one(external, "Certificate")["spec"]["issuerRef"] == {
        "name": "corp-ca",
        "kind": "ClusterIssuer",
        "group": "cert-manager.io",
    }


def test_helm_test_pod(helm: Helm) -> None:
    objects = helm.template(DEFAULT)
    (pod,) = (p for p in find(objects, "Pod") if hook_events(p) == {"test"})
    (container,) = pod["spec"]["containers"]
    assert container["command"][-1] == f"https://{SERVICE_DNS}:443/healthz"
    (volume,) = pod["spec"]["volumes"]
    assert volume["secret"]["secretName"] == _tls_secret(objects)


def test_notes(helm: Helm, tmp_path: Path) -> None:
    """NOTES.txt rendered through ``tpl`` in a copy of the chart (``helm template`` does not print it)."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    shutil.copy(chart / "templates" / "NOTES.txt", chart / "files" / "NOTES.txt")
    (chart / "templates" / "zz-notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes\n"
        'data:\n  notes: {{ tpl (.Files.Get "files/NOTES.txt") . | quote }}\n'
    )

    def notes(values: Path, *args: str) -> str:
        objects = helm.template(values, "1.33.0", *args, chart=chart)
        return str(one(objects, "ConfigMap", "notes")["data"]["notes"])

    text = notes(DEFAULT)
    for needle in (
        'fsdp-replay.io/record: "true"',
        "kubectl label namespace NAMESPACE fsdp-replay.io/record=enabled",
        "/var/lib/fsdp-replay/spool",
        "/var/lib/fsdp-replay/trace.zarr",
        "kubectl fsdp-replay replay TRACE --rank R",
        "--payload-image REGISTRY/fsdp-replay/replay:0.1.0",
        "kubectl fsdp-replay report JOB",
        f"helm test {RELEASE}",
        "port 9464",
        "failurePolicy: Ignore",
    ):
        assert needle in text, needle
    opt_in = notes(SCENARIOS["namespace-opt-in"])
    assert 'fsdp-replay.io/record: "true"' not in opt_in and "kubectl label namespace" in opt_in
    stored = notes(SCENARIOS["custom-images"])
    assert "uploads it to s3://ml-traces/fsdp-replay" in stored and "port 19464" in stored
    assert "PodMonitor fsdp-replay-sidecars scrapes them" in notes(SCENARIOS["monitoring"])


# -- the certgen script, for real (openssl), without an API server ---------------------------------
@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl on PATH (Debian package openssl)")
def test_certgen_makes_verifiable_certificates_and_keeps_them(helm: Helm, tmp_path: Path) -> None:
    objects = helm.template(DEFAULT)
    script = tmp_path / "certgen.py"
    script.write_text(one(objects, "ConfigMap", f"{RELEASE}-certgen")["data"]["certgen.py"])
    job = one(objects, "Job", f"{RELEASE}-certgen-create")
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"][:2] == ["python3", "/certgen/certgen.py"]
    env = {"PATH": os.environ["PATH"], **container_env(container)}
    out = tmp_path / "out"
    out.mkdir()

    def create(**overrides: str) -> str:
        proc = subprocess.run(
            [sys.executable, str(script), "create", "--dry-run", str(out)],
            env={**env, **overrides},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stderr

    assert "there is no Secret yet" in create()
    secret = json.loads((out / "secret.json").read_text())
    kubernetes_validate.validate(secret, "1.33", strict=True)
    assert secret["type"] == "kubernetes.io/tls"
    assert secret["metadata"]["name"] == _tls_secret(objects)
    assert secret["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE
    files = {k: base64.b64decode(v) for k, v in secret["data"].items()}
    ca = x509.load_pem_x509_certificate(files["ca.crt"])
    cert = x509.load_pem_x509_certificate(files["tls.crt"])
    cert.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.DNSName)) == set(json.loads(env["CERTGEN_DNS_NAMES"]))
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert x509.oid.ExtendedKeyUsageOID.SERVER_AUTH in eku
    lifetime = cert.not_valid_after_utc - datetime.datetime.now(datetime.timezone.utc)
    assert datetime.timedelta(days=3640) < lifetime < datetime.timedelta(days=3651)
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    # The CA's private key is not kept anywhere.
    assert set(files) == {"ca.crt", "tls.crt", "tls.key"}

    assert "holds a valid certificate; kept" in create()
    assert json.loads((out / "secret.json").read_text()) == secret
    assert "expires within" in create(CERTGEN_VALIDITY_DAYS="9000", CERTGEN_RENEW_BEFORE_DAYS="8000")
    assert "does not name" in create(CERTGEN_DNS_NAMES=json.dumps(["other.fsdp-replay.svc"]))
    broken = json.loads((out / "secret.json").read_text())
    broken["data"]["tls.key"] = secret["data"]["tls.key"]  # a key of another certificate
    (out / "secret.json").write_text(json.dumps(broken))
    assert "tls.key does not belong to tls.crt" in create(
        CERTGEN_DNS_NAMES=json.dumps(["other.fsdp-replay.svc"])
    )


def test_certgen_ca_bundle_patch_names_only_live_entries() -> None:
    """The patch Job's body: a strategic merge patch keyed by entry name (applied by the API server)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("certgen", CHART / "files" / "certgen.py")
    assert spec is not None and spec.loader is not None
    certgen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(certgen)
    patch = certgen.ca_bundle_patch(["pods.fsdp-replay.io"], b"PEM")
    assert patch == {"webhooks": [{"name": "pods.fsdp-replay.io", "clientConfig": {"caBundle": "UEVN"}}]}
