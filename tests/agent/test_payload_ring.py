"""The device payload ring (agent/payload_ring.py): its space on the CPU, its copies on a GPU."""

from __future__ import annotations

import itertools
import random
import threading
import time
from pathlib import Path

import pytest

from fsdp_replay.agent.payload_ring import ALIGN, Landing, RingSpace, pinned_bytes, take_waiting


def _overlaps(live: dict[int, int]) -> list[tuple[int, int]]:
    spans = sorted(live.items())
    return [(a, b) for (a, sa), (b, _) in itertools.pairwise(spans) if a + sa > b]


def test_slots_never_overlap_and_space_comes_back_in_any_order_of_frees() -> None:
    rng = random.Random(7)
    ring = RingSpace(1 << 20)
    live: dict[int, int] = {}  # offset -> aligned size
    taken = refused = 0
    for _ in range(20_000):
        if live and (rng.random() < 0.45 or len(live) > 40):
            off = rng.choice(list(live))  # frees out of order too
            ring.free(off)
            del live[off]
        else:
            n = rng.choice((1, 255, 256, 257, 4096, 100_000, 300_000, 700_000))
            off = ring.take(n)
            if off is None:
                refused += 1
                continue
            taken += 1
            size = -(-n // ALIGN) * ALIGN
            assert off % ALIGN == 0 and off + size <= ring.capacity, (off, n)
            live[off] = size
            assert not _overlaps(live), live
        assert ring.used == sum(live.values())
    assert taken > 5_000 and refused > 0  # both paths ran
    for off in list(live):
        ring.free(off)
    assert ring.live() == 0 and ring.used == 0
    assert ring.take(ring.capacity) == 0  # empty again: the whole ring is one slot


def test_a_full_ring_refuses_without_waiting_and_takes_again_once_the_oldest_is_freed() -> None:
    ring = RingSpace(4 * ALIGN)
    a, b, c, d = (ring.take(ALIGN) for _ in range(4))
    assert (a, b, c, d) == (0, ALIGN, 2 * ALIGN, 3 * ALIGN)
    assert ring.take(1) is None  # full
    ring.free(c)  # not the oldest: its space is not reusable yet (slots go in ring order)
    assert ring.take(1) is None
    ring.free(a)
    assert ring.take(ALIGN) == 0  # wrapped to the start
    assert ring.take(ALIGN) is None
    ring.free(b)
    ring.free(d)
    assert ring.take(2 * ALIGN) == ALIGN  # after the newest live slot (at 0): [ALIGN, 3 * ALIGN)
    assert ring.take(5 * ALIGN) is None  # larger than the ring: never fits


class _Copy:
    """A host copy in flight: lands when ``synchronize`` is called, or when set ``done``."""

    def __init__(self) -> None:
        self.done = False
        self.synced = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.synced += 1
        time.sleep(0.05)  # the copy engine finishing it
        self.done = True


def test_a_full_ring_waits_for_the_writer_to_free_a_slot_and_counts_the_wait() -> None:
    space, landing = RingSpace(4 * ALIGN), Landing(RingSpace(0))
    offs = [space.take(ALIGN) for _ in range(4)]
    assert space.take(ALIGN) is None  # full: --when-full drop refuses at once
    waits: list[int] = []
    writer = threading.Timer(0.3, space.free, args=(offs[0],))  # the writer writes the oldest
    writer.start()
    t0 = time.monotonic()
    assert take_waiting(space, landing, ALIGN, waits.append) == offs[0]
    assert time.monotonic() - t0 >= 0.25 and len(waits) == 1 and waits[0] >= 0.25e9
    writer.join()
    # nothing frees it: after the limit the payload is given up (the caller drops and warns)
    assert take_waiting(space, landing, ALIGN, waits.append, limit_s=0.2) is None and waits[-1] >= 0.2e9


def test_a_full_ring_waits_for_the_oldest_copy_in_flight_to_land() -> None:
    space = RingSpace(3 * ALIGN)
    landing = Landing(space)
    copies = [_Copy() for _ in range(3)]
    for c in copies:
        landing.add(c, space.take(ALIGN))  # type: ignore[arg-type]
    waits: list[int] = []
    assert take_waiting(space, landing, 2 * ALIGN, waits.append) is not None
    # the oldest two were waited for, in order, and their slots freed; the newest is in flight
    assert [c.synced for c in copies] == [1, 1, 0] and len(landing) == 1 and waits[0] > 0


def test_takes_and_frees_from_two_threads_keep_the_books() -> None:
    ring = RingSpace(1 << 16)
    handed: list[int] = []
    lock = threading.Lock()
    done = threading.Event()

    def writer() -> None:  # frees in the order slots were taken, as the writer thread does
        while not done.is_set() or handed:
            with lock:
                off = handed.pop(0) if handed else None
            if off is not None:
                ring.free(off)

    t = threading.Thread(target=writer)
    t.start()
    refused = 0
    for i in range(5_000):
        while (off := ring.take(1 + i % 3000)) is None:  # full: the writer frees, the taker retries
            refused += 1
            time.sleep(0.0001)
        with lock:
            handed.append(off)
    done.set()
    t.join()
    assert ring.live() == 0 and ring.used == 0
    assert refused > 0  # it did fill up while the other thread freed


class Copy:
    """A side-stream copy's event, as ``Landing`` queries it."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_slots_whose_copy_landed_elsewhere_are_freed_once_done_and_in_order() -> None:
    space = RingSpace(8 * ALIGN)
    landing = Landing(space)
    copies = [Copy() for _ in range(3)]
    for c in copies:
        off = space.take(2 * ALIGN)
        assert off is not None
        landing.add(c, off)
    assert landing.reap() == 0 and space.live() == 3  # nothing copied yet
    copies[1].done = True
    assert landing.reap() == 0  # the oldest copy runs first on the one side stream: wait for it
    copies[0].done = True
    assert landing.reap() == 2 and space.live() == 1 and len(landing) == 1
    copies[2].done = True
    assert landing.reap() == 1 and space.live() == 0 and space.used == 0


def test_pinned_blocks_are_charged_at_the_power_of_two_the_host_allocator_takes() -> None:
    assert [pinned_bytes(n) for n in (0, 1, 2, 3, 4096, 4097, 20 << 20, (20 << 20) + 1)] == [
        0,
        1,
        2,
        4,
        4096,
        8192,
        32 << 20,
        32 << 20,
    ]


# -- on a GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("sm_copy", [False, True], ids=["memcpy", "kernel"])
@pytest.mark.parametrize("contiguous", [False, True], ids=["strided", "contiguous"])
@pytest.mark.parametrize("own", [False, True], ids=["ring-host", "own-pinned"])
def test_the_staged_bytes_are_those_at_the_collective_not_after_an_in_place_write(
    sm_copy: bool, contiguous: bool, own: bool
) -> None:
    import torch

    from fsdp_replay.agent.payload_ring import PayloadRing

    ring = PayloadRing(torch.device("cuda"), 64 << 20, sm_copy=sm_copy)
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.uint8):
        src = (torch.randn(1000, 257, device="cuda") * 100).to(dtype)
        src[0, :3] = torch.tensor([float("nan"), float("-inf"), -0.0]).to(dtype)
        view = src if contiguous else src.t()  # strided: staged as the values in the view's order
        want = view.contiguous().cpu()
        nbytes = want.numel() * want.element_size()
        staged = ring.stage(view, nbytes, own)
        assert staged is not None
        slot, ready = staged
        src.zero_()  # the program writes in place right after, on the training stream
        ready.synchronize()
        host = slot if own else slot.host  # with ``own``: a pinned tensor of its own
        assert host.is_pinned()
        # bytes, not values: NaN is not equal to itself
        assert torch.equal(host.view(torch.uint8).reshape(-1)[:nbytes], want.reshape(-1).view(torch.uint8)), (
            dtype
        )
        if own:
            assert ring.landing.reap() == 1  # its copy is done: the slot is free
        else:
            slot.release()
    assert ring.space.live() == 0
    assert (ring._host is None) == own  # the ring's pinned half is made only when used


@pytest.mark.gpu
@pytest.mark.slow
def test_a_run_whose_payloads_overflow_a_small_ring_drops_and_counts_them(tmp_path: Path) -> None:
    from harness import CLI, EXAMPLE, child_env, run, torchrun_cmd

    from fsdp_replay.trace import schema
    from fsdp_replay.trace.reader import Trace

    out = tmp_path / "rec"
    run(
        [
            *CLI,
            "record",
            "--out",
            str(out),
            "--payloads",
            "all",
            "--payload-ring-bytes",
            str(256 << 10),
            "--",
            *torchrun_cmd(1, EXAMPLE, "--steps", "3", "--layers", "2", "--d-model", "256", "--seq-len", "64"),
        ],
        env=child_env(),
    )
    counters = Trace.open(out / schema.TRACE_DIR).rank(0).attrs["end"]["counters"]
    assert counters["ring_full_drops"] > 0 and counters["blobs_dropped"] >= counters["ring_full_drops"]
    assert counters["blobs"] > 0  # the payloads that fit were written
    text = run([*CLI, "inspect", str(out)]).stdout
    assert "because the GPU payload ring was full" in text and "--payload-ring-bytes" in text, text
    print("ring full:", counters["ring_full_drops"], "of", counters["ring_full_drops"] + counters["blobs"])
