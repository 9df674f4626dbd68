"""The replay a rendered Job describes, run without Kubernetes, reports what ``fsdp-replay replay`` reports.

One 2-rank CPU run is recorded with the environment the injector gives a trainer (its identity
resolved as the kubelet resolves the downward API, and a token from a Secret, which the recording
redacts), and shared by the tests:

- its trace is collected into a real S3-compatible store (moto's server on loopback); ``fsdp-replay
  job`` renders the Job of rank 1 from there; the Job's container command, arguments and
  environment run as a plain process (its Secret references resolved from a local table, its
  mount paths mapped to folders), and the report it stores in the bucket equals the report of
  ``fsdp-replay replay`` of the same rank; ``kubectl fsdp-replay report`` reads it back;
- ``fsdp-replay job`` refuses what it cannot render with a clear message and exit code;
- the real ``kubectl`` dispatches ``kubectl fsdp-replay`` to the plugin executable, whose
  ``replay --dry-run`` prints the same Job as ``fsdp-replay job --dry-run``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import tomllib
import yaml
import zarr
from harness import CLI, EXAMPLE, REPO, child_env, run, torchrun_cmd
from injector_support import apply_patch, load, make_config

from fsdp_replay.boot.pythonpath import PACKAGE_DIR
from fsdp_replay.injector import identity
from fsdp_replay.injector.job import REPLAY_CONTAINER
from fsdp_replay.injector.job_config import JobConfig
from fsdp_replay.injector.mutate import mutate

pytestmark = pytest.mark.slow
SMALL = ("--steps", "3", "--layers", "2", "--d-model", "64", "--seq-len", "32")
HF_TOKEN = "hf_" + "Z9yX8wV7uT6sR5qP4oN3mL2k"
SECRETS = {("hf", "token"): HF_TOKEN}
STORE_SECRET = "trace-store"
BUCKET = "traces"
HELM_DEST = REPO / ".venv" / "cache" / "helm"  # scripts/install-helm.sh puts kubectl beside helm


def identity_env() -> dict[str, str]:
    """The trainer's injected identity and its Secret-sourced token, resolved as in a pod."""
    pod = load("plain-pod")
    pod["spec"]["containers"][0]["env"] = [
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    ]
    pod["metadata"]["annotations"]["fsdp-replay.io/store-secret"] = STORE_SECRET
    trainer = apply_patch(pod, mutate(pod, "ml", make_config())[0])["spec"]["containers"][0]
    fields = {"metadata.name": "trainer-0", "metadata.namespace": "ml", "spec.serviceAccountName": "default"}
    env = {}
    for entry in trainer["env"]:
        if entry["name"] not in (*identity.IDENTITY_ENV, "HF_TOKEN"):
            continue  # the agent's own variables: `record` sets them
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        elif "fieldRef" in entry["valueFrom"]:
            env[entry["name"]] = fields[entry["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            ref = entry["valueFrom"]["secretKeyRef"]
            env[entry["name"]] = SECRETS[(ref["name"], ref["key"])]
    return env


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("job") / "run"
    run(
        # the spools are kept: the store test collects them once more, into its bucket
        [*CLI, "record", "--out", str(out), "--keep-spool", "--", *torchrun_cmd(2, EXAMPLE, *SMALL)],
        env=child_env(**identity_env()),
    )
    return out


@pytest.fixture(scope="module")
def replayed(recording: Path) -> dict[str, Any]:
    """``fsdp-replay replay`` of rank 1: the report a Job's replay must equal."""
    report = recording.parent / "replay-rank-1"
    proc = run([*CLI, "replay", str(recording), "--rank", "1", "--report", str(report)], check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return {"dir": report, "json": json.loads((report / "report.json").read_text()), "stdout": proc.stdout}


def job(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run([*CLI, "job", *args], env=env, check=False)


# -- a real S3-compatible store on loopback -------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def s3(tmp_path: Path) -> Iterator[dict[str, str]]:
    """moto's S3 server with the bucket, and the store Secret's keys (what envFrom gives the pod)."""
    pytest.importorskip("moto.server", reason="moto[server] (the test extras) runs the S3-compatible server")
    pytest.importorskip("s3fs", reason="s3fs (the test extras) is fsspec's s3:// filesystem")
    port = _free_port()
    log = (tmp_path / "s3.log").open("wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log
    )
    keys = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and server.poll() is None, "moto's server did not start"
                time.sleep(0.2)
        import boto3

        boto3.client(
            "s3",
            endpoint_url=keys["AWS_ENDPOINT_URL"],
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        ).create_bucket(Bucket=BUCKET)
        yield keys
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def run_container(
    job_yaml: str, mounts: dict[str, Path], secrets: dict[str, dict[str, str]], base: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """The Job's replay container as a process: exactly its command, arguments and environment, with
    ``valueFrom``/``envFrom`` resolved from ``secrets`` and each mount path mapped to a folder."""
    manifest = yaml.safe_load(job_yaml)
    (container,) = manifest["spec"]["template"]["spec"]["containers"]
    assert container["name"] == REPLAY_CONTAINER

    def mapped(value: str) -> str:
        for path, folder in mounts.items():
            value = value.replace(path, str(folder))
        return value

    env = dict(base)
    for source in container.get("envFrom", []):
        env.update(secrets[source["secretRef"]["name"]])
    for entry in container["env"]:
        if "value" in entry:
            env[entry["name"]] = mapped(entry["value"])
        else:
            ref = entry["valueFrom"]["secretKeyRef"]
            env[entry["name"]] = secrets[ref["name"]][ref["key"]]
    command = [mapped(a) for a in container["command"] + container["args"]]
    return run(command, env=env, check=False, cwd=mounts[JobConfig().work_path])


def payload_folder(folder: Path) -> Path:
    """What the init container leaves in the emptyDir: the package at lib/fsdp_replay (its copy runs
    in tests/deploy/test_replay_payload.py; the readers are this interpreter's own here)."""
    shutil.copytree(PACKAGE_DIR, folder / "lib" / "fsdp_replay", ignore=shutil.ignore_patterns("__pycache__"))
    return folder


def test_the_job_replays_the_rank_as_replay_does_and_stores_the_report_in_s3(
    recording: Path, replayed: dict[str, Any], s3: dict[str, str], tmp_path: Path
) -> None:
    """The trace on a volume (a claim mounted at the run folder), the report to a bucket. (A replay
    that reads its trace from s3:// is tests/sidecar/test_sidecar_store.py's: a Job passes the URL on.)"""
    aws = {**child_env(), **s3}
    report_url = f"s3://{BUCKET}/ml/run-1/replays/rank-1"
    rendered = job(
        str(recording), "--rank", "1", "--device", "cpu", "--dry-run", "--report", report_url,
        "--volume-claims", f"traces:{recording}",
    )  # fmt: skip
    assert rendered.returncode == 0 and rendered.stderr == "", rendered.stderr
    assert HF_TOKEN not in rendered.stdout
    manifest = yaml.safe_load(rendered.stdout)
    kubernetes_validate.validate(manifest, "1.33", strict=True)
    assert manifest["metadata"]["annotations"]["fsdp-replay.io/report"] == report_url

    mounts = {
        JobConfig().mount_path: payload_folder(tmp_path / "payload"),
        JobConfig().work_path: tmp_path / "work",
        str(recording): recording,  # the claim's volume, at the same path
    }
    mounts[JobConfig().work_path].mkdir()
    secrets = {STORE_SECRET: s3, "hf": {"token": HF_TOKEN}}
    base = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "LANG": "C.UTF-8"}  # the image's own
    proc = run_container(rendered.stdout, mounts, secrets, base)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert f"report stored at {report_url}" in proc.stderr

    import fsspec

    storage = {"endpoint_url": s3["AWS_ENDPOINT_URL"], "key": "testing", "secret": "testing"}
    with fsspec.open(f"{report_url}/report.json", "r", **storage) as f:
        stored = json.load(f)
    expected = replayed["json"]
    assert stored["status"] == expected["status"] == "bit-exact"
    for key in ("rank", "verified_steps", "collectives_verified", "recorded_collectives", "first_divergence"):
        assert stored[key] == expected[key], key
    assert stored["trace"] == str(recording / "trace.zarr")
    # `kubectl fsdp-replay report` reads it back from the store
    shown = run(
        [sys.executable, "-m", "fsdp_replay.cli.kubectl_plugin", "report", report_url], env=aws, check=False
    )
    assert shown.returncode == 0, shown.stderr
    assert "rank 1: BIT-EXACT over steps 0..2" in shown.stdout


def _strip_identity(trace: Path) -> None:
    """A trace recorded outside a pod the injector prepared: no identity in any rank's environment."""
    root = zarr.open_group(str(trace), mode="r+")
    for name in ("rank_00000", "rank_00001"):
        group = root[name]
        start = dict(group.attrs["rank_start"])
        start["env"] = {k: v for k, v in start["env"].items() if k not in identity.IDENTITY_ENV}
        group.attrs["rank_start"] = start


def test_job_refuses_what_it_cannot_render(recording: Path, tmp_path: Path) -> None:
    for args, code, message in (
        ((), 2, "give --rank R (a Job of one pod) or --all-ranks"),
        (("--rank", "2"), 2, "--rank 2: the trace's world has 2 ranks (0..1)"),
        (("--rank", "0", "--all-ranks"), 2, "--rank and --all-ranks exclude each other"),
    ):
        proc = job(str(recording), *args, "--dry-run")
        assert proc.returncode == code and message in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr and proc.stdout == ""
    missing = job(str(tmp_path / "nothing"), "--rank", "0", "--dry-run")
    assert missing.returncode == 3 and "no such trace" in missing.stderr

    bare = tmp_path / "bare" / "trace.zarr"
    shutil.copytree(recording / "trace.zarr", bare)
    _strip_identity(bare)
    proc = job(str(bare), "--rank", "0", "--dry-run")
    assert proc.returncode == 3 and "give --image and --namespace" in proc.stderr, proc.stderr
    given = job(str(bare), "--rank", "0", "--dry-run", "--image", "registry.example/ml/train:1.0", "-n", "ml")
    assert given.returncode == 0, given.stderr
    assert yaml.safe_load(given.stdout)["metadata"]["namespace"] == "ml"

    indexed = job(str(recording), "--all-ranks", "--dry-run", "--kubernetes-version", "1.28")
    assert indexed.returncode == 0, indexed.stderr
    manifest = yaml.safe_load(indexed.stdout)
    assert manifest["spec"]["completions"] == 2 and manifest["spec"]["completionMode"] == "Indexed"
    kubernetes_validate.validate(manifest, "1.28", strict=True)


# -- kubectl's plugin dispatch ----------------------------------------------------------------------
def _kubectl() -> Path:
    proc = subprocess.run(
        [str(REPO / "scripts" / "install-helm.sh"), str(HELM_DEST)],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        pytest.skip(
            f"kubectl could not be obtained (scripts/install-helm.sh: {(proc.stderr or proc.stdout)[-300:]})"
        )
    return HELM_DEST / "bin" / "kubectl"


def _plugin(folder: Path) -> Path:
    """The plugin executable as installed (``kubectl-fsdp_replay`` beside this Python), or made from
    ``pyproject.toml``'s ``[project.scripts]`` entry the way pip makes a console script."""
    name = "kubectl-fsdp_replay"
    installed = Path(sys.executable).parent / name
    if installed.is_file():
        return installed
    target = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"][name]
    module, function = target.split(":")
    script = folder / name
    script.write_text(
        f"#!{sys.executable}\nimport sys\nfrom {module} import {function}\nsys.exit({function}())\n"
    )
    script.chmod(0o755)
    return script


def test_kubectl_runs_the_plugin(recording: Path, replayed: dict[str, Any], tmp_path: Path) -> None:
    kubectl = _kubectl()
    plugin = _plugin(tmp_path)
    path = f"{plugin.parent}:{kubectl.parent}:/usr/bin:/bin"
    # no cluster: kubectl's plugin dispatch needs none
    env = {**child_env(), "PATH": path, "KUBECONFIG": str(tmp_path / "no-kubeconfig"), "HOME": str(tmp_path)}
    listed = run([str(kubectl), "plugin", "list"], env=env, check=False)
    assert str(plugin) in listed.stdout, listed.stdout + listed.stderr
    args = (str(recording), "--rank", "1", "--dry-run", "--device", "cpu")
    via_kubectl = run([str(kubectl), "fsdp-replay", "replay", *args], env=env, check=False)
    direct = job(*args)
    assert via_kubectl.returncode == direct.returncode == 0, via_kubectl.stderr
    assert via_kubectl.stdout == direct.stdout and yaml.safe_load(direct.stdout)["kind"] == "Job"
    shown = run([str(kubectl), "fsdp-replay", "report", str(replayed["dir"])], env=env, check=False)
    assert shown.returncode == 0 and shown.stdout == (replayed["dir"] / "report.txt").read_text()
    absent = run([str(kubectl), "fsdp-replay", "report", str(tmp_path / "none")], env=env, check=False)
    assert absent.returncode == 3 and "no report at" in absent.stderr
