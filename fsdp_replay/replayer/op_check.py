"""Replay mode of the op-level fingerprints (``agent/op_tap.py``): each op of the recorded window
against the record, in order, until the first difference, which the report names.

An op whose inputs match the record and whose outputs do not computed something else from the
same inputs: the op is the likeliest culprit (a racy kernel, an uninitialized read, a faulty
device). An op whose inputs already differ took the difference from outside the ops the window
saw (a batch, an RNG draw, a file, a step before the window). Where the replay runs other ops than
the record (FSDP's buffer handling around its asynchronous collectives can come in another order
in a replay), the check stops and says so. The finding localizes; it is not the verdict: the
verdict comes from the collectives, parameters, losses and RNG states, as without the window (an
op may compute garbage nobody reads, such as an all-gather buffer before its collective fills it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fsdp_replay.agent.op_tap import OpTap


class OpCheck:
    def __init__(
        self,
        recorded: dict[int, list[tuple[str, str, int, int]]],
        steps: Any,
        micro: Callable[[], int],
        verifying: Callable[[], bool],
        fail: Callable[[str, BaseException], None],
    ) -> None:
        self.recorded = recorded
        self.micro = micro
        self.verifying = verifying
        self.step = 0
        self.idx = 0
        self.checked = 0
        self.finding: dict[str, Any] | None = None
        self.tap = OpTap(steps, self.check, fail, {})

    def at_step(self, step: int) -> None:
        self.step, self.idx = step, 0
        self.tap.at_step(step if self.finding is None else -1)  # after a finding: no more cost

    def check(self, name: str, module: str, in_fp: int, out_fp: int) -> None:
        idx = self.idx
        self.idx += 1
        if self.finding is not None or not self.verifying():
            return
        ops = self.recorded.get(self.step, [])
        where = {"step": self.step, "micro": self.micro(), "idx": idx, "op": name, "module": module}
        if idx >= len(ops) or ops[idx][0] != name:
            recorded = "no more ops" if idx >= len(ops) else ops[idx][0]
            self.finding = {
                "kind": "op_sequence",
                **where,
                "detail": f"the replay ran {name} where the record has {recorded}: the op check stopped here",
            }
        elif ops[idx][2] != in_fp:
            self.finding = {
                "kind": "op_input",
                **where,
                "detail": "its inputs differ from the record, and every op before it matched: the difference comes "
                "from outside the ops this window saw (a batch, an RNG draw, a file, a step before it)",
            }
        elif ops[idx][3] != out_fp:
            self.finding = {
                "kind": "op_result",
                **where,
                "detail": "it computed another result from the same inputs (a racy or nondeterministic kernel, an "
                "uninitialized read, a faulty device)",
            }
        else:
            self.checked += 1
