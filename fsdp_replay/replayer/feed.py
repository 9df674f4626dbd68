"""Recorded batches fed to the replayed program where its DataLoader produced other data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fsdp_replay.agent.fingerprint import fingerprint
from fsdp_replay.replayer.expected import ExpectedTensor, RankRecord
from fsdp_replay.replayer.report import Divergence
from fsdp_replay.replayer.verify import Finding, value


@dataclass(slots=True)
class Fed:
    batch: Any = None
    """The batch to give the program instead of its own, or None (keep its own)."""
    differs: bool = False
    """The program's batch differs from the recorded one."""
    finding: Finding | None = None
    """It differs and the recorded bytes are not in the trace: nothing to feed (unusable)."""


def recorded_batch(
    rec: RankRecord, n: int, batch: Any, base: dict[str, Any], notes: list[str], first: bool
) -> Fed:
    """Compare batch ``n`` with the record; where it differs, the recorded tensors in its structure."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    exp = rec.batches[n]
    leaves, spec = tree_flatten(batch)
    tensor_idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    expected: list[ExpectedTensor] = exp["tensors"]
    if len(tensor_idx) != len(expected):
        notes.append(f"batch {n} has {len(tensor_idx)} tensors; recorded {len(expected)}: not replaced")
        return Fed()
    if all(
        value(fingerprint(leaves[i], e.algo)[0]) == e.fp for i, e in zip(tensor_idx, expected, strict=True)
    ):
        return Fed()
    if any(e.payload < 0 for e in expected):
        detail = f"batch {n} differs from the recorded one, whose bytes were not stored"
        d = Divergence(kind="batch", **base, detail=detail)
        return Fed(differs=True, finding=Finding(d, stop=True, unusable=True))
    if first:
        notes.append(
            f"the DataLoader produced different data than recorded (first at batch {n}, step "
            f"{base['step']}); the recorded batches were fed instead"
        )
    for i, e in zip(tensor_idx, expected, strict=True):
        leaves[i] = rec.tensor(e).to(leaves[i].device).clone()
    return Fed(batch=tree_unflatten(leaves, spec), differs=True)
