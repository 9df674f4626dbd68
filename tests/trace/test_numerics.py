"""The replay key's comparison (``trace/numerics.py``): what differs, when, and what it means."""

from __future__ import annotations

from fsdp_replay.trace import numerics

H200 = {
    "device": {
        "kind": "cuda",
        "name": "NVIDIA H200",
        "sm_count": 132,
        "capability": "9.0",
        "driver": "580.1",
    },
    "libraries": {"torch": "2.11.0", "cuda": "12.8", "cublas": "12.8.4", "nccl": "2.27.3"},
    "flags": {"matmul_allow_tf32": False, "use_deterministic_algorithms": False, "intra_op_threads": 8},
    "env": {"NCCL_ALGO": "Ring"},
}


def _with(part: str, **values: object) -> dict:
    return {**H200, part: {**H200[part], **values}}


def test_the_same_key_has_no_mismatch_and_each_leaf_is_named_with_its_kind() -> None:
    assert numerics.compare(H200, H200) == []
    other = {**_with("device", name="NVIDIA A100", sm_count=108), "env": {}}
    found = {m.key: m for m in numerics.compare(H200, other)}
    assert set(found) == {"device.name", "device.sm_count", "env.NCCL_ALGO"}
    assert found["device.name"].kind == numerics.DEVICE and "GPU model" in found["device.name"].meaning
    assert found["env.NCCL_ALGO"].kind == numerics.COLLECTIVE and found["env.NCCL_ALGO"].replay is None
    assert numerics.likely_cause(found.values()).key in ("device.name", "device.sm_count")


def test_a_leaf_an_older_agent_did_not_record_is_not_a_mismatch() -> None:
    older = {**H200, "libraries": {"torch": "2.11.0", "cuda": "12.8"}}
    assert numerics.compare(older, H200) == []


def test_nccl_settings_never_explain_a_one_rank_replay() -> None:
    ms = numerics.compare(
        H200, {**H200, "env": {"NCCL_ALGO": "Tree"}, "libraries": {**H200["libraries"], "nccl": "2.28"}}
    )
    assert {m.kind for m in ms} == {numerics.COLLECTIVE}
    assert numerics.likely_cause(ms) is None


def test_flags_in_effect_at_a_step_follow_the_recorded_changes() -> None:
    changes = [
        {"step": 2, "flags": {"matmul_allow_tf32": True}},
        {"step": 5, "flags": {"intra_op_threads": 4}},
    ]
    assert numerics.flags_at(H200, changes, 1)["matmul_allow_tf32"] is False
    at3 = numerics.flags_at(H200, changes, 3)
    assert at3["matmul_allow_tf32"] is True and at3["intra_op_threads"] == 8
    assert numerics.flags_at(H200, changes, 5)["intra_op_threads"] == 4
    ms = numerics.compare({"flags": at3}, {"flags": H200["flags"]}, step=3)
    assert [(m.key, m.step) for m in ms] == [("flags.matmul_allow_tf32", 3)]
    assert "(from step 3)" in ms[0].line()


def test_a_replay_applies_every_env_key_as_recorded() -> None:
    from fsdp_replay.trace import schema

    for v in (*numerics.KEY_ENV, *numerics.NCCL_ENV):
        assert v not in schema.ENV_MACHINE and not v.startswith(schema.ENV_MACHINE_PREFIXES), v
