"""Run a training script (``raise_in_replay.py SCRIPT ARGS...``); in a replay, raise at its
second optimizer step: an exception the recorded run never met."""

from __future__ import annotations

import os
import runpy
import sys

from torch.optim.optimizer import register_optimizer_step_pre_hook

if os.environ.get("FSDP_REPLAY_MODE") == "replay":
    calls = [0]

    def _raise_at_the_second_step(_opt: object, _args: object, _kwargs: object) -> None:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("planted: only the replay meets this")

    register_optimizer_step_pre_hook(_raise_at_the_second_step)

sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
