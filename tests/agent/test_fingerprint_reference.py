"""The agent's torch fingerprints and the trace's numpy reference agree, bit for bit, on every dtype,
layout and algorithm; and every single-bit change and swap changes them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fsdp_replay.agent.fingerprint import fingerprint as torch_fingerprint
from fsdp_replay.trace import fingerprint as ref
from fsdp_replay.trace import schema

# -- fingerprints: the torch (agent) and numpy (trace) versions agree -------------------------
DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
]
SIZES = [0, 1, 3, 7, 63, 64, 65, 511, 512, 513, 1023, 1024, 1025, 4099, 100_000]
ALGOS = ["zlib64", "lin64", "sk64"]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bit patterns (floats include NaN/Inf patterns: fingerprints hash bytes, not values)."""
    g = np.random.default_rng(seed)
    n = int(np.prod(shape, dtype=np.int64))
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    if dtype == torch.bool:
        return torch.from_numpy(g.integers(0, 2, n, dtype=np.uint8).astype(bool)).reshape(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = g.integers(0, 256, n * itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).reshape(shape).clone()


def raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's bytes in row-major order, without going through its dtype in numpy."""
    c = t.detach().contiguous().reshape(-1)
    if c.dtype == torch.bool:
        c = c.view(torch.uint8)
    return c.view(torch.uint8).numpy().tobytes()


def _agree(t: torch.Tensor, algo: str) -> None:
    fp, _nf, got_algo = torch_fingerprint(t, algo)
    assert got_algo == algo
    assert fp == ref.fingerprint(algo, raw_bytes(t)), f"{algo} {t.dtype} {tuple(t.shape)}"
    assert 0 <= fp < 1 << 64


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_and_numpy_fingerprints_agree(dtype: torch.dtype, algo: str, fp_impl: str) -> None:
    for n in SIZES:
        _agree(random_tensor((n,), dtype, seed=n), algo)


@pytest.mark.parametrize("algo", ALGOS)
def test_fingerprints_agree_on_non_contiguous_inputs(algo: str) -> None:
    for dtype in DTYPES:
        base = random_tensor((37, 129), dtype, seed=7)
        for view in (base.t(), base[:, ::3], base[::2, 5:], base[3:4].expand(6, 129), base.t()[1::4]):
            assert not view.is_contiguous() or view.storage_offset()
            _agree(view, algo)


@pytest.mark.parametrize("algo", ALGOS)
def test_fingerprints_agree_on_offset_views(algo: str, fp_impl: str) -> None:
    """Contiguous views that start inside their storage (at least one whole word long)."""
    base = random_tensor((5000,), torch.uint8, seed=3)
    for start in range(8):
        for n in (4, 5, 8, 9, 1025, 4099):
            _agree(base[start : start + n], algo)
    halves = random_tensor((300,), torch.bfloat16, seed=4)
    for start in range(4):
        _agree(halves[start : start + 5], algo)


def test_lin64_of_a_tiny_unaligned_view() -> None:
    base = torch.arange(16, dtype=torch.int8)
    for start in range(1, 4):
        for n in (0, 1, 2, 3):
            _agree(base[start : start + n], "lin64")
    _agree(torch.zeros(4, dtype=torch.bfloat16)[1:2], "lin64")  # one bf16 element at byte 2


def test_scalars_and_shapes_do_not_matter_beyond_bytes() -> None:
    t = random_tensor((6, 5), torch.float32, seed=1)
    for algo in ALGOS:
        _agree(torch.tensor(3.5), algo)
        assert torch_fingerprint(t, algo)[0] == torch_fingerprint(t.reshape(30), algo)[0]


def test_empty_input() -> None:
    assert ref.zlib64(b"") == 0
    assert ref.lin64(b"") == ref.combine_lin64(0, 0, 0, 0)
    assert ref.sk64(b"") == ref.combine_sk64(ref.sk64_crc(0, bytes(8 * ref.SK64_ROW), b""), 0)


def test_sk64_sees_sign_swaps_that_cancel_in_every_sum() -> None:
    """x and -x in the upper halves of two words differ by exactly 2**63: swapping them leaves the
    total unchanged and moves two row (or column) sums by 2**63; the sketch's CRC still sees it."""
    for d in (2, 128, 130, 1280):  # same row / same column / both differ / ten rows apart
        t = torch.zeros(4096, dtype=torch.float32)
        t[1], t[1 + d] = 3.0, -3.0
        u = t.clone()
        u[1], u[1 + d] = -3.0, 3.0
        assert torch_fingerprint(t, "sk64")[0] != torch_fingerprint(u, "sk64")[0], d
        assert ref.sk64(raw_bytes(t)) != ref.sk64(raw_bytes(u)), d


def test_recording_picks_sk64_for_cpu_tensors(fp_impl: str) -> None:
    """With the native core every CPU tensor gets sk64; the torch path keeps zlib64 below 64 KiB
    (its per-call cost would dominate there)."""
    small = torch.zeros(schema.SK64_MIN_BYTES // 4 - 1)
    large = torch.zeros(schema.SK64_MIN_BYTES // 4)
    assert torch_fingerprint(small)[2] == ("sk64" if fp_impl == "native" else "zlib64")
    assert torch_fingerprint(large)[2] == "sk64"


def test_native_nonfinite_flag_is_per_element(native_core: str) -> None:
    """The native core flags a NaN or infinite element, in every float dtype and position (also in
    the zero-padded last row and in complex numbers); finite values whose sum overflows are not."""
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        for n in (1, 63, 64, 65, 1000):
            t = torch.ones(n, dtype=dtype)
            assert not torch_fingerprint(t)[1]
            for i in {0, n // 2, n - 1}:
                for bad in (float("nan"), float("inf"), float("-inf")):
                    u = t.clone()
                    u[i] = bad
                    assert torch_fingerprint(u)[1], (dtype, n, i, bad)
    big = torch.finfo(torch.float32).max
    assert not torch_fingerprint(torch.tensor([big, big], dtype=torch.float32))[1]
    assert torch_fingerprint(torch.tensor([1 + 0j, complex(0, float("nan"))], dtype=torch.complex64))[1]
    assert not torch_fingerprint(torch.tensor([1 + 0j, 2j], dtype=torch.complex128))[1]
    assert not torch_fingerprint(torch.tensor([2**62, -1], dtype=torch.int64))[1]
    # float8 has no native rule: the torch path computes the same fingerprint
    if hasattr(torch, "float8_e5m2"):
        t = torch.ones(300).to(torch.float8_e5m2)
        assert torch_fingerprint(t)[0] == ref.fingerprint(torch_fingerprint(t)[2], raw_bytes(t))


def test_nonfinite_flag_is_the_float_sum(torch_fp: str) -> None:
    def nonfinite(t: torch.Tensor) -> bool:
        flags = {torch_fingerprint(t, algo)[1] for algo in ALGOS}
        assert len(flags) == 1
        return flags.pop()

    assert not nonfinite(torch.ones(10))
    assert nonfinite(torch.tensor([1.0, float("nan")]))
    assert nonfinite(torch.tensor([1.0, float("inf")], dtype=torch.bfloat16))
    assert nonfinite(torch.tensor([float("inf"), float("-inf")], dtype=torch.float64))
    # finite elements whose float32 sum overflows: flagged (the flag is about the sum)
    assert nonfinite(torch.tensor([3e38, 3e38], dtype=torch.float32))
    # float16 and bfloat16 are summed in float32, so 2 x 60000 does not overflow
    assert not nonfinite(torch.tensor([60000.0, 60000.0], dtype=torch.float16))
    # integers, bools and empty tensors are never non-finite
    assert not nonfinite(torch.tensor([2**62, 2**62], dtype=torch.int64))
    assert not nonfinite(torch.ones(3, dtype=torch.bool))
    assert not nonfinite(torch.empty(0))


def test_every_single_bit_flip_changes_both_fingerprints(fp_impl: str) -> None:
    data = bytearray(random_tensor((64,), torch.uint8, seed=11).numpy().tobytes())
    base = {algo: ref.fingerprint(algo, bytes(data)) for algo in ALGOS}
    for algo in ALGOS:
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        assert torch_fingerprint(t, algo)[0] == base[algo]
    for bit in range(64 * 8):
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        t = torch.frombuffer(flipped, dtype=torch.uint8).view(torch.float32)
        for algo in ALGOS:
            assert ref.fingerprint(algo, bytes(flipped)) != base[algo], (algo, bit)
            assert torch_fingerprint(t, algo)[0] != base[algo], (algo, bit)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.int64], ids=str)
def test_a_swap_of_two_unequal_elements_changes_both_fingerprints(dtype: torch.dtype, fp_impl: str) -> None:
    t = random_tensor((5000,), dtype, seed=5)
    before = {algo: torch_fingerprint(t, algo)[0] for algo in ALGOS}
    # neighbours, same word, same lin64 column one row apart, far apart, first/last
    for i, d in [
        (0, 1),
        (1, 1),
        (10, 2),
        (3, 3),
        (100, 7),
        (8, 8),
        (0, 1023),
        (5, 1024),
        (17, 1025),
        (0, 2048),
        (0, 4999),
        (1, 64),  # sk64: same row (float32: two per word, 128 per row)
        (3, 128),  # sk64: same column, next row
        (7, 512),  # sk64: same column four rows on (float32), one row on (int8)
    ]:
        u = t.clone()
        a, b = u[i].clone(), u[i + d].clone()
        if torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)):
            continue
        u[i], u[i + d] = b, a
        assert raw_bytes(u) != raw_bytes(t)
        for algo in ALGOS:
            assert torch_fingerprint(u, algo)[0] != before[algo], (algo, i, d)
            assert ref.fingerprint(algo, raw_bytes(u)) != before[algo], (algo, i, d)
