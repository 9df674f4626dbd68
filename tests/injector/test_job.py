"""``fsdp-replay job`` rendered from what a recorded pod leaves in its trace: valid Jobs, credentials by
reference only, and clear errors.

The metadata is made the way a cluster makes it: a fixture pod is injected by the real ``mutate``,
its trainer's environment resolved as the kubelet would (downward API fields, Secret keys) and
redacted by the recorder's own ``redact_env``. The end-to-end replay from a real recording is in
``test_job_replay.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from injector_support import apply_patch, load, make_config

from fsdp_replay.errors import ConfigError, TraceFormatError
from fsdp_replay.injector import identity
from fsdp_replay.injector.job import (
    ALL_RANKS,
    COMPLETION_INDEX_FIELD,
    ENV_DEPS,
    ENV_RANK,
    NOT_REPLAYED,
    REPLAY_CONTAINER,
    RenderedJob,
    default_name,
    default_report,
    render,
    user_pythonpath,
)
from fsdp_replay.injector.job_config import MAX_NAME_CHARS, JobConfig
from fsdp_replay.injector.mutate import mutate
from fsdp_replay.trace.redact import redact_env

VERSIONS = ["1.28", "1.33"]
HF_TOKEN = "hf_" + "Q7rT2yU8iO4pA6sD1fG3hJ5k"
WANDB_KEY = "0f8e7d6c5b4a39281706f5e4d3c2b1a0f9e8d7c6"
DB_PASSWORD = "correct-horse-battery-staple"
SECRETS = {("hf", "token"): HF_TOKEN, ("wandb", "api-key"): WANDB_KEY}
STORE = "s3://ml-traces/llm/run-7/trace.zarr"
DIGEST = "sha256:" + "3f" * 32


def recorded_meta(
    pod: dict[str, Any],
    *,
    container: int = 0,
    extra_env: dict[str, str] | None = None,
    python: str = "3.12.3",
) -> dict[str, Any]:
    """A ``rank_start`` as the agent records it in the injected ``pod``'s container."""
    ops, _ = mutate(pod, "ml", make_config())
    injected = apply_patch(pod, ops)
    fields = {
        "metadata.name": injected["metadata"]["name"],
        "metadata.namespace": injected["metadata"].get("namespace", "ml"),
        "spec.serviceAccountName": injected["spec"].get("serviceAccountName", "default"),
        "status.hostIP": "10.0.0.7",
    }
    env: dict[str, str] = {"PATH": "/usr/local/bin:/usr/bin", "HOME": "/root", "DATA_DIR": "/data"}
    for entry in injected["spec"]["containers"][container].get("env", []):
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        elif "fieldRef" in entry["valueFrom"]:
            env[entry["name"]] = fields.get(entry["valueFrom"]["fieldRef"]["fieldPath"], "zone-a")
        elif "secretKeyRef" in entry["valueFrom"]:
            ref = entry["valueFrom"]["secretKeyRef"]
            env[entry["name"]] = SECRETS[(ref["name"], ref["key"])]
    env.update(extra_env or {})
    return {
        "rank": 0,
        "world_size": 8,
        "executable": "/usr/bin/python3",
        "orig_argv": ["/usr/bin/python3", "-u", "train.py", "--steps", "100"],
        "cwd": "/workspace",
        "env": redact_env(env),
        "versions": {"python": python, "torch": "2.13.0"},
        "policy": {"payloads": "all"},
    }


def secret_pod() -> dict[str, Any]:
    """plain-pod with Secret-sourced variables, envFrom, pull Secrets, a service account and a store Secret."""
    pod = load("plain-pod")
    trainer = pod["spec"]["containers"][0]
    trainer["image"] = f"registry.example/ml/train@{DIGEST}"
    trainer["env"] = [
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
        {"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "api-key"}}},
        {"name": "NODE_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
    ]
    trainer["envFrom"] = [{"secretRef": {"name": "pip-credentials"}}, {"configMapRef": {"name": "settings"}}]
    pod["spec"]["imagePullSecrets"] = [{"name": "regcred"}]
    pod["spec"]["serviceAccountName"] = "trainer"
    pod["metadata"]["annotations"]["fsdp-replay.io/store"] = STORE
    pod["metadata"]["annotations"]["fsdp-replay.io/store-secret"] = "trace-store"
    return pod


def job_for(meta: dict[str, Any], trace: str = STORE, world: int = 8, **options: Any) -> RenderedJob:
    config = JobConfig(**{"rank": 3, **options} if "all_ranks" not in options else options)
    return render(meta, trace, world, config)


def spec_of(job: RenderedJob) -> dict[str, Any]:
    spec: dict[str, Any] = job.manifest["spec"]["template"]["spec"]
    return spec


def replay_container(job: RenderedJob) -> dict[str, Any]:
    (container,) = spec_of(job)["containers"]
    assert container["name"] == REPLAY_CONTAINER
    return dict(container)


SCENARIOS = {  # each told the cluster's version, as the chart tells the injector
    "one-rank": lambda v: job_for(recorded_meta(load("plain-pod")), kubernetes_version=v),
    "all-ranks": lambda v: job_for(
        recorded_meta(load("plain-pod")), all_ranks=True, parallelism=4, kubernetes_version=v
    ),
    "cpu": lambda v: job_for(
        recorded_meta(load("plain-pod")), device="cpu", cpu="4", memory="16Gi", kubernetes_version=v
    ),
    "secrets": lambda v: job_for(recorded_meta(secret_pod()), kubernetes_version=v),
    "s3-store": lambda v: job_for(
        recorded_meta(load("torchrun-pod")), from_step=90, to_step=99, kubernetes_version=v
    ),
    "volume": lambda v: job_for(
        recorded_meta(load("plain-pod")),
        trace="/traces/run-7/trace.zarr",
        volume_claims=("traces:/traces",),
        kubernetes_version=v,
    ),
}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_rendered_jobs_validate(scenario: str, version: str) -> None:
    job = SCENARIOS[scenario](version)
    try:
        kubernetes_validate.validate(job.manifest, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = ".".join(str(p) for p in e.path)
        raise AssertionError(f"not a valid Job for Kubernetes {version}: {path}: {e.message}") from None
    text = yaml.safe_dump(job.manifest)
    for secret in (HF_TOKEN, WANDB_KEY, DB_PASSWORD):
        assert secret not in text
    assert not [w for w in job.warnings if "local path" in w], job.warnings


def test_one_rank_job() -> None:
    job = SCENARIOS["one-rank"]("")
    assert (job.name, job.namespace) == ("replay-plain-rank-3", "ml")
    assert job.report == "s3://ml-traces/llm/run-7/replays/replay-plain-rank-3"
    container = replay_container(job)
    assert container["image"] == "registry.example/ml/train:1.0"
    assert container["command"] == ["/usr/bin/python3", "-m", "fsdp_replay", "job-run"]
    assert container["args"] == [
        STORE, "--rank", "3", "--from-step", "0", "--to-step", "-1", "--device", "cuda:0",
        "--report", job.report, "--work-dir", "/var/lib/fsdp-replay/report",
    ]  # fmt: skip
    env = {e["name"]: e for e in container["env"]}
    assert env["PYTHONPATH"]["value"] == "/opt/fsdp-replay/lib/fsdp_replay/boot/site:/opt/fsdp-replay/lib"
    assert env[ENV_DEPS]["value"] == "/opt/fsdp-replay"
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 1}}
    (copier,) = spec_of(job)["initContainers"]
    assert copier["image"] == JobConfig().payload_image
    assert copier["command"] == [
        "cp",
        "-R",
        "/fsdp-replay/lib",
        "/fsdp-replay/deps/cp312",
        "/fsdp-replay-target/",
    ]
    assert copier["securityContext"]["runAsNonRoot"] is True
    assert copier["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    metadata = job.manifest["metadata"]
    assert metadata["annotations"]["fsdp-replay.io/report"] == job.report
    assert metadata["annotations"]["fsdp-replay.io/rank"] == "3"
    assert metadata["annotations"]["fsdp-replay.io/replay-of"] == "ml/plain"
    assert metadata["annotations"]["fsdp-replay.io/command"] == "/usr/bin/python3 -u train.py --steps 100"
    policy = job.manifest["spec"]["podFailurePolicy"]["rules"]
    assert policy[0] == {
        "action": "FailJob",
        "onExitCodes": {"containerName": REPLAY_CONTAINER, "operator": "In", "values": [1, 2, 3]},
        "onPodConditions": [],
    }
    assert policy[1] == {
        "action": "Ignore",
        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
    }
    assert job.manifest["spec"]["backoffLimit"] == 1


def test_the_replay_pod_is_never_recorded() -> None:
    """The pod opts out of recording, so a namespace that records every pod leaves the replay alone."""
    job = SCENARIOS["secrets"]("")
    template = job.manifest["spec"]["template"]
    assert mutate(template, "ml", make_config(), namespace_default=True) == ([], [])


def test_credentials_are_referenced_never_copied() -> None:
    job = SCENARIOS["secrets"]("")
    container = replay_container(job)
    env = {e["name"]: e for e in container["env"]}
    # The two Secret keys the recording redacted come from the same Secrets; nothing else recorded
    # is in the Job (the replay takes the recorded values from the trace).
    assert env["HF_TOKEN"] == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"key": "token", "name": "hf"}},
    }
    assert env["WANDB_API_KEY"]["valueFrom"] == {"secretKeyRef": {"key": "api-key", "name": "wandb"}}
    assert set(env) == {"PYTHONPATH", ENV_DEPS, "HF_TOKEN", "WANDB_API_KEY"}
    assert container["envFrom"] == [
        {"secretRef": {"name": "pip-credentials"}},
        {"configMapRef": {"name": "settings"}},
        {"secretRef": {"name": "trace-store"}},  # the store's credentials, as the recording sidecar had them
    ]
    spec = spec_of(job)
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert spec["serviceAccountName"] == "trainer"
    # The image was pinned by digest: the recording kept it (a digest is no credential).
    assert container["image"] == f"registry.example/ml/train@{DIGEST}"
    assert job.warnings == []


def test_a_redacted_variable_without_a_source_is_named() -> None:
    """A replay leaves the machine's variables to the machine (PIP_*, SSH_*: never warned about)."""
    meta = recorded_meta(
        load("plain-pod"),
        extra_env={"DB_PASSWORD": DB_PASSWORD, "DB_URL": "x", "PIP_PASSWORD": "y", "SSH_AUTH_SOCK": "z"},
    )
    assert meta["env"]["DB_PASSWORD"] == "<redacted>"
    job = job_for(meta)
    (warning,) = job.warnings
    assert "redacted DB_PASSWORD" in warning and "runs without them" in warning
    assert "DB_PASSWORD" not in {e["name"] for e in replay_container(job)["env"]}
    assert DB_PASSWORD not in yaml.safe_dump(job.manifest)
    # With envFrom sources in the recorded container, the warning says they may hold it.
    meta = recorded_meta(secret_pod(), extra_env={"DB_PASSWORD": DB_PASSWORD})
    (warning,) = job_for(meta).warnings
    assert "envFrom sources (secret pip-credentials, configMap settings)" in warning


def test_all_ranks_is_an_indexed_job_of_isolated_replays() -> None:
    job = SCENARIOS["all-ranks"]("")
    spec = job.manifest["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 8, 4)
    assert spec["backoffLimitPerIndex"] == 1 and "backoffLimit" not in spec
    assert spec["podFailurePolicy"]["rules"][0]["action"] == "FailIndex"
    container = replay_container(job)
    assert "--rank" not in container["args"] and "--per-rank" in container["args"]
    rank = next(e for e in container["env"] if e["name"] == ENV_RANK)
    assert rank["valueFrom"] == {"fieldRef": {"fieldPath": COMPLETION_INDEX_FIELD}}
    assert job.name == "replay-plain-all-ranks"
    assert job.manifest["metadata"]["annotations"]["fsdp-replay.io/rank"] == ALL_RANKS
    # Before 1.29 an Indexed Job has no per-index failure: the first finding fails the Job.
    old = job_for(recorded_meta(load("plain-pod")), all_ranks=True, kubernetes_version="1.28")
    assert "backoffLimitPerIndex" not in old.manifest["spec"]
    assert old.manifest["spec"]["podFailurePolicy"]["rules"][0]["action"] == "FailJob"


def test_the_variables_a_replay_drops_are_the_replayers() -> None:
    """The renderer restates the replay's list (the injector may not import the replayer)."""
    from fsdp_replay.replayer import launch

    assert set(NOT_REPLAYED) == set(launch._DROP_ENV)
    meta = recorded_meta(
        load("plain-pod"), extra_env={"TORCHELASTIC_ERROR_FILE": "/tmp/" + "a8Xk2Lp9Qz7Rv4Tn" * 2}
    )
    assert meta["env"]["TORCHELASTIC_ERROR_FILE"] == "<redacted>"
    assert job_for(meta).warnings == []  # dropped by the replay anyway: nothing to say about it


def test_cpu_device_asks_for_no_gpu() -> None:
    container = replay_container(SCENARIOS["cpu"](""))
    assert container["resources"] == {"requests": {"cpu": "4", "memory": "16Gi"}}
    assert container["args"][container["args"].index("--device") + 1] == "cpu"
    gpu = replay_container(job_for(recorded_meta(load("plain-pod")), gpu_resource="amd.com/gpu"))
    assert gpu["resources"] == {"limits": {"amd.com/gpu": 1}}


def test_user_pythonpath_is_kept_after_ours() -> None:
    """The recorded PYTHONPATH less the recording agent's two folders: the replay's agent comes first."""
    meta = recorded_meta(load("torchrun-pod"))
    assert meta["env"]["PYTHONPATH"].startswith("/opt/fsdp-replay/lib/fsdp_replay/boot/site:")
    assert user_pythonpath(meta["env"]) == "/workspace/src:/opt/extra"
    job = job_for(meta, mount_path="/replay")
    env = {e["name"]: e.get("value") for e in replay_container(job)["env"]}
    assert env["PYTHONPATH"] == "/replay/lib/fsdp_replay/boot/site:/replay/lib:/workspace/src:/opt/extra"
    # A trace of `fsdp-replay record` (the agent's folder is the run folder's link)
    assert user_pythonpath({"PYTHONPATH": "/src/fsdp_replay/boot/site:/run/.agent-path:/w"}) == "/w"


def test_identity_round_trip() -> None:
    """What the injection writes, the recorder redacts and the renderer reads back are the same."""
    pod = secret_pod()
    pod["spec"]["containers"][0]["env"].append(
        {"name": "ZONE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['$(zone)']"}}}
    )
    meta = recorded_meta(pod)
    refs = meta["env"][identity.ENV_POD_REFS]
    assert "$$(zone)" in refs  # Kubernetes would expand $(zone) in a value
    back = identity.recorded_pod(meta["env"])
    assert (
        back.known and back.name == "plain" and back.namespace == "ml" and back.service_account == "trainer"
    )
    assert back.image == f"registry.example/ml/train@{DIGEST}" and back.container == "trainer"
    assert back.env_refs["ZONE"] == {"fieldRef": {"fieldPath": "metadata.labels['$(zone)']"}}
    assert set(back.env_refs) == {"HF_TOKEN", "WANDB_API_KEY", "NODE_IP", "ZONE"}
    assert back.pull_secrets == ("regcred",) and back.store_secret == "trace-store"
    assert [next(iter(s)) for s in back.env_from] == ["secretRef", "configMapRef"]
    assert json.loads(refs.replace("$$(", "$("))["storeSecret"] == "trace-store"


# -- bad input ------------------------------------------------------------------------------------
def test_missing_or_impossible_rank_is_a_usage_error() -> None:
    meta = recorded_meta(load("plain-pod"))
    with pytest.raises(ConfigError, match="give --rank R"):
        render(meta, STORE, 8, JobConfig())
    with pytest.raises(ConfigError, match=r"--rank 8: the trace's world has 8 ranks \(0..7\)"):
        render(meta, STORE, 8, JobConfig(rank=8))
    with pytest.raises(ConfigError, match="exclude each other"):
        JobConfig(rank=1, all_ranks=True)


def test_a_trace_without_the_pod_identity() -> None:
    meta = recorded_meta(load("plain-pod"))
    meta["env"] = {k: v for k, v in meta["env"].items() if k not in identity.IDENTITY_ENV}
    with pytest.raises(TraceFormatError, match="give --image and --namespace"):
        render(meta, STORE, 8, JobConfig(rank=0))
    with pytest.raises(TraceFormatError, match="give --namespace"):
        render(meta, STORE, 8, JobConfig(rank=0, image="registry.example/ml/train:1.0"))
    job = render(meta, STORE, 8, JobConfig(rank=0, image="registry.example/ml/train:1.0", namespace="ml"))
    assert job.name == "replay-trace-rank-0" and job.namespace == "ml"
    meta["env"][identity.ENV_POD_REFS] = "<redacted>"
    with pytest.raises(TraceFormatError, match="redacted FSDP_REPLAY_POD_REFS"):
        render(meta, STORE, 8, JobConfig(rank=0))


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("FSDP_REPLAY_JOB_DEVICE", "tpu", "expected one of cuda, cpu"),
        ("FSDP_REPLAY_JOB_RANK", "-1", "must be >= 0"),
        ("FSDP_REPLAY_JOB_TO_STEP", "3", None),
        ("FSDP_REPLAY_JOB_NAME", "Replay_1", "not a valid Kubernetes name"),
        ("FSDP_REPLAY_JOB_MEMORY", "lots", "not a Kubernetes quantity"),
        ("FSDP_REPLAY_JOB_VOLUME_CLAIMS", "traces", "is not CLAIM:/path"),
        ("FSDP_REPLAY_JOB_VOLUME_CLAIMS", "traces:/opt/fsdp-replay/x", "overlap"),
        ("FSDP_REPLAY_JOB_IMAGE_PULL_POLICY", "Sometimes", "expected one of Always"),
    ],
)
def test_bad_options_name_their_variable(variable: str, value: str, message: str | None) -> None:
    env = {variable: value, "FSDP_REPLAY_JOB_FROM_STEP": "0"}
    if message is None:
        assert JobConfig.from_env(env).to_step == 3
        return
    with pytest.raises(ConfigError, match=message):
        JobConfig.from_env(env)


def test_old_python_is_warned_about() -> None:
    job = job_for(recorded_meta(load("plain-pod"), python="3.10.14"))
    assert any("Python 3.10.14" in w and "exit 3" in w for w in job.warnings)
    unknown = recorded_meta(load("plain-pod"))
    del unknown["versions"]
    (copier,) = spec_of(job_for(unknown))["initContainers"]
    assert copier["command"][3] == "/fsdp-replay/deps/."  # every version's libraries


def test_a_trace_without_payloads_is_warned_about() -> None:
    meta = recorded_meta(load("plain-pod"))
    meta["policy"] = {"payloads": "none"}
    assert any("replay TRACE --all-ranks" in w for w in job_for(meta).warnings)


# -- names and places -------------------------------------------------------------------------------
def test_default_names_are_short_unique_labels() -> None:
    long = "llama-70b-pretraining-" + "x" * 60 + "-worker-17"
    names = set()
    for rank in (0, 12):
        for start in (0, 9000):
            name = default_name(long, JobConfig(rank=rank, from_step=start))
            assert len(name) <= MAX_NAME_CHARS and name.endswith(
                f"rank-{rank}" + (f"-from-{start}" if start else "")
            )
            names.add(name)
    assert len(names) == 4
    assert default_name(long + "a", JobConfig(rank=0)) != default_name(long + "b", JobConfig(rank=0))
    assert default_name("Trainer_0", JobConfig(rank=1, to_step=5)) == "replay-trainer-0-rank-1-to-5"


@pytest.mark.parametrize(
    ("trace", "report"),
    [
        ("s3://b/llm/run-7/trace.zarr", "s3://b/llm/run-7/replays/J"),
        ("s3://b/llm/run-7/", "s3://b/llm/replays/J"),
        ("s3://b", "s3://b/replays/J"),
        ("/traces/run-7/trace.zarr", "/traces/run-7/replays/J"),
    ],
)
def test_default_report_is_beside_the_trace(trace: str, report: str) -> None:
    assert default_report(trace, "J") == report


# -- a real cluster (opt-in) -------------------------------------------------------------------------
def _kubectl(*args: str, stdin: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["kubectl", *args], input=stdin, capture_output=True, text=True, timeout=timeout)


@pytest.mark.k8s
@pytest.mark.skipif(shutil.which("kubectl") is None, reason="k8s: kubectl is not on PATH")
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_replay_jobs_pass_server_side_dry_run(scenario: str) -> None:
    """On a real cluster: the API server (admission, defaulting, validation of podFailurePolicy and the
    Indexed Job fields for its version) accepts every rendered Job, in the current namespace."""
    version = json.loads(_kubectl("version", "-o", "json").stdout)["serverVersion"]
    job = SCENARIOS[scenario](f"{version['major']}.{version['minor'].rstrip('+')}")
    job.manifest["metadata"].pop("namespace")
    dry = _kubectl("create", "--dry-run=server", "-o", "json", "-f", "-", stdin=json.dumps(job.manifest))
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["spec"]["template"]["spec"]["containers"][0]["name"] == REPLAY_CONTAINER


@pytest.mark.k8s
@pytest.mark.skipif(shutil.which("kubectl") is None, reason="k8s: kubectl is not on PATH")
@pytest.mark.skipif(
    not (
        os.environ.get("FSDP_REPLAY_TEST_K8S_TRACE") and os.environ.get("FSDP_REPLAY_TEST_K8S_PAYLOAD_IMAGE")
    ),
    reason="k8s: a replay Job needs a trace recorded in that cluster (FSDP_REPLAY_TEST_K8S_TRACE, a store URL its "
    "pods read) and the replay payload image pushed there (FSDP_REPLAY_TEST_K8S_PAYLOAD_IMAGE)",
)
def test_a_replay_job_runs_in_the_cluster(tmp_path: Path) -> None:
    """On a real cluster, from a trace the injector's sidecar stored: ``kubectl fsdp-replay replay``
    creates the Job, it completes, and its stored report says BIT-EXACT."""
    name = f"replay-test-{uuid.uuid4().hex[:8]}"
    trace, image = os.environ["FSDP_REPLAY_TEST_K8S_TRACE"], os.environ["FSDP_REPLAY_TEST_K8S_PAYLOAD_IMAGE"]
    plugin = [sys.executable, "-m", "fsdp_replay.cli.kubectl_plugin"]
    args = [trace, "--rank", "0", "--device", "cpu", "--payload-image", image, "--name", name]
    shown = subprocess.run(
        [*plugin, "replay", *args, "--dry-run"], capture_output=True, text=True, timeout=300
    )
    assert shown.returncode == 0, shown.stderr
    namespace = yaml.safe_load(shown.stdout)["metadata"]["namespace"]
    created = subprocess.run([*plugin, "replay", *args], capture_output=True, text=True, timeout=300)
    assert created.returncode == 0, created.stderr
    try:
        done = _kubectl(
            "wait", "-n", namespace, "--for=condition=complete", f"job/{name}", "--timeout=900s", timeout=960
        )
        logs = subprocess.run(
            [*plugin, "logs", name, "-n", namespace], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr + logs.stdout[-4000:]
        assert "rank 0: BIT-EXACT" in logs.stdout
        report = subprocess.run(
            [*plugin, "report", name, "-n", namespace], capture_output=True, text=True, timeout=120
        )
        assert report.returncode == 0 and "BIT-EXACT" in report.stdout, report.stderr
    finally:
        _kubectl("delete", "job", name, "-n", namespace, "--wait=false")
