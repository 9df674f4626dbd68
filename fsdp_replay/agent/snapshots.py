"""The rank's state at step boundaries as events record it: snapshots, RNG states, local modules.

Each is copied on the training thread (cheaply: CPU copies, fingerprints) and encoded on the
writer thread (``BackgroundWriter.call``), which is where the bytes are serialized.

A snapshot's device tensors go to the host without holding the training stream
(``AsyncCopies``): into one slab of pinned memory (``SnapshotArena``: pinned once, at the first
snapshot, and reused by every later one), on a side stream of their device that starts behind
the step boundary, while the program's next forward and backward run (the copies move on a copy
engine; the 4 GB state of a 350M-parameter AdamW job takes about 80 ms of it, a third of a step).
The program must not change that state before the copies are done, and it does not in a normal
step: parameters and optimizer state change in ``optimizer.step()``. So at the next step's
``optimizer.step()`` (its pre-hook: ``settle``) the program's stream waits for the copies (a
wait on the device, never on the host), and each copied tensor's version counter is compared with
the one it had at the boundary: a program that changed one in place in between (weights clipped
after ``optimizer.step()``) made the copy torn, so that snapshot is never used (counted in
``snapshots_torn``, said once) and the rank's later snapshots are copied on the program's stream,
as below. Only a settled snapshot is handed to the writer or the flight recorder.

Where no slab can be had (the host cannot pin one; every slab still held by a window) a snapshot
is copied the simple way (``DeviceCopies``): into pinned blocks of torch's caching host allocator,
on the device's current stream, behind the step boundary and before any later write of the
program's; the writer waits for the copies before it encodes them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fsdp_replay import options
from fsdp_replay.agent import capture
from fsdp_replay.agent.config import RecordConfig
from fsdp_replay.agent.counters import AgentState
from fsdp_replay.agent.fingerprint import fingerprint_many
from fsdp_replay.agent.flight import FlightRecorder
from fsdp_replay.agent.payload_ring import WAIT_LIMIT_S
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


ASYNC_ENV = "FSDP_REPLAY_SNAPSHOT_ASYNC"  # 0: snapshots copied on the program's stream
SLAB_ALIGN = 512  # each tensor's bytes start at a multiple of this in a slab
SETTLE_WAIT_S = 10.0  # at the end, how long a snapshot's copies may take before it is let go of


class Slab:
    """One snapshot's pinned host memory: ``nbytes`` bytes, reused once ``release``d."""

    __slots__ = ("arena", "buf", "busy", "nbytes")

    def __init__(self, arena: SnapshotArena, buf: torch.Tensor) -> None:
        self.arena, self.buf, self.nbytes, self.busy = arena, buf, buf.numel(), True

    def release(self) -> None:
        self.arena.give_back(self)


class SnapshotArena:
    """Pinned host slabs for snapshots, pinned once and reused: a slab is plain host memory
    registered with CUDA (``cudaHostRegister``: exactly its size, where torch's caching host
    allocator would round a 4.2 GB request up to 8 GB), made at the first snapshot that finds no
    free one of its size, at most ``max_slabs`` of them (the snapshots a window holds, plus the
    one being taken). ``register`` makes the memory pinned (None: it could not)."""

    def __init__(
        self,
        max_slabs: int,
        register: Callable[[torch.Tensor], bool] | None = None,
        unregister: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        self.max_slabs = max_slabs
        self.register = register if register is not None else _cuda_register
        self.unregister = unregister if unregister is not None else _cuda_unregister
        self.slabs: list[Slab] = []
        self.pinned_bytes = 0
        self.error: str | None = None  # why slabs cannot be pinned here (then: DeviceCopies)
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)

    def take(self, nbytes: int, wait_s: float = 0.0) -> Slab | None:
        """A free slab of at least ``nbytes``: a released one, or a new one while fewer than
        ``max_slabs`` exist (one too small for a grown state is let go of first); else, within
        ``wait_s``, the first one released; else None."""
        deadline = time.monotonic() + wait_s
        with self._freed:
            while True:
                free = [sl for sl in self.slabs if not sl.busy and sl.nbytes >= nbytes]
                if free:
                    found = min(free, key=lambda sl: sl.nbytes)
                    found.busy = True
                    return found
                small = [sl for sl in self.slabs if not sl.busy and sl.nbytes < nbytes]
                for sl in small:  # the state grew (optimizer state made after a step): pin anew
                    self.slabs.remove(sl)
                    self.pinned_bytes -= sl.nbytes
                    self.unregister(sl.buf)
                if len(self.slabs) < self.max_slabs and self.error is None:
                    made = self._pin(nbytes)
                    if made is not None:
                        return made
                left = deadline - time.monotonic()
                if left <= 0 or not self.slabs or self.error is not None:
                    return None
                self._freed.wait(min(left, 0.25))

    def _pin(self, nbytes: int) -> Slab | None:
        try:
            buf = torch.empty(nbytes, dtype=torch.uint8)
            if not self.register(buf):
                raise RuntimeError("cudaHostRegister failed")
        except (RuntimeError, MemoryError) as e:
            self.error = f"{type(e).__name__}: {e}"[:300]
            log.warning(
                "fsdp-replay: cannot pin %d bytes for snapshots (%s); snapshots are copied on the "
                "program's stream",
                nbytes,
                self.error,
            )
            return None
        slab = Slab(self, buf)
        self.slabs.append(slab)
        self.pinned_bytes += nbytes
        return slab

    def give_back(self, slab: Slab) -> None:
        with self._freed:
            slab.busy = False
            self._freed.notify_all()


def _cuda_register(buf: torch.Tensor) -> bool:
    """Page-lock ``buf``'s memory for the GPUs' copy engines (until ``_cuda_unregister``)."""
    cudart: Any = torch.cuda.cudart()
    rc = cudart.cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
    return int(getattr(rc, "value", rc)) == 0


def _cuda_unregister(buf: torch.Tensor) -> None:
    cudart: Any = torch.cuda.cudart()
    cudart.cudaHostUnregister(buf.data_ptr())


class _Slot:
    """Where a device tensor's copy goes in a snapshot's state, until the slab is known."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


def _fill(x: Any, views: list[torch.Tensor]) -> Any:
    if isinstance(x, _Slot):
        return views[x.i]
    if isinstance(x, dict):
        return {k: _fill(v, views) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_fill(v, views) for v in x)
    return x


class AsyncCopies:
    """The tensor callable of ``capture.snapshot_state`` that copies a snapshot's device tensors
    into one slab on side streams (see the module's docstring): ``__call__`` notes each one (a
    CPU tensor is copied at once), ``start`` takes the slab and issues the copies, and
    ``StateRecorder.settle`` settles them at the next ``optimizer.step()``."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.watched: list[tuple[torch.Tensor, int]] = []  # (tensor, its version at the boundary)

    def __call__(self, t: torch.Tensor) -> Any:
        local = capture.local(t).detach()
        if local.device.type != "cuda":
            return capture.host_copy(local)
        self.tensors.append(local)
        self.watched += versions(t)
        return _Slot(len(self.tensors) - 1)

    def layout(self) -> tuple[list[int], int]:
        """Each tensor's offset in the slab, and the slab's size."""
        offsets, end = [], 0
        for t in self.tensors:
            offsets.append(end)
            end += -(-(t.numel() * t.element_size()) // SLAB_ALIGN) * SLAB_ALIGN
        return offsets, end

    def start(self, state: Any, slab: Slab) -> tuple[Any, list[tuple[torch.device, Any]]]:
        """Issue the copies into ``slab`` on each device's side stream, behind the program's
        stream as it is now; the state with its views of the slab, and each device's event after
        its copies."""
        offsets, _ = self.layout()
        views: list[torch.Tensor] = []
        streams: dict[torch.device, Any] = {}
        for t, off in zip(self.tensors, offsets, strict=True):
            n = t.numel() * t.element_size()
            view = (
                slab.buf[off : off + n].view(t.dtype).view(t.shape)
                if n
                else torch.empty(t.shape, dtype=t.dtype)
            )
            side = streams.get(t.device)
            if side is None:
                side = streams[t.device] = _side_stream(t.device)
                side.wait_stream(torch.cuda.current_stream(t.device))
            if n:
                with torch.cuda.stream(side):
                    view.copy_(t, non_blocking=True)
                t.record_stream(side)  # a tensor the program frees meanwhile stays until copied
            views.append(view)
        done = []
        for device, side in streams.items():
            event = torch.cuda.Event(blocking=True)
            event.record(side)
            done.append((device, event))
        return _fill(state, views), done

    def unchanged(self) -> bool:
        """Whether no copied tensor was changed in place since the boundary."""
        return all(t._version == v for t, v in self.watched)


def versions(t: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """What an in-place change of ``t`` bumps: its version counter, and for a DTensor also its
    local tensor's (an in-place op through the DTensor bumps the wrapper's counter only, one on
    the local tensor only the local's)."""
    local = capture.local(t)
    out = [(t, t._version)]
    if local is not t:
        out.append((local, local._version))
    return out


_SIDE: dict[torch.device, Any] = {}


def _side_stream(device: torch.device) -> Any:
    side = _SIDE.get(device)
    if side is None:
        side = _SIDE[device] = torch.cuda.Stream(device=device)
    return side


@dataclass(slots=True)
class InFlight:
    """A snapshot whose copies are in flight: handed over once ``settle``d."""

    step: int
    state: Any
    metas: list[list[Any]]
    nbytes: int
    copies: AsyncCopies
    done: list[tuple[torch.device, Any]]  # each device's event after its side stream's copies
    ready: list[Any]  # every event the writer waits for (those, and the buffers' copies)
    slab: Slab


def snapshot_items(
    step: int,
    state: Any,
    metas: list[list[Any]],
    ready: list[Any] | None = None,
    release: Callable[[], None] | None = None,
) -> list[tuple[str, Any]]:
    """A snapshot's blob and event for the writer (``BackgroundWriter.call``), on its thread,
    once its device copies (``ready``) are complete; ``release`` lets its slab go once encoded."""
    for event in ready or ():
        event.synchronize()
    try:
        data = capture.encode_snapshot(state)
    finally:
        if release is not None:
            release()
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
        # Snapshots copied off the program's stream (AsyncCopies), unless switched off, or the
        # program was seen to change its state outside optimizer.step() (the probe, or a torn copy)
        self.async_on = options.process_switch(ASYNC_ENV, True)
        self.arena: SnapshotArena | None = None  # made at the first device snapshot taken so
        self.pending: InFlight | None = None
        self.torn = 0  # snapshots whose state the program changed while they were copied
        self.last_bytes = 0  # the tensor bytes of the last snapshot taken
        self.sync_copies = 0  # device snapshots copied on the program's stream
        # The probe: each optimizer tensor's version at a step's end, compared at the next
        # optimizer.step(); None until taken, True once a step passed with none changed.
        self._probe: list[tuple[torch.Tensor, int]] | None = None
        self.probe_clean: bool | None = None

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
        tensor, on its device: the copies are not complete yet). Device tensors are copied off
        the program's stream where that is safe (``AsyncCopies``: handed over at ``settle``)."""
        step = self.state.pos.step
        t0 = time.thread_time_ns()
        self.settle(w)  # an older one still in flight (snapshots a step apart) goes first
        try:
            if self._async_now(step) and self._snapshot_async(w, opt, roots, names, step):
                return
            copies = DeviceCopies()
            state = capture.snapshot_state([opt], roots, names, step, copies)
            ready = copies.ready()
            self.sync_copies += bool(copies.devices)
            self._hand_over(w, step, state, self._metas(opt, state), ready, None)
        finally:
            self.state.cpu_parts["snapshots"] += time.thread_time_ns() - t0

    def _async_now(self, step: int) -> bool:
        """Copy this snapshot off the program's stream: switched on, past step 1 (the step-0
        snapshot is settled at once anyway), and a step has shown that the program changes no
        optimizer tensor outside ``optimizer.step()`` (the probe)."""
        return self.async_on and step >= 2 and self.probe_clean is True

    def _snapshot_async(
        self,
        w: BackgroundWriter,
        opt: torch.optim.Optimizer,
        roots: list[torch.nn.Module],
        names: dict[int, str],
        step: int,
    ) -> bool:
        """The snapshot through ``AsyncCopies`` (False: no slab to be had, nothing was done)."""
        copies = AsyncCopies()
        buffers = DeviceCopies()  # module buffers change in a forward (batch norm): copied now
        state = capture.snapshot_state([opt], roots, names, step, copies, buffers)
        if not copies.tensors:  # all on the CPU: copied already
            self._hand_over(w, step, state, self._metas(opt, state), buffers.ready(), None)
            return True
        _, size = copies.layout()
        slab = self._slab(size)
        if slab is None:
            return False
        state, done = copies.start(state, slab)
        ready = [e for _, e in done] + buffers.ready()
        metas = self._metas(opt, state)
        self.pending = InFlight(step, state, metas, _tensor_bytes(state), copies, done, ready, slab)
        return True

    def _slab(self, nbytes: int) -> Slab | None:
        if self.arena is None:
            # a window holds the snapshots from the newest at or before its start (its N steps and
            # the late non-finite check's lag back) to now, and takes the next; otherwise the
            # writer has one while the next is taken: two
            slabs = 2
            if self.flight is not None:
                every = max(1, self.config.snapshot_interval)
                slabs = (self.config.payloads.window + max(self.flight.lag, 2)) // every + 3
            self.arena = SnapshotArena(slabs)
        wait = 0.0 if self.flight is not None or self.config.when_full != "wait" else WAIT_LIMIT_S
        t0 = time.monotonic_ns()
        slab = self.arena.take(nbytes, wait)
        if self.flight is None and self.state.writer is not None and time.monotonic_ns() - t0 > 1_000_000:
            self.state.writer.waited(time.monotonic_ns() - t0)  # the writer still had both slabs
        return slab

    def _metas(self, opt: torch.optim.Optimizer, state: Any) -> list[list[Any]]:
        live = [capture.local(p) for p in capture.optimizer_params(opt)]
        return [
            [n, dtype_name(p.dtype), list(p.shape), fp, algo, nf]
            for n, p, (fp, nf, algo) in zip(
                state["optimizers"][0]["param_names"], live, fingerprint_many(live), strict=True
            )
        ]

    def _hand_over(
        self,
        w: BackgroundWriter,
        step: int,
        state: Any,
        metas: list[list[Any]],
        ready: list[Any],
        release: Any,
    ) -> None:
        self.state.snapshots += 1
        self.last_bytes = _tensor_bytes(state)
        if self.flight is not None:
            self.flight.hold_snapshot(step, state, metas, self.last_bytes, ready, release)
        else:
            w.call(lambda: snapshot_items(step, state, metas, ready, release))

    def settle(self, w: BackgroundWriter, final: bool = False) -> None:
        """The snapshot in flight, at the program's next ``optimizer.step()`` (its pre-hook) or at
        the end (``final``): the program's stream waits for its copies (on the device), and it is
        handed over unless the program changed a copied tensor in place since the boundary (then
        it is torn: let go of, and the rank's later snapshots are copied on the program's stream)."""
        p, self.pending = self.pending, None
        if p is None:
            return
        if final:
            deadline = time.monotonic() + SETTLE_WAIT_S
            while not all(e.query() for e in p.ready):
                if time.monotonic() > deadline:  # the device is stuck (a hung collective)
                    log.warning(
                        "fsdp-replay: the snapshot of step %d did not reach the host; left out", p.step
                    )
                    return  # (its slab may still be written: never given back)
                time.sleep(0.01)
        else:
            for device, e in p.done:  # the program's stream goes on once the copies are done
                torch.cuda.current_stream(device).wait_event(e)
        if not p.copies.unchanged():
            self.torn += 1
            self.async_on = False
            p.slab.release()  # the side stream writes it again only after these copies
            log.warning(
                "fsdp-replay: the program changed its parameters or optimizer state in place between "
                "optimizer.step() calls (after step %d's); that snapshot is left out and the rank's later "
                "snapshots are copied on its stream",
                p.step - 1,
            )
            return
        self._hand_over(w, p.step, p.state, p.metas, p.ready, p.slab.release)

    def probe_start(self, opt: torch.optim.Optimizer) -> None:
        """At a step's end, until the probe has passed: note each optimizer tensor's version."""
        if self.probe_clean is not None or not self.async_on:
            return
        tensors = capture.optimizer_params(opt) + [
            v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)
        ]
        self._probe = [w for t in tensors if capture.local(t).device.type == "cuda" for w in versions(t)]

    def probe_check(self) -> None:
        """At the next ``optimizer.step()``: clean if none of them changed in between."""
        if self._probe is None:
            return
        probe, self._probe = self._probe, None
        self.probe_clean = all(t._version == v for t, v in probe)
        if not self.probe_clean:
            log.info(
                "fsdp-replay: the program changes optimizer tensors in place outside optimizer.step(); "
                "snapshots are copied on its stream"
            )

    def counters(self) -> dict[str, int]:
        arena = self.arena
        return {
            "snapshots_torn": self.torn,
            "snapshots_sync_copied": self.sync_copies,
            "snapshot_pinned_bytes": arena.pinned_bytes if arena is not None else 0,
        }

    def write_modules(self, w: BackgroundWriter) -> None:
        """The local source files the program imported, hashed on the writer thread."""
        script = capture.script_info()["path"]
        roots = [os.getcwd()] + ([os.path.dirname(script)] if script else [])
        mods = capture.local_modules(roots)

        def hashed() -> list[tuple[str, Any]]:
            listing = [{"name": n, "path": p, "sha256": capture.sha256_file(p)} for n, p in mods]
            return [("ev", {"type": schema.EV_MODULES, "modules": listing})]

        w.call(hashed)
