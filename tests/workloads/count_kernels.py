"""Run a training script while counting, per optimizer step, the ops that really computed on a
tensor of more than fastforward.SMALL elements (an independent witness for the fast-forward).

    COUNT_KERNELS_OUT=OUT.json python count_kernels.py SCRIPT.py [ARGS...]

Without the variable the script just runs (a recording runs at full speed; its replay counts). A
dispatch mode pushed before the script runs sees every op that reaches a kernel: in a replay the
fast-forward's own mode sits above it (pushed later) and answers skipped ops without calling down,
so what this mode counts in a skipped step is what computed there. Each optimizer step appends a
line {"step": k, "big": n, "all": m} to OUT (a replay that stops at --to-step ends the process
without running exit handlers). In a replay the file may land in the replay's private folder.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

SMALL = 4096  # fsdp_replay.replayer.fastforward.SMALL, restated: this witness imports nothing of ours


class Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.step = 0
        self.counts: dict[int, dict[str, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        row = self.counts.setdefault(self.step, {"big": 0, "all": 0})
        row["all"] += 1
        if not func.is_view and func.namespace == "aten":
            leaves = tree_flatten((args, kwargs))[0]
            if any(
                isinstance(t, torch.Tensor) and t.numel() > SMALL and t.device.type != "meta" for t in leaves
            ):
                row["big"] += 1
        return func(*args, **kwargs)


def main() -> None:
    script, *rest = sys.argv[1:]
    out = os.environ.get("COUNT_KERNELS_OUT")
    sys.argv = [script, *rest]
    if not out:
        runpy.run_path(script, run_name="__main__")
        return
    counter = Counter()
    counter.__enter__()

    def stepped(*_: Any) -> None:
        row = counter.counts.pop(counter.step, {"big": 0, "all": 0})
        with open(out, "a") as f:
            f.write(json.dumps({"step": counter.step, **row}) + "\n")
        counter.step += 1

    register_optimizer_step_post_hook(stepped)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
