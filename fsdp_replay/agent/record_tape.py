"""Recording the tape: what each call of a taped (nondeterministic) op computed (``tape.py``).

Each call becomes a ``kop`` event: the op, where in the program it ran (step, micro-step, its
number on the tape), and each output's entry: its fingerprint, computed on the device with no
host synchronization, and its bytes when the step's payloads are stored. The op's own kernel runs
unchanged: the recorded run stays bit-identical to an unrecorded one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from fsdp_replay.agent import capture
from fsdp_replay.agent.config import RecordConfig
from fsdp_replay.agent.counters import AgentState
from fsdp_replay.agent.fingerprint import fingerprint_many
from fsdp_replay.agent.tape import outputs_of
from fsdp_replay.agent.tensor_record import TensorRecorder
from fsdp_replay.agent.writer import BackgroundWriter
from fsdp_replay.trace import schema


class TapeRecorder:
    """The tape's handler in record mode (``tape.TapeHandler``)."""

    def __init__(
        self,
        config: RecordConfig,
        state: AgentState,
        tensors: TensorRecorder,
        start: Callable[[], BackgroundWriter],
        fail: Callable[[str, BaseException], None],
    ) -> None:
        self.state = state
        self.stored_steps = config.tape_payloads  # None: as the collectives' payloads
        self.tensors = tensors
        self.start = start
        self.fail = fail
        self.seq = 0
        self.calls = 0
        self._lock = threading.Lock()  # backward ops run on the autograd engine's threads

    def active(self) -> bool:
        return self.state.recording

    def taped(self, name: str, call: Callable[[], Any]) -> Any:
        st = self.state
        t0, p0 = time.thread_time_ns(), st.program_ns
        gpu = st.gpu  # the CUPTI capture, while armed: our fingerprints' kernels are ours
        ours = gpu.agent(True) if gpu is not None else False
        result = st.program(call)
        try:
            w = self.start()
            with self._lock:
                seq = self.seq
                self.seq += 1
            pos = st.pos
            record = self.tensors.record
            store = st.payload_now if self.stored_steps is None else pos.step in self.stored_steps
            # --tape-payloads none: fingerprints only, so a replay names the kernel (not even small results)
            small = self.stored_steps is None or not self.stored_steps.empty
            outs = [capture.local(t) for t in outputs_of(result)]
            # one pass for all the call's outputs (on CUDA: one Triton launch, or a fixed number of
            # torch launches without Triton; one copy and one event), not a pass per output: the
            # tape runs in the backward of every attention layer, and on a host-bound step each
            # launch counts
            fps = fingerprint_many(outs)
            w.event(
                {
                    "type": schema.EV_KERNEL_OP,
                    "seq": seq,
                    "step": pos.step,
                    "micro": pos.micro,
                    "op": name,
                    "tensors": [record("o", t, store, fp, small) for t, fp in zip(outs, fps, strict=True)],
                }
            )
            self.calls += 1
        except Exception as e:  # never the program's: its result is returned unchanged
            self.fail(f"tape {name}", e)
        finally:
            if gpu is not None:
                gpu.agent(ours)
            st.cpu_ns += time.thread_time_ns() - t0 - (st.program_ns - p0)
        return result
