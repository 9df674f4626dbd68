"""DataLoader batches as events record them: their structure, and each tensor's entry."""

from __future__ import annotations

import random
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch

from fsdp_replay.agent import capture
from fsdp_replay.agent.counters import AgentState
from fsdp_replay.agent.tensor_record import TensorRecorder
from fsdp_replay.agent.writer import BackgroundWriter, BlobRef
from fsdp_replay.trace import schema


def _typed(x: Any, node: dict[str, Any]) -> dict[str, Any]:
    """A container of a subclass (transformers' ``BatchEncoding``, a namedtuple) names its class,
    ``module:qualname``, so a replay that serves the batch from the trace rebuilds the same type."""
    cls = type(x)
    if cls not in (dict, list, tuple):
        node["c"] = f"{cls.__module__}:{cls.__qualname__}"
    return node


def encode_structure(x: Any, tensors: list[torch.Tensor]) -> Any:
    """A batch as JSON with tensors replaced by their index in ``tensors`` (appended here)."""
    if isinstance(x, torch.Tensor):
        tensors.append(x)
        return {"T": len(tensors) - 1}
    if isinstance(x, dict):
        return _typed(
            x, {"d": [[encode_structure(k, tensors), encode_structure(v, tensors)] for k, v in x.items()]}
        )
    if isinstance(x, tuple):
        fields = getattr(x, "_fields", None)
        items = [encode_structure(v, tensors) for v in x]
        return _typed(x, {"n": [type(x).__name__, list(fields), items]} if fields else {"t": items})
    if isinstance(x, list):
        return _typed(x, {"l": [encode_structure(v, tensors) for v in x]})
    if x is None or isinstance(x, bool | int | float | str):
        return {"v": x}
    return {"o": repr(x)[:200]}


class BatchRecorder:
    """Numbers DataLoader iterators (``loader``) and their batches (``index``) and writes each."""

    def __init__(
        self, state: AgentState, tensors: TensorRecorder, start: Callable[[], BackgroundWriter]
    ) -> None:
        self.state = state
        self.tensors = tensors
        self.start = start
        self.iterators: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()
        self.loaders = 0
        self._rng_before: tuple[Any, ...] | None = None

    def before(self) -> None:
        self._rng_before = _rng_now()

    def on_batch(self, iterator: Any, batch: Any) -> None:
        w = self.start()
        slot = self.iterators.get(iterator)
        if slot is None:
            slot = self.iterators[iterator] = [self.loaders, 0]
            self.loaders += 1
        leaves: list[torch.Tensor] = []
        structure = encode_structure(batch, leaves)
        st = self.state
        event: dict[str, Any] = {
            "type": schema.EV_BATCH,
            "step": st.pos.step,
            "micro": st.pos.micro,
            "index": slot[1],
            "loader": slot[0],
            "structure": structure,
            "tensors": [self.tensors.record("", t, st.payload_now, kind="batches") for t in leaves],
        }
        after = _rng_now()
        if self._rng_before is not None and not _same_rng(self._rng_before, after):
            # The fetch drew random numbers in this process (a dataset or collate function that
            # augments): a replay that serves the batch without running them sets this state.
            state = capture.rng_state()

            def with_rng() -> list[tuple[str, Any]]:
                ref = BlobRef()
                return [("raw", (ref, capture.encode_rng(state)[1])), ("ev", {**event, "rng": ref})]

            w.call(with_rng)
        else:
            w.event(event)
        self._rng_before = None
        slot[1] += 1
        st.batches += 1


def _rng_now() -> tuple[Any, ...]:
    """The process's CPU RNG states, cheaply comparable (a fetch that draws changes one)."""
    np = sys.modules.get("numpy")
    return (
        torch.get_rng_state(),
        random.getstate(),
        np.random.get_state(legacy=True) if np is not None else None,
    )


def _same_rng(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    if not torch.equal(a[0], b[0]) or a[1] != b[1]:
        return False
    if a[2] is None or b[2] is None:
        return a[2] is b[2]
    return bool(a[2][2] == b[2][2] and a[2][3] == b[2][3] and (a[2][1] == b[2][1]).all())
