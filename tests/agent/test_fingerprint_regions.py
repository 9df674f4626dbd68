"""In-place all-gathers (FSDP2): the input is a slice of the output, so the recorder fingerprints
the output once and takes the input's sk64 from its rows. Both must equal the plain values."""

from __future__ import annotations

import pytest
import torch

from fsdp_replay.agent.fingerprint import fingerprint, fingerprint_with_region, region_of
from fsdp_replay.trace import fingerprint as ref

SHARD = 99_136  # float32 elements of one rank's shard in the example (not a multiple of 128)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("tail", [0, 6])
def test_every_rank_region_gives_the_plain_fingerprints(world: int, tail: int, fp_impl: str) -> None:
    out = torch.randn(world * SHARD + tail)
    if tail:
        out[-1] = float("nan")
    for rank in range(world):
        n = SHARD + (tail if rank == world - 1 else 0)
        inp = out[rank * SHARD : rank * SHARD + n]
        off = region_of(inp, out)
        assert off == rank * SHARD * 4
        whole, part = fingerprint_with_region(out, off, n * 4)
        assert whole == fingerprint(out)[:2]
        assert part == fingerprint(inp)[:2]
        raw = inp.numpy().tobytes()
        assert part[0] == ref.sk64(raw)


def test_a_nan_in_another_rank_region_flags_only_the_output(fp_impl: str) -> None:
    out = torch.randn(2 * SHARD)
    out[SHARD + 5] = float("nan")
    whole, part = fingerprint_with_region(out, 0, SHARD * 4)
    assert whole[1] and not part[1]


def test_region_of_refuses_what_it_cannot_share(torch_fp: str) -> None:
    out = torch.randn(4 * 40_000)
    assert region_of(out[100:40_100], out) is None  # not on a row boundary
    assert region_of(out[:40_001], out) is None  # ends inside a row, not at the end
    assert region_of(torch.randn(40_000), out) is None  # another buffer
    assert region_of(out[:100], out) is None  # small: zlib64, not sk64
    assert region_of(out.view(torch.int32)[:40_000], out) is None  # another dtype
    assert region_of(out[::2][:40_000], out) is None  # not contiguous


def test_the_device_path_packs_the_same_values() -> None:
    """The sketch a GPU computes (three reductions, one host buffer) gives the CPU's values; run
    here on CPU tensors, and on CUDA by the gpu test below."""
    from fsdp_replay.agent.fingerprint import nbytes_of
    from fsdp_replay.agent.fingerprint.tensor import _DeviceSketch, _sketch_sums

    def _sk64_on_device(t: torch.Tensor, slices: int = 1) -> _DeviceSketch | None:
        sums = _sketch_sums(t, slices)
        return None if sums is None else _DeviceSketch(*sums, nbytes_of(t))

    n = 99_200  # slices of whole 256-byte rows for 2-byte dtypes too
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.float16):
        t = (torch.randn(4 * n) * 3).to(dtype)
        sketch = _sk64_on_device(t, 4)
        assert sketch is not None
        values = sketch.values()
        assert values[0] == fingerprint(t)[:2]
        for r in range(4):
            part = t[r * n : (r + 1) * n]
            assert values[1 + r] == fingerprint(part)[:2]
            assert values[1 + r][0] == ref.sk64(part.view(torch.uint8).numpy().tobytes())
    assert _sk64_on_device(torch.randn(SHARD + 1)) is None  # not whole rows: the general path


@pytest.mark.gpu
def test_sk64_and_regions_on_cuda_equal_the_cpu_values() -> None:
    from fsdp_replay.agent.fingerprint import Pending

    def value(x: object) -> object:
        return x.value() if isinstance(x, Pending) else x

    out = torch.randn(2 * SHARD)
    out[SHARD + 9] = float("nan")
    dev = out.cuda()
    for algo_t in (dev, dev[:SHARD]):
        fp, nf, algo = fingerprint(algo_t)
        assert algo == "sk64"
        assert (value(fp), value(nf)) == fingerprint(algo_t.cpu(), "sk64")[:2]
    for rank in range(2):
        inp = dev[rank * SHARD : (rank + 1) * SHARD]
        off = region_of(inp, dev)
        assert off == rank * SHARD * 4
        both = fingerprint_with_region(dev, off, SHARD * 4)
        assert both is not None
        (wfp, wnf), (pfp, pnf) = both
        assert (value(wfp), value(wnf)) == fingerprint(out)[:2]
        assert (value(pfp), value(pnf)) == fingerprint(inp.cpu())[:2]
