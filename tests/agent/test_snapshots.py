"""A snapshot's parts on the training thread (``agent/capture.py``, ``agent/snapshots.py``): the LR
schedulers it finds, and its copies (on the CPU here; the device's pinned copies run on the GPU in
tests/system/test_gpu.py)."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from fsdp_replay.agent import capture
from fsdp_replay.agent.snapshots import DeviceCopies, snapshot_items


def _opt() -> torch.optim.Optimizer:
    return torch.optim.AdamW(torch.nn.Linear(4, 4).parameters(), lr=0.1)


def test_schedulers_made_before_and_after_the_first_snapshot_are_found_and_the_heap_walked_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    opt, other = _opt(), _opt()
    step = torch.optim.lr_scheduler.StepLR(opt, 2)
    torch.optim.lr_scheduler.StepLR(other, 3)  # another optimizer's: never found for ``opt``
    assert capture.schedulers_of(opt) == [step]
    walks: list[Any] = []
    real = gc.get_referrers

    def counted(*objs: Any) -> list[Any]:
        walks.append(objs)
        return real(*objs)

    monkeypatch.setattr(gc, "get_referrers", counted)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    lam = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    found = capture.schedulers_of(opt)
    assert walks == []  # the registry, not the heap
    assert sorted(map(id, found)) == sorted(map(id, [step, plateau, lam]))
    assert [type(s).__name__ for s in found] == sorted(type(s).__name__ for s in found)
    del plateau, found
    gc.collect()
    assert {type(s).__name__ for s in capture.schedulers_of(opt)} == {"StepLR", "LambdaLR"}
    assert capture.schedulers_of(_opt()) == [] and len(walks) > 0  # a new optimizer: walked once


def test_cpu_snapshot_copies_are_complete_at_once_and_need_no_wait() -> None:
    t = torch.arange(6.0)
    copies = DeviceCopies()
    state = capture.snapshot_state([_opt()], [], {}, 0, copies)
    c = copies(t)
    t.zero_()
    assert c.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] and copies.ready() == []
    items = snapshot_items(0, state, [], copies.ready())
    assert [k for k, _ in items] == ["payload", "ev"]
