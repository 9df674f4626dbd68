"""The rank's state at step boundaries as events record it: snapshots, RNG states, local modules.

Each is copied on the training thread (cheaply: CPU copies, fingerprints) and encoded on the
writer thread (``BackgroundWriter.call``), which is where the bytes are serialized. A snapshot's
device tensors are copied into pinned memory on their device's current stream without the host
waiting (``DeviceCopies``): the writer waits for the copies before it encodes them. Copying on the
program's stream, not a side stream, is what keeps them right: the program may change the state
in place right after the step boundary (weights clipped after ``optimizer.step()``), and its
stream runs those writes after the copies. The pinned blocks come from torch's caching host
allocator, so the next snapshot of the same shapes reuses them once this one is let go of.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from fsdp_replay.agent import capture
from fsdp_replay.agent.config import RecordConfig
from fsdp_replay.agent.counters import AgentState
from fsdp_replay.agent.fingerprint import fingerprint_many
from fsdp_replay.agent.flight import FlightRecorder
from fsdp_replay.agent.tensor_record import dtype_name
from fsdp_replay.agent.writer import BackgroundWriter, BlobRef
from fsdp_replay.trace import schema

log = logging.getLogger(__name__)


def _tensor_bytes(x: Any) -> int:
    """The bytes of the tensors in a snapshot's state (what holding it in memory costs)."""
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, dict):
        return sum(_tensor_bytes(v) for v in x.values())
    if isinstance(x, list | tuple):
        return sum(_tensor_bytes(v) for v in x)
    return 0


class DeviceCopies:
    """Copies of device tensors into pinned memory, made on each device's current stream and
    not waited for (a CPU tensor's copy is complete at once); ``ready`` is what to wait for."""

    def __init__(self) -> None:
        self.devices: dict[torch.device, None] = {}
        self.pageable = 0  # copies made into pageable memory, waited for: no pinned memory left

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        t = capture.local(t).detach()
        if t.device.type != "cuda":
            return capture.host_copy(t)
        try:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        except RuntimeError as e:  # the host cannot pin more: the waited-for copy, as before pinning
            if not self.pageable:
                log.warning(
                    "fsdp-replay: no pinned memory for a snapshot (%s); copying it with the host waiting", e
                )
            self.pageable += 1
            return capture.host_copy(t)
        host.copy_(t, non_blocking=True)
        self.devices[t.device] = None
        return host

    def ready(self) -> list[Any]:
        """An event behind the copies on each device's stream (none where all were on the CPU)."""
        events = []
        for device in self.devices:
            event = torch.cuda.Event(blocking=True)
            event.record(torch.cuda.current_stream(device))
            events.append(event)
        return events


def snapshot_items(
    step: int, state: Any, metas: list[list[Any]], ready: list[Any] | None = None
) -> list[tuple[str, Any]]:
    """A snapshot's blob and event for the writer (``BackgroundWriter.call``), on its thread,
    once its device copies (``ready``) are complete."""
    for event in ready or ():
        event.synchronize()
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
        flight: FlightRecorder | None = None,
    ) -> None:
        self.config = config
        self.state = state
        self.flight = flight  # with a payload window, snapshots and their RNG states are held there

    def write_rng(self, w: BackgroundWriter, step: int, state: dict[str, Any]) -> None:
        # Every step boundary gets the states' fingerprints (the replay checks them); the states
        # themselves (~20 kB) only where a replay can restore them: process start, snapshot
        # steps, and the steps whose payloads are kept (with a payload window: held with the
        # snapshot, written with it on a failure).
        snapshot_step = self.config.snapshot_step(step)
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
        """The rank's state at this step boundary: host copies now (a device's not waited for),
        encoded on the writer thread (with a payload window: held in memory, encoded if a failure
        dumps it). Each parameter's entry: name, dtype, shape and fingerprint (of the live
        tensor, on its device: the copies are not complete yet)."""
        step = self.state.pos.step
        t0 = time.thread_time_ns()
        copies = DeviceCopies()
        state = capture.snapshot_state([opt], roots, names, step, copies)
        ready = copies.ready()
        live = [capture.local(p) for p in capture.optimizer_params(opt)]
        metas = [
            [n, dtype_name(p.dtype), list(p.shape), fp, algo, nf]
            for n, p, (fp, nf, algo) in zip(
                state["optimizers"][0]["param_names"], live, fingerprint_many(live), strict=True
            )
        ]
        self.state.snapshots += 1
        if self.flight is not None:
            self.flight.hold_snapshot(step, state, metas, _tensor_bytes(state), ready)
        else:
            w.call(lambda: snapshot_items(step, state, metas, ready))
        self.state.cpu_parts["snapshots"] += time.thread_time_ns() - t0

    def write_modules(self, w: BackgroundWriter) -> None:
        """The local source files the program imported, hashed on the writer thread."""
        script = capture.script_info()["path"]
        roots = [os.getcwd()] + ([os.path.dirname(script)] if script else [])
        mods = capture.local_modules(roots)

        def hashed() -> list[tuple[str, Any]]:
            listing = [{"name": n, "path": p, "sha256": capture.sha256_file(p)} for n, p in mods]
            return [("ev", {"type": schema.EV_MODULES, "modules": listing})]

        w.call(hashed)
