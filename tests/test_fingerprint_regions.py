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
def test_every_rank_region_gives_the_plain_fingerprints(world: int, tail: int) -> None:
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


def test_a_nan_in_another_rank_region_flags_only_the_output() -> None:
    out = torch.randn(2 * SHARD)
    out[SHARD + 5] = float("nan")
    whole, part = fingerprint_with_region(out, 0, SHARD * 4)
    assert whole[1] and not part[1]


def test_region_of_refuses_what_it_cannot_share() -> None:
    out = torch.randn(4 * 40_000)
    assert region_of(out[100:40_100], out) is None  # not on a row boundary
    assert region_of(out[:40_001], out) is None  # ends inside a row, not at the end
    assert region_of(torch.randn(40_000), out) is None  # another buffer
    assert region_of(out[:100], out) is None  # small: zlib64, not sk64
    assert region_of(out.view(torch.int32)[:40_000], out) is None  # another dtype
    assert region_of(out[::2][:40_000], out) is None  # not contiguous
