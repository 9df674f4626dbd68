"""Helpers of the injector tests: fixture files, a test CA, the webhook process and its client, validation."""

from __future__ import annotations

import base64
import datetime
import http.client
import ipaddress
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fsdp_replay.injector.config import InjectorConfig

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).resolve().parents[2]
PLAIN_VERSION = "1.28"  # sidecar_mode auto -> a plain container
NATIVE_VERSION = "1.33"  # sidecar_mode auto -> a native sidecar
AGENT_IMAGE = "registry.example/fsdp-replay/agent:test"
SIDECAR_IMAGE = "registry.example/fsdp-replay/sidecar:test"
SERVER_START_S = 30.0


def load(name: str) -> Any:
    """The single document of fixture ``name`` (``plain-pod`` -> fixtures/plain-pod.yaml)."""
    return yaml.safe_load((FIXTURES / f"{name}.yaml").read_text())


def load_all(name: str) -> list[Any]:
    return [d for d in yaml.safe_load_all((FIXTURES / f"{name}.yaml").read_text()) if d is not None]


def make_config(version: str = NATIVE_VERSION, **overrides: Any) -> InjectorConfig:
    return InjectorConfig(
        agent_image=AGENT_IMAGE, sidecar_image=SIDECAR_IMAGE, kubernetes_version=version, **overrides
    )


def validate_pod(pod: dict[str, Any], version: str) -> None:
    """``kubernetes-validate --strict`` on a Pod (or a pod template, wrapped in a Pod) for ``version``."""
    if pod.get("kind") != "Pod":
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": pod.get("metadata") or {"name": "t"},
            "spec": pod["spec"],
        }
        pod["metadata"].setdefault("name", "template")
    try:
        kubernetes_validate.validate(pod, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = ".".join(str(p) for p in e.path)
        raise AssertionError(f"not a valid Pod for Kubernetes {version}: {path}: {e.message}") from None


def apply_patch(doc: Any, ops: Sequence[Any]) -> Any:
    """The reference JSON Patch implementation (``jsonpatch``), on a copy."""
    return jsonpatch.JsonPatch(ops).apply(doc, in_place=False)


# -- TLS ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tls:
    ca: Path
    cert: Path
    key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_tls(folder: Path) -> Tls:
    """A throwaway CA and a server certificate it signed for 127.0.0.1 (and the in-cluster service name)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("fsdp-replay test CA"))
        .issuer_name(_name("fsdp-replay test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("fsdp-replay-webhook.fsdp-replay.svc"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.IPAddress(ipaddress.IPv4Address("127.0.0.1")),
                    x509.DNSName("fsdp-replay-webhook.fsdp-replay.svc"),
                ]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = Tls(ca=folder / "ca.pem", cert=folder / "tls.crt", key=folder / "tls.key")
    paths.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    paths.key.chmod(0o600)
    return paths


# -- the webhook process ------------------------------------------------------------------------
@dataclass
class Webhook:
    """A running ``fsdp-replay webhook`` and a client for it."""

    version: str
    port: int
    context: ssl.SSLContext
    log: Path
    process: subprocess.Popen[bytes]

    @property
    def native(self) -> bool:
        return self.version == NATIVE_VERSION

    def request(
        self, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPSConnection("127.0.0.1", self.port, context=self.context, timeout=10)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            response = conn.getresponse()
            return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
        finally:
            conn.close()

    def review(
        self, pod: Any, path: str = "/mutate", *, operation: str = "CREATE", namespace: str = "ml"
    ) -> dict[str, Any]:
        """POST an AdmissionReview v1 for ``pod`` and return its ``response`` (HTTP 200 required)."""
        uid = str(uuid.uuid4())
        status, headers, body = self.request(
            "POST",
            path,
            json.dumps(admission_review(pod, uid, operation, namespace)).encode(),
            {"Content-Type": "application/json"},
        )
        assert status == 200, body
        assert headers["content-type"] == "application/json"
        review = json.loads(body)
        assert (review["apiVersion"], review["kind"]) == ("admission.k8s.io/v1", "AdmissionReview")
        assert review["response"]["uid"] == uid
        return review["response"]

    def log_text(self) -> str:
        return self.log.read_text()


def admission_review(pod: Any, uid: str, operation: str = "CREATE", namespace: str = "ml") -> dict[str, Any]:
    """An AdmissionReview v1 request as the API server sends it for a pod."""
    name = pod.get("metadata", {}).get("name", "") if isinstance(pod, dict) else ""
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
            "requestResource": {"group": "", "version": "v1", "resource": "pods"},
            "name": name,
            "namespace": namespace,
            "operation": operation,
            "userInfo": {"username": "system:serviceaccount:kube-system:job-controller", "groups": []},
            "object": pod,
            "oldObject": None,
            "dryRun": False,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }


def patched(pod: Any, response: dict[str, Any]) -> Any:
    """``pod`` with the response's JSON Patch applied by ``jsonpatch`` (unchanged without a patch)."""
    assert response["allowed"] is True
    if "patch" not in response:
        return pod
    assert response["patchType"] == "JSONPatch"
    return apply_patch(pod, json.loads(base64.b64decode(response["patch"])))


def start_webhook(tls: Tls, version: str, folder: Path) -> Webhook:
    log = folder / f"webhook-{version}.log"
    # Some options through the environment, some as flags: both paths of the CLI's helper are used.
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_REPLAY_")}
    env.update(
        FSDP_REPLAY_INJECTOR_TLS_CERT_FILE=str(tls.cert),
        FSDP_REPLAY_INJECTOR_TLS_KEY_FILE=str(tls.key),
        FSDP_REPLAY_INJECTOR_AGENT_IMAGE=AGENT_IMAGE,
        FSDP_REPLAY_INJECTOR_SIDECAR_IMAGE=SIDECAR_IMAGE,
        FSDP_REPLAY_INJECTOR_KUBERNETES_VERSION="1.20",  # overridden by the flag below
        FSDP_REPLAY_INJECTOR_LOG_LEVEL="INFO",
    )
    cmd = [
        sys.executable, "-m", "fsdp_replay.injector.cli", "webhook",
        "--listen-address", "127.0.0.1", "--port", "0", "--kubernetes-version", version,
    ]  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if m := re.search(r"listening on https://127\.0\.0\.1:(\d+)", log.read_text()):
            context = ssl.create_default_context(cafile=str(tls.ca))
            return Webhook(version=version, port=int(m.group(1)), context=context, log=log, process=process)
        if process.poll() is not None:
            break
        time.sleep(0.05)
    process.kill()
    process.wait()
    raise AssertionError(f"the webhook did not start:\n{log.read_text()}")


def stop_webhook(webhook: Webhook) -> None:
    webhook.process.send_signal(signal.SIGTERM)
    try:
        code = webhook.process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        webhook.process.kill()
        webhook.process.wait()
        raise AssertionError(f"the webhook ignored SIGTERM:\n{webhook.log_text()}") from None
    assert code == 0, f"the webhook exited {code} on SIGTERM:\n{webhook.log_text()}"
