"""A tensor as events record it: its fingerprint, and its bytes staged for the writer when stored."""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

import torch

from fsdp_replay.agent import capture
from fsdp_replay.agent.budget import KINDS
from fsdp_replay.agent.config import RecordConfig
from fsdp_replay.agent.counters import AgentState
from fsdp_replay.agent.fingerprint import fingerprint, nbytes_of
from fsdp_replay.agent.flight import FlightRecorder, NoMemory
from fsdp_replay.agent.payload_ring import WAIT_LIMIT_S, PayloadRings, TooLarge, pinned_bytes
from fsdp_replay.agent.writer import BackgroundWriter, BlobRef
from fsdp_replay.trace import schema
from fsdp_replay.trace.events import Tensor

log = logging.getLogger(__name__)
_DTYPE_NAMES: dict[torch.dtype, str] = {}
SMALL_PAYLOAD_BYTES = 64 << 10
"""In the first two steps (``WARMUP_PAYLOAD_STEPS``) a tensor this small keeps its bytes under any
steps/all payload policy: what a framework exchanges once (DDP's parameter shapes at construction,
its rebuilt buckets at the second step's forward) and the small batches of the steps a replay's
fast-forward computes before it skips (``replayer/fastforward.py``)."""
WARMUP_PAYLOAD_STEPS = 2
TINY_PAYLOAD_BYTES = 64
"""In every step a tensor this small keeps its bytes: a loss or a flag the program all-reduces to
log or to decide on; the one it makes after a window's last optimizer step is counted in the next
step, and a replay of the window needs it. Larger ones only in the first steps: a small model's
every collective is small, and keeping them all would keep everything."""


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``bfloat16`` (the names of trace/dtypes.py)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def entry(role: str, t: torch.Tensor, fp: Any, algo: str, nf: Any, blob: Any) -> Tensor:
    """A tensor as events store it (``events.Tensor``)."""
    return Tensor(role, dtype_name(t.dtype), list(t.shape), fp, algo, nf, blob, t.device.type)


def placeholder(t: torch.Tensor) -> Tensor:
    """An input whose fingerprint is filled in later (after issue, or with its output)."""
    return entry("i", capture.local(t), None, schema.FP_SK64, None, schema.NO_BLOB)


def _copy(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """A host copy of ``t``'s bytes, and the event after which it is complete (None on the CPU):
    a device's is copied into pinned memory behind an event, so only the writer ever waits."""
    if t.device.type == "cpu":
        return torch.empty(t.shape, dtype=t.dtype).copy_(t.detach()), None
    copy = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    copy.copy_(t.detach(), non_blocking=True)
    ready = torch.cuda.Event(blocking=True)
    ready.record()
    return copy, ready


class TensorRecorder:
    """Fingerprints tensors and, for stored ones, copies their bytes for the writer (or, with a
    payload window, into the flight recorder's memory: ``flight.py``)."""

    def __init__(self, config: RecordConfig, state: AgentState, flight: FlightRecorder | None = None) -> None:
        self.max_pending_bytes = config.max_pending_bytes
        self.wait = config.when_full == "wait"  # back-pressure: a full writer or ring is waited for
        self._stuck_warned = False
        self.state = state
        self.flight = flight
        # not with `none` (the user keeps no bytes) nor a window (a healthy run writes none)
        self.small_always = not config.payloads.empty and not config.payloads.window
        self.rings = PayloadRings(config.payload_ring_bytes)
        self.stored = dict.fromkeys(KINDS, 0)  # payload bytes kept (stored or held) by kind, so far

    def _stage(
        self, t: torch.Tensor, nbytes: int, own: bool = False
    ) -> tuple[Any, Any] | Literal[False] | None:
        """A device tensor's bytes on their way to the host through its device's ring
        (``payload_ring.py``; with ``own``, into pinned memory of their own); None: no ring, or a
        payload larger than it (the plain copy); False: the ring is full (with ``--when-full
        wait``: it stayed full for ``WAIT_LIMIT_S``)."""
        if t.device.type != "cuda":
            return None
        ring = self.rings.ring(t.device)
        if ring is None:
            return None
        w = self.state.writer
        try:
            staged = ring.stage(t, nbytes, own, wait=w.waited if self.wait and w is not None else None)
        except TooLarge:  # a payload larger than the ring: copied on the training stream
            return None
        except RuntimeError:  # a dtype the byte ring cannot view, no pinned memory: the plain copy
            return None
        return False if staged is None else staged

    def _room(self, w: BackgroundWriter, nbytes: int) -> bool:
        """With ``--when-full wait``: wait until the writer has room for ``nbytes`` more pending
        bytes (counted as a wait); False with ``drop``, or when the writer freed nothing for
        ``WAIT_LIMIT_S``."""
        if not self.wait:
            return False
        ok = w.wait_room(nbytes, self.max_pending_bytes, WAIT_LIMIT_S)
        if not ok and not self._stuck_warned:
            self._stuck_warned = True
            log.warning(
                "fsdp-replay: the spool writer took no payload bytes for %.0f s (a stuck disk?); payloads "
                "past --max-pending-bytes are dropped while it stays so",
                WAIT_LIMIT_S,
            )
        return ok

    def _hold(self, w: BackgroundWriter, t: torch.Tensor, fp: Any, nbytes: int, algo: str) -> int:
        """Into the flight recorder's memory: a device payload through its GPU's ring into pinned
        memory of its own, else a plain copy; charged at the pinned block's size on a GPU."""
        assert self.flight is not None
        how: list[str] = []

        def copy() -> tuple[Any, Any] | None:
            made = self._stage(t, nbytes, own=True)
            if made is False:
                how.append("ring full")
                return None
            if made is None:
                try:
                    return _copy(t)
                except RuntimeError as e:  # pinned memory: none left on the host
                    raise NoMemory(str(e)) from e
            how.append("landed")
            return made

        cost = pinned_bytes(nbytes) if t.device.type == "cuda" else nbytes
        blob = self.flight.hold(self.state.pos.step, fp, nbytes, algo, copy, cost)
        # landed: a new payload (``copy`` runs only for one)
        return self._counted(w, blob, nbytes, ring_full=how == ["ring full"], landed=how == ["landed"])

    def _counted(self, w: BackgroundWriter, blob: int, nbytes: int, ring_full: bool, landed: bool) -> int:
        """``blob`` as held: a drop counted (as a full ring or not), or a payload that landed."""
        assert self.flight is not None
        if blob == schema.NO_BLOB:
            w.count_dropped(nbytes, ring_full=ring_full)
        elif landed:
            self.flight.landed += 1
        return blob

    def hold_kept(self, step: int, nbytes: int, host: torch.Tensor | None, ready: Any) -> int:
        """Into the flight recorder's memory: a payload whose pinned copy was made elsewhere (by
        the tape's C++ hook: ``host``, complete once ``ready`` is), charged at the pinned block's
        size; ``host`` None: the hook could not keep it (its bound of device copies in flight, or no
        memory), dropped and counted as a full ring."""
        assert self.flight is not None and self.state.writer is not None
        self.stored["tape"] += nbytes
        made = None if host is None else (host, ready)
        blob = self.flight.hold(step, None, nbytes, schema.FP_LIN64, lambda: made, pinned_bytes(nbytes))
        return self._counted(self.state.writer, blob, nbytes, ring_full=host is None, landed=True)

    def small_limit(self, step: int) -> int:
        """Tensors of at most this many bytes keep their bytes at ``step`` whatever the policy
        stores (larger in the first steps), or -1 where the policy stores none."""
        if not self.small_always:
            return -1
        return SMALL_PAYLOAD_BYTES if step < WARMUP_PAYLOAD_STEPS else TINY_PAYLOAD_BYTES

    def record(
        self,
        role: str,
        t: torch.Tensor,
        store: bool,
        known: tuple[int, bool, str] | None = None,
        small: bool = True,
        kind: str = "collectives",
    ) -> Tensor:
        """A tensor's entry; fingerprinted here unless its (fingerprint, nonfinite, algo) is ``known``;
        ``small``: a small tensor keeps its bytes whatever ``store`` (TINY/SMALL_PAYLOAD_BYTES);
        ``kind``: what it is (``budget.KINDS``), for the bytes a step stores."""
        w = self.state.writer
        assert w is not None
        t = capture.local(t)
        fp, nf, algo = known if known is not None else fingerprint(t)
        blob: Any = schema.NO_BLOB
        if not store and small:
            store = nbytes_of(t) <= self.small_limit(self.state.pos.step)
        if store:
            t0 = time.thread_time_ns()
            nbytes = nbytes_of(t)
            self.stored[kind] += nbytes
            if self.flight is not None:
                blob = self._hold(w, t, fp, nbytes, algo)
            elif w.pending_bytes + nbytes > self.max_pending_bytes and not self._room(w, nbytes):
                w.count_dropped(nbytes)
            else:
                staged = self._stage(t, nbytes)
                if staged is False:  # the device's ring has no room now: dropped, never waited for
                    w.count_dropped(nbytes, ring_full=True)
                else:
                    blob = BlobRef()
                    copy, ready = staged or _copy(t)
                    w.blob(blob, copy, fp, nbytes, algo, ready)
            self.state.cpu_parts["payloads"] += time.thread_time_ns() - t0
        return entry(role, t, fp, algo, nf, blob)
