"""Whether a rank's CUDA kernels and copies are captured (``agent/cupti``), and when.

The recorder calls ``step_end`` at every step end and ``finish`` at the end. The first step end
decides: a rank whose optimizer's parameters are not on a CUDA device, or a ``--cupti off``
policy, never imports ``agent/cupti`` (nor cupti-python), and says so once in a ``cupti_state``
event, as a rank whose machine lacks cupti-python does. Nothing here raises into the program.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from fsdp_replay.agent import capture
from fsdp_replay.agent.config import RecordConfig
from fsdp_replay.agent.counters import AgentState
from fsdp_replay.agent.writer import BackgroundWriter
from fsdp_replay.trace import schema

log = logging.getLogger(__name__)
GPU_EXTRA = "pip install 'fsdp-replay[gpu]' (cupti-python)"


class GpuActivity:
    def __init__(self, config: RecordConfig, state: AgentState) -> None:
        self.config = config
        self.state = state
        self.capture: Any = None  # agent/cupti/activity.CuptiCapture, once started
        self.decided = False

    def step_end(self, writer: BackgroundWriter, opt: torch.optim.Optimizer) -> None:
        try:
            if not self.decided:
                self.decided = True
                self._start(writer, opt)
            if self.capture is not None:
                self.capture.step_end()
        except Exception as e:  # the capture's own failures are handled inside it: this is ours
            self.capture = None
            log.warning("fsdp-replay: CUPTI capture not started: %r", e)
            self._say(writer, "error", f"the capture could not start: {e!r}"[:500])

    def _start(self, writer: BackgroundWriter, opt: torch.optim.Optimizer) -> None:
        policy = self.config.cupti
        if policy.off:
            self._say(writer, "off", "--cupti off")
            return
        devices = sorted({p.device.type for p in capture.optimizer_params(opt)})
        if "cuda" not in devices or not torch.cuda.is_initialized():
            self._say(writer, "off", f"no CUDA device in use (the optimizer's parameters are on {devices})")
            return
        try:
            from fsdp_replay.agent.cupti.activity import CuptiCapture
        except ImportError as e:
            self._say(writer, "off", f"cupti-python cannot be imported ({e}): {GPU_EXTRA}")
            return
        self.capture = CuptiCapture(policy, self.config.snapshot_every, self.state, writer)

    def _say(self, writer: BackgroundWriter, state: str, reason: str) -> None:
        writer.event(
            {
                "type": schema.EV_CUPTI_STATE,
                "state": state,
                "reason": reason,
                "step": self.state.pos.step,
                "t_ns": self.state.t_ns(),
            }
        )

    def finish(self) -> None:
        if self.capture is not None:
            self.capture.finish()
