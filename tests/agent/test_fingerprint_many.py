"""The batched lin64 path of ``fingerprint_many`` gives the per-tensor values, in few torch ops.

On the CPU, ``fingerprint_many`` keeps computing zlib64/sk64 per tensor (by size); the batched lin64 path that it
uses on CUDA is ``_lin64_many`` here, checked against ``fingerprint(t, "lin64")`` and the numpy
reference. The ``gpu`` test checks ``fingerprint_many`` itself on CUDA tensors.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_replay.agent.fingerprint import fingerprint, fingerprint_many
from fsdp_replay.agent.fingerprint import many as fpm
from fsdp_replay.trace import fingerprint as ref

SIZES = (0, 1, 2, 3, 1023, 1024, 1025, 5000)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64)
# one row of 1024 words per chunk, a few rows per chunk, and the default
CHUNKS = {"1-row": 4096, "3-rows": 3 * 4096, "default": fpm._CHUNK_BYTES}


def raw_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous()
    if t.dtype == torch.bool:
        t = t.view(torch.uint8)
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def values(t: torch.Tensor) -> tuple[int, bool]:
    fp, nf, algo = fingerprint(t, "lin64")
    assert algo == "lin64"
    return fp, nf


def mixed(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out: list[torch.Tensor] = []
    for dtype in DTYPES:
        for n in SIZES:
            if dtype.is_floating_point:
                out.append((torch.randn(n, generator=g) * 100).to(dtype))
            else:
                out.append(torch.randint(-(2**62), 2**62, (n,), generator=g, dtype=dtype))
    base = torch.randn(64, 48, generator=g)
    words = torch.arange(-5000, 5000, dtype=torch.int32)
    out += [
        torch.randn(3, 5, 7, generator=g),  # n-d
        torch.tensor(2.5),  # 0-d
        base.t(),  # transposed: not contiguous
        base[:, ::3],  # strided
        base[5:9, 10:40],  # a block
        base.to(torch.bfloat16)[:, 1::2],
        torch.arange(16, dtype=torch.int8)[1:6],  # 5 bytes at byte offset 1
        torch.zeros(4, dtype=torch.bfloat16)[1:2] + 1,  # a fresh 2-byte tensor
        torch.randn(9, generator=g).to(torch.float16)[1:],  # 16 bytes at byte offset 2
        words.view(torch.uint8)[3:4003],  # 4000 bytes at byte offset 3
        words.view(torch.int16)[1:2049],  # 4096 bytes at byte offset 2
        torch.rand(1031, generator=g) > 0.5,  # bool, 1031 bytes
        torch.randint(0, 256, (777,), generator=g, dtype=torch.uint8),
        torch.randn(3000, generator=g, dtype=torch.float64),
        torch.randn(33, generator=g, dtype=torch.complex64),  # no batched path: per tensor
        torch.randn(300_000, generator=g),  # 1.2 MB: spans many chunks of a few rows
    ]
    return out


@pytest.fixture(params=list(CHUNKS), ids=list(CHUNKS))
def chunk(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(fpm, "_CHUNK_BYTES", CHUNKS[request.param])
    return CHUNKS[request.param]


def test_batched_lin64_equals_the_per_tensor_path_and_the_reference(chunk: int) -> None:
    tensors = mixed()
    got = fpm._lin64_many(tensors)
    assert len(got) == len(tensors)
    for t, (fp, nf) in zip(tensors, got, strict=True):
        assert (fp, nf) == values(t), (t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
        assert fp == ref.lin64(raw_bytes(t))


def test_the_chunks_are_bounded(chunk: int) -> None:
    tensors = mixed()
    fpm._lin64_many(tensors)
    layout = fpm._layout(tensors, torch.device("cpu"))
    assert all(c.rows * fpm._ROW_BYTES <= max(chunk, fpm._ROW_BYTES) for c in layout.chunks)
    if chunk < 1 << 20:
        assert len(layout.chunks) > 1


def test_one_tensor_and_an_order_change() -> None:
    tensors = mixed(seed=3)
    for t in tensors[::7]:
        assert fpm._lin64_many([t]) == [values(t)]
    rev = tensors[::-1]
    assert fpm._lin64_many(rev) == [values(t) for t in rev]
    assert fpm._lin64_many([]) == []


NONFINITE = [
    (torch.ones(10), False),
    (torch.tensor([1.0, float("nan")]), True),
    (torch.tensor([1.0, float("inf")], dtype=torch.bfloat16), True),
    (torch.tensor([float("inf"), float("-inf")], dtype=torch.float64), True),
    (torch.tensor([float("-inf")], dtype=torch.float16), True),
    (torch.tensor([3e38, 3e38], dtype=torch.float32), True),  # the float32 sum overflows
    (torch.tensor([60000.0, 60000.0], dtype=torch.float16), False),  # summed in float32
    (torch.tensor([1e308, 1e308], dtype=torch.float64), True),
    (torch.tensor([2**62, 2**62], dtype=torch.int64), False),
    (torch.ones(3, dtype=torch.bool), False),
    (torch.empty(0), False),
    (torch.empty(0, dtype=torch.bfloat16), False),
    (torch.tensor([1.0, float("nan")], dtype=torch.complex64), True),  # per-tensor fallback
]


def test_nonfinite_flags_agree(chunk: int) -> None:
    big = torch.randn(5000)
    big[4321] = float("nan")  # in the 2nd row (of a 20000-byte tensor): other chunks stay finite
    late_inf = torch.zeros(3000, dtype=torch.bfloat16)
    late_inf[-1] = float("inf")
    cases = [*NONFINITE, (big, True), (late_inf, True), (torch.randn(5000), False)]
    tensors = [t for t, _ in cases]
    got = fpm._lin64_many(tensors)
    for (t, flag), (fp, nf) in zip(cases, got, strict=True):
        assert nf is flag, (t.dtype, t[:4])
        assert (fp, nf) == values(t)
    # interleaved with finite tensors of other dtypes, each flag stays with its tensor
    mix = [x for t, _ in cases for x in (t, torch.ones(1500, dtype=torch.float64))]
    assert fpm._lin64_many(mix) == [values(t) for t in mix]


def _flip(t: torch.Tensor, byte: int, bit: int) -> None:
    b = t.view(-1).view(torch.uint8)
    b[byte] ^= 1 << bit


def test_the_layout_is_cached_and_values_follow_every_changed_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fpm, "_CHUNK_BYTES", 2 * 4096)
    g = torch.Generator().manual_seed(7)
    tensors = [
        torch.randn(5000, generator=g),
        torch.randn(1025, generator=g).to(torch.bfloat16),
        torch.randint(0, 100, (3,), generator=g, dtype=torch.int8),  # 3 bytes: a padded tail word
        torch.randn(2048, generator=g).to(torch.float16),
    ]
    fpm._LAYOUTS.clear()
    first = fpm._lin64_many(tensors)
    assert len(fpm._LAYOUTS) == 1
    layout = fpm._layout(tensors, torch.device("cpu"))
    assert fpm._lin64_many(tensors) == first
    # the same layout with other values (new tensors of the same dtypes and sizes)
    fresh = [torch.zeros_like(t) for t in tensors]
    assert fpm._lin64_many(fresh) == [values(t) for t in fresh]
    assert len(fpm._LAYOUTS) == 1 and fpm._layout(fresh, torch.device("cpu")) is layout
    prev = first
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        for byte in sorted({0, 1, nbytes // 2, 4095 % nbytes, nbytes - 1}):
            for bit in (0, 7):
                _flip(t, byte, bit)
                now = fpm._lin64_many(tensors)
                assert now == [values(x) for x in tensors]
                assert now[i][0] != prev[i][0], (i, byte, bit)
                assert [v for j, v in enumerate(now) if j != i] == [v for j, v in enumerate(prev) if j != i]
                prev = now
    assert len(fpm._LAYOUTS) == 1 and fpm._layout(tensors, torch.device("cpu")) is layout


def test_a_swap_of_two_unequal_elements_changes_the_batched_fingerprint() -> None:
    t = torch.randn(5000)
    other = torch.randn(100)
    before = fpm._lin64_many([other, t])[1][0]
    for i, j in ((0, 1), (0, 1024), (5, 4999), (1023, 1024)):
        s = t.clone()
        s[i], s[j] = t[j], t[i]
        assert fpm._lin64_many([other, s])[1][0] != before, (i, j)


def test_the_layout_cache_is_bounded() -> None:
    for n in range(1, 3 * fpm._LAYOUT_CACHE_SIZE):
        fpm._lin64_many([torch.ones(n)])
    assert len(fpm._LAYOUTS) <= fpm._LAYOUT_CACHE_SIZE


def test_fingerprint_many_on_the_cpu_is_per_tensor(fp_impl: str) -> None:
    tensors = [*mixed(seed=1), torch.ones(1 << 15)]
    assert fingerprint_many(tensors) == [fingerprint(t) for t in tensors]
    algos = {"sk64"} if fp_impl == "native" else {"zlib64", "sk64"}
    assert {algo for _, _, algo in fingerprint_many(tensors)} == algos
    assert fingerprint_many([]) == []


class FakeEvent:
    def __init__(self) -> None:
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1


def test_the_pending_values_read_their_own_rows() -> None:
    # what fingerprint_many returns on CUDA, with the rows already on the host
    tensors = mixed(seed=4)
    rows, row_of = fpm._lin64_rows(tensors)
    event = FakeEvent()
    out = fpm._pendings(tensors, row_of, fpm._HostRows(), event, rows.clone())
    assert all(isinstance(fp, fpm.Pending) and isinstance(nf, fpm.Pending) for fp, nf, _ in out)
    assert [(fp.value(), nf.value(), algo) for fp, nf, algo in out] == [
        (*values(t), "lin64") for t in tensors
    ]
    assert event.waits == 2 * len(tensors)


# -- how many torch ops ---------------------------------------------------------------------------
class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[Any] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))

    def compute(self) -> int:
        """Ops that are not views: on a device, each launches one or a few kernels."""
        return sum(
            n for op, n in self.ops.items() if not op.is_view and op is not torch.ops.aten.detach.default
        )


def count(fn: Callable[[], object]) -> OpCounter:
    with OpCounter() as c:
        fn()
    return c


def params(n: int) -> list[torch.Tensor]:
    shapes = [(64, 48), (64,), (100, 7), (5,)]
    return [torch.randn(shapes[i % 4]).to(torch.bfloat16 if i % 3 else torch.float32) for i in range(n)]


def per_tensor(tensors: list[torch.Tensor]) -> Iterator[torch.Tensor]:
    for t in tensors:  # what fingerprint() computes on the device for each tensor
        yield fpm.lin64_sums(t)
        nf = fpm._nonfinite(t)
        if nf is not None:
            yield nf


def test_the_batched_path_dispatches_a_fixed_number_of_compute_ops() -> None:
    small, large = params(10), params(100)
    fpm._lin64_many(small), fpm._lin64_many(large)  # build the layouts
    c10 = count(lambda: fpm._lin64_rows(small))
    c100 = count(lambda: fpm._lin64_rows(large))
    assert c10.compute() == c100.compute() <= 30
    # the rest are views of each tensor (flatten, as bytes): host work only
    assert sum(c100.ops.values()) - c100.compute() <= 4 * 100 + 20
    old = count(lambda: list(per_tensor(large)))
    assert old.compute() > 10 * c100.compute()


# -- CUDA -----------------------------------------------------------------------------------------
def _resolve(v: Any) -> Any:
    return v.value() if isinstance(v, fpm.Pending) else v


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_fingerprint_many_on_cuda_equals_fingerprint_per_tensor(
    deterministic: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        cpu = mixed(seed=2) + [t for t, _ in NONFINITE]
        tensors = [t.cuda() for t in cpu]
        tensors.append(torch.randn(64, 48, device="cuda").t())  # not contiguous on the device
        for chunk_bytes in (4096, 3 * 4096, 256 << 20):
            monkeypatch.setattr(fpm, "_CHUNK_BYTES", chunk_bytes)
            many = fingerprint_many(tensors)
            one = [fingerprint(t, "lin64") for t in tensors]
            torch.cuda.synchronize()
            for t, (fp, nf, algo), (fp1, nf1, algo1) in zip(tensors, many, one, strict=True):
                assert algo == algo1 == "lin64"
                assert (_resolve(fp), _resolve(nf)) == (_resolve(fp1), _resolve(nf1)), (t.dtype, t.shape)
                assert _resolve(fp) == ref.lin64(raw_bytes(t.cpu()))
            # the same layout again, after an in-place change of every contiguous tensor
            for t in tensors:
                if t.numel() and t.is_contiguous():
                    _flip(t, t.numel() * t.element_size() - 1, 0)
            again = [(_resolve(fp), _resolve(nf)) for fp, nf, _ in fingerprint_many(tensors)]
            assert again == [
                (_resolve(fp), _resolve(nf)) for fp, nf, _ in (fingerprint(t, "lin64") for t in tensors)
            ]
    finally:
        torch.use_deterministic_algorithms(was)
