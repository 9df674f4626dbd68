"""Snapshot blobs: raw tensor bytes behind a JSON index, decoded without pickle, every field
checked; an older agent's pickled snapshot loads only through torch's weights-only allow-list."""

from __future__ import annotations

import io
import json
import os
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp_replay.agent import capture, snapshot_blob
from fsdp_replay.errors import TraceFormatError


def _state() -> dict[str, Any]:
    return {
        "format": 1,
        "step": 7,
        "optimizers": [
            {
                "type": "AdamW",
                "param_names": ["w", "b"],
                "params": [torch.randn(3, 5).bfloat16(), torch.randn(5)[::2]],  # a strided view too
                "state": [{"step": torch.tensor(7.0), "exp_avg": torch.zeros(3, 5)}, {}],
                "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "foreach": None, "capturable": False}],
                "schedulers": [
                    {
                        "type": "ReduceLROnPlateau",
                        "state": {"best": float("inf"), "mode_worse": float("-inf")},
                    },
                    {"type": "LambdaLR", "state": {"lr_lambdas": [None], "_last_lr": [1e-3], 3: "int key"}},
                ],
            }
        ],
        "buffers": {
            "0.mask": torch.tensor([True, False]),
            "0.empty": torch.empty(0, 4),
            "0.scalar": torch.tensor(3, dtype=torch.int64),
            "0.f8": torch.zeros(4, dtype=torch.float8_e4m3fn),
        },
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(
                a.view(torch.uint8) if a.numel() and a.dtype.itemsize == 1 else a.float(),
                b.view(torch.uint8) if b.numel() and b.dtype.itemsize == 1 else b.float(),
            )
        )
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


def test_a_snapshot_round_trips_without_pickle() -> None:
    state = _state()
    data = capture.encode_snapshot(state)
    assert data.startswith(snapshot_blob.MAGIC) and data[:2] != b"PK"
    decoded = snapshot_blob.decode(data)
    assert decoded.unsupported == []
    assert _same(state, decoded.state)
    # writable: a restore may hand a state tensor to the optimizer as it is
    decoded.state["optimizers"][0]["params"][0].add_(1)


def test_a_value_the_format_cannot_hold_is_left_out_and_named() -> None:
    state = {"format": 1, "step": 0, "optimizers": [], "buffers": {}, "extra": {"fn": print, "ok": 1}}
    decoded = snapshot_blob.decode(capture.encode_snapshot(state))
    assert decoded.state["extra"] == {"ok": 1}
    assert decoded.unsupported == ["builtins.builtin_function_or_method"]


def _with_index(data: bytes, change: Any) -> bytes:
    magic, n = struct.unpack_from("<8sQ", data)
    index = json.loads(data[16 : 16 + n])
    change(index)
    raw = json.dumps(index).encode()
    return struct.pack("<8sQ", magic, len(raw)) + raw + data[16 + n :]


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda i: i["tensors"][0].update(offset=10**12), "lies outside"),
        (lambda i: i["tensors"][0].update(nbytes=10**12), "lies outside"),
        (lambda i: i["tensors"][0].update(shape=[10**9, 10**9]), "takes"),
        (lambda i: i["tensors"][0].update(shape=[-1]), "bad shape"),
        (lambda i: i["tensors"][0].update(dtype="os.system"), "unknown dtype"),
        (lambda i: i["tensors"][0].update(dtype="Tensor"), "unknown dtype"),
        (lambda i: i.update(state={"x": {"__tensor__": 99}}), "names tensor 99"),
        (lambda i: i.update(state=[1]), "not an object"),
        (lambda i: i.update(format=3), "not of format"),
        (lambda i: i.update(state={"x": {"__dict__": [[[1], 2]]}}), "not hashable"),
        (lambda i: i.update(state={"x": {"__device__": "no such device"}}), "names device"),
    ],
)
def test_a_crafted_index_is_refused(change: Any, words: str) -> None:
    data = _with_index(capture.encode_snapshot(_state()), change)
    with pytest.raises(TraceFormatError, match=words):
        snapshot_blob.decode(data)


@pytest.mark.parametrize(
    "data",
    [b"", b"FSRSNAP\x02", struct.pack("<8sQ", snapshot_blob.MAGIC, 10**15), b"\x80\x04N." + b"\0" * 20],
)
def test_short_or_foreign_bytes_are_refused(data: bytes) -> None:
    with pytest.raises(TraceFormatError):
        snapshot_blob.decode(data)


def test_deep_nesting_is_refused() -> None:
    state: Any = {"format": 1}
    for _ in range(200):
        state = {"x": state}
    with pytest.raises(TraceFormatError, match="nested too deeply"):
        snapshot_blob.decode(capture.encode_snapshot(state))


class _Boom:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_an_older_agents_pickle_loads_weights_only(tmp_path: Path) -> None:
    plain = io.BytesIO()
    torch.save(_state(), plain)  # what older agents wrote: tensors and plain containers
    assert _same(_state()["buffers"], snapshot_blob.decode(plain.getvalue()).state["buffers"])
    marker = tmp_path / "pwned"
    crafted = io.BytesIO()
    torch.save({"optimizers": [_Boom(str(marker))]}, crafted)
    with pytest.raises(TraceFormatError, match=r"a safe load refuses.*--trust-trace"):
        snapshot_blob.decode(crafted.getvalue())
    assert not marker.exists()
    snapshot_blob.decode(crafted.getvalue(), trusted=True)  # the user vouched for it: it is a pickle
    assert marker.exists()
