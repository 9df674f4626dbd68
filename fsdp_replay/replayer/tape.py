"""Replaying the tape: run each taped op, compare with what the recording kept, inject it.

Each call of a taped (nondeterministic) op runs its own kernel; its outputs are fingerprinted and
compared with the record's call of the same number. Where they differ and the recorded bytes are
in the trace, the recorded result is written into the outputs (before any other op reads them:
this runs below autograd, at the CUDA or CPU dispatch key) and counted; the replay goes on and
stays verifiable. Where the bytes are not there, the divergence is reported as one at a known
nondeterministic kernel, distinct from a divergence anywhere else.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

from fsdp_replay.agent import capture
from fsdp_replay.agent.fingerprint import fingerprint
from fsdp_replay.agent.tape import OpTape, outputs_of, start_tape
from fsdp_replay.errors import ReplayMismatchError
from fsdp_replay.replayer.expected import RankRecord
from fsdp_replay.replayer.report import Divergence
from fsdp_replay.replayer.verify import Finding, missing_payload_hint, stored_by_policy, value


class TapeOwner(Protocol):
    rank: int
    step: int
    micro: int
    truncated: bool
    rec: RankRecord
    notes: list[str]
    tape: ReplayTape | None
    op_tape: OpTape | None

    def fail(self, where: str, exc: BaseException) -> None: ...

    def active(self) -> bool: ...

    def verifying(self) -> bool: ...

    def found(self, f: Finding) -> None: ...

    def record_ended(self, where: str) -> None: ...


class ReplayTape:
    """The tape's handler in replay mode (``agent.tape.TapeHandler``)."""

    def __init__(self, rec: RankRecord, owner: TapeOwner) -> None:
        self.rec = rec
        self.owner = owner
        self.seq = 0
        self.injected: collections.Counter[str] = collections.Counter()
        self.matched = 0
        self._lock = threading.Lock()

    def active(self) -> bool:
        return self.owner.active()

    def taped(self, name: str, call: Callable[[], Any]) -> Any:
        result = call()
        with self._lock:
            n = self.seq
            self.seq += 1
        o = self.owner
        base: dict[str, Any] = {"rank": o.rank, "step": o.step, "micro": o.micro}
        exp = self.rec.tape.get(n)
        if exp is None:
            if o.truncated:
                o.record_ended(f"before call #{n} of the nondeterministic-kernel tape ({name})")
            elif o.verifying():
                detail = (
                    f"the recorded rank made {len(self.rec.tape)} calls of taped ops; the replay makes more"
                )
                o.found(
                    Finding(Divergence(kind="extra_tape_call", **base, op=name, detail=detail), stop=True)
                )
            return result
        if exp.op != name:
            if o.verifying():
                detail = f"call #{n} of the tape is {name}; recorded {exp.op}: the program took another path"
                o.found(Finding(Divergence(kind="tape_op", **base, op=name, detail=detail), stop=True))
            return result
        outs = outputs_of(result)
        for i, (t, e) in enumerate(zip(outs, exp.tensors, strict=False)):
            t = capture.local(t)
            fp = value(fingerprint(t, e.algo)[0])
            if fp == e.fp:
                self.matched += 1
                continue
            if e.payload >= 0 and tuple(t.shape) == e.shape:
                with torch.no_grad():
                    t.copy_(self.rec.tensor(e).to(t.device))
                self.injected[name] += 1
            elif o.verifying() and stored_by_policy(self.rec, exp.step, tape=True)[0]:
                # kept by the policy but not in the trace (dropped, damaged): no verdict past it
                detail = missing_payload_hint(self.rec, exp.step, exp.step, tape=True)
                d = Divergence(kind="payload_missing", **base, op=name, tensor=f"output {i}", detail=detail)
                o.found(Finding(d, stop=True, unusable=True))
                break
            elif o.verifying():
                d = Divergence(
                    kind="nondeterministic_kernel",
                    **base,
                    op=name,
                    tensor=f"output {i}",
                    expected_fp=e.fp,
                    actual_fp=fp,
                    detail=f"at a known nondeterministic kernel ({name}, step {exp.step}, call #{n}): expected "
                    "without deterministic mode; the recording kept this step's fingerprints only: record with "
                    f"--tape-payloads steps:{exp.step} to have the replay inject what the kernel computed",
                )
                o.found(Finding(d, stop=True))
                break
        return result


def attach_tape(owner: TapeOwner) -> None:
    """Tape the ops the recording taped (its policy names them), so that the calls line up."""
    policy = owner.rec.meta.get("policy") or {}
    if not policy.get("tape"):
        if policy.get("tape_error"):
            owner.notes.append(f"the recording ran without the tape: {policy['tape_error']}")
        return
    owner.tape = ReplayTape(owner.rec, owner)
    owner.op_tape, error = start_tape(owner.tape, str(policy.get("tape_ops") or ""), owner.fail)
    if error:  # without it the replay would recompute what the record injected: no verdict
        raise ReplayMismatchError(f"{error}; the recording taped these kernels")
