"""The three images, built by the real engine and run the way Kubernetes would run them.

- webhook: the chart's own certgen script makes its certificate inside the image; the webhook runs
  with the chart's environment, read-only and unprivileged, and answers /healthz and a real
  AdmissionReview over TLS for the Service's DNS name; the chart's `helm test` script passes.
- sidecar: from inside the container (``--pid=host``), the project's bcc probe attaches to a
  process running outside it, through /proc/<pid>/root, and sees every one of its NCCL calls.
- agent-payload: copied out by its own ``cp`` exactly as the injector's init container runs it;
  built with Python 3.13, it makes the host's Python 3.11 record a 2-rank torchrun job with only
  the environment the injector gives a trainer.

dockerd runs without a bridge here (scripts/install-docker.sh, as docs/ENVIRONMENT says), so
ports cannot be published: containers that serve use the host's network namespace and listen on
a free port of 127.0.0.1, which is what ``-p 127.0.0.1:PORT:PORT`` would give a client.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonpatch
import kubernetes_validate
import pytest
import yaml
from deploy_support import (
    CHART,
    DOCKER,
    HERE,
    INJECTOR_FIXTURES,
    NAMESPACE,
    RELEASE,
    REPO,
    SCRIPTS,
    Helm,
    Images,
    admission_review,
    container_env,
    docker,
    find,
    free_port,
    hook_events,
    https,
    one,
    wait_for,
    webhook_container,
)

from fsdp_replay.boot.pythonpath import PACKAGE_DIR, SITE_DIR
from fsdp_replay.injector.config import InjectorConfig
from fsdp_replay.injector.containers import COPY_CONTAINER, COPY_TARGET, copy_container
from fsdp_replay.injector.mutate import mutate

pytestmark = pytest.mark.docker

SERVICE_DNS = f"{RELEASE}-webhook.{NAMESPACE}.svc"
EXAMPLE = REPO / "examples" / "train_fsdp.py"
BIN = Path(sys.executable).parent
SITE_IN_LIB = SITE_DIR.relative_to(PACKAGE_DIR.parent)  # fsdp_replay/boot/site


def _image_config(tag: str) -> dict[str, Any]:
    return dict(json.loads(docker("image", "inspect", tag).stdout)[0]["Config"])


def _export(tag: str) -> dict[str, tarfile.TarInfo]:
    """The image's files, from ``docker create`` + ``docker export``."""
    container = docker("create", tag).stdout.strip()
    try:
        raw = subprocess.run([DOCKER, "export", container], capture_output=True, check=True).stdout
    finally:
        docker("rm", container)
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        return {m.name.removeprefix("./"): m for m in tar.getmembers()}


@pytest.fixture
def container_name() -> Iterator[str]:
    """A unique name, and the container of that name removed afterwards whatever happened."""
    name = f"fsdpr-test-{uuid.uuid4().hex[:10]}"
    yield name
    docker("rm", "-f", name, check=False)


# -- the scripts --------------------------------------------------------------------------------
def test_install_docker_is_idempotent() -> None:
    start = time.monotonic()
    proc = subprocess.run(
        [str(SCRIPTS / "install-docker.sh"), "start"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "already answers" in proc.stdout and time.monotonic() - start < 15
    status = subprocess.run([str(SCRIPTS / "install-docker.sh"), "status"], capture_output=True, text=True)
    assert status.returncode == 0 and "running" in status.stdout


def test_make_base_image_is_idempotent(base_images: tuple[str, str]) -> None:
    for name in base_images:
        start = time.monotonic()
        proc = subprocess.run(
            [str(SCRIPTS / "make-base-image.sh"), name], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0 and f"{name} exists" in proc.stdout, proc.stderr
        assert time.monotonic() - start < 10
    labels = _image_config(base_images[1])["Labels"]
    assert labels["io.fsdp-replay.base.suite"] == "trixie"


# -- webhook ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_webhook_image_holds_the_package_on_the_standard_library(images: Images) -> None:
    config = _image_config(images.webhook)
    assert config["User"] == "65532:65532"
    assert config["Entrypoint"] == ["fsdp-replay", "webhook"]
    help_text = docker("run", "--rm", "--network", "none", images.webhook, "--help").stdout
    assert (
        help_text.startswith("usage: fsdp-replay webhook")
        and "FSDP_REPLAY_INJECTOR_TLS_CERT_FILE" in help_text
    )
    # Outside the standard library's names: only the package, __main__ and Debian's sitecustomize.
    probe = (
        "import importlib.util, json, sys\n"
        "import fsdp_replay.cli, fsdp_replay.injector.server\n"
        "fsdp_replay.cli.build_parser()\n"
        "third = sorted({m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names)"
        " - {'fsdp_replay', '__main__', 'sitecustomize'})\n"
        "absent = {n: importlib.util.find_spec(n) is None for n in ('torch', 'numpy', 'yaml', 'zarr', 'pip')}\n"
        "print(json.dumps({'third_party': third, 'absent': absent}))\n"
    )
    out = docker(
        "run",
        "--rm",
        "--network",
        "none",
        "--read-only",
        "--entrypoint",
        "python3",
        images.webhook,
        "-c",
        probe,
    )
    result = json.loads(out.stdout)
    assert result["third_party"] == [], "the webhook imports something outside the standard library"
    assert all(result["absent"].values()), result["absent"]


@pytest.mark.slow
def test_webhook_container_answers_over_tls(
    images: Images, helm: Helm, tmp_path: Path, container_name: str
) -> None:
    objects = helm.template(CHART / "ci" / "default-values.yaml", "1.33.0")
    # 1. The certificate, made by the chart's certgen script in the image its Job runs.
    job = one(objects, "Job", f"{RELEASE}-certgen-create")
    (job_container,) = job["spec"]["template"]["spec"]["containers"]
    script = tmp_path / "certgen"
    script.mkdir()
    (script / "certgen.py").write_text(one(objects, "ConfigMap", f"{RELEASE}-certgen")["data"]["certgen.py"])
    tls = tmp_path / "tls"
    tls.mkdir()
    tls.chmod(0o777)  # written by uid 65532, as the Job's user
    env_args = [a for k, v in container_env(job_container).items() for a in ("-e", f"{k}={v}")]
    docker(
        "run", "--rm", "--network", "none", "--user", "65532:65532", "--read-only", "--tmpfs", "/tmp",
        "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
        "-v", f"{script}:/certgen:ro", "-v", f"{tls}:/out", *env_args,
        "--entrypoint", "python3", images.webhook, "/certgen/certgen.py", "create", "--dry-run", "/out",
    )  # fmt: skip
    assert {p.name for p in tls.iterdir()} >= {"ca.crt", "tls.crt", "tls.key", "secret.json"}

    # 2. The webhook, with the Deployment's environment, as its securityContext says.
    webhook = webhook_container(objects)
    env = container_env(webhook)
    port = free_port()
    env.update(FSDP_REPLAY_INJECTOR_LISTEN_ADDRESS="127.0.0.1", FSDP_REPLAY_INJECTOR_PORT=str(port))
    env_args = [a for k, v in env.items() for a in ("-e", f"{k}={v}")]
    docker(
        "run", "-d", "--name", container_name, "--network", "host", "--user", "65532:65532", "--read-only",
        "--cap-drop", "ALL", "--security-opt", "no-new-privileges", "-v", f"{tls}:/tls:ro", *env_args,
        images.webhook,
    )  # fmt: skip
    ca = tls / "ca.crt"
    wait_for(lambda: https(SERVICE_DNS, port, ca, "GET", "/healthz")[0] == 200, 30, "the webhook's /healthz")
    assert https(SERVICE_DNS, port, ca, "GET", "/healthz") == (200, b"ok\n")
    assert https(SERVICE_DNS, port, ca, "GET", "/readyz") == (200, b"ok\n")

    # 3. A real AdmissionReview for an annotated pod: a patch that makes a valid recorded pod.
    pod = yaml.safe_load((INJECTOR_FIXTURES / "plain-pod.yaml").read_text())
    uid = str(uuid.uuid4())
    status, body = https(
        SERVICE_DNS, port, ca, "POST", "/mutate", json.dumps(admission_review(pod, uid, "ml")).encode()
    )
    assert status == 200, body
    response = json.loads(body)["response"]
    assert response["uid"] == uid and response["allowed"] is True and response["patchType"] == "JSONPatch"
    patched = jsonpatch.JsonPatch(json.loads(base64.b64decode(response["patch"]))).apply(pod)
    kubernetes_validate.validate(patched, "1.33", strict=True)
    init = {c["name"]: c for c in patched["spec"]["initContainers"]}
    assert init[COPY_CONTAINER]["image"] == env["FSDP_REPLAY_INJECTOR_AGENT_IMAGE"]
    assert init["fsdp-replay-sidecar"]["image"] == env["FSDP_REPLAY_INJECTOR_SIDECAR_IMAGE"]
    assert init["fsdp-replay-sidecar"]["restartPolicy"] == "Always"  # native: the chart said 1.33
    unannotated = yaml.safe_load((INJECTOR_FIXTURES / "unannotated-pod.yaml").read_text())
    status, body = https(
        SERVICE_DNS,
        port,
        ca,
        "POST",
        "/mutate",
        json.dumps(admission_review(unannotated, uid, "ml")).encode(),
    )
    assert status == 200 and "patch" not in json.loads(body)["response"]

    # 4. The chart's `helm test` pod script, against this webhook (its port instead of the Service's).
    (test_pod,) = (p for p in find(objects, "Pod") if hook_events(p) == {"test"})
    command = test_pod["spec"]["containers"][0]["command"]
    url = command[-1].replace(":443/", f":{port}/")
    test_run = docker(
        "run", "--rm", "--network", "host", "--add-host", f"{SERVICE_DNS}:127.0.0.1", "--user", "65532:65532",
        "--read-only", "--cap-drop", "ALL", "-v", f"{ca}:/tls/ca.crt:ro",
        "--entrypoint", command[0], images.webhook, *command[1:-1], url,
    )  # fmt: skip
    assert f"{url} 200 ok" in test_run.stdout

    # 5. SIGTERM: it stops cleanly (exit 0) after the requests in flight.
    docker("stop", "-t", "20", container_name)
    state = json.loads(docker("inspect", container_name).stdout)[0]["State"]
    logs = docker("logs", container_name).stderr + docker("logs", container_name).stdout
    assert state["ExitCode"] == 0, logs
    assert f"listening on https://127.0.0.1:{port}" in logs


# -- sidecar ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_sidecar_image_has_its_dependencies_but_not_torch(images: Images) -> None:
    config = _image_config(images.sidecar)
    assert config["Entrypoint"] == ["fsdp-replay", "sidecar"]
    probe = (
        "import importlib.metadata as m, importlib.util, json, sys\n"
        "import bcc, fsspec, numcodecs, numpy, prometheus_client, psutil, s3fs, zarr\n"
        "import fsdp_replay.sidecar.ebpf.probe, fsdp_replay.sidecar.discovery, fsdp_replay.trace.collect\n"
        "dists = {d.metadata['Name'].lower().replace('_', '-'): str(d.locate_file('')) for d in m.distributions()}\n"
        "print(json.dumps({'bcc': bcc.__file__, 'torch': importlib.util.find_spec('torch') is not None,\n"
        "    'dists': dists, 'prefix': sys.prefix}))\n"
    )
    out = json.loads(
        docker(
            "run", "--rm", "--network", "none", "--entrypoint", "python3", images.sidecar, "-c", probe
        ).stdout
    )
    assert out["torch"] is False
    assert out["bcc"].startswith("/usr/lib/python3/dist-packages/bcc/"), "bcc must be Debian's python3-bpfcc"
    venv = {name for name, where in out["dists"].items() if where.startswith(out["prefix"])}
    assert {
        "fsdp-replay",
        "numpy",
        "zarr",
        "numcodecs",
        "psutil",
        "prometheus-client",
        "fsspec",
        "s3fs",
    } <= venv
    assert not venv & {"torch", "bcc", "rich", "matplotlib"}, venv


@pytest.mark.slow
def test_sidecar_probes_a_host_process_from_inside_the_container(
    images: Images, host_libnccl: Path, nccl_loop: Path, container_name: str
) -> None:
    calls = 20_000
    loop = subprocess.Popen(
        [str(nccl_loop), str(host_libnccl), str(calls), "wait"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    sidecar: subprocess.Popen[str] | None = None
    try:
        assert loop.stdout is not None and loop.stdin is not None
        assert loop.stdout.readline().strip() == "ready"
        sidecar = subprocess.Popen(
            [
                DOCKER, "run", "--rm", "-i", "--name", container_name,
                "--pid=host", "--cap-add", "SYS_ADMIN", "--cap-add", "SYS_PTRACE", "--network", "none",
                "-v", "/lib/modules:/lib/modules:ro", "-v", "/usr/src:/usr/src:ro",
                "-v", "/sys/kernel/tracing:/sys/kernel/tracing",
                "-v", f"{HERE / 'helpers'}:/helpers:ro",
                "--entrypoint", "python3", images.sidecar, "/helpers/probe_in_container.py", str(loop.pid), str(calls),
            ],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert sidecar.stdout is not None and sidecar.stdin is not None
        line = sidecar.stdout.readline()
        if not line:
            raise AssertionError(f"the probe did not attach:\n{sidecar.communicate(timeout=30)[1]}")
        attached = json.loads(line)
        assert attached["attached"] == f"/proc/{loop.pid}/root{host_libnccl}"
        assert attached["probed"] == {"ncclAllReduce": "ncclAllReduce"}
        loop.stdin.write("\n")
        loop.stdin.flush()
        out, err = loop.communicate(timeout=120)
        assert loop.returncode == 0, err
        assert f"calls={calls} " in out
        stdout, stderr = sidecar.communicate("\n", timeout=120)
        assert sidecar.returncode == 0, stderr
    finally:
        if loop.poll() is None:
            loop.kill()
            loop.communicate()
        if sidecar is not None and sidecar.poll() is None:
            sidecar.kill()
            sidecar.communicate()
    seen = json.loads(stdout.strip().splitlines()[-1])
    assert seen["pids"] == {str(loop.pid): calls}  # host pids: the container shares the host's
    assert seen["lost"] == 0 and seen["entries"] == seen["delivered"] == calls
    assert seen["exactly_once"] == calls
    # The loop's arguments, the 7th (stream) read from the caller's stack, from inside the container.
    first = seen["first"]
    assert (first["sendbuff"], first["recvbuff"], first["datatype"], first["op"]) == (0x1000, 0x2000, 7, 0)
    assert first["stream"] == 0x7777 and first["count"] == 0
    assert first["ret"] != 0  # NCCL rejected the zeroed communicator, after the probe point


# -- agent payload ------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("which", ["agent", "agent_py313"])
def test_payload_image_layout(images: Images, which: str) -> None:
    tag = getattr(images, which)
    config = _image_config(tag)
    assert config["User"] == "65532:65532"
    files = _export(tag)
    lib = "fsdp-replay/lib"
    assert f"{lib}/{SITE_IN_LIB}/sitecustomize.py" in files
    # The folder first on the trainers' PYTHONPATH holds only our sitecustomize (and its bytecode).
    site_entries = {
        n.split("/")[len(f"{lib}/{SITE_IN_LIB}".split("/"))]
        for n in files
        if n.startswith(f"{lib}/{SITE_IN_LIB}/")
    }
    assert site_entries == {"sitecustomize.py", "__pycache__"}
    assert {n.split("/")[2] for n in files if n.startswith(f"{lib}/")} == {
        "fsdp_replay"
    }  # no dist-info, no bin
    assert [
        n
        for n in files
        if re.fullmatch(rf"{lib}/fsdp_replay/agent/fingerprint/_fpcore\.cpython-3\d+-x86_64-linux-gnu\.so", n)
    ]
    assert files["bin/cp"].issym() and files["bin/cp"].linkname == "busybox"
    payload = {n: m for n, m in files.items() if n.startswith("fsdp-replay/")}
    for name, member in payload.items():
        assert member.uid == 0, name
        need = 0o005 if member.isdir() else 0o004
        assert member.mode & need == need, f"{name} is not world-readable ({oct(member.mode)})"
    pycs = [n for n in payload if n.endswith(".pyc")]
    sources = [n for n in payload if n.endswith(".py")]
    assert len(pycs) == len(sources) > 50
    size = sum(m.size for m in files.values() if m.isfile())
    assert size < 20_000_000, f"the payload image holds {size / 1e6:.1f} MB"


@pytest.mark.slow
def test_payload_bytecode_is_unchecked_hash(images: Images, tmp_path: Path) -> None:
    """Every .pyc of the payload is hash-based and unchecked (PEP 552 flags == 0b01): valid after
    the copy gives every file a new mtime, and never recompiled on the read-only mount."""
    container = docker("create", images.agent).stdout.strip()
    try:
        docker("cp", f"{container}:/fsdp-replay", str(tmp_path))
    finally:
        docker("rm", container)
    pycs = list((tmp_path / "fsdp-replay").rglob("*.pyc"))
    assert pycs
    flags = {int.from_bytes(p.read_bytes()[4:8], "little") for p in pycs}
    assert flags == {0b01}


def _copy_like_the_init_container(tag: str, target: Path) -> None:
    """Run the injector's copy container spec (command, user, read-only root, no capabilities)."""
    spec = copy_container(InjectorConfig())
    sc = spec["securityContext"]
    target.mkdir()
    target.chmod(0o777)  # the kubelet makes an emptyDir world-writable
    assert sc["readOnlyRootFilesystem"] and sc["capabilities"] == {"drop": ["ALL"]}
    docker(
        "run", "--rm", "--network", "none", "--user", f"{sc['runAsUser']}:{sc['runAsGroup']}", "--read-only",
        "--cap-drop", "ALL", "--security-opt", "no-new-privileges", "-v", f"{target}:{COPY_TARGET}",
        "--entrypoint", spec["command"][0], tag, *spec["command"][1:],
    )  # fmt: skip


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_REPLAY_") and k != "PYTHONPATH"}
    return {**env, **extra}


@pytest.mark.slow
def test_payload_from_python_3_13_records_on_the_hosts_python_3_11(images: Images, tmp_path: Path) -> None:
    copy, run = tmp_path / "agent", tmp_path / "run"
    _copy_like_the_init_container(images.agent_py313, copy)
    assert list((copy / "lib" / "fsdp_replay" / "agent" / "fingerprint").glob("_fpcore.cpython-313-*.so"))
    # The trainer's environment is exactly what the injector gives it: mutate a real pod with the
    # copy's folder as the mount path and take the trainer container's env from the patched pod.
    pod = yaml.safe_load((INJECTOR_FIXTURES / "plain-pod.yaml").read_text())
    config = InjectorConfig(mount_path=str(copy), spool_path=str(run), kubernetes_version="1.33")
    ops, warnings = mutate(pod, "ml", config)
    assert warnings == []
    trainer = jsonpatch.JsonPatch(ops).apply(pod)["spec"]["containers"][0]
    injected = container_env(trainer)
    assert set(injected) == {
        "PYTHONPATH", "FSDP_REPLAY_MODE", "FSDP_REPLAY_OUT", "FSDP_REPLAY_PAYLOADS",
        # the literal half of the identity a replay Job is made from (injector/identity.py)
        "FSDP_REPLAY_POD_IMAGE", "FSDP_REPLAY_POD_CONTAINER", "FSDP_REPLAY_POD_REFS",
    }  # fmt: skip
    assert injected["PYTHONPATH"] == f"{copy}/lib/{SITE_IN_LIB}:{copy}/lib"
    base = {"PATH": f"{BIN}:/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1"}
    env = {**base, **injected}
    # The editable install of this checkout stays invisible: a process with that environment
    # imports the copy (the cwd is not the checkout, which would come first on sys.path).
    probe = (
        "import json, sys, fsdp_replay; "
        "print(json.dumps([fsdp_replay.__file__, sys.modules['sitecustomize'].__file__, sys.version_info[:2]]))"
    )
    where = subprocess.run(
        [sys.executable, "-c", probe],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    package, sitecustomize, version = json.loads(where.stdout)
    assert package == f"{copy}/lib/fsdp_replay/__init__.py"
    assert sitecustomize == f"{copy}/lib/{SITE_IN_LIB}/sitecustomize.py"
    assert tuple(version) == (3, 11)
    train = subprocess.run(
        [
            str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", str(EXAMPLE),
            "--steps", "2", "--layers", "2", "--d-model", "64", "--seq-len", "32",
        ],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert train.returncode == 0, train.stderr[-4000:]
    assert "agent not started" not in train.stderr, train.stderr[-4000:]
    # beside the rank spools: the attach markers (RUN/spool/attached/), one per process with the agent
    assert sorted(p.name for p in (run / "spool").iterdir()) == ["attached", "rank-00000", "rank-00001"]
    cli = [str(BIN / "fsdp-replay")]
    collected = subprocess.run(
        [*cli, "collect", str(run)], env=_clean_env(), capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert collected.returncode == 0, collected.stderr
    shown = subprocess.run(
        [*cli, "inspect", str(run), "--json", "-v"],
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    summary = json.loads(shown.stdout)
    assert summary["world_size"] == 2 and summary["ranks"] == [0, 1] and summary["missing_ranks"] == []
    for rank in summary["per_rank"]:
        assert rank["steps"] == 2 and rank["complete"] is True and rank["collectives"] > 0, rank["rank"]
        environment = rank["environment"]
        assert environment["versions"]["python"].startswith("3.11.")
        # The C fingerprint core built on trixie (a plain shared library) loaded into Python 3.11.
        assert environment["fingerprint_algos"]["native_core"] is True
    text = subprocess.run(
        [*cli, "inspect", str(run)], env=_clean_env(), capture_output=True, text=True, timeout=120
    )
    assert text.returncode == 0 and "ranks present [0, 1]" in text.stdout
