"""The recorder's side of the C++ kernel: attach it, turn its records into the Python kernels' events.

All C++-kernel knowledge of the recorder is here (the library itself: ``kernel.py``). While
attached, the kernel numbers collectives from the state it shares with the recorder
(``AgentState.pos`` is the kernel's ``State``) and keeps compact records; ``drain`` turns them into
the events the Python kernels would have written, at step ends and at the program's waits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fsdp_replay.agent.collectives import reduce_op_name
from fsdp_replay.agent.config import RecordConfig
from fsdp_replay.agent.counters import AgentState, Position
from fsdp_replay.agent.cxx.kernel import DTYPES as KERNEL_DTYPES
from fsdp_replay.agent.cxx.kernel import OPS as KERNEL_OPS
from fsdp_replay.agent.cxx.kernel import Kernel, KernelError
from fsdp_replay.agent.process_groups import ProcessGroups
from fsdp_replay.agent.tensor_record import dtype_name
from fsdp_replay.agent.writer import BackgroundWriter
from fsdp_replay.trace import schema
from fsdp_replay.trace.events import Tensor

log = logging.getLogger(__name__)


class KernelBridge:
    def __init__(
        self,
        config: RecordConfig,
        state: AgentState,
        pgs: ProcessGroups,
        start: Callable[[], BackgroundWriter],
        fail: Callable[[str, BaseException], None],
        fault_at: int,
    ) -> None:
        self.config = config
        self.state = state
        self.pgs = pgs
        self.start = start
        self.fail = fail
        self.fault_at = fault_at  # the N-th kernel call raises (FSDP_REPLAY_INJECT_FAULT=kernel:N+1), or -1
        self.kernel: Kernel | None = None
        self.drained = 0  # records turned into events since the last step end

    def attach(self) -> Callable[[], None] | None:
        """Let the C++ kernel record the hot CPU collectives, where configured and the policy stores
        no payloads; returns how to detach it, or None where it is not used."""
        path = self.config.cxx_kernel_lib
        if not path:
            return None
        if not self.config.payloads.empty or self.config.payload_inputs:
            log.info("fsdp-replay: the C++ kernel records no payloads; the Python kernels record this run")
            return None
        try:
            k = Kernel(path)
        except KernelError as e:
            log.warning("fsdp-replay: C++ kernel not used (%s); the Python kernels record", e)
            return None
        st, pos = k.state, self.state.pos
        st.t0, st.seq, st.step, st.micro = self.state.t0, pos.seq, pos.step, pos.micro
        st.fault_at = self.fault_at
        st.failed, st.inflight_seq = 0, -1
        try:
            k.install()
        except KernelError as e:
            log.warning("fsdp-replay: C++ kernel not used (%s); the Python kernels record", e)
            return None
        self.kernel, self.state.pos = k, st
        return self.detach

    def detach(self) -> None:
        k = self.kernel
        if k is None:
            return
        k.uninstall()
        self.state.pos = Position(k.state.seq, k.state.step, k.state.micro)

    def cpu_ns(self) -> int:
        """The kernel's own thread CPU time on the program's threads."""
        return self.kernel.state.cpu_ns if self.kernel is not None else 0

    def drain(self, force: bool = False) -> None:
        """Turn the kernel's finished records into events, after completing all its deferred
        all-gathers with ``force`` (the step end); between step ends the program's waits complete
        them (hooks.py)."""
        k = self.kernel
        assert k is not None
        if force and k.complete(True) < 0:
            log.warning("fsdp-replay: a deferred all-gather failed at the step end: %s", k.error())
        records = k.drain()
        if records:
            w = self.start()
            for r in records:
                w.event(self._event(r))
        self.drained += len(records)
        if k.state.failed and not self.state.failed:
            self.fail("C++ kernel", RuntimeError(k.error()))

    def inflight(self, step: int) -> tuple[int, int, str, int, int] | None:
        """The collective the kernel is waiting in, as the recorder tracks its own."""
        k = self.kernel
        if k is None or k.state.inflight_seq < 0:
            return None
        st = k.state
        pg = self.pgs.known_address(st.inflight_pg)
        return (st.inflight_seq, step, KERNEL_OPS[st.inflight_op], pg, st.inflight_t_ns)

    def _event(self, r: Any) -> dict[str, Any]:
        """The event the Python kernel would have written for this record."""
        pg = self.pgs.id_of_address(r.pg)
        tensors = []
        for j in range(r.ntensors):
            t = r.t[j]
            tensors.append(
                Tensor(
                    chr(t.role),
                    dtype_name(KERNEL_DTYPES[t.dtype]),
                    list(t.shape[: t.ndim]),
                    t.fp,
                    schema.FP_SK64,
                    bool(t.nf),
                    schema.NO_BLOB,
                    "cpu",
                )
            )
        return {
            "type": schema.EV_COLLECTIVE,
            "seq": r.seq,
            "step": r.step,
            "micro": r.micro,
            "op": KERNEL_OPS[r.op],
            "pg": pg,
            "reduce_op": None if r.reduce_op < 0 else reduce_op_name(r.reduce_op),
            "root": None,
            "t_ns": r.t_ns,
            "dur_ns": r.dur_ns,
            "tensors": tensors,
        }
