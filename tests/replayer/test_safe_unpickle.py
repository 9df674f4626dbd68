"""Object collectives in a replay unpickle their recorded bytes without calling what they name."""

from __future__ import annotations

import collections
import dataclasses
import io
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from fsdp_replay.replayer.safe_unpickle import RefusedObjectError, SafeUnpickler


@dataclasses.dataclass
class Point:
    x: int
    y: list[float]


def _round(obj: Any, modules: frozenset[str] = frozenset()) -> Any:
    class U(SafeUnpickler):
        program_modules = frozenset({"__main__", *modules})

    buf = io.BytesIO()
    pickle.Pickler(buf).dump(obj)  # what torch.distributed's _object_to_tensor does
    return U(io.BytesIO(buf.getvalue())).load()


def test_what_programs_send_still_arrives() -> None:
    state = {
        "step": 3,
        "lr": [1e-3, float("inf")],
        "w": torch.randn(2, 3),
        "bf": torch.ones(2, dtype=torch.bfloat16),
        "dtype": torch.float16,
        "arr": np.arange(4, dtype=np.int32),
        "od": collections.OrderedDict(a=1),
        "dd": collections.defaultdict(list),
        "set": {1, 2},
        "bytes": b"x",
    }
    got = _round(state)
    assert (
        torch.equal(got["w"], state["w"])
        and got["bf"].dtype == torch.bfloat16
        and got["dtype"] is torch.float16
    )
    assert np.array_equal(got["arr"], state["arr"]) and got["od"] == state["od"] and got["set"] == {1, 2}
    assert _round(Point(1, [2.0]), frozenset({__name__})) == Point(1, [2.0])  # the program's own class


class _Boom:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_object_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with pytest.raises(RefusedObjectError, match=r"names posix\.system"):
        _round([_Boom(str(marker))])
    with pytest.raises(RefusedObjectError, match=r"names test_safe_unpickle\.Point"):
        _round(Point(1, []))  # a class of a module the replay did not check
    evil = pickle.dumps(getattr)  # a builtin that is not a data type
    with pytest.raises(RefusedObjectError):
        SafeUnpickler(io.BytesIO(evil)).load()
    assert not marker.exists()


def test_a_tensors_storage_loads_weights_only(tmp_path: Path) -> None:
    """A tensor's storage is a nested torch.load: a crafted one is refused there too."""
    marker = tmp_path / "pwned"
    inner = io.BytesIO()
    torch.save(_Boom(str(marker)), inner)

    class Storage:
        def __reduce__(self) -> tuple[Any, ...]:
            import torch.storage

            return (torch.storage._load_from_bytes, (inner.getvalue(),))

    with pytest.raises(pickle.UnpicklingError):
        _round([Storage()])
    assert not marker.exists()
