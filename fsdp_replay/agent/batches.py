"""DataLoader batches as events record them: their structure, and each tensor's entry."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from fsdp_replay.agent.counters import AgentState
from fsdp_replay.agent.tensor_record import TensorRecorder
from fsdp_replay.agent.writer import BackgroundWriter
from fsdp_replay.trace import schema


def encode_structure(x: Any, tensors: list[torch.Tensor]) -> Any:
    """A batch as JSON with tensors replaced by their index in ``tensors`` (appended here)."""
    if isinstance(x, torch.Tensor):
        tensors.append(x)
        return {"T": len(tensors) - 1}
    if isinstance(x, dict):
        return {"d": [[encode_structure(k, tensors), encode_structure(v, tensors)] for k, v in x.items()]}
    if isinstance(x, tuple):
        fields = getattr(x, "_fields", None)
        items = [encode_structure(v, tensors) for v in x]
        return {"n": [type(x).__name__, list(fields), items]} if fields else {"t": items}
    if isinstance(x, list):
        return {"l": [encode_structure(v, tensors) for v in x]}
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

    def on_batch(self, iterator: Any, batch: Any) -> None:
        w = self.start()
        slot = self.iterators.get(iterator)
        if slot is None:
            slot = self.iterators[iterator] = [self.loaders, 0]
            self.loaders += 1
        leaves: list[torch.Tensor] = []
        structure = encode_structure(batch, leaves)
        st = self.state
        w.event(
            {
                "type": schema.EV_BATCH,
                "step": st.pos.step,
                "micro": st.pos.micro,
                "index": slot[1],
                "loader": slot[0],
                "structure": structure,
                "tensors": [self.tensors.record("", t, st.payload_now) for t in leaves],
            }
        )
        slot[1] += 1
        st.batches += 1
