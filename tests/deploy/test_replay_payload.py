"""The replay payload image (Dockerfile target ``replay-payload``), built by the real engine, makes an
image without zarr replay every rank of a trace as an Indexed replay Job's pods would.

The "recorded image" is a Python 3.11 environment that has torch and numpy, as training images
do, but none of the libraries a replay reads a trace with: a virtualenv whose site-packages links
this checkout's torch, numpy and the rest, less every package the payload brings. A 2-rank run is
recorded in it (with the identity the injector gives a trainer), ``fsdp-replay job --all-ranks``
renders its Indexed Job, the Job's init container runs in Docker exactly as specified (its image,
command, user, read-only root, no capabilities), and the replay container's command and
environment run for each completion index as plain processes. Both ranks replay BIT-EXACT,
reading the trace with the payload's zarr, and ``kubectl fsdp-replay report`` merges their stored
reports.
"""

from __future__ import annotations

import importlib.metadata
import io
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_support import DOCKER, REPO, docker

from fsdp_replay.injector import identity
from fsdp_replay.injector.job import COMPLETION_INDEX_FIELD, ENV_RANK, PAYLOAD_CONTAINER, REPLAY_CONTAINER
from fsdp_replay.injector.job_config import JobConfig

pytestmark = [pytest.mark.docker, pytest.mark.slow]
TAG = "fsdp-replay/replay:test"
PYTHONS = ("cp311", "cp312", "cp313")
EXAMPLE = REPO / "examples" / "train_fsdp.py"
SMALL = ("--steps", "3", "--layers", "2", "--d-model", "64", "--seq-len", "32")
# What a training image has besides torch: numpy, and torch's own dependencies (fsspec, typing_extensions, ...).
IMAGE_HAS = {"numpy"} | {
    re.split(r"[^A-Za-z0-9_.-]", r, maxsplit=1)[0].lower().replace("-", "_")
    for r in importlib.metadata.requires("torch") or []
    if "extra ==" not in r
}


@pytest.fixture(scope="module")
def replay_image(base_images: tuple[str, str]) -> str:
    args = ["build", "--network", "host", "--progress", "plain", "--build-arg", f"BASE={base_images[0]}"]
    ca = os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt"
    if Path(ca).is_file():
        args += ["--secret", f"id=pip-ca,src={ca}"]
    start = time.monotonic()
    docker(*args, "--target", "replay-payload", "-t", TAG, str(REPO), timeout=1800)
    print(f"replay-payload built in {time.monotonic() - start:.0f} s")
    return TAG


def _files(tag: str) -> dict[str, tarfile.TarInfo]:
    container = docker("create", tag).stdout.strip()
    try:
        raw = subprocess.run([DOCKER, "export", container], capture_output=True, check=True).stdout
    finally:
        docker("rm", container)
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        return {m.name.removeprefix("./"): m for m in tar.getmembers()}


def test_replay_payload_layout(replay_image: str) -> None:
    config = json.loads(docker("image", "inspect", replay_image).stdout)[0]["Config"]
    assert config["User"] == "65532:65532"
    files = _files(replay_image)
    assert "fsdp-replay/lib/fsdp_replay/boot/site/sitecustomize.py" in files
    assert files["bin/cp"].issym()
    for python in PYTHONS:
        deps = f"fsdp-replay/deps/{python}"
        tops = {n.split("/")[3] for n in files if n.startswith(f"{deps}/") and n.count("/") >= 3}
        assert {"zarr", "numcodecs", "numpy", "fsspec", "s3fs", "psutil"} <= tops, python
        assert not tops & {"torch", "bin", "fsdp_replay"}, python
        # compiled for that Python (from wheels: nothing built, whatever the build's own Python is)
        assert any(n.startswith(f"{deps}/numcodecs/") and f".cpython-{python[2:]}-" in n for n in files), (
            python
        )
    for name, member in files.items():
        if name.startswith("fsdp-replay/"):
            need = 0o005 if member.isdir() else 0o004
            assert member.mode & need == need, f"{name} is not world-readable"


def _image_python(folder: Path, payload_entries: list[str]) -> Path:
    """A Python 3.11 with this environment's packages but not those the payload brings (numpy aside)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = folder / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    )  # fmt: skip

    def package(name: str) -> str:  # numpy-2.4.6.dist-info, numpy.libs, numpy -> numpy
        return name.split("-")[0].split(".")[0].lower()

    brought = {package(name) for name in payload_entries} - IMAGE_HAS
    assert {"zarr", "numcodecs"} <= brought
    ours = Path(sysconfig.get_paths()["purelib"])
    for entry in ours.iterdir():
        name = package(entry.name)
        if name in brought or name.startswith(("__editable__", "fsdp_replay", "__pycache__")):
            continue
        (site / entry.name).symlink_to(entry.resolve())
    return python


def _copy_like_the_init_container(job: dict[str, Any], target: Path) -> None:
    (init,) = job["spec"]["template"]["spec"]["initContainers"]
    assert init["name"] == PAYLOAD_CONTAINER
    sc = init["securityContext"]
    target.mkdir()
    target.chmod(0o777)  # the kubelet makes an emptyDir world-writable
    docker(
        "run", "--rm", "--network", "none", "--user", f"{sc['runAsUser']}:{sc['runAsGroup']}", "--read-only",
        "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
        "-v", f"{target}:{init['volumeMounts'][0]['mountPath']}",
        "--entrypoint", init["command"][0], init["image"], *init["command"][1:],
    )  # fmt: skip


def test_an_image_without_zarr_replays_every_rank_from_the_payload(replay_image: str, tmp_path: Path) -> None:
    env_base = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_REPLAY_") and k != "PYTHONPATH"}
    cli = [sys.executable, "-m", "fsdp_replay"]
    # The packages the payload brings for Python 3.11 (its own busybox `ls` lists them).
    brought = docker(
        "run", "--rm", "--network", "none", "--entrypoint", "ls", replay_image, "/fsdp-replay/deps/cp311"
    )
    python = _image_python(tmp_path / "image", brought.stdout.split())
    lacks = subprocess.run([str(python), "-c", "import zarr"], capture_output=True, text=True)
    assert lacks.returncode != 0 and "No module named 'zarr'" in lacks.stderr

    run = tmp_path / "run"
    identity_env = {
        identity.ENV_POD_IMAGE: "registry.example/ml/train:1.0",
        identity.ENV_POD_CONTAINER: "trainer",
        identity.ENV_POD_NAME: "trainer-0",
        identity.ENV_POD_NAMESPACE: "ml",
        identity.ENV_POD_REFS: '{"env":[],"envFrom":[],"imagePullSecrets":[]}',
    }
    record = subprocess.run(
        [*cli, "record", "--out", str(run), "--", str(python), "-m", "torch.distributed.run", "--standalone",
         "--nproc_per_node=2", str(EXAMPLE), *SMALL],
        env={**env_base, **identity_env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600,
        cwd=REPO,
    )  # fmt: skip
    assert record.returncode == 0, record.stderr[-4000:]

    reports = tmp_path / "reports"
    rendered = subprocess.run(
        [*cli, "job", str(run), "--all-ranks", "--device", "cpu", "--dry-run", "--payload-image", replay_image,
         "--report", str(reports), "--volume-claims", f"traces:{run},reports:{reports}"],
        env=env_base, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert rendered.returncode == 0 and rendered.stderr == "", rendered.stderr
    job = yaml.safe_load(rendered.stdout)
    payload = tmp_path / "emptydir"
    _copy_like_the_init_container(job, payload)
    assert sorted(p.name for p in payload.iterdir()) == ["cp311", "lib"]  # the recorded Python's only

    (spec,) = job["spec"]["template"]["spec"]["containers"]
    assert spec["name"] == REPLAY_CONTAINER
    work = tmp_path / "work"
    mounts = {JobConfig().mount_path: str(payload), JobConfig().work_path: str(work)}

    def mapped(value: str) -> str:
        for path, folder in mounts.items():
            value = value.replace(path, folder)
        return value

    for index in range(job["spec"]["completions"]):
        work.mkdir(exist_ok=True)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LANG": "C.UTF-8"}  # the image's own
        for entry in spec["env"]:
            if "value" in entry:
                env[entry["name"]] = mapped(entry["value"])
            else:  # the completion index, from the pod's annotation
                assert entry == {
                    "name": ENV_RANK,
                    "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX_FIELD}},
                }
                env[ENV_RANK] = str(index)
        where = subprocess.run(
            [str(python), "-c", "import zarr, numpy; print(zarr.__file__); print(numpy.__file__)"],
            env=env, capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
        assert where[0].startswith(f"{payload}/cp311/") and not where[1].startswith(str(payload))
        proc = subprocess.run(
            [mapped(a) for a in spec["command"] + spec["args"]], env=env, capture_output=True, text=True,
            timeout=600, cwd=work,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        assert f"rank {index}: BIT-EXACT over steps 0..2" in proc.stdout
        shutil.rmtree(work)  # each pod has its own emptyDir

    shown = subprocess.run(
        [sys.executable, "-m", "fsdp_replay.cli.kubectl_plugin", "report", str(reports), "--ranks", "2"],
        env=env_base, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines() == ["rank 0: BIT-EXACT", "rank 1: BIT-EXACT", "all ranks: BIT-EXACT"]
