"""Recording the tape: what each call of a taped (nondeterministic) op computed (``tape.py``).

Each call becomes a ``kop`` event: the op, where in the program it ran (step, micro-step, its
number on the tape), and each output's entry: its fingerprint, computed on the device with no
host synchronization, and its bytes when the step's payloads are stored. The op's own kernel runs
unchanged: the recorded run stays bit-identical to an unrecorded one.

With the C++ hook (``cxx/tape.py``) stacked on the tape, the calls of steps that store no payloads
are recorded in C++, and so are the CUDA calls of the flight recorder's steps (``--payloads
window:N``), their outputs kept by the hook (copied on the device, then into pinned memory on a
side stream: ``keep_outputs`` in ``_tape.cpp``); ``drain_native`` turns its records into the same
events before each step's end, hands the kept copies to the flight recorder, and fingerprints
the calls it left to Python (their outputs cloned).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from fsdp_replay.agent import capture
from fsdp_replay.agent.config import RecordConfig
from fsdp_replay.agent.counters import AgentState
from fsdp_replay.agent.cxx.tape import dtype_of
from fsdp_replay.agent.fingerprint import Pending, fingerprint_many
from fsdp_replay.agent.tape import outputs_of
from fsdp_replay.agent.tensor_record import TensorRecorder, dtype_name
from fsdp_replay.agent.writer import BackgroundWriter
from fsdp_replay.trace import schema
from fsdp_replay.trace.events import Tensor
from fsdp_replay.trace.fingerprint import combine_lin64

log = logging.getLogger(__name__)


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
        self.native: Any = None  # the C++ hook (cxx/tape.NativeTape), while stacked on the tape
        self.native_note = ""  # why its CUDA path is off, once tried
        self._cuda_tried = False
        self._mark_warned = False

    def _next_seq(self) -> int:
        if self.native is not None:  # one numbering for the C++ hook's calls and ours
            return int(self.native.next_seq())
        with self._lock:
            seq = self.seq
            self.seq += 1
        return seq

    def active(self) -> bool:
        return self.state.recording

    def taped(self, name: str, call: Callable[[], Any]) -> Any:
        st = self.state
        t0, p0 = time.thread_time_ns(), st.program_ns
        gpu = st.gpu  # the CUPTI capture, while armed: our fingerprints' kernels are ours
        ours = gpu.agent(True) if gpu is not None else False
        result = st.program(call)
        try:
            self._write(name, self._next_seq(), st.pos.step, st.pos.micro, outputs_of(result))
            self.calls += 1
        except Exception as e:  # never the program's: its result is returned unchanged
            self.fail(f"tape {name}", e)
        finally:
            if gpu is not None:
                gpu.agent(ours)
            spent = time.thread_time_ns() - t0 - (st.program_ns - p0)
            st.cpu_ns += spent
            st.cpu_parts["tape"] += spent
        return result

    def _write(self, name: str, seq: int, step: int, micro: int, tensors: list[Any]) -> None:
        """A call's ``kop`` event, its outputs fingerprinted (and stored, by the policy) here."""
        w = self.start()
        record = self.tensors.record
        store, small = self._stores(step)
        outs = [capture.local(t) for t in tensors]
        # one pass for all the call's outputs (on CUDA: one Triton launch, or a fixed number of
        # torch launches without Triton; one copy and one event), not a pass per output: the
        # tape runs in the backward of every attention layer, and on a host-bound step each
        # launch counts
        fps = fingerprint_many(outs)
        w.event(
            {
                "type": schema.EV_KERNEL_OP,
                "seq": seq,
                "step": step,
                "micro": micro,
                "op": name,
                "tensors": [
                    record("o", t, store, fp, small, kind="tape") for t, fp in zip(outs, fps, strict=True)
                ],
            }
        )
        if self.native is not None and not self._cuda_tried and outs and outs[0].is_cuda:
            self._arm_native_cuda(outs[0].device)

    def _stores(self, step: int) -> tuple[bool, bool]:
        """Whether ``step``'s taped results are stored, and whether small ones keep their bytes
        anyway (not with --tape-payloads none: fingerprints only, so a replay names the kernel)."""
        store = self.state.payload_now if self.stored_steps is None else step in self.stored_steps
        return store, self.stored_steps is None or not self.stored_steps.empty

    # -- the C++ hook ---------------------------------------------------------------------------
    def _arm_native_cuda(self, device: Any) -> None:
        """Once the fused kernel is compiled and its direct launch checked (the first taped call's
        fingerprint did both): let the C++ hook launch it, after a check of its own."""
        from fsdp_replay.agent.fingerprint import fused

        compiled = fused._direct
        if compiled is None:
            return  # not launched yet (a call without device outputs): the next call tries
        self._cuda_tried = True
        if not compiled:
            self.native_note = "the fused fingerprint kernel is not launched directly here"
        else:
            try:
                self.native.set_kernel(compiled, device)
                return
            except Exception as e:
                self.native_note = str(e)
        log.info("fsdp-replay: taped CUDA calls are recorded by Python: %s", self.native_note)

    def sync_native(self) -> None:
        """Tell the C++ hook where the program is and whether it may record this step's calls:
        not while the agent stands aside, or for steps whose payloads are written (the Python
        path stores them); for the flight recorder's steps it records them and keeps their CUDA
        outputs (``keep``), within the payload ring's size of device copies in flight. While CUPTI
        traces, the hook marks its own launches as the agent's (``mark``, with libcupti's functions
        the capture gives); where it cannot, or CUPTI refused a mark, the Python kernel records."""
        n = self.native
        if n is None:
            return
        st = self.state
        pos = st.pos
        step = pos.step
        store, small = self._stores(step)
        ns = n.state
        ns.step, ns.micro = step, pos.micro
        ns.small_limit = self.tensors.small_limit(step) if small else -1
        keep = store and self.tensors.flight is not None and self.tensors.rings.capacity > 0
        ns.keep, ns.keep_limit = int(keep), self.tensors.rings.capacity
        ns.keep_sm = int(self.tensors.rings.sm_copy)
        ns.keep_wait = int(self.tensors.wait)  # --when-full wait: past the bound a call waits
        marking = st.gpu.marking() if st.gpu is not None else None
        if marking is not None:
            ns.mark_push, ns.mark_pop, ns.mark_kind, ns.mark_id = marking
        ns.mark = int(marking is not None)
        can = st.gpu is None or (marking is not None and not ns.mark_errors)
        ns.fast = int(st.recording and (keep or not store) and can)

    def micro(self, micro: int) -> None:
        if self.native is not None:
            self.native.state.micro = micro

    def drain_native(self) -> None:
        """The C++ hook's records as ``kop`` events (before the step's end, and at the end)."""
        n = self.native
        if n is None:
            return
        records = n.drain()
        if records:
            w = self.start()
            for r in records:
                name = n.names[r.op] if r.op < len(n.names) else f"#{r.op}"
                if r.deferred:
                    self._write(name, r.seq, r.step, r.micro, n.take(r.seq))
                else:
                    w.event(self._native_event(n, name, r, self._kept(n, r)))
            self.calls += len(records)
        if n.state.failed and not self.state.failed:
            self.fail("C++ tape", RuntimeError(n.error()))
        if n.state.mark_errors and not self._mark_warned:
            self._mark_warned = True
            log.warning(
                "fsdp-replay: CUPTI refused the tape's C++ hook a mark of its own launches (counter "
                "tape_cxx_mark_errors); the Python kernel records the taped calls from here on"
            )

    def _kept(self, n: Any, r: Any) -> list[int] | None:
        """The blob ids of a kept call's outputs (held by the flight recorder, or dropped at its
        bound or, ``r.kept == 2``, at the hook's), or None for a call whose outputs were not kept."""
        if not r.kept:
            return None
        t0 = time.thread_time_ns()
        hosts, ready = n.kept(r.seq, r.ready) if r.kept == 1 else ([], None)
        sizes = [r.t[j].nbytes for j in range(r.ntensors)]
        if len(hosts) != len(sizes):  # not kept, or nothing to take: every output dropped
            hosts = [None] * len(sizes)
        blobs = [
            self.tensors.hold_kept(r.step, nbytes, host, ready)
            for nbytes, host in zip(sizes, hosts, strict=True)
        ]
        self.state.cpu_parts["payloads"] += time.thread_time_ns() - t0
        return blobs

    @staticmethod
    def _native_event(n: Any, name: str, r: Any, blobs: list[int] | None = None) -> dict[str, Any]:
        rows = _Rows(n, r.slot, r.event) if r.slot >= 0 else None
        tensors = []
        for j in range(r.ntensors):
            t = r.t[j]
            dtype = dtype_name(dtype_of(t.dtype))
            shape = list(t.shape[: t.ndim])
            if t.cuda:
                assert rows is not None
                fp: Any = Pending(None, None, rows.fp(j, t.nbytes))
                nf: Any = Pending(None, None, rows.nf(j))
                blob = blobs[j] if blobs is not None else schema.NO_BLOB
                tensors.append(Tensor("o", dtype, shape, fp, schema.FP_LIN64, nf, blob, "cuda"))
            else:
                tensors.append(
                    Tensor("o", dtype, shape, t.fp, schema.FP_SK64, bool(t.nf), schema.NO_BLOB, "cpu")
                )
        return {
            "type": schema.EV_KERNEL_OP,
            "seq": r.seq,
            "step": r.step,
            "micro": r.micro,
            "op": name,
            "tensors": tensors,
        }


class _Rows:
    """One C++-recorded call's rows: read once, by the writer thread (it waits for the event)."""

    __slots__ = ("_event", "_native", "_rows", "_slot")

    def __init__(self, native: Any, slot: int, event: int) -> None:
        self._native, self._slot, self._event = native, slot, event
        self._rows: list[list[int]] | None = None

    def get(self) -> list[list[int]]:
        if self._rows is None:
            self._rows = self._native.rows(self._slot, self._event)
        return self._rows

    def fp(self, j: int, nbytes: int) -> Any:
        def combine(_host: Any) -> int:
            s, a, b, _ = self.get()[j]
            return combine_lin64(s, a, b, nbytes)

        return combine

    def nf(self, j: int) -> Any:
        return lambda _host: bool(self.get()[j][3])
