"""``fsdp-replay inject -f`` and ``webhook`` as commands: real processes, YAML out, validated pods."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from injector_support import AGENT_IMAGE, FIXTURES, REPO, SIDECAR_IMAGE, load, load_all, validate_pod

from fsdp_replay.injector import templates

IMAGES = ["--agent-image", AGENT_IMAGE, "--sidecar-image", SIDECAR_IMAGE]


def inject(
    *args: str, stdin: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_REPLAY_")}
    return subprocess.run(
        [sys.executable, "-m", "fsdp_replay.injector.cli", "inject", *args],
        input=stdin,
        capture_output=True,
        text=True,
        env={**base, **(env or {})},
        cwd=REPO,
        timeout=60,
    )


def pod_templates(doc: Any) -> list[Any]:
    return [templates.resolve(doc, t) for t in templates.pod_templates(doc)]


def kubernetes_validate_cli(path: Path, version: str) -> subprocess.CompletedProcess[str]:
    tool = Path(sys.executable).parent / "kubernetes-validate"
    return subprocess.run(
        [str(tool), "--strict", "-k", version, str(path)], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("version", ["1.28", "1.33"])
def test_inject_multi_document_file(tmp_path: Path, version: str) -> None:
    proc = inject("-f", str(FIXTURES / "multi.yaml"), "--kubernetes-version", version, *IMAGES)
    assert proc.returncode == 0, proc.stderr
    before = load_all("multi")
    after = list(yaml.safe_load_all(proc.stdout))
    assert [d["kind"] for d in after] == [d["kind"] for d in before]
    for old, new in zip(before, after, strict=True):
        if old["kind"] in ("ConfigMap", "Service", "StatefulSet"):
            assert new == old, old["kind"]  # no template, or not annotated: printed as read
    injected = [t for d in after for t in pod_templates(d)]
    recorded = [t for t in injected if "fsdp-replay.io/injected" in (t["metadata"].get("annotations") or {})]
    assert (
        len(recorded) == 5
    )  # Deployment, Job, CronJob, JobSet, the List's Pod; the StatefulSet is not annotated
    for template in injected:
        validate_pod(template, version)
    mode = "native" if version == "1.33" else "container"
    assert {t["metadata"]["annotations"]["fsdp-replay.io/sidecar-mode"] for t in recorded} == {mode}
    # The real kubernetes-validate CLI accepts the whole output (CRDs and the List have no schema: WARN).
    out = tmp_path / "out.yaml"
    out.write_text(proc.stdout)
    checked = kubernetes_validate_cli(out, version)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "ERROR" not in checked.stdout
    assert checked.stdout.count("INFO") == 6
    assert "&id" not in proc.stdout  # no YAML anchors in a manifest meant for review
    assert "fsdp-replay: injected Deployment/online-trainer" in proc.stderr


def test_inject_output_is_stable(tmp_path: Path) -> None:
    first = inject("-f", str(FIXTURES / "multi.yaml"), *IMAGES)
    second = inject("-f", "-", *IMAGES, stdin=first.stdout)
    assert first.returncode == second.returncode == 0
    assert second.stdout == first.stdout
    assert "injected" not in second.stderr


def test_inject_pytorchjob_from_stdin() -> None:
    proc = inject("-f", "-", *IMAGES, stdin=(FIXTURES / "pytorchjob.yaml").read_text())
    assert proc.returncode == 0, proc.stderr
    (job,) = yaml.safe_load_all(proc.stdout)
    for role in ("Master", "Worker"):
        validate_pod(job["spec"]["pytorchReplicaSpecs"][role]["template"], "1.33")


def test_namespace_default_flag_and_env() -> None:
    for args, env in (
        ((("--namespace-default",)), None),
        ((), {"FSDP_REPLAY_INJECTOR_NAMESPACE_DEFAULT": "1"}),
    ):
        proc = inject("-f", str(FIXTURES / "unannotated-pod.yaml"), *args, env=env)
        assert proc.returncode == 0, proc.stderr
        assert "fsdp-replay.io/injected" in proc.stdout
    plain = inject("-f", str(FIXTURES / "unannotated-pod.yaml"))
    assert yaml.safe_load(plain.stdout) == load("unannotated-pod")


def test_env_configures_inject_and_flags_win() -> None:
    env = {"FSDP_REPLAY_INJECTOR_SIDECAR_MODE": "container", "FSDP_REPLAY_INJECTOR_SPOOL_PATH": "/runs"}
    proc = inject("-f", str(FIXTURES / "plain-pod.yaml"), "--sidecar-mode", "native", env=env)
    pod = yaml.safe_load(proc.stdout)
    assert pod["metadata"]["annotations"]["fsdp-replay.io/sidecar-mode"] == "native"
    assert {"name": "FSDP_REPLAY_OUT", "value": "/runs"} in pod["spec"]["containers"][0]["env"]


def test_warnings_go_to_stderr() -> None:
    proc = inject("-f", str(FIXTURES / "broken-pod.yaml"))
    assert proc.returncode == 0
    assert yaml.safe_load(proc.stdout) == load("broken-pod")
    assert "Pod/broken: not injected: pod ml/broken: spec.containers is not a list" in proc.stderr


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["-f", "/nonexistent.yaml"], 3, "cannot read /nonexistent.yaml"),
        (["-f", "-", "--sidecar-mode", "sideways"], 2, "FSDP_REPLAY_INJECTOR_SIDECAR_MODE='sideways'"),
        (["-f", "-"], 3, "is not YAML"),
    ],
)
def test_inject_errors(args: list[str], code: int, message: str) -> None:
    proc = inject(*args, stdin="a: [unclosed\n")
    assert proc.returncode == code and message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_webhook_without_tls_is_a_usage_error() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_replay.injector.cli", "webhook", "--port", "0"],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("FSDP_REPLAY_")},
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--tls-cert-file and --tls-key-file" in proc.stderr and "Traceback" not in proc.stderr


def test_webhook_with_a_bad_key_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "c").write_text("not a certificate")
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_replay.injector.cli", "webhook", "--port", "0",
         "--tls-cert-file", str(tmp_path / "c"), "--tls-key-file", str(tmp_path / "c")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "cannot load the TLS certificate" in proc.stderr


def test_webhook_configuration_example() -> None:
    """The registration in docs/injector.md: valid, its paths served by the webhook, and allowed by the
    API server's rule for service paths (each segment an RFC 1123 subdomain: no query strings)."""
    from fsdp_replay.injector import server, validate

    config = load("webhook-configuration")
    for version in ("1.28", "1.33"):
        import kubernetes_validate

        kubernetes_validate.validate(config, version, strict=True)
    for hook in config["webhooks"]:
        path = hook["clientConfig"]["service"]["path"]
        assert path in server.ROUTES
        assert all(validate.is_dns_subdomain(segment) for segment in path.strip("/").split("/"))
        assert hook["failurePolicy"] == "Ignore" and hook["sideEffects"] == "None"
        selector = {e["key"]: e for e in hook["namespaceSelector"]["matchExpressions"]}
        wants_default = selector["fsdp-replay.io/record"]["operator"] == "In"
        assert server.ROUTES[path] is wants_default
    docs = (REPO / "docs" / "injector.md").read_text()
    blocks = [b.split("```", 1)[0] for b in docs.split("```yaml\n")[1:]]
    shown = [yaml.safe_load(b) for b in blocks if "MutatingWebhookConfiguration" in b]
    assert shown == [config], "docs/injector.md shows another webhook configuration than the fixture"


@pytest.mark.k8s
@pytest.mark.skipif(shutil.which("kubectl") is None, reason="k8s: kubectl is not on PATH")
def test_patched_pod_passes_server_side_dry_run(tmp_path: Path) -> None:
    """On a real cluster: the API server itself (admission and validation) accepts an injected pod."""
    proc = inject("-f", str(FIXTURES / "torchrun-pod.yaml"), *IMAGES)
    pod = yaml.safe_load(proc.stdout)
    pod["metadata"].pop("namespace")
    path = tmp_path / "pod.yaml"
    path.write_text(yaml.safe_dump(pod))
    dry = subprocess.run(
        ["kubectl", "create", "--dry-run=server", "-o", "yaml", "-f", str(path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert dry.returncode == 0, dry.stderr
