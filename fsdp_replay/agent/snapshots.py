"""The rank's state at step boundaries as events record it: snapshots, RNG states, local modules.

Each is copied on the training thread (cheaply: CPU copies, fingerprints) and encoded on the
writer thread (``BackgroundWriter.call``), which is where the bytes are serialized.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from fsdp_replay.agent import capture
from fsdp_replay.agent.config import RecordConfig
from fsdp_replay.agent.counters import AgentState
from fsdp_replay.agent.flight import FlightRecorder
from fsdp_replay.agent.tensor_record import TensorRecorder
from fsdp_replay.agent.writer import BackgroundWriter, BlobRef
from fsdp_replay.trace import schema


def _tensor_bytes(x: Any) -> int:
    """The bytes of the tensors in a snapshot's state (what holding it in memory costs)."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, dict):
        return sum(_tensor_bytes(v) for v in x.values())
    if isinstance(x, list | tuple):
        return sum(_tensor_bytes(v) for v in x)
    return 0


def snapshot_items(step: int, state: Any, metas: list[list[Any]]) -> list[tuple[str, Any]]:
    """A snapshot's blob and event for the writer (``BackgroundWriter.call``), on its thread."""
    data = capture.encode_snapshot(state)
    ref = BlobRef()
    return [
        ("payload", (ref, data)),
        ("ev", {"type": schema.EV_SNAPSHOT, "step": step, "blob": ref, "nbytes": len(data), "params": metas}),
    ]


class StateRecorder:
    def __init__(
        self,
        config: RecordConfig,
        state: AgentState,
        tensors: TensorRecorder,
        flight: FlightRecorder | None = None,
    ) -> None:
        self.config = config
        self.state = state
        self.tensors = tensors
        self.flight = flight  # with a payload window, snapshots and their RNG states are held there

    def write_rng(self, w: BackgroundWriter, step: int, state: dict[str, Any]) -> None:
        # Every step boundary gets the states' fingerprints (the replay checks them); the states
        # themselves (~20 kB) only where a replay can restore them: process start, snapshot
        # steps, and the steps whose payloads are kept (with a payload window: held with the
        # snapshot, written with it on a failure).
        every = self.config.snapshot_interval
        snapshot_step = bool(every and step % every == 0)
        flight = self.flight if step > 0 else None
        keep = step <= 0 or snapshot_step or (flight is None and step in self.config.payloads)

        # Its id now, its bytes when the writer has encoded them: a dump taken in between (on
        # this thread) still names and writes them, since the writer encodes them first.
        held = flight.hold_later(step) if flight is not None and snapshot_step else None

        def encoded() -> list[tuple[str, Any]]:
            fps, data = capture.encode_rng(state)
            if held is not None:
                held[1](data)
                return [("ev", {"type": schema.EV_RNG, "step": step, "states": {**fps, "blob": held[0]}})]
            if not keep or flight is not None:
                return [
                    ("ev", {"type": schema.EV_RNG, "step": step, "states": {**fps, "blob": schema.NO_BLOB}})
                ]
            ref = BlobRef()
            return [
                ("raw", (ref, data)),
                ("ev", {"type": schema.EV_RNG, "step": step, "states": {**fps, "blob": ref}}),
            ]

        w.call(encoded)

    def snapshot(
        self,
        w: BackgroundWriter,
        opt: torch.optim.Optimizer,
        roots: list[torch.nn.Module],
        names: dict[int, str],
    ) -> None:
        """The rank's state at this step boundary: CPU copies now, encoded on the writer thread
        (with a payload window: held in memory, encoded if a failure dumps it)."""
        step = self.state.pos.step
        state = capture.snapshot_state([opt], roots, names, step)
        param_names = state["optimizers"][0]["param_names"]
        metas = [
            [n, *self.tensors.record("", p, False)[1:6]]
            for n, p in zip(param_names, state["optimizers"][0]["params"], strict=True)
        ]
        self.state.snapshots += 1
        if self.flight is not None:
            self.flight.hold_snapshot(step, state, metas, _tensor_bytes(state))
            return
        w.call(lambda: snapshot_items(step, state, metas))

    def write_modules(self, w: BackgroundWriter) -> None:
        """The local source files the program imported, hashed on the writer thread."""
        script = capture.script_info()["path"]
        roots = [os.getcwd()] + ([os.path.dirname(script)] if script else [])
        mods = capture.local_modules(roots)

        def hashed() -> list[tuple[str, Any]]:
            listing = [{"name": n, "path": p, "sha256": capture.sha256_file(p)} for n, p in mods]
            return [("ev", {"type": schema.EV_MODULES, "modules": listing})]

        w.call(hashed)
