"""``mutate`` and ``mutate_template`` as pure functions: idempotence, the PYTHONPATH rule, env precedence,
JSON Pointer escaping, least privilege, and the shapes a pod can have."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from injector_support import (
    FIXTURES,
    NATIVE_VERSION,
    PLAIN_VERSION,
    apply_patch,
    load,
    load_all,
    make_config,
    validate_pod,
)

from fsdp_replay.agent.config import RecordConfig, StepSet
from fsdp_replay.boot.pythonpath import PACKAGE_DIR, SITE_DIR, agent_pythonpath
from fsdp_replay.errors import ConfigError
from fsdp_replay.injector import containers, patch, validate
from fsdp_replay.injector.errors import InjectionError
from fsdp_replay.injector.mutate import mutate, mutate_template

POD_FIXTURES = ["plain-pod", "torchrun-pod", "select-one-pod", "user-payloads-pod", "unannotated-pod"]
CONFIGS = {
    "plain": make_config(PLAIN_VERSION),
    "native": make_config(NATIVE_VERSION),
    "sys-admin": make_config(NATIVE_VERSION, add_sys_admin=True),
    "custom-paths": make_config(
        PLAIN_VERSION, mount_path="/agent", spool_path="/runs/now", metrics_port=9100
    ),
    "signed": make_config(NATIVE_VERSION, signing_key_secret="trace-signing"),
}
SITE = "/opt/fsdp-replay/lib/fsdp_replay/boot/site"
LIB = "/opt/fsdp-replay/lib"


def inject(pod: dict[str, Any], config: str = "native", **kw: Any) -> tuple[dict[str, Any], list[str]]:
    ops, warnings = mutate(pod, "ml", CONFIGS[config], **kw)
    return apply_patch(pod, ops), warnings


def pod_with(**container: Any) -> dict[str, Any]:
    pod = load("plain-pod")
    pod["spec"]["containers"][0].update(container)
    return pod


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def named(pod: dict[str, Any], name: str) -> dict[str, Any]:
    everything = pod["spec"]["containers"] + pod["spec"].get("initContainers", [])
    return next(c for c in everything if c["name"] == name)


# -- idempotence and the patch itself -------------------------------------------------------------
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("name", POD_FIXTURES)
def test_idempotent(name: str, config: str) -> None:
    pod = load(name)
    for namespace_default in (False, True):
        once, _ = inject(pod, config, namespace_default=namespace_default)
        assert mutate(once, "ml", CONFIGS[config], namespace_default=namespace_default) == ([], [])


def test_our_containers_alone_mark_a_pod_injected() -> None:
    """A copy of an injected pod whose status annotations were dropped is still not injected twice."""
    once, _ = inject(load("plain-pod"))
    for key in [
        k
        for k in once["metadata"]["annotations"]
        if k.startswith("fsdp-replay.io/") and k != "fsdp-replay.io/record"
    ]:
        del once["metadata"]["annotations"][key]
    assert mutate(once, "ml", CONFIGS["native"]) == ([], [])


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("name", POD_FIXTURES)
def test_patch_applier_matches_jsonpatch(name: str, config: str) -> None:
    """``patch.apply`` (used by ``inject -f``) gives what the reference implementation gives."""
    pod = load(name)
    ops, _ = mutate(pod, "ml", CONFIGS[config], namespace_default=True)
    assert patch.apply(copy.deepcopy(pod), ops) == apply_patch(pod, ops)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("name", POD_FIXTURES)
def test_patched_pods_validate(name: str, config: str) -> None:
    out, _ = inject(load(name), config, namespace_default=True)
    validate_pod(out, NATIVE_VERSION if CONFIGS[config].native_sidecar else PLAIN_VERSION)


def test_user_entries_are_never_replaced_or_reordered() -> None:
    """Only additions, plus the value of the user's PYTHONPATH: every other user field is kept as is."""
    pod = load("torchrun-pod")
    ops, _ = mutate(pod, "ml", CONFIGS["native"])
    assert {op["op"] for op in ops} == {"add"}
    out = apply_patch(pod, ops)
    for field in ("containers", "initContainers"):
        for before in pod["spec"][field]:
            after = named(out, before["name"])
            for key, value in before.items():
                if key not in ("env", "volumeMounts"):
                    assert after[key] == value
            assert after.get("volumeMounts", [])[: len(before.get("volumeMounts", []))] == before.get(
                "volumeMounts", []
            )


# -- PYTHONPATH ---------------------------------------------------------------------------------
def test_agent_dirs_follow_the_package_layout() -> None:
    site, lib = containers.agent_dirs("/opt/fsdp-replay")
    assert (site, lib) == (SITE, LIB)
    # The folder the rule names really is where the sitecustomize lives in the package.
    relative = Path(site).relative_to(lib)
    assert (SITE_DIR.parents[len(relative.parts) - 1] / relative / "sitecustomize.py").is_file()


@pytest.mark.parametrize(
    "existing",
    [None, "", "/workspace", "/a:/b:/a", f"{SITE}:{LIB}:/workspace", f"/workspace:{LIB}", "$(EXTRA):/x"],
)
def test_pythonpath_is_the_boot_rule(existing: str | None) -> None:
    env = [] if existing is None else [{"name": "PYTHONPATH", "value": existing}]
    out, _ = inject(pod_with(env=env))
    value = env_of(out["spec"]["containers"][0])["PYTHONPATH"]
    assert value == agent_pythonpath(SITE, LIB, existing, sep=":")
    # Applying the rule again changes nothing: no second copy of our folders.
    assert agent_pythonpath(SITE, LIB, value, sep=":") == value
    assert value.split(":").count(SITE) == 1 and value.split(":").count(LIB) == 1


def test_pythonpath_already_right_is_not_touched() -> None:
    pod = pod_with(env=[{"name": "PYTHONPATH", "value": f"{SITE}:{LIB}:/w"}])
    ops, _ = mutate(pod, "ml", CONFIGS["native"])
    assert not [op for op in ops if op["path"].startswith("/spec/containers/0/env/0")]


def test_pythonpath_from_value_from_is_kept_with_a_warning() -> None:
    source = {"configMapKeyRef": {"name": "paths", "key": "pythonpath"}}
    out, warnings = inject(pod_with(env=[{"name": "PYTHONPATH", "valueFrom": source}]))
    env = out["spec"]["containers"][0]["env"]
    assert [e for e in env if e["name"] == "PYTHONPATH"] == [{"name": "PYTHONPATH", "valueFrom": source}]
    assert any("PYTHONPATH from valueFrom kept" in w and f"{SITE}:{LIB}" in w for w in warnings)
    assert env_of(out["spec"]["containers"][0])["FSDP_REPLAY_MODE"] == "record"
    validate_pod(out, NATIVE_VERSION)


def test_custom_mount_path() -> None:
    out, _ = inject(load("plain-pod"), "custom-paths")
    container = out["spec"]["containers"][0]
    assert env_of(container)["PYTHONPATH"] == "/agent/lib/fsdp_replay/boot/site:/agent/lib"
    assert env_of(container)["FSDP_REPLAY_OUT"] == "/runs/now"
    assert out["metadata"]["annotations"]["prometheus.io/port"] == "9100"


# -- env precedence -----------------------------------------------------------------------------
def test_users_env_wins_over_annotation_and_default() -> None:
    pod = load("user-payloads-pod")
    pod["spec"]["containers"][0]["env"].append({"name": "FSDP_REPLAY_SNAPSHOT_EVERY", "value": "7"})
    pod["metadata"]["annotations"]["fsdp-replay.io/snapshot-every"] = "100"
    out, warnings = inject(pod)
    env = env_of(out["spec"]["containers"][0])
    assert env["FSDP_REPLAY_PAYLOADS"] == "steps:9000-9010"
    assert env["FSDP_REPLAY_SNAPSHOT_EVERY"] == "7"
    assert [e["name"] for e in out["spec"]["containers"][0]["env"]].count("FSDP_REPLAY_PAYLOADS") == 1
    assert warnings == []


def test_annotation_wins_over_the_injector_default() -> None:
    pod = load("plain-pod")
    pod["metadata"]["annotations"]["fsdp-replay.io/payloads"] = "none"
    out, _ = inject(pod)
    assert env_of(out["spec"]["containers"][0])["FSDP_REPLAY_PAYLOADS"] == "none"
    out, _ = mutate_template(load("plain-pod"), make_config(payloads="steps:5"))
    assert env_of(out["spec"]["containers"][0])["FSDP_REPLAY_PAYLOADS"] == "steps:5"


def test_user_value_from_is_kept_silently() -> None:
    ref = {"secretKeyRef": {"name": "s", "key": "k"}}
    out, warnings = inject(pod_with(env=[{"name": "FSDP_REPLAY_MODE", "valueFrom": ref}]))
    assert env_of(out["spec"]["containers"][0])["FSDP_REPLAY_MODE"] == ref
    assert warnings == []


def test_user_mode_and_out_are_kept_with_warnings() -> None:
    pod = pod_with(
        env=[{"name": "FSDP_REPLAY_MODE", "value": "off"}, {"name": "FSDP_REPLAY_OUT", "value": "/scratch"}]
    )
    out, warnings = inject(pod)
    env = env_of(out["spec"]["containers"][0])
    assert (env["FSDP_REPLAY_MODE"], env["FSDP_REPLAY_OUT"]) == ("off", "/scratch")
    assert any("FSDP_REPLAY_MODE='off': not recorded" in w for w in warnings)
    assert any("FSDP_REPLAY_OUT='/scratch'" in w and "will not collect" in w for w in warnings)


def test_env_from_is_warned_about() -> None:
    _, warnings = inject(pod_with(envFrom=[{"configMapRef": {"name": "settings"}}]))
    assert any("uses envFrom" in w for w in warnings)


def test_injected_env_is_what_the_agent_reads() -> None:
    """The variables the injector writes are the ones ``RecordConfig.from_env`` reads, with valid values."""
    out, _ = inject(load("torchrun-pod"))
    env = {k: v for k, v in env_of(named(out, "trainer")).items() if isinstance(v, str)}
    config = RecordConfig.from_env(env)
    assert config.mode == "record" and config.out == "/var/lib/fsdp-replay"
    assert str(config.payloads) == "steps:0-3,100-"
    assert config.snapshot_every == 500
    assert str(config.module_fingerprints) == "steps:100-"


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "none",
        "all",
        "steps:0-3,10,20-",
        "5",
        " steps:1 ",
        "1-",
        "steps:",
        "steps:3-1",
        "a",
        "1,,2",
        "steps:all",
        "-1",
        "1 - 2",
    ],
)
def test_step_grammar_matches_the_agents(spec: str) -> None:
    try:
        StepSet.parse(spec)
        agent_ok = True
    except ConfigError:
        agent_ok = False
    assert (validate.step_spec_error(spec) is None) == agent_ok


def test_a_bad_payload_policy_names_every_form_it_takes() -> None:
    why = validate.payload_spec_error("most")
    assert why is not None and "none, all, steps:0-3,10,20- or window:N" in why, why


# -- JSON Pointer ---------------------------------------------------------------------------------
def test_pointer_escaping() -> None:
    assert patch.escape("a~b/c") == "a~0b~1c"
    assert patch.escape("~1") == "~01"  # "~" first, or "~1" would read back as "/"
    assert patch.unescape(patch.escape("x/~1~0/y")) == "x/~1~0/y"
    assert (
        patch.pointer("metadata", "annotations", "fsdp-replay.io/injected")
        == "/metadata/annotations/fsdp-replay.io~1injected"
    )
    doc = {"metadata": {"annotations": {"a~b/c": "1"}}}
    ops: list[patch.Op] = [patch.add(patch.pointer("metadata", "annotations", "a~b/c"), "2")]
    assert (
        apply_patch(doc, ops)
        == patch.apply(copy.deepcopy(doc), ops)
        == {"metadata": {"annotations": {"a~b/c": "2"}}}
    )


def test_annotation_keys_are_escaped_in_the_patch() -> None:
    ops, _ = mutate(load("plain-pod"), "ml", CONFIGS["native"])
    paths = [op["path"] for op in ops if op["path"].startswith("/metadata/annotations/")]
    assert "/metadata/annotations/fsdp-replay.io~1injected" in paths
    assert "/metadata/annotations/prometheus.io~1scrape" in paths
    assert all("/" not in p.removeprefix("/metadata/annotations/") for p in paths)


def test_custom_prefix() -> None:
    pod = load("plain-pod")
    pod["metadata"]["annotations"] = {"replay.example.com/record": "true"}
    out, _ = mutate_template(pod, make_config(annotation_prefix="replay.example.com"))
    assert out["metadata"]["annotations"]["replay.example.com/injected-containers"] == "trainer"
    assert mutate(load("plain-pod"), "ml", make_config(annotation_prefix="replay.example.com")) == ([], [])


# -- least privilege --------------------------------------------------------------------------------
def _walk(value: Any) -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [(k, v) for k, v in value.items()] + [kv for v in value.values() for kv in _walk(v)]
    if isinstance(value, list):
        return [kv for v in value for kv in _walk(v)]
    return []


@pytest.mark.parametrize("config", CONFIGS)
def test_least_privilege(config: str) -> None:
    out, _ = inject(load("torchrun-pod"), config)
    assert ("privileged", True) not in _walk(out)
    assert "hostPID" not in out["spec"] and "hostNetwork" not in out["spec"] and "hostPath" not in str(out)
    sidecar = named(out, "fsdp-replay-sidecar")["securityContext"]
    expected = {"BPF", "PERFMON", "SYS_PTRACE"} | ({"SYS_ADMIN"} if config == "sys-admin" else set())
    assert sidecar["privileged"] is False
    assert sidecar["capabilities"]["drop"] == ["ALL"]
    assert set(sidecar["capabilities"]["add"]) == expected
    assert len(sidecar["capabilities"]["add"]) == len(expected)
    assert sidecar["readOnlyRootFilesystem"] is True
    if config == "sys-admin":
        # The API server refuses allowPrivilegeEscalation: false together with CAP_SYS_ADMIN.
        assert "allowPrivilegeEscalation" not in sidecar
    else:
        assert sidecar["allowPrivilegeEscalation"] is False
    copier = named(out, "fsdp-replay-agent")["securityContext"]
    assert copier["capabilities"] == {"drop": ["ALL"]}
    assert copier["runAsNonRoot"] is True and copier["allowPrivilegeEscalation"] is False
    # The trainers get mounts and env only: their security context is the user's.
    for before in load("torchrun-pod")["spec"]["containers"]:
        assert named(out, before["name"]).get("securityContext") == before.get("securityContext")
    agent_mount = next(m for m in named(out, "trainer")["volumeMounts"] if m["name"] == "fsdp-replay-agent")
    assert agent_mount["readOnly"] is True


# -- which containers ---------------------------------------------------------------------------------
def test_named_init_container_gets_the_payload_before_it_runs() -> None:
    pod = load("torchrun-pod")
    pod["spec"]["initContainers"] = [
        {"name": "wait-for-rendezvous", "image": "busybox"},
        {"name": "warmup", "image": "registry.example/ml/train:1.0", "command": ["python", "warmup.py"]},
    ]
    pod["metadata"]["annotations"]["fsdp-replay.io/containers"] = "warmup, trainer"
    out, _ = inject(pod, "native")
    names = [c["name"] for c in out["spec"]["initContainers"]]
    assert names == ["wait-for-rendezvous", "fsdp-replay-agent", "warmup", "fsdp-replay-sidecar"]
    assert "PYTHONPATH" in env_of(named(out, "warmup"))
    assert "FSDP_REPLAY_MODE" not in env_of(named(out, "evaluator"))
    assert out["metadata"]["annotations"]["fsdp-replay.io/injected-containers"] == "trainer,warmup"
    validate_pod(out, NATIVE_VERSION)


def test_unknown_and_invalid_container_names() -> None:
    pod = load("select-one-pod")
    pod["metadata"]["annotations"]["fsdp-replay.io/containers"] = "trainer,missing,Bad_Name"
    out, warnings = inject(pod)
    assert any("no container named missing" in w for w in warnings)
    assert any("'Bad_Name'" in w for w in warnings)
    assert out["metadata"]["annotations"]["fsdp-replay.io/injected-containers"] == "trainer"
    pod["metadata"]["annotations"]["fsdp-replay.io/containers"] = "missing"
    ops, warnings = mutate(pod, "ml", CONFIGS["native"])
    assert ops == [] and warnings[-1] == "fsdp-replay: no container to record; pod left unchanged"


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda p: p["spec"].setdefault("volumes", []).append({"name": "fsdp-replay-spool", "emptyDir": {}}), "volume named fsdp-replay-spool"),
        (lambda p: p["spec"]["containers"][0].update(volumeMounts=[{"name": "x", "mountPath": "/opt/fsdp-replay/"}]), "already mounts something at /opt/fsdp-replay"),
        (lambda p: p["spec"]["containers"][0].update(ports=[{"containerPort": 9464}]), "uses port 9464"),
    ],
    ids=["volume-name", "mount-path", "metrics-port"],
)  # fmt: skip
def test_conflicts_leave_the_pod_unchanged(change: Any, reason: str) -> None:
    pod = load("plain-pod")
    change(pod)
    ops, warnings = mutate(pod, "ml", CONFIGS["native"])
    assert ops == []
    assert (
        len(warnings) == 1 and reason in warnings[0] and warnings[0].startswith("fsdp-replay: not injected: ")
    )


def test_metrics_port_annotation_avoids_a_conflict() -> None:
    pod = load("plain-pod")
    pod["spec"]["containers"][0]["ports"] = [{"containerPort": 9464}]
    pod["metadata"]["annotations"]["fsdp-replay.io/metrics-port"] = "9465"
    out, warnings = inject(pod)
    assert warnings == []
    assert named(out, "fsdp-replay-sidecar")["ports"][0]["containerPort"] == 9465
    assert out["metadata"]["annotations"]["prometheus.io/port"] == "9465"


# -- annotation values -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "value", "variable"),
    [
        ("payloads", "steps:9-1", "FSDP_REPLAY_PAYLOADS"),
        ("snapshot-every", "often", "FSDP_REPLAY_SNAPSHOT_EVERY"),
        ("snapshot-every", "-5", "FSDP_REPLAY_SNAPSHOT_EVERY"),
        ("cupti", "sometimes", "FSDP_REPLAY_CUPTI"),
        ("module-fingerprints", "every", "FSDP_REPLAY_MODULE_FINGERPRINTS"),
        ("reserve-bytes", "1GiB", "FSDP_REPLAY_RESERVE_BYTES"),
    ],
)
def test_bad_annotation_values_fall_back_with_a_warning(name: str, value: str, variable: str) -> None:
    pod = load("plain-pod")
    pod["metadata"]["annotations"][f"fsdp-replay.io/{name}"] = value
    out, warnings = inject(pod)
    env = env_of(out["spec"]["containers"][0])
    if variable == "FSDP_REPLAY_PAYLOADS":
        assert env[variable] == "all"
    else:
        assert variable not in env
    assert len(warnings) == 1 and f"fsdp-replay.io/{name}" in warnings[0]
    validate_pod(out, NATIVE_VERSION)


def test_bad_secret_name_mounts_nothing() -> None:
    pod = load("plain-pod")
    pod["metadata"]["annotations"]["fsdp-replay.io/store-secret"] = "Not A Name"
    out, warnings = inject(pod)
    assert "envFrom" not in named(out, "fsdp-replay-sidecar")
    assert any("is not a Secret name" in w for w in warnings)
    validate_pod(out, NATIVE_VERSION)


@pytest.mark.parametrize(
    ("value", "recorded"), [("true", True), ("TRUE", True), ("1", True), ("false", False), ("no", False)]
)
def test_record_values(value: str, recorded: bool) -> None:
    pod = load("plain-pod")
    pod["metadata"]["annotations"]["fsdp-replay.io/record"] = value
    ops, warnings = mutate(pod, "ml", CONFIGS["native"], namespace_default=True)
    assert bool(ops) is recorded and warnings == []


def test_unclear_record_value_is_not_recorded() -> None:
    pod = load("plain-pod")
    pod["metadata"]["annotations"]["fsdp-replay.io/record"] = "maybe"
    ops, warnings = mutate(pod, "ml", CONFIGS["native"], namespace_default=True)
    assert ops == [] and "neither true nor false" in warnings[0]


# -- pod-level fields ---------------------------------------------------------------------------------
def test_guaranteed_pod_stays_guaranteed() -> None:
    pod = load("plain-pod")
    pod["spec"]["containers"][0]["resources"] = {
        "limits": {"cpu": "4", "memory": "16Gi"},
        "requests": {"cpu": "4000m", "memory": "16Gi"},
    }
    assert containers.is_guaranteed(pod["spec"])
    out, _ = inject(pod)
    assert not containers.is_guaranteed(pod["spec"] | {"initContainers": [{"name": "x", "resources": {}}]})
    assert containers.is_guaranteed(out["spec"])
    sidecar = named(out, "fsdp-replay-sidecar")["resources"]
    assert sidecar == {
        "requests": {"cpu": "100m", "memory": "1Gi"},
        "limits": {"cpu": "100m", "memory": "1Gi"},
    }


def test_burstable_pod_gets_the_configured_resources() -> None:
    out, _ = inject(load("torchrun-pod"))
    assert named(out, "fsdp-replay-sidecar")["resources"] == {
        "requests": {"cpu": "100m", "memory": "256Mi"},
        "limits": {"memory": "1Gi"},
    }


def test_users_prometheus_annotations_are_kept() -> None:
    pod = load("plain-pod")
    pod["metadata"]["annotations"].update({"prometheus.io/scrape": "true", "prometheus.io/port": "8000"})
    out, warnings = inject(pod)
    assert out["metadata"]["annotations"]["prometheus.io/port"] == "8000"
    assert "prometheus.io/path" not in out["metadata"]["annotations"]
    assert any("prometheus.io annotations are kept" in w for w in warnings)


def test_share_process_namespace_false_is_kept() -> None:
    pod = load("plain-pod")
    pod["spec"]["shareProcessNamespace"] = False
    out, warnings = inject(pod)
    assert out["spec"]["shareProcessNamespace"] is False
    assert any("shareProcessNamespace: false is kept" in w for w in warnings)


def test_host_pid_pod_gets_no_share_process_namespace() -> None:
    pod = load("plain-pod")
    pod["spec"]["hostPID"] = True
    out, _ = inject(pod)
    assert "shareProcessNamespace" not in out["spec"]
    validate_pod(out, NATIVE_VERSION)


def test_pod_without_annotations_or_lists() -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": "w-"},
        "spec": {"containers": [{"name": "c", "image": "i"}]},
    }
    ops, _ = mutate(pod, "ml", CONFIGS["plain"], namespace_default=True)
    paths = [op["path"] for op in ops]
    for path in (
        "/metadata/annotations",
        "/spec/volumes",
        "/spec/initContainers",
        "/spec/containers/0/env",
        "/spec/containers/0/volumeMounts",
    ):
        assert path in paths
    validate_pod(apply_patch(pod, ops), PLAIN_VERSION)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda p: p["spec"].update(containers={"a": {}}), "spec.containers is not a list"),
        (lambda p: p["spec"].pop("containers"), "spec.containers is missing"),
        (lambda p: p["spec"].update(initContainers="x"), "spec.initContainers is not a list"),
        (lambda p: p["spec"]["containers"].append("x"), "spec.containers[1] is not a container"),
        (lambda p: p["spec"]["containers"][0].update(env={"A": "1"}), "env is not a list"),
        (lambda p: p["spec"]["containers"][0].update(env=[{"value": "1"}]), "env[0] has no name"),
        (lambda p: p.update(spec=[]), "spec is not an object"),
        (lambda p: p["metadata"].update(annotations=["fsdp-replay.io/record"]), "metadata.annotations is not an object"),
    ],
)  # fmt: skip
def test_shapes_it_cannot_patch_raise(change: Any, message: str) -> None:
    pod = load("plain-pod")
    change(pod)
    with pytest.raises(InjectionError, match=message.replace("[", r"\[").replace("]", r"\]")):
        mutate(pod, "ml", CONFIGS["native"])


# -- templates ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("version", [PLAIN_VERSION, NATIVE_VERSION])
def test_pytorchjob_templates(version: str) -> None:
    job = load("pytorchjob")
    out, warnings = mutate_template(job, make_config(version))
    assert warnings == []
    assert job == load("pytorchjob")  # the input is not changed
    for role in ("Master", "Worker"):
        template = out["spec"]["pytorchReplicaSpecs"][role]["template"]
        validate_pod(template, version)
        assert template["metadata"]["annotations"]["fsdp-replay.io/injected-containers"] == "pytorch"
        assert (
            out["spec"]["pytorchReplicaSpecs"][role]["replicas"]
            == job["spec"]["pytorchReplicaSpecs"][role]["replicas"]
        )
    worker = out["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert env_of(worker)["PYTHONPATH"] == f"{SITE}:{LIB}:/workspace"
    # Master has CPU and memory limits (requests default to them): Guaranteed, and still so once injected.
    master = out["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    assert containers.is_guaranteed(master)
    assert mutate_template(out, make_config(version)) == (out, [])


def test_all_template_kinds() -> None:
    docs = load_all("multi")
    injected = {}
    for doc in docs:
        out, _ = mutate_template(doc, CONFIGS["native"])
        injected[doc["kind"]] = (doc, out)
    for kind in ("ConfigMap", "Service", "StatefulSet"):
        assert injected[kind][0] == injected[kind][1], kind
    templates = {
        "Deployment": lambda d: d["spec"]["template"],
        "Job": lambda d: d["spec"]["template"],
        "CronJob": lambda d: d["spec"]["jobTemplate"]["spec"]["template"],
        "JobSet": lambda d: d["spec"]["replicatedJobs"][0]["template"]["spec"]["template"],
        "List": lambda d: d["items"][0],
    }
    for kind, get in templates.items():
        template = get(injected[kind][1])
        assert template["metadata"]["annotations"]["fsdp-replay.io/injected"], kind
        validate_pod(template, NATIVE_VERSION)
    job_env = env_of(injected["Job"][1]["spec"]["template"]["spec"]["containers"][0])
    assert job_env["FSDP_REPLAY_PAYLOADS"] == "none"


def test_same_kind_in_another_group_is_left_alone() -> None:
    crd = {
        "apiVersion": "example.com/v1",
        "kind": "Job",
        "metadata": {"name": "x"},
        "spec": {"template": load("plain-pod")},
    }
    assert mutate_template(crd, CONFIGS["native"]) == (crd, [])


def test_broken_template_is_left_alone_with_a_warning() -> None:
    job = load("pytorchjob")
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"] = {"pytorch": {}}
    out, warnings = mutate_template(job, CONFIGS["native"])
    assert out["spec"]["pytorchReplicaSpecs"]["Worker"] == job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert "injected" in str(out["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["metadata"])
    assert warnings == [
        "fsdp-replay: PyTorchJob/llm-pretrain /spec/pytorchReplicaSpecs/Worker/template: not injected: "
        "pod ml/(unnamed): spec.containers is not a list"
    ]


# -- layering -----------------------------------------------------------------------------------------
def test_webhook_imports_neither_torch_nor_yaml() -> None:
    """The webhook image needs the standard library only; ``inject`` imports PyYAML when it runs."""
    code = (
        "import sys, fsdp_replay.injector.server, fsdp_replay.injector.cli, fsdp_replay.injector.mutate;"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'yaml', 'numpy', 'zarr'));"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=FIXTURES.parents[2])


def test_injected_env_loads_our_sitecustomize_from_the_copied_payload(tmp_path: Path) -> None:
    """The whole in-pod path without a cluster: lay out the payload image's /fsdp-replay, run the copy
    container's own command into the 'emptyDir', then start Python with the recorded container's
    injected environment: it loads our sitecustomize and our package from the copy, and keeps the
    user's PYTHONPATH after them."""
    source = tmp_path / "image" / "fsdp-replay"  # the payload image's /fsdp-replay
    shutil.copytree(PACKAGE_DIR, source / "lib" / "fsdp_replay", ignore=shutil.ignore_patterns("__pycache__"))
    mount, spool, user = tmp_path / "opt" / "fsdp-replay", tmp_path / "spool", tmp_path / "workspace"
    mount.mkdir(parents=True)
    user.mkdir()
    (user / "usermod.py").write_text("VALUE = 42\n")
    config = make_config(mount_path=str(mount), spool_path=str(spool))
    out, _ = mutate_template(pod_with(env=[{"name": "PYTHONPATH", "value": str(user)}]), config)

    copier = named(out, "fsdp-replay-agent")
    command = [
        a.replace(containers.PAYLOAD_SOURCE + "/", f"{source}/").replace(
            containers.COPY_TARGET + "/", f"{mount}/"
        )
        for a in copier["command"]
    ]
    subprocess.run(command, check=True)
    assert (mount / "lib" / "fsdp_replay" / "boot" / "site" / "sitecustomize.py").is_file()

    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_REPLAY_", "PYTHON"))}
    # the literal values (the downward API's identity variables need a kubelet, and nothing here reads them)
    env.update({e["name"]: e["value"] for e in out["spec"]["containers"][0]["env"] if "value" in e})
    code = (
        "import sys, sitecustomize, fsdp_replay, usermod;"
        "print(sitecustomize.__file__); print(fsdp_replay.__file__); print(usermod.VALUE)"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    site_file, package_file, value = proc.stdout.split()
    assert Path(site_file).parent == mount / "lib" / "fsdp_replay" / "boot" / "site"
    assert Path(package_file).parent == mount / "lib" / "fsdp_replay"
    assert value == "42"
    assert "agent not started" not in proc.stderr


def test_a_signing_key_secret_reaches_the_sidecar_only() -> None:
    """The key's Secret is a volume mounted read-only in the sidecar alone (the trainers never see
    it), the sidecar is told where the key file is, and a missing Secret cannot hold the pod back."""
    out, _ = inject(load("torchrun-pod"), "signed")
    volume = next(v for v in out["spec"]["volumes"] if v["name"] == containers.SIGNING_VOLUME)
    assert volume["secret"]["secretName"] == "trace-signing" and volume["secret"]["optional"] is True
    sidecar = named(out, containers.SIDECAR_CONTAINER)
    assert env_of(sidecar)[containers.SIDECAR_ENV_SIGNING_KEY] == containers.SIGNING_KEY_FILE
    assert {
        "name": containers.SIGNING_VOLUME,
        "mountPath": containers.SIGNING_KEY_DIR,
        "readOnly": True,
    } in sidecar["volumeMounts"]
    for c in out["spec"]["containers"]:
        assert all(m["name"] != containers.SIGNING_VOLUME for m in c.get("volumeMounts", [])), c["name"]
    unsigned, _ = inject(load("torchrun-pod"), "native")
    assert all(v["name"] != containers.SIGNING_VOLUME for v in unsigned["spec"]["volumes"])


def test_auto_records_a_gpu_container_with_the_flight_recorder_and_a_cpu_one_with_every_step() -> None:
    # the chart's default (injection.payloads: auto): a container that asks for a GPU records
    # with the agent's GPU default, one that does not with every step's payloads
    from fsdp_replay.agent.config import AUTO_GPU_POLICY

    assert validate.AUTO_GPU_POLICY == AUTO_GPU_POLICY  # the injector restates the agent's
    gpu_pod = load("torchrun-pod")
    del gpu_pod["metadata"]["annotations"]["fsdp-replay.io/payloads"]
    out, _ = inject(gpu_pod)
    assert env_of(out["spec"]["containers"][0])["FSDP_REPLAY_PAYLOADS"] == AUTO_GPU_POLICY
    cpu_pod = load("plain-pod")
    assert "resources" not in cpu_pod["spec"]["containers"][0]
    out, _ = inject(cpu_pod)
    assert env_of(out["spec"]["containers"][0])["FSDP_REPLAY_PAYLOADS"] == "all"
    zero = copy.deepcopy(cpu_pod)
    zero["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": 0, "cpu": "4"}}
    out, _ = inject(zero)
    assert env_of(out["spec"]["containers"][0])["FSDP_REPLAY_PAYLOADS"] == "all"
    annotated = copy.deepcopy(gpu_pod)
    annotated["metadata"]["annotations"]["fsdp-replay.io/payloads"] = "steps:5"
    out, _ = inject(annotated)  # the pod's own policy wins
    assert env_of(out["spec"]["containers"][0])["FSDP_REPLAY_PAYLOADS"] == "steps:5"
