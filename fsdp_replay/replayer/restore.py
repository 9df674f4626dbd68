"""Putting the replayed rank where the record was: a snapshot's parameters, optimizer and scheduler
state, and RNG states; and checking the RNG states at step boundaries."""

from __future__ import annotations

from typing import Any

import torch

from fsdp_replay.agent import capture
from fsdp_replay.replayer.expected import RankRecord
from fsdp_replay.replayer.report import Divergence

RNG_KINDS = ("python", "torch", "numpy")


def restore_snapshot(rec: RankRecord, snap: dict[str, Any], opt: torch.optim.Optimizer) -> None:
    """Load the snapshot's parameters, optimizer state, param-group settings and schedulers into
    the live optimizer, in place (the program keeps its own objects)."""
    state = capture.decode_snapshot(rec.blob(int(snap["payload"])))
    saved = state["optimizers"][0]
    params = capture.optimizer_params(opt)
    with torch.no_grad():
        for p, value in zip(params, saved["params"], strict=True):
            capture.local(p).copy_(value)
        for p, st in zip(params, saved["state"], strict=True):
            current = opt.state[p]
            for k, v in st.items():
                cur = current.get(k)
                if isinstance(v, torch.Tensor) and isinstance(cur, torch.Tensor):
                    capture.local(cur).copy_(v)
                else:
                    current[k] = v
        for group, g in zip(opt.param_groups, saved["param_groups"], strict=True):
            group.update({k: v for k, v in g.items() if k != "params"})
    for sched, s in zip(capture.schedulers_of(opt), saved["schedulers"], strict=False):
        sched.load_state_dict(s["state"])


def restore_rng(rec: RankRecord, step: int, what: str, notes: list[str]) -> None:
    """Set the RNG states recorded at ``step`` (-1: process start), noting where none was kept."""
    exp = rec.rng.get(step)
    if exp is None or exp["payload"] < 0:
        notes.append(f"no RNG state recorded at {what}")
        return
    fps, _ = capture.encode_rng(capture.rng_state())
    differs = [k for k in RNG_KINDS if k in exp and k in fps and fps[k] != exp[k]]
    capture.set_rng_state(capture.decode_rng(rec.blob(exp["payload"])))
    if differs and step < 0:
        notes.append(
            f"the {', '.join(differs)} RNG state at {what} was set to the recorded one: a new process "
            "starts with another (the OS seeds them unless the program does), so this is expected and "
            "needs nothing from you"
        )


def rng_divergence(rec: RankRecord, step: int, rank: int, micro: int) -> Divergence | None:
    """The first RNG state at the start of ``step`` that differs from the record, if any."""
    exp = rec.rng.get(step)
    if exp is None:
        return None
    fps, _ = capture.encode_rng(capture.rng_state())
    for k in RNG_KINDS:
        if k in exp and k in fps and fps[k] != exp[k]:
            return Divergence(
                kind="rng",
                rank=rank,
                step=step - 1,
                micro=micro,
                tensor=k,
                expected_fp=exp[k],
                actual_fp=fps[k],
                detail=f"the {k} RNG state at the end of step {step - 1} differs: the "
                "program drew a different amount of randomness",
            )
    return None
