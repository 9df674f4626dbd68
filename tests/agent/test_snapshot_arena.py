"""The pinned slabs snapshots are copied into off the training stream (``agent/snapshots.py``:
``SnapshotArena``, ``AsyncCopies``), without a GPU: pinning is a function the arena is given. The
copies themselves, the settle at the next ``optimizer.step()`` and a torn snapshot run on the GPU
(tests/system/test_gpu.py)."""

from __future__ import annotations

import threading
import time

import torch

from fsdp_replay.agent.snapshots import SLAB_ALIGN, AsyncCopies, SnapshotArena, _fill, _Slot


class Pins:
    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.pinned: list[int] = []
        self.unpinned: list[int] = []

    def register(self, buf: torch.Tensor) -> bool:
        if self.fail:
            return False
        self.pinned.append(buf.numel())
        return True

    def unregister(self, buf: torch.Tensor) -> None:
        self.unpinned.append(buf.numel())


def test_slabs_are_pinned_once_and_reused() -> None:
    pins = Pins()
    arena = SnapshotArena(2, pins.register, pins.unregister)
    a = arena.take(1000)
    b = arena.take(1000)
    assert a is not None and b is not None and a is not b and pins.pinned == [1000, 1000]
    assert arena.take(1000) is None  # both in use, no more may be made, no wait asked for
    a.release()
    c = arena.take(900)  # a released slab large enough: no new pinning
    assert c is a and pins.pinned == [1000, 1000] and arena.pinned_bytes == 2000


def test_a_grown_state_pins_anew_and_lets_the_small_slab_go() -> None:
    pins = Pins()
    arena = SnapshotArena(2, pins.register, pins.unregister)
    small = arena.take(100)
    assert small is not None
    small.release()
    big = arena.take(5000)  # optimizer state made after the first step: the state grew
    assert big is not None and big.nbytes == 5000
    assert pins.unpinned == [100] and arena.pinned_bytes == 5000 and arena.slabs == [big]


def test_taking_waits_for_a_release_when_asked_and_gives_up_after_its_time() -> None:
    arena = SnapshotArena(1, Pins().register, Pins().unregister)
    held = arena.take(64)
    assert held is not None
    threading.Timer(0.2, held.release).start()  # the writer encoded the snapshot
    t0 = time.monotonic()
    again = arena.take(64, wait_s=5.0)
    assert again is held and time.monotonic() - t0 >= 0.15
    t0 = time.monotonic()
    assert arena.take(64, wait_s=0.2) is None and time.monotonic() - t0 >= 0.2


def test_an_arena_that_cannot_pin_says_so_once_and_asks_for_the_simple_copy() -> None:
    pins = Pins(fail=True)
    arena = SnapshotArena(2, pins.register, pins.unregister)
    assert arena.take(100) is None and arena.error is not None and "cudaHostRegister" in arena.error
    assert arena.take(100, wait_s=1.0) is None  # not retried, not waited for


def test_the_slab_layout_aligns_each_tensor_and_the_state_gets_its_views() -> None:
    copies = AsyncCopies()
    tensors = [torch.zeros(3), torch.zeros(200, dtype=torch.bfloat16), torch.zeros(0)]
    copies.tensors = tensors  # as __call__ notes device tensors (CPU ones here: layout only)
    offsets, size = copies.layout()
    assert offsets == [0, SLAB_ALIGN, SLAB_ALIGN * 2] and size == SLAB_ALIGN * 2
    state = {"params": [_Slot(0), (_Slot(1), "x")], "buffers": {"b": _Slot(2)}, "step": 7}
    views = [torch.ones(1), torch.ones(2), torch.ones(3)]
    filled = _fill(state, views)
    assert filled["params"][0] is views[0] and filled["params"][1] == (views[1], "x")
    assert filled["buffers"]["b"] is views[2] and filled["step"] == 7
    # a CPU tensor is copied at once, not noted
    cpu = torch.arange(4.0)
    out = AsyncCopies()(cpu)
    assert torch.equal(out, cpu) and out.data_ptr() != cpu.data_ptr()
