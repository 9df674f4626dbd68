"""Every annotation value is checked for characters and length before its grammar (pure functions)."""

from __future__ import annotations

from typing import Any

import pytest
from injector_support import apply_patch, load, make_config

from fsdp_replay.injector import validate
from fsdp_replay.injector.mutate import mutate


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("s3://bucket/prefix", None),
        ("café", None),  # not ASCII, but printable: the grammar decides
        (True, None),  # YAML written by hand: record: true
        (5, None),
        (2.5, None),
        ("x" * validate.MAX_ANNOTATION_CHARS, None),
        ("x" * (validate.MAX_ANNOTATION_CHARS + 1), "longer than 1024 characters"),
        ("a\x00b", "control character (U+0000 at 1)"),
        ("a\tb", "control character (U+0009 at 1)"),
        ("a\x7f", "control character (U+007F at 1)"),
        ("a\x9b", "control character (U+009B at 1)"),
        ("a\u2029", "control character (U+2029 at 1)"),
        ("\ud800", "control character (U+D800 at 0)"),
        (["true"], "a list is not a string"),
        ({"a": 1}, "a dict is not a string"),
    ],
)
def test_annotation_value_error(value: Any, error: str | None) -> None:
    why = validate.annotation_value_error(value)
    assert why == error if error is None else (why is not None and error in why)


def test_store_urls_may_be_longer() -> None:
    url = "s3://bucket/" + "x" * (validate.MAX_STORE_URL_CHARS - 12)
    assert validate.annotation_value_error(url, max_chars=validate.MAX_STORE_URL_CHARS) is None
    assert validate.annotation_value_error(url + "x", max_chars=validate.MAX_STORE_URL_CHARS) is not None


def test_shown_is_short_and_escaped() -> None:
    assert validate.shown("a\nb") == "'a\\nb'"
    text = validate.shown("y" * 100_000)
    assert len(text) < 80 and text.endswith("... (100000 characters)")


def test_hand_written_yaml_booleans_and_numbers_still_work() -> None:
    pod = load("plain-pod")
    pod["metadata"]["annotations"] = {"fsdp-replay.io/record": True, "fsdp-replay.io/snapshot-every": 10}
    ops, warnings = mutate(pod, "ml", make_config())
    assert ops and warnings == []


def test_a_bad_value_leaves_the_rest_of_the_pod_injected() -> None:
    pod = load("plain-pod")
    pod["metadata"]["annotations"]["fsdp-replay.io/store"] = "s3://b/\x00"
    pod["metadata"]["annotations"]["fsdp-replay.io/payloads"] = "none"
    ops, warnings = mutate(pod, "ml", make_config(store="s3://default/traces"))
    out = apply_patch(pod, ops)
    env = {e["name"]: e.get("value") for e in out["spec"]["containers"][0]["env"]}
    assert env["FSDP_REPLAY_PAYLOADS"] == "none"
    sidecar = next(c for c in out["spec"]["initContainers"] if c["name"] == "fsdp-replay-sidecar")
    stores = [e["value"] for e in sidecar["env"] if e["name"] == "FSDP_REPLAY_SIDECAR_STORE"]
    assert stores == ["s3://default/traces"]
    (warning,) = warnings
    assert "fsdp-replay.io/store" in warning and "using the default store" in warning
