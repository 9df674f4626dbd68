"""Putting the replayed rank where the record was: a snapshot's parameters, optimizer and scheduler
state, and RNG states; and checking the RNG states at step boundaries."""

from __future__ import annotations

from typing import Any

import torch

from fsdp_replay.agent import capture
from fsdp_replay.replayer.expected import RankRecord
from fsdp_replay.replayer.report import Divergence

RNG_KINDS = ("python", "torch", "numpy")


def restore_snapshot(
    rec: RankRecord,
    snap: dict[str, Any],
    opt: torch.optim.Optimizer,
    roots: list[torch.nn.Module] | None = None,
    notes: list[str] | None = None,
) -> None:
    """Load the snapshot's parameters, optimizer state, param-group settings, schedulers and the
    root modules' buffers into the live objects, in place (the program keeps its own objects)."""
    state = rec.snapshot_state(int(snap["payload"]))
    saved = state["optimizers"][0]
    params = capture.optimizer_params(opt)
    if any(saved["state"]) and not opt.state:
        _init_optimizer_state(opt)  # a fast-forward that skipped every step never made it
    with torch.no_grad():
        for p, value in zip(params, saved["params"], strict=True):
            capture.local(p).copy_(value)
        for p, group, st in zip(params, _groups_of(opt), saved["state"], strict=True):
            current = opt.state[p]
            for k, v in st.items():
                cur = current.get(k)
                if isinstance(v, torch.Tensor) and isinstance(cur, torch.Tensor):
                    capture.local(cur).copy_(v)
                elif isinstance(v, torch.Tensor):
                    current[k] = _state_tensor(p, group, v)
                else:
                    current[k] = v
        for group, g in zip(opt.param_groups, saved["param_groups"], strict=True):
            group.update({k: v for k, v in g.items() if k != "params"})
        _restore_buffers(roots or [], state.get("buffers") or {}, notes)
    for sched, s in zip(capture.schedulers_of(opt), saved["schedulers"], strict=False):
        sched.load_state_dict(s["state"])


def _groups_of(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [g for g in opt.param_groups for _ in g["params"]]


def _init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """The optimizer's state made the way torch's distributed checkpointing makes it (a step with
    zero gradients at lr 0): every tensor of the type, device and sharding the optimizer uses.
    The values are overwritten from the snapshot next; the step hooks know this step is not one
    of the program's."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(opt)


def _state_tensor(p: torch.Tensor, group: dict[str, Any], v: torch.Tensor) -> torch.Tensor:
    """A state entry the live optimizer lacks, placed like the parameter (shaped like it) or, for
    a scalar such as Adam's ``step``, where the optimizer keeps it (the device with fused or
    capturable, else the CPU)."""
    local = capture.local(p)
    if v.shape == local.shape and v.ndim:
        t = torch.zeros_like(p, dtype=v.dtype)
        capture.local(t).copy_(v)
        return t
    on_device = bool(group.get("fused") or group.get("capturable"))
    return v.to(local.device) if on_device else v.clone()


def _restore_buffers(
    roots: list[torch.nn.Module], saved: dict[str, torch.Tensor], notes: list[str] | None
) -> None:
    """The root modules' buffers (batch-norm statistics, counters), listed as the recorder listed
    them (``{root index}.{name}``)."""
    if not saved:
        return
    restored = 0
    for i, root in enumerate(roots):
        for name, buf in root.named_buffers():
            value = saved.get(f"{i}.{name}")
            if value is not None and tuple(value.shape) == tuple(capture.local(buf).shape):
                capture.local(buf).copy_(value)
                restored += 1
    if restored < len(saved) and notes is not None:
        notes.append(
            f"{len(saved) - restored} of the snapshot's {len(saved)} module buffers had no counterpart here "
            "and kept the values the program gave them"
        )


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
