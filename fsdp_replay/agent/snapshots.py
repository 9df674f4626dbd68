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
from fsdp_replay.agent.tensor_record import TensorRecorder
from fsdp_replay.agent.writer import BackgroundWriter, BlobRef
from fsdp_replay.trace import schema


class StateRecorder:
    def __init__(self, config: RecordConfig, state: AgentState, tensors: TensorRecorder) -> None:
        self.config = config
        self.state = state
        self.tensors = tensors

    def write_rng(self, w: BackgroundWriter, step: int, state: dict[str, Any]) -> None:
        # Every step boundary gets the states' fingerprints (the replay checks them); the states
        # themselves (~20 kB) only where a replay can restore them: process start, snapshot
        # steps, and the steps whose payloads are kept.
        every = self.config.snapshot_every
        keep = step <= 0 or (every and step % every == 0) or step in self.config.payloads

        def encoded() -> list[tuple[str, Any]]:
            fps, data = capture.encode_rng(state)
            if not keep:
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
        """The rank's state at this step boundary: CPU copies now, encoded on the writer thread."""
        step = self.state.pos.step
        state = capture.snapshot_state([opt], roots, names, step)
        param_names = state["optimizers"][0]["param_names"]
        metas = [
            [n, *self.tensors.record("", p, False)[1:6]]
            for n, p in zip(param_names, state["optimizers"][0]["params"], strict=True)
        ]
        self.state.snapshots += 1

        def encoded() -> list[tuple[str, Any]]:
            data = capture.encode_snapshot(state)
            ref = BlobRef()
            return [
                ("payload", (ref, data)),
                (
                    "ev",
                    {
                        "type": schema.EV_SNAPSHOT,
                        "step": step,
                        "blob": ref,
                        "nbytes": len(data),
                        "params": metas,
                    },
                ),
            ]

        w.call(encoded)

    def write_modules(self, w: BackgroundWriter) -> None:
        """The local source files the program imported, hashed on the writer thread."""
        script = capture.script_info()["path"]
        roots = [os.getcwd()] + ([os.path.dirname(script)] if script else [])
        mods = capture.local_modules(roots)

        def hashed() -> list[tuple[str, Any]]:
            listing = [{"name": n, "path": p, "sha256": capture.sha256_file(p)} for n, p in mods]
            return [("ev", {"type": schema.EV_MODULES, "modules": listing})]

        w.call(hashed)
