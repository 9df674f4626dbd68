"""The native fingerprint core (``fsdp_replay/agent/fingerprint/_fpcore.c``, loaded with ctypes).

Its values must be the numpy reference's (``fsdp_replay.trace.fingerprint``) for any length,
alignment, dtype and number of slices; the agent must fall back to torch where it does not apply.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
import sys
import threading
import zlib
from typing import Any

import numpy as np
import pytest
import torch

from fsdp_replay.agent.fingerprint import fingerprint, fingerprint_with_region, native, region_of
from fsdp_replay.trace import fingerprint as ref


def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))


def test_crc32_is_zlibs(native_core: str) -> None:
    core = native.core()
    assert core is not None
    for n in (0, 1, 7, 8, 9, 255, 4096, 100_003):
        b = _bytes(n + 3, seed=n)
        for start in range(3):
            data = b[start : start + n].numpy().tobytes()
            buf = b[start : start + n]
            assert core.crc32(0, buf.data_ptr() if n else None, n) == zlib.crc32(data)
            assert core.crc32(12345, buf.data_ptr() if n else None, n) == zlib.crc32(data, 12345)


def test_sk64_is_the_reference_for_any_length_and_alignment(native_core: str) -> None:
    for n in (0, 1, 7, 8, 9, 255, 256, 257, 511, 4096, 65_535, 65_536, 65_537, 300_001):
        base = _bytes(n + 8, seed=n)
        for start in (0, 1, 3, 8):
            t = base[start : start + n]
            got = native.sk64(t)
            assert got is not None
            assert got[0] == got[1]
            assert got[0][0] == ref.sk64(t.numpy().tobytes()), (n, start)


@pytest.mark.parametrize("slices", [2, 3, 8])
def test_slices_are_each_the_reference(slices: int, native_core: str) -> None:
    t = torch.randn(slices * 64 * 37)  # slices of 37 rows of 256 bytes
    got = native.sk64(t, slices)
    assert got is not None and len(got) == slices + 1
    assert got[0][0] == ref.sk64(t.numpy())
    for i, part in enumerate(t.view(slices, -1)):
        assert got[1 + i][0] == ref.sk64(part.numpy())
    # a NaN in one slice flags that slice and the whole only
    t[64 * 37 + 5] = float("nan")
    flags = [nf for _, nf in native.sk64(t, slices) or []]
    assert flags == [True, False, True] + [False] * (slices - 2)


def test_slices_that_are_not_whole_rows_are_refused(native_core: str) -> None:
    assert native.sk64(torch.randn(2 * 100), 2) is None  # 400 bytes per slice
    assert native.sk64(torch.randn(2 * 64), 0) is None


def test_small_in_place_all_gathers_share_one_pass(native_core: str) -> None:
    out = torch.randn(4 * 64 * 3)  # four ranks' shards of 768 bytes: far below 64 KiB
    inp = out[2 * 192 : 3 * 192]
    assert region_of(inp, out) == 2 * 768
    whole, part = fingerprint_with_region(out, 2 * 768, 768) or ((None, None), (None, None))
    assert whole == fingerprint(out)[:2] and part == fingerprint(inp)[:2]
    assert part[0] == ref.sk64(inp.numpy())


def test_where_it_does_not_apply_the_torch_path_does(native_core: str) -> None:
    base = torch.randn(64, 65)
    assert native.sk64(base.t()) is None  # strided
    fp, _, algo = fingerprint(base.t())
    assert algo == "sk64" and fp == ref.sk64(base.t().contiguous().numpy())
    if hasattr(torch, "float8_e4m3fn"):
        f8 = torch.randn(1000).to(torch.float8_e4m3fn)
        assert native.sk64(f8) is None
        assert fingerprint(f8)[0] == ref.sk64(f8.view(torch.uint8).numpy())


def test_many_tensors_in_one_call(native_core: str) -> None:
    from fsdp_replay.agent.fingerprint import fingerprint_many

    base = torch.randn(64, 65)
    tensors = [
        torch.randn(1000),
        torch.empty(0),
        base.t(),  # strided: not taken natively
        torch.arange(77, dtype=torch.int64),
        torch.nn.Parameter(torch.randn(513).to(torch.bfloat16)),
        torch.tensor([1.0, float("inf")], dtype=torch.float16),
    ]
    got = native.sk64_many(tensors)
    assert got is not None and got[2] is None
    for t, g in zip(tensors, got, strict=True):
        if g is not None:
            assert g == native.sk64(t)[0]  # type: ignore[index]
    assert fingerprint_many(tensors) == [fingerprint(t) for t in tensors]
    assert [nf for _, nf, _ in fingerprint_many(tensors)] == [False] * 5 + [True]


def test_repeated_calls_with_the_same_tensors_see_their_new_bytes(native_core: str) -> None:
    """sk64_many reuses its argument arrays for the same tensors (a step's parameters), but a
    tensor whose bytes changed in place, or whose storage was replaced, gets its new value."""
    params = [torch.randn(300), torch.randn(5000), torch.zeros(7, dtype=torch.bfloat16)]
    first = native.sk64_many(params)
    assert native.sk64_many(params) == first
    params[1].add_(1.0)  # an optimizer step: in place
    second = native.sk64_many(params)
    assert second is not None and first is not None
    assert second[1] != first[1] and second[0] == first[0]
    params[0].data = torch.randn(600)  # a new storage (load_state_dict, .data = ...)
    third = native.sk64_many(params)
    assert third is not None and third[0] == native.sk64(params[0])[0]  # type: ignore[index]
    assert third[0][0] == ref.sk64(params[0].numpy())  # type: ignore[index]


def test_threads_get_their_own_row_buffers(native_core: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "HOLD_GIL_MAX_BYTES", 0)  # every call releases the GIL: they overlap
    tensors = [torch.randn(1000 + 977 * i) for i in range(8)]
    want = [ref.sk64(t.numpy()) for t in tensors]
    bad: list[int] = []

    def work(k: int) -> None:
        for _ in range(200):
            for i in (k, 7 - k):
                got = native.sk64(tensors[i])
                if got is None or got[0][0] != want[i]:
                    bad.append(i)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert bad == []


def test_small_calls_keep_the_gil_and_large_ones_release_it(
    native_core: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The training thread's calls keep the GIL up to HOLD_GIL_MAX_BYTES (another thread taking it
    mid-call would make the training thread wait for it afterwards); above it they release it.
    Measured with a thread that counts while it holds the GIL: it counts during a call only if
    the call released the GIL. Both ways give the same values."""
    big = torch.randn(8 << 20)  # 32 MiB: a few milliseconds
    count = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1

    def counted_during_calls(limit: int) -> tuple[list[int], Any]:
        monkeypatch.setattr(native, "HOLD_GIL_MAX_BYTES", limit)
        counts, value = [], None
        for _ in range(9):
            before = count[0]
            value = native.sk64(big)
            counts.append(count[0] - before)
        return counts, value

    # A thread waiting for the GIL forces a switch after the switch interval; a long one keeps
    # such switches (which can land anywhere) out of the held calls.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.05)
    th = threading.Thread(target=spin, daemon=True)
    th.start()
    try:
        held, held_value = counted_during_calls(1 << 40)
        released, released_value = counted_during_calls(0)
    finally:
        stop.set()
        th.join()
        sys.setswitchinterval(interval)
    assert held_value == released_value
    assert held_value is not None and held_value[0] == (ref.sk64(big.numpy()), False)
    # On a busy machine the counting thread may get no CPU during some calls: the most it counted
    # during a releasing call, against the least during a holding one.
    assert max(released) > 1000, released
    assert min(held) < max(released) // 10, (held, released)
    # the mechanism itself, which load cannot blur: PyDLL functions keep the GIL
    core = native.core()
    assert core is not None
    flag = ctypes._FUNCFLAG_PYTHONAPI  # type: ignore[attr-defined]
    assert core.sk64._flags_ & flag and core.sk64_many._flags_ & flag
    assert not core.sk64_released._flags_ & flag and not core.sk64_many_released._flags_ & flag
    assert native.HOLD_GIL_MAX_BYTES == 0
    monkeypatch.undo()
    assert 1 << 20 <= native.HOLD_GIL_MAX_BYTES < big.numel() * 4  # a step's parameters: held


def test_it_can_be_disabled(torch_fp: str) -> None:
    assert native.core() is None
    assert native.sk64(torch.randn(100)) is None
    assert fingerprint(torch.randn(100))[2] == "zlib64"


def test_a_library_of_another_version_is_not_used(
    native_core: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(native, "_ABI", 1)
    native.reload()
    with caplog.at_level(logging.WARNING, logger="fsdp_replay.agent.fingerprint.native"):
        assert native.core() is None
    assert "from another version" in caplog.text
    monkeypatch.undo()
    native.reload()
    assert native.core() is not None


def test_a_freed_storage_raises_instead_of_crashing(native_core: str) -> None:
    """FSDP frees unsharded parameters with ``untyped_storage().resize_(0)``; reading one would
    crash the process (the recorder's guard turns the error into "recording stopped"). Run in a
    child process, so that a crash fails this test instead of ending the test run."""
    code = (
        "import torch\n"
        "from fsdp_replay.agent.fingerprint import native\n"
        "from fsdp_replay.agent.fingerprint import fingerprint, fingerprint_many\n"
        "t = torch.randn(1000)\n"
        "t.untyped_storage().resize_(0)\n"
        "for f in (lambda: fingerprint(t), lambda: fingerprint_many([torch.ones(3), t])):\n"
        "    try:\n"
        "        f()\n"
        "    except native.FreedStorageError as e:\n"
        "        print('raised:', e)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("raised: a (1000,) torch.float32 tensor's storage was freed") == 2, proc.stdout
