"""Device payloads to the host off the training stream, through a bounded ring.

A stored payload that lives on a GPU (a collective's output, a taped kernel's result) must reach
the spool without the training stream waiting for a copy to the host (about 55 GB/s on an H200:
2 ms for a 100 MB all-gather output) and without the training thread ever waiting at all. The
ring does it in two copies, ordered by CUDA events:

1. on the **training stream**, a device-to-device copy of the payload into a slot of a device
   buffer (at memory bandwidth, about 30x faster than to the host): the only work the training
   stream does, and the reason the bytes are right, since the program may write into the tensor
   in place (a gradient clipped, a bucket reused) right after the collective;
2. on a **side stream** of the same device, after an event recorded behind that copy, a
   device-to-host copy of the slot into the same slot of a pinned host buffer, followed by the
   event the writer thread waits on before it writes the bytes to the spool and frees the slot.

The device and the host buffer have the same size and a payload has the same offset in both;
slots are taken in ring order (``RingSpace``) and freed by the writer, which writes them in the
order they were taken. A payload the flight recorder holds (``--payloads window:N``) lands instead
in pinned memory of its own (``stage(..., own=True)``, through torch's caching host allocator, so
the blocks of evicted payloads are reused for the next steps' payloads of the same size class):
its device slot is freed by the training thread as soon as that copy is done (``reap``: an event
query at the next stage), and nothing is copied on the host at all. When there is no room (the
writer is behind, or the host copies in flight fill it), the payload waits for room
(``--when-full wait``, the default: for the oldest copy in flight to land, or for the writer to
free a slot; the wait is counted), or with ``--when-full drop`` it is dropped and counted
(``ring_full_drops``), its metadata and fingerprint kept. A payload larger than the ring
(``TooLarge``) is copied on the training stream instead (``tensor_record._copy``). The device buffer is allocated when the first
device payload of a device is stored (through the caching allocator, so it shows in the
program's memory statistics), the pinned host buffer at the first payload that goes through it;
both live until the process ends.

The bound, stated: per stored device payload, the training stream runs one device-to-device copy
of its bytes and one event record; it never waits for the host copy, the writer or the disk. The
training *thread* waits only when the ring is full, and only with ``--when-full wait``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fsdp_replay import options

log = logging.getLogger(__name__)
ALIGN = 256
"""Slot offsets are multiples of this (any dtype's alignment; the copy engines like it too)."""


class RingSpace:
    """Offsets in ``[0, capacity)`` handed out in ring order, as contiguous slots.

    ``take`` places a slot right after the newest live one, or at 0 when it does not fit before
    the end; ``free`` may come in any order, and space comes back as the oldest live slots are
    freed. Thread-safe: slots are taken on the training thread and freed on the writer's."""

    def __init__(self, capacity: int, align: int = ALIGN) -> None:
        if capacity < 0:
            raise ValueError(f"ring capacity {capacity} < 0")
        self.capacity = capacity - capacity % align
        self.align = align
        self._live: deque[list[int]] = deque()  # [offset, size, freed], oldest first
        self._by_offset: dict[int, list[int]] = {}
        self._head = 0  # where the next slot goes (the newest live slot's end)
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self.used = 0  # bytes in live slots (their aligned sizes)

    def slot_size(self, nbytes: int) -> int:
        return max(self.align, -(-nbytes // self.align) * self.align)

    def take(self, nbytes: int) -> int | None:
        """An offset with ``nbytes`` free after it, or None when there is no room now."""
        size = self.slot_size(nbytes)
        with self._lock:
            if not self._live:
                self._head = 0
                off = 0 if size <= self.capacity else None
            else:
                tail = self._live[0][0]
                if self._head > tail:  # live slots in [tail, head): room at the end, then before tail
                    if size <= self.capacity - self._head:
                        off = self._head
                    elif size <= tail:
                        off = 0
                    else:
                        off = None
                else:  # wrapped (or full): room only in [head, tail)
                    off = self._head if size <= tail - self._head else None
            if off is None:
                return None
            slot = [off, size, 0]
            self._live.append(slot)
            self._by_offset[off] = slot
            self._head = off + size
            self.used += size
            return off

    def free(self, offset: int) -> None:
        with self._lock:
            slot = self._by_offset.pop(offset)
            slot[2] = 1
            self.used -= slot[1]
            while self._live and self._live[0][2]:
                self._live.popleft()
            self._freed.notify_all()

    def wait_freed(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for a slot to be freed (by the writer)."""
        with self._freed:
            self._freed.wait(timeout)

    def live(self) -> int:
        with self._lock:
            return len(self._live)


SM_COPY_ENV = "FSDP_REPLAY_SM_COPY"  # 1: device-to-device copies of payloads as a kernel on the SMs


def pinned_bytes(nbytes: int) -> int:
    """The pinned memory torch's caching host allocator takes for ``nbytes``: its blocks are
    powers of two (what the flight recorder charges against its bound for a pinned payload)."""
    return 1 << max(0, nbytes - 1).bit_length() if nbytes > 0 else 0


class _Done(Protocol):
    def query(self) -> bool: ...


class Landing:
    """Slots whose host copy lands in memory of its own, oldest first: each is freed once its
    copy's event has completed. The copies run in order on one side stream, so the oldest
    pending one is the first to complete and ``reap`` stops at the first that has not."""

    def __init__(self, space: RingSpace) -> None:
        self.space = space
        self._pending: deque[tuple[_Done, int]] = deque()
        self._lock = threading.Lock()

    def add(self, done: _Done, offset: int) -> None:
        with self._lock:
            self._pending.append((done, offset))

    def reap(self) -> int:
        """Free the slots whose copies are done (never waits); how many were freed."""
        freed = 0
        with self._lock:
            while self._pending and self._pending[0][0].query():
                self.space.free(self._pending.popleft()[1])
                freed += 1
        return freed

    def wait_oldest(self) -> bool:
        """Wait for the oldest pending copy to land, then free what has; False if none is pending."""
        with self._lock:
            oldest = self._pending[0][0] if self._pending else None
        if oldest is None:
            return False
        sync = getattr(oldest, "synchronize", None)
        if sync is not None:
            sync()
        self.reap()
        return True

    def __len__(self) -> int:
        return len(self._pending)


class TooLarge(Exception):
    """A payload larger than the whole ring: the caller copies it another way."""


WAIT_LIMIT_S = 120.0
"""The longest a payload waits for room (``--when-full wait``) before it is dropped after all,
with a warning: a writer that frees nothing for two minutes is stuck (a hung file system), and the
training must not hang with it."""


def take_waiting(
    space: RingSpace,
    landing: Landing,
    nbytes: int,
    wait: Callable[[int], None],
    limit_s: float = WAIT_LIMIT_S,
) -> int | None:
    """A slot of ``space`` once there is room: the oldest host copy in flight landed (its slot
    freed by ``landing``), or the writer freed one. Calls ``wait`` with the ns it waited; None
    after ``limit_s`` seconds without room."""
    t0 = time.monotonic_ns()
    deadline = time.monotonic() + limit_s
    off = space.take(nbytes)
    if off is not None:
        return off
    while off is None and time.monotonic() < deadline:
        if not landing.wait_oldest():
            space.wait_freed(min(0.05, max(0.0, deadline - time.monotonic())))
        off = space.take(nbytes)
    wait(time.monotonic_ns() - t0)
    return off


@dataclass(slots=True)
class Staged:
    """A payload's bytes in the host ring (valid once ``ready`` completes); ``release`` frees the
    slot (the writer calls it once it wrote or dropped the bytes)."""

    host: torch.Tensor  # uint8 view of the pinned slot
    ring: PayloadRing
    offset: int

    def release(self) -> None:
        self.ring.space.free(self.offset)


class PayloadRing:
    """The device and pinned host buffers of one device, their ``RingSpace`` and side stream."""

    def __init__(self, device: torch.device, capacity: int, sm_copy: bool = False) -> None:
        self.space = RingSpace(capacity)
        # The slot copy as an elementwise kernel on the SMs (a bitwise OR with 0 over 32-bit words,
        # bit-exact) instead of copy_'s memcpy, which may queue on a copy engine behind the side
        # stream's host copies: measured against each other by bench/bench_payload_ring.py.
        self.sm_copy = sm_copy
        self.device = device
        n = self.space.capacity
        self.dev = torch.empty(n, dtype=torch.uint8, device=device)
        self._host: torch.Tensor | None = None  # the pinned half, made at its first payload
        self.stream = torch.cuda.Stream(device=device)
        self.landing = Landing(self.space)

    @property
    def host(self) -> torch.Tensor:
        if self._host is None:
            self._host = torch.empty(self.space.capacity, dtype=torch.uint8, pin_memory=True)
        return self._host

    def stage(
        self,
        t: torch.Tensor,
        nbytes: int,
        own: bool = False,
        wait: Callable[[int], None] | None = None,
    ) -> tuple[Any, Any] | None:
        """Copy ``t`` (on this ring's device) into a slot; None when the ring has no room (with
        ``wait``: none came within ``WAIT_LIMIT_S``; ``wait`` is called with the ns waited). The
        bytes land in the slot of the pinned host buffer (a ``Staged`` the writer releases), or
        with ``own`` in a pinned uint8 tensor of their own, the slot freed by a later ``reap``.
        Raises ``TooLarge`` for a payload larger than the ring."""
        if self.space.slot_size(nbytes) > self.space.capacity:
            raise TooLarge(nbytes)
        if len(self.landing):
            self.landing.reap()
        off = self.space.take(nbytes)
        if off is None and wait is not None:
            off = take_waiting(self.space, self.landing, nbytes, wait)
            if off is None:
                log.warning(
                    "fsdp-replay: no room in the payload ring of %s for %.0f s (the writer is stuck?): a "
                    "payload of %d bytes is dropped",
                    self.device,
                    WAIT_LIMIT_S,
                    nbytes,
                )
        if off is None:
            return None
        try:
            host = (
                torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                if own
                else self.host[off : off + nbytes]
            )
        except RuntimeError:  # no pinned memory: the caller's plain copy says so
            self.space.free(off)
            raise
        dev = self.dev[off : off + nbytes]
        # 1. on the training stream: the bytes as they are now (an in-place write after this
        # point does not reach the slot)
        training = torch.cuda.current_stream(self.device)
        try:
            if self.sm_copy and t.is_contiguous() and nbytes % 4 == 0 and t.data_ptr() % 4 == 0:
                words = t.detach().reshape(-1).view(torch.uint8).view(torch.int32)
                torch.bitwise_or(words, 0, out=dev.view(torch.int32))
            else:
                dev.view(t.dtype).view(t.shape).copy_(t.detach())
        except RuntimeError:  # a dtype a byte buffer cannot be viewed as: the plain copy takes it
            self.space.free(off)
            raise
        copied = torch.cuda.Event()
        copied.record(training)
        # 2. on the side stream, behind that copy: to the host (torch's copy records its event
        # on a block of the caching host allocator, which reuses the block only after it)
        self.stream.wait_event(copied)
        with torch.cuda.stream(self.stream):
            host.copy_(dev, non_blocking=True)
        ready = torch.cuda.Event(blocking=True)
        ready.record(self.stream)
        if own:
            self.landing.add(ready, off)
            return host, ready
        return Staged(host, self, off), ready


class PayloadRings:
    """One ``PayloadRing`` per device, made at its first payload; ``capacity`` 0: no ring (device
    payloads are copied on the training stream into pinned memory, the way before the ring)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        # the device-to-device copies by a kernel on the SMs (PayloadRing's and the tape's C++ hook's)
        self.sm_copy = options.process_switch(SM_COPY_ENV, False)
        self._rings: dict[int, PayloadRing] = {}
        self.error: str | None = None  # why the ring could not be made (then: the plain copy)

    def ring(self, device: torch.device) -> PayloadRing | None:
        if self.capacity <= 0 or self.error is not None:
            return None
        idx = device.index if device.index is not None else torch.cuda.current_device()
        ring = self._rings.get(idx)
        if ring is None:
            try:
                ring = self._rings[idx] = PayloadRing(torch.device("cuda", idx), self.capacity, self.sm_copy)
            except (RuntimeError, torch.OutOfMemoryError) as e:  # no memory for it: say so once, go on
                self.error = f"{type(e).__name__}: {e}"[:300]
                log.warning(
                    "fsdp-replay: no payload ring on cuda:%d (%s); device payloads are copied on the "
                    "training stream",
                    idx,
                    self.error,
                )
                return None
        return ring
