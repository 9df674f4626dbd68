"""The real webhook over HTTPS: AdmissionReview v1 in, JSON Patch out, applied with ``jsonpatch`` and
validated with ``kubernetes-validate --strict`` for the version each server was told (1.28, 1.33)."""

from __future__ import annotations

import json
import os
import socket
import ssl
import threading
from typing import Any

import pytest
import yaml
from injector_support import (
    AGENT_IMAGE,
    FIXTURES,
    SIDECAR_IMAGE,
    Webhook,
    admission_review,
    load,
    patched,
    validate_pod,
)

from fsdp_replay import __version__
from fsdp_replay.boot.pythonpath import agent_pythonpath
from fsdp_replay.injector import server

SITE = "/opt/fsdp-replay/lib/fsdp_replay/boot/site"
LIB = "/opt/fsdp-replay/lib"


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def by_name(containers: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in containers}


def sidecar_of(pod: dict[str, Any], webhook: Webhook) -> dict[str, Any]:
    """The sidecar, where this server's mode puts it (and nowhere else)."""
    inits = by_name(pod["spec"].get("initContainers", []))
    regular = by_name(pod["spec"]["containers"])
    if webhook.native:
        assert "fsdp-replay-sidecar" not in regular
        sidecar = inits["fsdp-replay-sidecar"]
        assert sidecar["restartPolicy"] == "Always"
    else:
        assert "fsdp-replay-sidecar" not in inits
        sidecar = regular["fsdp-replay-sidecar"]
        assert "restartPolicy" not in sidecar
    return sidecar


def test_plain_annotated_pod(webhook: Webhook) -> None:
    pod = load("plain-pod")
    response = webhook.review(pod)
    assert "warnings" not in response
    out = patched(pod, response)
    validate_pod(out, webhook.version)

    trainer = by_name(out["spec"]["containers"])["trainer"]
    assert env_of(trainer) == {
        "FSDP_REPLAY_MODE": "record",
        "FSDP_REPLAY_OUT": "/var/lib/fsdp-replay",
        "FSDP_REPLAY_PAYLOADS": "all",
        "PYTHONPATH": f"{SITE}:{LIB}",
        # where it runs, for a replay Job made from its trace (fsdp_replay/injector/identity.py)
        "FSDP_REPLAY_POD_IMAGE": "registry.example/ml/train:1.0",
        "FSDP_REPLAY_POD_CONTAINER": "trainer",
        "FSDP_REPLAY_POD_NAME": {"fieldRef": {"fieldPath": "metadata.name"}},
        "FSDP_REPLAY_POD_NAMESPACE": {"fieldRef": {"fieldPath": "metadata.namespace"}},
        "FSDP_REPLAY_POD_SERVICE_ACCOUNT": {"fieldRef": {"fieldPath": "spec.serviceAccountName"}},
        "FSDP_REPLAY_POD_REFS": '{"env":[],"envFrom":[],"imagePullSecrets":[]}',
    }
    assert trainer["volumeMounts"] == [
        {"name": "fsdp-replay-agent", "mountPath": "/opt/fsdp-replay", "readOnly": True},
        {"name": "fsdp-replay-spool", "mountPath": "/var/lib/fsdp-replay"},
    ]
    copier = out["spec"]["initContainers"][0]
    assert (copier["name"], copier["image"]) == ("fsdp-replay-agent", AGENT_IMAGE)
    assert copier["command"] == ["cp", "-R", "/fsdp-replay/.", "/fsdp-replay-target/"]
    sidecar = sidecar_of(out, webhook)
    assert sidecar["image"] == SIDECAR_IMAGE and sidecar["command"] == ["fsdp-replay", "sidecar"]
    assert {"name": "fsdp-replay-spool", "mountPath": "/var/lib/fsdp-replay"} in sidecar["volumeMounts"]
    assert sidecar["ports"] == [{"name": "fsdpr-metrics", "containerPort": 9464, "protocol": "TCP"}]
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "fsdpr-metrics"}
    assert sidecar["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "fsdpr-metrics"}
    assert env_of(sidecar)["FSDP_REPLAY_SIDECAR_MODE"] == ("native" if webhook.native else "container")
    assert out["spec"]["shareProcessNamespace"] is True
    assert {v["name"] for v in out["spec"]["volumes"]} == {
        "fsdp-replay-agent",
        "fsdp-replay-spool",
        "fsdp-replay-tmp",
    }
    annotations = out["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == "9464"
    assert annotations["fsdp-replay.io/injected"] == __version__
    assert annotations["fsdp-replay.io/injected-containers"] == "trainer"
    assert annotations["fsdp-replay.io/sidecar-mode"] == ("native" if webhook.native else "container")


def test_native_sidecar_needs_129_or_later(webhooks: dict[str, Webhook]) -> None:
    """Why auto picks a plain container on 1.28: the 1.27 schema has no restartPolicy on containers at all,
    and 1.28 only behind an alpha gate. The native server's pod is valid on 1.33 and invalid on 1.27."""
    native = patched(load("plain-pod"), webhooks["1.33"].review(load("plain-pod")))
    validate_pod(native, "1.33")
    with pytest.raises(AssertionError, match="restartPolicy"):
        validate_pod(native, "1.27")
    plain = patched(load("plain-pod"), webhooks["1.28"].review(load("plain-pod")))
    validate_pod(plain, "1.27")


def test_torchrun_pod_keeps_pythonpath_and_init_order(webhook: Webhook) -> None:
    pod = load("torchrun-pod")
    response = webhook.review(pod)
    out = patched(pod, response)
    validate_pod(out, webhook.version)

    containers = by_name(out["spec"]["containers"])
    trainer, evaluator = containers["trainer"], containers["evaluator"]
    assert env_of(trainer)["PYTHONPATH"] == f"{SITE}:{LIB}:/workspace/src:/opt/extra"
    assert env_of(trainer)["PYTHONPATH"] == agent_pythonpath(SITE, LIB, "/workspace/src:/opt/extra", sep=":")
    assert env_of(evaluator)["PYTHONPATH"] == f"{SITE}:{LIB}:/workspace/src"
    # The user's entries keep their place; ours follow.
    assert [e["name"] for e in trainer["env"]][:2] == ["PYTHONPATH", "NCCL_DEBUG"]
    for container in (trainer, evaluator):
        env = env_of(container)
        assert env["FSDP_REPLAY_PAYLOADS"] == "steps:0-3,100-"
        assert env["FSDP_REPLAY_SNAPSHOT_EVERY"] == "500"
        assert env["FSDP_REPLAY_CUPTI"] == "steps:10-12"
        assert env["FSDP_REPLAY_MODULE_FINGERPRINTS"] == "steps:100-"
        assert container["volumeMounts"][0]["name"] == "data"  # the user's mounts stay first
    # No init container of the user's is recorded, so ours runs after theirs.
    inits = [c["name"] for c in out["spec"]["initContainers"]]
    assert inits[:2] == ["fetch-data", "fsdp-replay-agent"]
    assert out["spec"]["initContainers"][0] == pod["spec"]["initContainers"][0]
    sidecar = sidecar_of(out, webhook)
    env = env_of(sidecar)
    assert env["FSDP_REPLAY_SIDECAR_STORE"] == "s3://traces/llm"
    assert env["FSDP_REPLAY_SIDECAR_CONTAINERS"] == "trainer,evaluator"
    # The credentials are referenced, never copied into the pod.
    assert sidecar["envFrom"] == [{"secretRef": {"name": "trace-store-credentials", "optional": True}}]
    assert out["metadata"]["annotations"]["team.example/owner"] == "ml-infra"
    assert out["metadata"]["annotations"]["fsdp-replay.io/injected-containers"] == "trainer,evaluator"


def test_annotation_selects_one_container(webhook: Webhook) -> None:
    pod = load("select-one-pod")
    out = patched(pod, webhook.review(pod))
    validate_pod(out, webhook.version)
    containers = by_name(out["spec"]["containers"])
    assert containers["log-shipper"] == pod["spec"]["containers"][0]
    assert "PYTHONPATH" in env_of(containers["trainer"])
    assert out["metadata"]["annotations"]["fsdp-replay.io/injected-containers"] == "trainer"


def test_users_own_payloads_win(webhook: Webhook) -> None:
    pod = load("user-payloads-pod")
    out = patched(pod, webhook.review(pod))
    validate_pod(out, webhook.version)
    trainer = out["spec"]["containers"][0]
    assert [e for e in trainer["env"] if e["name"] == "FSDP_REPLAY_PAYLOADS"] == [
        {"name": "FSDP_REPLAY_PAYLOADS", "value": "steps:9000-9010"}
    ]
    assert env_of(trainer)["FSDP_REPLAY_MODE"] == "record"


def test_already_injected_pod_is_unchanged(webhook: Webhook) -> None:
    pod = load("injected-pod")
    response = webhook.review(pod)
    assert "patch" not in response and "warnings" not in response
    assert patched(pod, response) == pod
    # The same from the namespace-default entry: an injected pod is never injected again.
    assert "patch" not in webhook.review(pod, server.NAMESPACE_DEFAULT_PATH)


def test_output_of_the_webhook_is_idempotent(webhook: Webhook) -> None:
    for name in ("plain-pod", "torchrun-pod", "select-one-pod", "user-payloads-pod"):
        once = patched(load(name), webhook.review(load(name)))
        again = webhook.review(once)
        assert "patch" not in again, name
        assert patched(once, again) == once


def test_pod_without_annotation_gets_no_patch(webhook: Webhook) -> None:
    pod = load("unannotated-pod")
    response = webhook.review(pod)
    assert response == {"uid": response["uid"], "allowed": True}


def test_namespace_default_entry(webhook: Webhook) -> None:
    """/mutate/namespace-default records pods without the annotation; "false" still opts out."""
    pod = load("unannotated-pod")
    out = patched(pod, webhook.review(pod, server.NAMESPACE_DEFAULT_PATH))
    validate_pod(out, webhook.version)
    assert out["metadata"]["annotations"]["fsdp-replay.io/injected"] == __version__
    opted_out = load("opted-out-pod")
    assert "patch" not in webhook.review(opted_out, server.NAMESPACE_DEFAULT_PATH)


def test_other_operations_are_allowed_untouched(webhook: Webhook) -> None:
    response = webhook.review(load("plain-pod"), operation="UPDATE")
    assert response == {"uid": response["uid"], "allowed": True}


def test_mutation_failure_fails_open(webhook: Webhook) -> None:
    pod = load("broken-pod")
    response = webhook.review(pod)
    assert response["allowed"] is True
    assert "patch" not in response
    assert response["warnings"] == ["fsdp-replay: not injected: pod ml/broken: spec.containers is not a list"]
    assert "pod ml/broken" in webhook.log_text() and "admitted unchanged" in webhook.log_text()


def test_non_pod_kind_is_allowed_with_a_warning(webhook: Webhook) -> None:
    review = admission_review(load("plain-pod"), "u-1")
    review["request"]["kind"] = {"group": "apps", "version": "v1", "kind": "Deployment"}
    status, _, body = webhook.request("POST", "/mutate", json.dumps(review).encode())
    response = json.loads(body)["response"]
    assert status == 200 and response["allowed"] is True and "patch" not in response
    assert "only Pods" in response["warnings"][0]


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{not json", "the body is not JSON"),
        (b"[]", "got a JSON list"),
        (json.dumps({"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "request": {}}), "only 'admission.k8s.io/v1'"),
        (json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "Pod"}), "kind is 'Pod', expected 'AdmissionReview'"),
        (json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}), "no request object"),
        (json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"kind": {"kind": "Pod"}, "object": {}}}), "request.uid is missing"),
        (json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": "u", "object": {}}}), "request.kind is missing"),
        (json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": "u", "kind": {"kind": "Pod"}, "operation": "CREATE"}}), "request.object is missing"),
    ],
    ids=["bad-json", "not-object", "v1beta1", "wrong-kind", "no-request", "no-uid", "no-kind", "no-object"],
)  # fmt: skip
def test_malformed_request_is_400(webhooks: dict[str, Webhook], body: bytes | str, reason: str) -> None:
    webhook = webhooks["1.33"]
    data = body.encode() if isinstance(body, str) else body
    status, headers, text = webhook.request("POST", "/mutate", data, {"Content-Type": "application/json"})
    assert status == 400
    assert headers["content-type"].startswith("text/plain")
    assert text.decode().startswith("bad AdmissionReview: ")
    assert reason in text.decode()


def test_routes_and_health(webhooks: dict[str, Webhook]) -> None:
    webhook = webhooks["1.33"]
    for path in ("/healthz", "/readyz"):
        assert webhook.request("GET", path)[::2] == (200, b"ok\n")
    status, headers, _ = webhook.request("GET", "/mutate")
    assert status == 405 and headers["allow"] == "POST"
    assert webhook.request("POST", "/validate", b"{}")[0] == 404
    assert webhook.request("GET", "/metrics")[0] == 404


def test_tls_is_verified_against_the_ca(webhooks: dict[str, Webhook]) -> None:
    webhook = webhooks["1.33"]
    # A client that does not trust our CA refuses the server.
    untrusting = ssl.create_default_context()
    with (
        socket.create_connection(("127.0.0.1", webhook.port), timeout=5) as raw,
        pytest.raises(ssl.SSLCertVerificationError),
    ):
        untrusting.wrap_socket(raw, server_hostname="127.0.0.1")
    # Plain HTTP on the TLS port gets no answer, and the server keeps serving afterwards.
    with socket.create_connection(("127.0.0.1", webhook.port), timeout=5) as raw:
        raw.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        try:
            reply = raw.recv(100)
        except ConnectionResetError:
            reply = b""
        assert not reply.startswith(b"HTTP/")
    assert webhook.request("GET", "/healthz")[0] == 200


def test_concurrent_reviews(webhooks: dict[str, Webhook]) -> None:
    """One thread per connection: a client stuck in its TLS handshake does not block the others."""
    webhook = webhooks["1.33"]
    stuck = socket.create_connection(("127.0.0.1", webhook.port), timeout=5)  # never says hello
    results: list[dict[str, Any]] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            results.append(webhook.review(load("torchrun-pod")))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    stuck.close()
    assert not errors and len(results) == 16
    assert len({r["patch"] for r in results}) == 1  # same pod, same patch


def test_golden_injected_pod_matches(webhooks: dict[str, Webhook]) -> None:
    """fixtures/injected-pod.yaml is what the 1.33 server makes of plain-pod.yaml (the version aside)."""
    out = patched(load("plain-pod"), webhooks["1.33"].review(load("plain-pod")))
    golden = load("injected-pod")
    golden["metadata"]["annotations"]["fsdp-replay.io/injected"] = __version__
    if out != golden and os.environ.get("FSDP_REPLAY_REGEN_GOLDEN") == "1":
        text = (FIXTURES / "injected-pod.yaml").read_text()
        header = "".join(line for line in text.splitlines(keepends=True) if line.startswith("#"))
        (FIXTURES / "injected-pod.yaml").write_text(header + yaml.safe_dump(out, sort_keys=False))
        pytest.skip("regenerated fixtures/injected-pod.yaml")
    assert out == golden, "the injection changed: review it, then regenerate with FSDP_REPLAY_REGEN_GOLDEN=1"
