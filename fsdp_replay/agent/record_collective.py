"""The collective hot path of recording: fingerprint inputs, run the op, record its outputs.

A few dozen calls a step. Inside a training process each call and attribute read here costs
microseconds (cold caches), so it makes few of them; bench/README.md says where the time goes.
Collectives whose outputs are read later (FSDP2's prefetched all-gathers) are completed at the
program's own wait, not at issue, so recording keeps the overlap the program built.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fsdp_replay.agent import capture, objects
from fsdp_replay.agent.collectives import DEFERRABLE_OPS, P2P_OPS, CollectiveCall, wait_result, work_of
from fsdp_replay.agent.config import RecordConfig
from fsdp_replay.agent.counters import AgentState
from fsdp_replay.agent.fingerprint import fingerprint, fingerprint_with_region, nbytes_of, region_of
from fsdp_replay.agent.process_groups import ProcessGroups
from fsdp_replay.agent.tensor_record import TensorRecorder, placeholder
from fsdp_replay.agent.writer import BackgroundWriter
from fsdp_replay.trace import schema

# Ops whose gloo implementation only reads its inputs (ProcessGroupGloo: the reduce-scatters clone
# them before the in-place reduction; the all-gathers copy or send them), so that an input which
# shares no memory with an output keeps its bytes while the op runs. Not P2P (their events may be
# completed on another thread) nor functional ops (outputs unknown until they return).
LATE_OPS = frozenset(
    {
        "_reduce_scatter_base_",
        "reduce_scatter_tensor_coalesced_",
        "_allgather_base_",
        "allgather_",
        "allgather_coalesced_",
        "allgather_into_tensor_coalesced_",
    }
)
# All-gathers whose input may be a slice of their output (in place), left unchanged by the op.
REGION_OPS = frozenset(
    {"_allgather_base_", "allgather_into_tensor_coalesced_", "allgather_", "allgather_coalesced_"}
)
Plan = tuple[dict[int, tuple[int, int]], tuple[int, ...]]
_NO_PLAN: Plan = ({}, ())
# (work, call, event, regions, store outputs): a collective completed at the program's wait
Deferred = tuple[Any, CollectiveCall, dict[str, Any], dict[int, tuple[int, int]], bool]


def input_plan(call: CollectiveCall) -> Plan:
    """Which inputs are fingerprinted after the op is issued rather than before:

    - regions: inputs of an in-place all-gather that are a part of one of its outputs
      (FSDP2): input index -> (output index, byte offset). The op does not change their bytes,
      so they are fingerprinted with the output, once, when it completes
      (``fingerprint_with_region``);
    - late: CPU inputs that share no memory with any output, of ops that only read their
      inputs (``LATE_OPS``): fingerprinted right after the op is issued, while gloo's threads
      move the data.
    """
    outs = [capture.local(o) for o in call.outputs]
    ins = [capture.local(t) for t in call.inputs]
    regions: dict[int, tuple[int, int]] = {}
    if call.op in REGION_OPS:
        taken: set[int] = set()
        for i, t in enumerate(ins):
            for j, o in enumerate(outs):
                off = region_of(t, o) if j not in taken else None
                if off is not None:
                    regions[i] = (j, off)
                    taken.add(j)
                    break
    if call.op not in LATE_OPS or len(regions) == len(ins):
        return regions, ()
    spans = []
    for o in outs:
        if o.device.type != "cpu" or not o.is_contiguous():
            return regions, ()  # a strided output's bytes are not one range: stay on the safe side
        spans.append((o.data_ptr(), o.data_ptr() + nbytes_of(o)))
    late = []
    for i, t in enumerate(ins):
        if i in regions or t.device.type != "cpu" or not t.is_contiguous():
            continue
        a, b = t.data_ptr(), t.data_ptr() + nbytes_of(t)
        if all(b <= lo or a >= hi for lo, hi in spans):
            late.append(i)
    return regions, tuple(late)


class CollectiveRecorder:
    """The collectives interceptor's handler in record mode (``collectives.Handler``)."""

    def __init__(
        self,
        config: RecordConfig,
        state: AgentState,
        tensors: TensorRecorder,
        pgs: ProcessGroups,
        start: Callable[[], BackgroundWriter],
        fail: Callable[[str, BaseException], None],
        check_fault: Callable[[str], None],
    ) -> None:
        self.payload_inputs = config.payload_inputs
        self.state = state
        self.tensors = tensors
        self.pgs = pgs
        self.start = start
        self.fail = fail
        self.check_fault = check_fault
        self.step_colls = 0  # completed in the current step
        # the collective being waited in: (seq, step, op, pg, t_ns), and whether it was reported stuck
        self.inflight: tuple[int, int, str, int, int] | None = None
        self.stuck_reported = False
        self.deferred: list[Deferred] = []
        self.on_gpu: bool | None = None  # set by the recorder at the first step end
        self.drain_kernel: Callable[[bool], None] | None = None  # the C++ kernel's, when attached

    def active(self) -> bool:
        return self.state.recording

    def run(self, call: CollectiveCall, real: Callable[[], Any]) -> Any:
        """Record one collective around ``real()``; our thread CPU time (not the collective's)
        is added to ``cpu_ns``."""
        st = self.state
        t0, p0 = time.thread_time_ns(), st.program_ns
        gpu = st.gpu  # the CUPTI capture, while armed: what we launch here is ours (agent/cupti)
        ours = gpu.agent(True) if gpu is not None else False
        try:
            return self._run(call, real)
        finally:
            if gpu is not None:
                gpu.agent(ours)
            spent = time.thread_time_ns() - t0 - (st.program_ns - p0)
            st.cpu_ns += spent
            st.cpu_parts["collectives"] += spent

    def _run(self, call: CollectiveCall, real: Callable[[], Any]) -> Any:
        if self.deferred:
            self.complete_deferred()
        st = self.state
        op = call.op
        try:
            self.check_fault("coll")
            self.start()
            store_in = st.payload_now and self.payload_inputs
            regions, late = (
                input_plan(call) if not store_in and (op in REGION_OPS or op in LATE_OPS) else _NO_PLAN
            )
            inputs = call.inputs
            pos = st.pos
            seq, t_ns = pos.seq, time.monotonic_ns() - st.t0
            pg = self.pgs.id_of(call.process_group)
            record = self.tensors.record
            event: dict[str, Any] = {
                "type": schema.EV_COLLECTIVE,
                "seq": seq,
                "step": pos.step,
                "micro": pos.micro,
                "op": op,
                "pg": pg,
                "reduce_op": call.reduce_op,
                "root": call.root,
                "t_ns": t_ns,
                "dur_ns": 0,
                "tensors": [
                    placeholder(t) if i in regions or i in late else record("i", t, store_in)
                    for i, t in enumerate(inputs)
                ],
            }
            sending = objects.current()
            if sending is not None:  # what the pickled bytes stand for (none on a receiving rank)
                event["tensors"].append(record("j", sending.sent, False))
            extra = call.extra
            if extra:
                event["extra"] = extra
            pos.seq = seq + 1
            self.inflight = (seq, pos.step, op, pg, t_ns)
            self.stuck_reported = False
            if st.gpu is not None:  # kernels from here on run under this collective's seq
                st.gpu.boundary()
        except Exception as e:
            self.fail(f"collective {op}", e)
            return st.program(real)
        store = st.payload_now  # for the outputs: decided at issue, even if completed later
        result = st.program(real)
        try:
            for i in late:  # while the collective runs (it only reads them)
                event["tensors"][i] = record("i", inputs[i], False)
            if call.functional:
                call.set_outputs(result)
                work = None
            else:
                work = work_of(result)
            if work is not None and op in P2P_OPS and call.outputs and call.outputs[0].device.type == "cpu":
                # Waiting here could deadlock a program that posts irecv before isend on both sides.
                work.get_future().then(lambda _f: self._complete(call, event, regions, store))
                return result
            if work is not None and self._deferrable(call):
                # FSDP2 issues its all-gathers ahead and waits for them later (prefetch): waiting
                # here would serialize them with compute. The outputs are taken at the wait.
                self.deferred.append((work, call, event, regions, store))
                return result
        except Exception as e:
            self.fail(f"collective {op}", e)
            return result
        # The program's own error (a timeout, an abort) propagates from these waits, as it would from its own.
        if call.functional:
            st.program(wait_result, result, call)
        elif work is not None:
            if st.writer is not None and self.on_gpu is not True:
                st.writer.kick()  # the writer encodes pending events while we block in the wait
            st.program(work.wait)
        self._complete(call, event, regions, store)
        return result

    @staticmethod
    def _deferrable(call: CollectiveCall) -> bool:
        return (
            call.op in DEFERRABLE_OPS
            and bool(call.bound.get("async_op", True))
            and all(t.device.type == "cpu" for t in call.outputs)  # CUDA waits only order streams
        )

    def complete_deferred(self, force: bool = False) -> None:
        """Finish the deferred collectives whose work is done (all of them with ``force``).

        Called right after the program's own ``Work.wait()`` returns (so before it reads the
        outputs), at the next collective, and at the step end, where any still pending is waited
        for: a program that waits only from C++ is still recorded.
        """
        if self.drain_kernel is not None and force:
            self.drain_kernel(True)
        pending, self.deferred = self.deferred, []
        for item in pending:
            work = item[0]
            try:
                done = work.is_completed()
            except Exception:
                done = True
            if not done and not force:
                self.deferred.append(item)
                continue
            if not done:
                self.state.program(work.wait)  # the program's own error propagates, as from its own wait
            self._complete(*item[1:])

    def _complete(
        self, call: CollectiveCall, event: dict[str, Any], regions: dict[int, tuple[int, int]], store: bool
    ) -> None:
        try:
            st = self.state
            if not st.recording:
                return
            known: dict[int, tuple[int, bool, str]] = {}
            tensors = event["tensors"]
            for i, (j, off) in regions.items():
                out, inp = capture.local(call.outputs[j]), capture.local(call.inputs[i])
                both = fingerprint_with_region(out, off, nbytes_of(inp))
                if both is None:  # a layout the shared path does not take: apart (same bytes)
                    fp, nf, algo = fingerprint(inp, schema.FP_SK64)
                    tensors[i] = tensors[i]._replace(fp=fp, algo=algo, nonfinite=nf)
                    continue
                whole, part = both
                tensors[i] = tensors[i]._replace(fp=part[0], algo=schema.FP_SK64, nonfinite=part[1])
                known[j] = (whole[0], whole[1], schema.FP_SK64)
            record = self.tensors.record
            tensors += [record("o", t, store, known.get(j)) for j, t in enumerate(call.outputs)]
            event["dur_ns"] = time.monotonic_ns() - st.t0 - event["t_ns"]
            assert st.writer is not None
            st.writer.event(event)
            self.step_colls += 1
            inflight = self.inflight
            if inflight is not None and inflight[0] == event["seq"]:
                self.inflight = None
        except Exception as e:
            self.fail(f"collective {call.op}", e)

    def inflight_dict(self) -> dict[str, Any] | None:
        i = self.inflight
        return None if i is None else dict(zip(("seq", "step", "op", "pg", "t_ns"), i, strict=True))
