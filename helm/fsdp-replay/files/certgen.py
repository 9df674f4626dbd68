"""The webhook's self-signed TLS, made by the chart's hook Jobs with openssl and the standard library.

    certgen.py create   (pre-install, pre-upgrade) Make sure the Secret holds a CA and a serving
                        certificate that the CA signed for every DNS name of the webhook's Service,
                        valid for more than the renewal margin; otherwise make new ones (the CA's
                        private key is thrown away: nothing can sign with it again) and, if the
                        webhook's Deployment exists, restart its pods so that they serve them.
    certgen.py patch    (post-install, post-upgrade) Put the Secret's ca.crt into the caBundle of
                        every entry of the MutatingWebhookConfiguration.
    certgen.py create --dry-run DIR
                        The same decision and certificates without the API: DIR/secret.json is the
                        current Secret (if any) and receives the new one.

Settings, from the Job's environment: CERTGEN_NAMESPACE, CERTGEN_SECRET, CERTGEN_DNS_NAMES (a JSON
list), CERTGEN_VALIDITY_DAYS, CERTGEN_RENEW_BEFORE_DAYS, CERTGEN_DEPLOYMENT,
CERTGEN_WEBHOOK_CONFIGURATION, CERTGEN_LABELS (a JSON object, the Secret's labels).
The API calls use the pod's service account (the chart's Role and ClusterRole allow exactly these).
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import secrets
import ssl
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
RESTART_ANNOTATION = "fsdp-replay.io/tls-serial"
KEYS = ("ca.crt", "tls.crt", "tls.key")


def log(message: str) -> None:
    print(f"certgen: {message}", file=sys.stderr, flush=True)


def openssl(*args: str, cwd: Path) -> str:
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {args[0]} failed: {done.stderr.strip()}")
    return done.stdout


# -- certificates -------------------------------------------------------------------------------
def generate(dns_names: list[str], days: int, work: Path) -> dict[str, bytes]:
    """A new CA (P-256) and a serving certificate it signed for ``dns_names``."""
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl(
        "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", str(days),
        "-subj", "/CN=fsdp-replay webhook CA",
        "-addext", "basicConstraints=critical,CA:TRUE,pathlen:0",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=work,
    )  # fmt: skip
    openssl(
        "req", "-new", *ec, "-keyout", "tls.key", "-out", "tls.csr", "-subj", f"/CN={dns_names[0]}", cwd=work
    )
    (work / "tls.ext").write_text(
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth\n"
        f"subjectAltName={','.join('DNS:' + n for n in dns_names)}\n"
    )
    openssl(
        "x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-set_serial", "0x" + secrets.token_hex(16), "-days", str(days),
        "-extfile", "tls.ext", "-out", "tls.crt",
        cwd=work,
    )  # fmt: skip
    return {k: (work / k).read_bytes() for k in KEYS}


def still_good(
    files: dict[str, bytes], dns_names: list[str], renew_before_days: int, work: Path
) -> str | None:
    """Why the current files must be replaced, or None when they can stay."""
    if any(not files.get(k) for k in KEYS):
        return "the Secret lacks " + ", ".join(k for k in KEYS if not files.get(k))
    for k in KEYS:
        (work / f"current-{k}").write_bytes(files[k])
    try:
        openssl("verify", "-CAfile", "current-ca.crt", "current-tls.crt", cwd=work)
        margin = str(renew_before_days * 86400)
        for k in ("ca.crt", "tls.crt"):
            done = subprocess.run(
                ["openssl", "x509", "-checkend", margin, "-noout", "-in", f"current-{k}"],
                cwd=work,
                capture_output=True,
            )
            if done.returncode != 0:
                return f"{k} expires within {renew_before_days} days"
        san = openssl("x509", "-noout", "-ext", "subjectAltName", "-in", "current-tls.crt", cwd=work)
        have = {part.strip().removeprefix("DNS:") for part in san.splitlines()[-1].split(",")}
        if missing := [n for n in dns_names if n not in have]:
            return "the certificate does not name " + ", ".join(missing)
        cert_key = openssl("x509", "-noout", "-pubkey", "-in", "current-tls.crt", cwd=work)
        key_key = openssl("pkey", "-pubout", "-in", "current-tls.key", cwd=work)
        if cert_key != key_key:
            return "tls.key does not belong to tls.crt"
    except RuntimeError as e:
        return str(e)
    return None


def serial(cert: bytes, work: Path) -> str:
    (work / "serial.crt").write_bytes(cert)
    return openssl("x509", "-noout", "-serial", "-in", "serial.crt", cwd=work).strip().split("=", 1)[1]


def secret_object(
    name: str, namespace: str, labels: dict[str, str], files: dict[str, bytes]
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "data": {k: base64.b64encode(files[k]).decode() for k in KEYS},
    }


def ca_bundle_patch(entry_names: list[str], ca: bytes) -> dict[str, Any]:
    """A strategic merge patch (webhooks merge by name) setting every entry's caBundle."""
    bundle = base64.b64encode(ca).decode()
    return {"webhooks": [{"name": n, "clientConfig": {"caBundle": bundle}} for n in entry_names]}


# -- the API server -----------------------------------------------------------------------------
class Api:
    """The few calls the Jobs make, as the pod's service account."""

    def __init__(self) -> None:
        self.host = os.environ["KUBERNETES_SERVICE_HOST"]
        self.port = int(os.environ.get("KUBERNETES_SERVICE_PORT", "443"))
        self.token = (SERVICE_ACCOUNT / "token").read_text().strip()
        self.context = ssl.create_default_context(cafile=str(SERVICE_ACCOUNT / "ca.crt"))

    def call(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        """The response's JSON; None for 404. Any other failure is an error."""
        conn = http.client.HTTPSConnection(self.host, self.port, context=self.context, timeout=30)
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = content_type
        try:
            conn.request(method, path, body=data, headers=headers)
            response = conn.getresponse()
            raw = response.read()
        finally:
            conn.close()
        if response.status == 404:
            return None
        if response.status >= 300:
            raise RuntimeError(
                f"{method} {path}: HTTP {response.status}: {raw[:500].decode(errors='replace')}"
            )
        return json.loads(raw) if raw else {}


def decode(secret: dict[str, Any] | None) -> dict[str, bytes]:
    data = (secret or {}).get("data") or {}
    return {k: base64.b64decode(v) for k, v in data.items() if k in KEYS}


# -- the two steps --------------------------------------------------------------------------------
def create(dry_run: Path | None) -> int:
    namespace, name = os.environ["CERTGEN_NAMESPACE"], os.environ["CERTGEN_SECRET"]
    dns_names = json.loads(os.environ["CERTGEN_DNS_NAMES"])
    labels = json.loads(os.environ.get("CERTGEN_LABELS") or "{}")
    days, margin = int(os.environ["CERTGEN_VALIDITY_DAYS"]), int(os.environ["CERTGEN_RENEW_BEFORE_DAYS"])
    if margin >= days:
        raise SystemExit(f"certgen: renewBeforeDays ({margin}) must be less than validityDays ({days})")
    api = None if dry_run else Api()
    secret_path = f"/api/v1/namespaces/{namespace}/secrets/{name}"
    if dry_run:
        current_file = dry_run / "secret.json"
        current = json.loads(current_file.read_text()) if current_file.exists() else None
    else:
        assert api is not None
        current = api.call("GET", secret_path)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        why = (
            "there is no Secret yet"
            if current is None
            else still_good(decode(current), dns_names, margin, work)
        )
        if why is None:
            log(f"{namespace}/{name} holds a valid certificate; kept")
            return 0
        log(f"making a new CA and serving certificate: {why}")
        files = generate(dns_names, days, work)
        new = secret_object(name, namespace, labels, files)
        new_serial = serial(files["tls.crt"], work)
    if dry_run:
        for k in KEYS:
            (dry_run / k).write_bytes(files[k])
        (dry_run / "secret.json").write_text(json.dumps(new, indent=2))
        log(f"dry run: wrote {dry_run}/secret.json (serial {new_serial})")
        return 0
    assert api is not None
    if current is None:
        api.call("POST", f"/api/v1/namespaces/{namespace}/secrets", new)
    else:
        new["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        api.call("PUT", secret_path, new)
    log(f"stored {namespace}/{name} (serial {new_serial})")
    deployment = os.environ.get("CERTGEN_DEPLOYMENT", "")
    if deployment:
        restart = {"spec": {"template": {"metadata": {"annotations": {RESTART_ANNOTATION: new_serial}}}}}
        path = f"/apis/apps/v1/namespaces/{namespace}/deployments/{deployment}"
        if api.call("PATCH", path, restart, "application/strategic-merge-patch+json") is not None:
            log(f"restarting deployment {deployment} to serve the new certificate")
    return 0


def patch() -> int:
    namespace, name = os.environ["CERTGEN_NAMESPACE"], os.environ["CERTGEN_SECRET"]
    configuration = os.environ["CERTGEN_WEBHOOK_CONFIGURATION"]
    api = Api()
    secret = api.call("GET", f"/api/v1/namespaces/{namespace}/secrets/{name}")
    ca = decode(secret).get("ca.crt")
    if not ca:
        raise SystemExit(f"certgen: {namespace}/{name} has no ca.crt (did the create Job run?)")
    path = f"/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/{configuration}"
    live = api.call("GET", path)
    if live is None:
        raise SystemExit(f"certgen: MutatingWebhookConfiguration {configuration} does not exist")
    # Only the entries that exist: a strategic merge patch would add a half-made one otherwise.
    names = [w["name"] for w in live.get("webhooks") or []]
    api.call("PATCH", path, ca_bundle_patch(names, ca), "application/strategic-merge-patch+json")
    log(f"caBundle set on {configuration}: {', '.join(names)}")
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["create"] and len(argv) in (1, 3) and (len(argv) == 1 or argv[1] == "--dry-run"):
        return create(Path(argv[2]) if len(argv) == 3 else None)
    if argv == ["patch"]:
        return patch()
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
