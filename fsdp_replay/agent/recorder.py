"""The recorder: turns what the hooks see into spool events, on the training thread's budget.

Everything here runs inside the program's own calls (a collective, ``optimizer.step``, ``next``
on a DataLoader iterator, ``backward``), so it only fingerprints, copies and enqueues: encoding
and disk I/O happen on the writer thread. Any exception of ours stops recording (``fail``):
the program's own call always runs, and its own errors always reach it unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdp_replay.agent import capture
from fsdp_replay.agent.collectives import (
    DEFERRABLE_OPS,
    P2P_OPS,
    CollectiveCall,
    reduce_op_name,
    wait_result,
    work_of,
)
from fsdp_replay.agent.config import RecordConfig
from fsdp_replay.agent.cxx.kernel import DTYPES as KERNEL_DTYPES
from fsdp_replay.agent.cxx.kernel import OPS as KERNEL_OPS
from fsdp_replay.agent.cxx.kernel import Kernel, KernelError
from fsdp_replay.agent.fingerprint import (
    fingerprint,
    fingerprint_many,
    fingerprint_with_region,
    host_values,
    native,
    nbytes_of,
    region_of,
)
from fsdp_replay.agent.writer import BackgroundWriter, BlobRef
from fsdp_replay.trace import schema
from fsdp_replay.trace.spool import SpoolWriter, rank_dir

log = logging.getLogger(__name__)
FLUSH_TIMEOUT_S = 60.0
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


_DTYPE_NAMES: dict[torch.dtype, str] = {}
_NO_PLAN: tuple[dict[int, tuple[int, int]], tuple[int, ...]] = ({}, ())


def dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def encode_structure(x: Any, tensors: list[torch.Tensor]) -> Any:
    """A batch as JSON with tensors replaced by their index in ``tensors`` (appended here)."""
    if isinstance(x, torch.Tensor):
        tensors.append(x)
        return {"T": len(tensors) - 1}
    if isinstance(x, dict):
        return {"d": [[encode_structure(k, tensors), encode_structure(v, tensors)] for k, v in x.items()]}
    if isinstance(x, tuple):
        fields = getattr(x, "_fields", None)
        items = [encode_structure(v, tensors) for v in x]
        return {"n": [type(x).__name__, list(fields), items]} if fields else {"t": items}
    if isinstance(x, list):
        return {"l": [encode_structure(v, tensors) for v in x]}
    if x is None or isinstance(x, bool | int | float | str):
        return {"v": x}
    return {"o": repr(x)[:200]}


def _uncaught_exception() -> str | None:
    """The exception the program is dying of, when ``finish`` runs at exit after one: Python
    stores it in ``sys.last_exc``/``sys.last_value`` before printing it and running atexit."""
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return None if exc is None else repr(exc)[:500]


class Fault:
    """``WHERE:N`` from FSDP_REPLAY_INJECT_FAULT: raise inside the agent at the N-th WHERE."""

    def __init__(self, spec: str) -> None:
        where, _, n = spec.partition(":")
        self.where = where
        self.n = int(n or 1)
        self.count = 0

    def check(self, where: str) -> None:
        if where == self.where:
            self.count += 1
            if self.count == self.n:
                raise RuntimeError(f"fault injected by FSDP_REPLAY_INJECT_FAULT at {where} #{self.n}")


class _Counters:
    """The sequence number, step and micro-step; the C++ kernel's shared state replaces it."""

    __slots__ = ("micro", "seq", "step")

    def __init__(self, seq: int = 0, step: int = 0, micro: int = 0) -> None:
        self.seq, self.step, self.micro = seq, step, micro


class Recorder:
    """One per process: the state of recording and the callbacks the hooks call."""

    # Shared with the C++ kernel when it is attached: both number collectives from one counter.
    seq = property(lambda self: self._st.seq, lambda self, v: setattr(self._st, "seq", v))
    step = property(lambda self: self._st.step, lambda self, v: setattr(self._st, "step", v))
    micro = property(lambda self: self._st.micro, lambda self, v: setattr(self._st, "micro", v))

    def __init__(self, config: RecordConfig) -> None:
        self.config = config
        self.pid = os.getpid()
        self.recording = True
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: Recorder._forked(ref))
        self.failed = False
        self.errors = 0
        self.cpu_ns = 0  # thread CPU time spent in our hooks, on the program's threads
        self.program_ns = 0  # of which the program's own work they ran (not counted in cpu_ns)
        self.writer: BackgroundWriter | None = None
        self.rank = -1
        self.t0 = time.monotonic_ns()
        self._st: Any = _Counters()
        self.kernel: Kernel | None = None
        self._kernel_pgs: dict[int, int] = {}  # process group address -> pg id
        self.step_colls = 0
        self.payload_now = 0 in config.payloads
        self.losses: list[Any] = []
        self.pgs: dict[str, int] = {}
        self._pg_ids: dict[int, tuple[Any, int]] = {}
        self.primary: weakref.ref[torch.optim.Optimizer] | None = None
        self.roots: list[weakref.ref[torch.nn.Module]] = []
        self.names: dict[int, str] = {}
        # the collective being waited in: (seq, step, op, pg, t_ns), and whether it was reported stuck
        self.inflight: tuple[int, int, str, int, int] | None = None
        self._stuck_reported = False
        self.iterators: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()
        self.loaders = 0
        self.batches = 0
        self.snapshots = 0
        self.initial_rng = capture.rng_state()
        self.fault = Fault(config.inject_fault) if config.inject_fault else None
        self.finished = False
        self._lock = threading.Lock()
        self.on_step_zero_done: Callable[[], None] | None = None
        self.module_idx = 0
        # (work, call, event, regions, store outputs): collectives completed at the program's wait
        self._deferred: list[
            tuple[Any, CollectiveCall, dict[str, Any], dict[int, tuple[int, int]], bool]
        ] = []
        self._pending_marker: threading.Event | None = None
        self._on_gpu: bool | None = None  # the primary optimizer's parameters are on a GPU
        self.tap: Any = None
        if not config.module_fingerprints.empty:
            from fsdp_replay.agent.modules import ModuleTap

            self.tap = ModuleTap(self._emit_module, self._tap_enabled, self.fail)
            self.tap.install()

    # -- life cycle ---------------------------------------------------------------------------
    def active(self) -> bool:
        # A forked child (DataLoader worker) inherits this object but not the writer thread:
        # _forked() turns ``recording`` off in the child.
        return self.recording

    @staticmethod
    def _forked(ref: weakref.ref[Recorder]) -> None:
        rec = ref()
        if rec is not None and os.getpid() != rec.pid:
            rec.recording = False
            if rec.kernel is not None:
                rec.kernel.state.enabled = 0

    def fail(self, where: str, exc: BaseException) -> None:
        """Stop recording after an internal error: log once, count, leave the program alone."""
        self.errors += 1
        if self.failed:
            return
        self.failed = True
        self.recording = False
        if self.kernel is not None:
            self.kernel.state.enabled = 0  # its calls go to the Python kernels, which pass them through
        log.warning("fsdp-replay: internal error in %s, recording stopped: %r", where, exc)
        if self.writer is not None:
            self.writer.event(
                {
                    "type": schema.EV_AGENT_ERROR,
                    "where": where,
                    "message": repr(exc),
                    "traceback": "".join(traceback.format_exception(exc))[-4000:],
                    "step": self.step,
                    "seq": self.seq,
                }
            )

    def _check_fault(self, where: str) -> None:
        if self.fault is not None:
            self.fault.check(where)

    def _ensure_started(self) -> BackgroundWriter:
        if self.writer is not None:
            return self.writer
        with self._lock:
            if self.writer is not None:
                return self.writer
            if dist.is_available() and dist.is_initialized():
                rank, world = dist.get_rank(), dist.get_world_size()
            else:
                rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
            self.rank = rank
            spool = SpoolWriter(
                rank_dir(Path(self.config.out) / schema.SPOOL_DIR, rank),
                rank,
                reserve_bytes=self.config.reserve_bytes,
            )
            writer = BackgroundWriter(spool, self.fail, self._on_idle)
            info = capture.process_info(rank, world, int(os.environ.get("LOCAL_RANK", 0)))
            start = {
                "type": schema.EV_RANK_START,
                "format_version": schema.FORMAT_VERSION,
                **info,
                "policy": {
                    "payloads": str(self.config.payloads),
                    "payload_inputs": self.config.payload_inputs,
                    "snapshot_every": self.config.snapshot_every,
                    "sync_steps": self.config.sync_steps,
                },
                "start_ns": time.time_ns(),
                "t0_wall_ns": time.time_ns() - (time.monotonic_ns() - self.t0),
                "fingerprint_algos": {
                    "cpu": schema.FP_SK64 if native.available() else schema.FP_ZLIB64,
                    "native_core": native.available(),
                    "cxx_kernel": self.kernel is not None,
                    "cpu_large": schema.FP_SK64,
                    "cpu_large_min_bytes": schema.SK64_MIN_BYTES,
                    "cuda": schema.FP_LIN64,
                },
            }

            def with_script() -> list[tuple[str, Any]]:
                return [("ev", {**start, "script": capture.script_info()})]

            writer.call(with_script)
            self._write_rng(writer, -1, self.initial_rng)
            self.writer = writer
            return writer

    def _on_idle(self) -> dict[str, Any] | None:
        """Writer thread, about once a second while it has nothing to write: the collective this
        rank has waited in for a while (once), else an ``alive`` mark of how far the rank got."""
        if self.failed:
            return None  # recording stopped: an `alive` mark would claim a record that is not kept
        stuck = self._stuck()
        if stuck is not None:
            return stuck
        return {
            "type": schema.EV_ALIVE,
            "seq": self.seq,
            "step": self.step,
            "t_ns": time.monotonic_ns() - self.t0,
        }

    def _stuck(self) -> dict[str, Any] | None:
        """The collective this rank has waited in for a while, once."""
        inflight = self.inflight
        k = self.kernel
        if k is not None and k.state.inflight_seq >= 0:
            st = k.state
            inflight = (
                st.inflight_seq,
                self.step,
                KERNEL_OPS[st.inflight_op],
                self._kernel_pgs.get(st.inflight_pg, -1),
                st.inflight_t_ns,
            )
        if inflight is None or self._stuck_reported:
            return None
        waited = time.monotonic_ns() - self.t0 - inflight[4]
        if waited < schema.STUCK_AFTER_NS:
            return None
        self._stuck_reported = True
        return {"type": schema.EV_STUCK, **self._inflight_dict(inflight), "waited_ns": waited}

    @staticmethod
    def _inflight_dict(inflight: tuple[int, int, str, int, int]) -> dict[str, Any]:
        return dict(zip(("seq", "step", "op", "pg", "t_ns"), inflight, strict=True))

    def finish(self, reason: str = "exit") -> None:
        """Write the end event and drain the writer (atexit, SIGTERM). Idempotent."""
        if self.finished or os.getpid() != self.pid or self.writer is None:
            return
        self.finished = True
        w = self.writer
        if self._deferred or self.kernel is not None:
            with contextlib.suppress(Exception):
                self.complete_deferred(force=True)
        self._write_modules(w)
        counters = w.counters.as_dict()
        counters["agent_errors"] = self.errors
        counters["agent_cpu_ns"] = self.agent_cpu_ns()
        counters["writer_cpu_ns"] = w.cpu_ns()
        counters["batches"] = self.batches
        counters["snapshots"] = self.snapshots
        w.event(
            {
                "type": schema.EV_END,
                "reason": reason,
                "steps": self.step,
                "colls": self.seq,
                "t_ns": time.monotonic_ns() - self.t0,
                "counters": counters,
                "inflight": None if self.inflight is None else self._inflight_dict(self.inflight),
                "exception": _uncaught_exception(),
            }
        )
        w.flush(FLUSH_TIMEOUT_S)
        w.close()

    def _write_modules(self, w: BackgroundWriter) -> None:
        script = capture.script_info()["path"]
        roots = [os.getcwd()] + ([os.path.dirname(script)] if script else [])
        mods = capture.local_modules(roots)

        def hashed() -> list[tuple[str, Any]]:
            listing = [{"name": n, "path": p, "sha256": capture.sha256_file(p)} for n, p in mods]
            return [("ev", {"type": schema.EV_MODULES, "modules": listing})]

        w.call(hashed)

    # -- tensors ------------------------------------------------------------------------------
    def _tensor(
        self, role: str, t: torch.Tensor, store: bool, known: tuple[int, bool, str] | None = None
    ) -> list[Any]:
        """A tensor's record; fingerprinted here unless its (fingerprint, nonfinite, algo) is ``known``."""
        w = self.writer
        assert w is not None
        t = capture.local(t)
        fp, nf, algo = known if known is not None else fingerprint(t)
        blob: Any = schema.NO_BLOB
        if store:
            nbytes = nbytes_of(t)
            if w.pending_bytes + nbytes > self.config.max_pending_bytes:
                w.count_dropped(nbytes)
            else:
                blob = BlobRef()
                if t.device.type == "cpu":
                    copy = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach())
                    w.blob(blob, copy, fp, nbytes, algo)
                else:
                    copy = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                    copy.copy_(t.detach(), non_blocking=True)
                    ready = torch.cuda.Event(blocking=True)
                    ready.record()
                    w.blob(blob, copy, fp, nbytes, algo, ready)
        return self._record(role, t, fp, algo, nf, blob)

    @staticmethod
    def _record(role: str, t: torch.Tensor, fp: Any, algo: str, nf: Any, blob: Any) -> list[Any]:
        """A tensor as events store it (``schema.TENSOR_FIELDS``)."""
        return [role, dtype_name(t.dtype), list(t.shape), fp, algo, nf, blob, t.device.type]

    # -- the C++ kernel -----------------------------------------------------------------------
    def attach_kernel(self) -> Callable[[], None] | None:
        """Let the C++ kernel (``kernel.py``) record the hot CPU collectives, where configured and
        the policy stores no payloads; returns how to detach it, or None where it is not used."""
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
        st = k.state
        st.t0, st.seq, st.step, st.micro = self.t0, self.seq, self.step, self.micro
        st.fault_at = self.fault.n - 1 if self.fault is not None and self.fault.where == "kernel" else -1
        st.failed, st.inflight_seq = 0, -1
        try:
            k.install()
        except KernelError as e:
            log.warning("fsdp-replay: C++ kernel not used (%s); the Python kernels record", e)
            return None
        self.kernel, self._st = k, st
        return self.detach_kernel

    def agent_cpu_ns(self) -> int:
        """The agent's thread CPU time on the program's threads: the hooks' and the C++ kernel's."""
        k = self.kernel
        return self.cpu_ns + (k.state.cpu_ns if k is not None else 0)

    def detach_kernel(self) -> None:
        k = self.kernel
        if k is None:
            return
        k.uninstall()
        self._st = _Counters(k.state.seq, k.state.step, k.state.micro)

    def drain_kernel(self, force: bool = False) -> None:
        """Turn the C++ kernel's finished records into events, after completing all its deferred
        all-gathers with ``force`` (the step end); between step ends the program's waits complete
        them (hooks.py)."""
        k = self.kernel
        assert k is not None
        if force and k.complete(True) < 0:
            log.warning("fsdp-replay: a deferred all-gather failed at the step end: %s", k.error())
        records = k.drain()
        if records:
            w = self._ensure_started()
            for r in records:
                w.event(self._kernel_event(r))
        self.step_colls += len(records)
        if k.state.failed and not self.failed:
            self.fail("C++ kernel", RuntimeError(k.error()))

    def _kernel_event(self, r: Any) -> dict[str, Any]:
        """The event the Python kernel would have written for this record."""
        pg = self._kernel_pgs.get(r.pg)
        if pg is None:
            group = dist.ProcessGroup.unbox(torch.ops.fsdpr.pg_of(r.pg))
            pg = self._kernel_pgs[r.pg] = self._pg(group)
        tensors = []
        for j in range(r.ntensors):
            t = r.t[j]
            tensors.append(
                [
                    chr(t.role),
                    dtype_name(KERNEL_DTYPES[t.dtype]),
                    list(t.shape[: t.ndim]),
                    t.fp,
                    schema.FP_SK64,
                    bool(t.nf),
                    schema.NO_BLOB,
                    "cpu",
                ]
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

    # -- collectives --------------------------------------------------------------------------
    def _pg(self, pg: dist.ProcessGroup | None) -> int:
        if pg is None:
            return -1
        got = self._pg_ids.get(id(pg))
        if got is not None and got[0] is pg:
            return got[1]
        pid = self._new_pg(pg)
        self._pg_ids[id(pg)] = (pg, pid)  # holds pg: its id is never reused while cached
        return pid

    def _new_pg(self, pg: dist.ProcessGroup) -> int:
        name = pg.group_name
        if name in self.pgs:
            return self.pgs[name]
        pid = len(self.pgs)
        self.pgs[name] = pid
        try:
            ranks = dist.get_process_group_ranks(pg)
        except Exception:  # a group created outside the world's registry
            ranks = []
        try:
            backend = str(dist.get_backend(pg))
        except Exception:
            backend = pg.name()
        assert self.writer is not None
        self.writer.event(
            {
                "type": schema.EV_PROCESS_GROUP,
                "pg": pid,
                "name": name,
                "ranks": ranks,
                "backend": backend,
                "size": pg.size(),
                "group_rank": pg.rank(),
            }
        )
        return pid

    def run(self, call: CollectiveCall, real: Callable[[], Any]) -> Any:
        """Record one collective around ``real()``; our thread CPU time (not the collective's)
        is added to ``cpu_ns``."""
        t0, p0 = time.thread_time_ns(), self.program_ns
        try:
            return self._run(call, real)
        finally:
            self.cpu_ns += time.thread_time_ns() - t0 - (self.program_ns - p0)

    def _program(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run the program's own work (the collective, its wait) inside our hooks, timed apart."""
        t0 = time.thread_time_ns()
        try:
            return fn(*args)
        finally:
            self.program_ns += time.thread_time_ns() - t0

    def _run(self, call: CollectiveCall, real: Callable[[], Any]) -> Any:
        # The hot path of recording (a few dozen calls a step). Inside a training process each
        # call and attribute read here costs microseconds (cold caches), so it makes few of them;
        # bench/README.md says where the time goes.
        if self._deferred:
            self.complete_deferred()
        op = call.op
        try:
            self._check_fault("coll")
            self._ensure_started()
            store_in = self.payload_now and self.config.payload_inputs
            regions, late = (
                self._input_plan(call) if not store_in and (op in REGION_OPS or op in LATE_OPS) else _NO_PLAN
            )
            inputs = call.inputs
            seq, t_ns = self.seq, time.monotonic_ns() - self.t0
            pg = self._pg(call.process_group)
            event: dict[str, Any] = {
                "type": schema.EV_COLLECTIVE,
                "seq": seq,
                "step": self.step,
                "micro": self.micro,
                "op": op,
                "pg": pg,
                "reduce_op": call.reduce_op,
                "root": call.root,
                "t_ns": t_ns,
                "dur_ns": 0,
                "tensors": [
                    self._placeholder(t) if i in regions or i in late else self._tensor("i", t, store_in)
                    for i, t in enumerate(inputs)
                ],
            }
            extra = call.extra
            if extra:
                event["extra"] = extra
            self.seq = seq + 1
            self.inflight = (seq, self.step, op, pg, t_ns)
            self._stuck_reported = False
        except Exception as e:
            self.fail(f"collective {op}", e)
            return self._program(real)
        store = self.payload_now  # for the outputs: decided at issue, even if completed later
        result = self._program(real)
        try:
            for i in late:  # while the collective runs (it only reads them)
                event["tensors"][i] = self._tensor("i", inputs[i], False)
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
                self._deferred.append((work, call, event, regions, store))
                return result
        except Exception as e:
            self.fail(f"collective {op}", e)
            return result
        # The program's own error (a timeout, an abort) propagates from these waits, as it would from its own.
        if call.functional:
            self._program(wait_result, result, call)
        elif work is not None:
            if self.writer is not None and self._on_gpu is not True:
                self.writer.kick()  # the writer encodes pending events while we block in the wait
            self._program(work.wait)
        self._complete(call, event, regions, store)
        return result

    @staticmethod
    def _input_plan(call: CollectiveCall) -> tuple[dict[int, tuple[int, int]], tuple[int, ...]]:
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

    @classmethod
    def _placeholder(cls, t: torch.Tensor) -> list[Any]:
        """An input whose fingerprint is filled in later (after issue, or with its output)."""
        return cls._record("i", capture.local(t), None, schema.FP_SK64, None, schema.NO_BLOB)

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
        if self.kernel is not None and force:
            self.drain_kernel(force=True)
        pending, self._deferred = self._deferred, []
        for item in pending:
            work = item[0]
            try:
                done = work.is_completed()
            except Exception:
                done = True
            if not done and not force:
                self._deferred.append(item)
                continue
            if not done:
                self._program(work.wait)  # the program's own error propagates, as from its own wait
            self._complete(*item[1:])

    def _complete(
        self, call: CollectiveCall, event: dict[str, Any], regions: dict[int, tuple[int, int]], store: bool
    ) -> None:
        try:
            if not self.recording:
                return
            known: dict[int, tuple[int, bool, str]] = {}
            tensors = event["tensors"]
            for i, (j, off) in regions.items():
                out, inp = capture.local(call.outputs[j]), capture.local(call.inputs[i])
                both = fingerprint_with_region(out, off, nbytes_of(inp))
                if both is None:  # a layout the shared path does not take: apart (same bytes)
                    fp, nf, algo = fingerprint(inp, schema.FP_SK64)
                    tensors[i][3:6] = [fp, algo, nf]
                    continue
                whole, part = both
                tensors[i][3:6] = [part[0], schema.FP_SK64, part[1]]
                known[j] = (whole[0], whole[1], schema.FP_SK64)
            tensors += [self._tensor("o", t, store, known.get(j)) for j, t in enumerate(call.outputs)]
            event["dur_ns"] = time.monotonic_ns() - self.t0 - event["t_ns"]
            assert self.writer is not None
            self.writer.event(event)
            self.step_colls += 1
            inflight = self.inflight
            if inflight is not None and inflight[0] == event["seq"]:
                self.inflight = None
        except Exception as e:
            self.fail(f"collective {call.op}", e)

    # -- steps --------------------------------------------------------------------------------
    def on_step_begin(self, opt: torch.optim.Optimizer) -> None:
        if self.primary is None:
            self.primary = weakref.ref(opt)
            self._ensure_started()
            self._name_params(opt)
            self._snapshot(opt)  # step 0: the initial parameters, before the first update

    def on_step_end(self, opt: torch.optim.Optimizer) -> None:
        if self.primary is None or self.primary() is not opt:
            return
        self._check_fault("step")
        w = self._ensure_started()
        if self._deferred or self.kernel is not None:
            self.complete_deferred(force=True)
        params = fingerprint_many([capture.local(p) for p in capture.optimizer_params(opt)])
        loss = host_values(torch.stack(self.losses)) if self.losses else []
        w.event(
            {
                "type": schema.EV_STEP,
                "step": self.step,
                "micro_steps": self.micro,
                "colls": self.step_colls,
                "params": [[fp, nf, algo] for fp, nf, algo in params],
                "loss": loss,
                "t_ns": time.monotonic_ns() - self.t0,
                "cpu_ns": [self.agent_cpu_ns(), w.cpu_ns()],
            }
        )
        if self.step == 0:
            self._write_modules(w)
            if self.on_step_zero_done is not None:
                self.on_step_zero_done()
        self.step += 1
        self.micro = 0
        self.step_colls = 0
        self.module_idx = 0
        self.losses = []
        self.payload_now = self.step in self.config.payloads
        self._write_rng(w, self.step, capture.rng_state())
        every = self.config.snapshot_every
        if every and self.step % every == 0:
            self._snapshot(opt)
        if self.config.sync_steps:
            self._sync_step(w, opt)

    def _sync_step(self, w: BackgroundWriter, opt: torch.optim.Optimizer) -> None:
        """Crash consistency: a finished step's records reach the disk before the next step ends.

        On the CPU a step's values are final when it ends, so we wait for them now. On a GPU
        they are final only when the device has run the step: waiting now would stall the host
        until the device drains (no more running ahead), so we wait for the previous step's
        records instead, which the device has long finished.
        """
        if self._on_gpu is None:
            self._on_gpu = any(p.device.type != "cpu" for p in capture.optimizer_params(opt)[:1])
        marker = w.marker()
        wait_for = self._pending_marker if self._on_gpu else marker
        self._pending_marker = marker
        if wait_for is not None and not wait_for.wait(FLUSH_TIMEOUT_S):
            log.warning(
                "fsdp-replay: the spool writer did not finish step %d within %.0fs",
                self.step - (2 if self._on_gpu else 1),
                FLUSH_TIMEOUT_S,
            )

    def _name_params(self, opt: torch.optim.Optimizer) -> None:
        for ref in self.roots:
            root = ref()
            if root is not None:
                for name, p in root.named_parameters():
                    self.names.setdefault(id(p), name)

    def _write_rng(self, w: BackgroundWriter, step: int, state: dict[str, Any]) -> None:
        # Every step boundary gets the states' fingerprints (the replay checks them); the states
        # themselves (~20 kB) only where a replay can restore them: process start, snapshot
        # steps, and the steps whose payloads are kept.
        every = self.config.snapshot_every
        keep = step <= 0 or (every and step % every == 0) or step in self.config.payloads

        def encoded() -> list[tuple[str, Any]]:
            fps, data = capture.encode_rng(state)
            if not keep:
                return [
                    ("ev", {"type": schema.EV_RNG, "step": step, "states": {**fps, "blob": schema.NO_BLOB}})
                ]
            ref = BlobRef()
            return [
                ("raw", (ref, data)),
                ("ev", {"type": schema.EV_RNG, "step": step, "states": {**fps, "blob": ref}}),
            ]

        w.call(encoded)

    def _snapshot(self, opt: torch.optim.Optimizer) -> None:
        w = self._ensure_started()
        roots = [m for m in (r() for r in self.roots) if m is not None]
        state = capture.snapshot_state([opt], roots, self.names, self.step)
        names = state["optimizers"][0]["param_names"]
        metas = [
            [n, *self._tensor("", p, False)[1:6]]
            for n, p in zip(names, state["optimizers"][0]["params"], strict=True)
        ]
        step = self.step
        self.snapshots += 1

        def encoded() -> list[tuple[str, Any]]:
            data = capture.encode_snapshot(state)
            ref = BlobRef()
            return [
                ("payload", (ref, data)),
                (
                    "ev",
                    {
                        "type": schema.EV_SNAPSHOT,
                        "step": step,
                        "blob": ref,
                        "nbytes": len(data),
                        "params": metas,
                    },
                ),
            ]

        w.call(encoded)

    # -- backward, batches, modules -----------------------------------------------------------
    def on_backward(self, tensors: Any) -> None:
        if isinstance(tensors, torch.Tensor) and tensors.numel() == 1:
            self.losses.append(tensors.detach().reshape(()).to(torch.float64))

    def after_backward(self) -> None:
        self.micro += 1

    def on_batch(self, iterator: Any, batch: Any) -> None:
        self._check_fault("batch")
        w = self._ensure_started()
        slot = self.iterators.get(iterator)
        if slot is None:
            slot = self.iterators[iterator] = [self.loaders, 0]
            self.loaders += 1
        leaves: list[torch.Tensor] = []
        structure = encode_structure(batch, leaves)
        w.event(
            {
                "type": schema.EV_BATCH,
                "step": self.step,
                "micro": self.micro,
                "index": slot[1],
                "loader": slot[0],
                "structure": structure,
                "tensors": [self._tensor("", t, self.payload_now) for t in leaves],
            }
        )
        slot[1] += 1
        self.batches += 1

    def on_root_forward(self, module: torch.nn.Module) -> None:
        if all(r() is not module for r in self.roots):
            self.roots.append(weakref.ref(module))
            if self.tap is not None:
                self.tap.name_modules(module)

    def _tap_enabled(self) -> bool:
        return self.active() and self.step in self.config.module_fingerprints

    def _emit_module(self, name: str, kind: str, fp: int, nonfinite: bool, algo: str) -> None:
        w = self._ensure_started()
        w.event(
            {
                "type": schema.EV_MODULE_FP,
                "step": self.step,
                "micro": self.micro,
                "idx": self.module_idx,
                "name": name,
                "kind": kind,
                "fp": fp,
                "algo": algo,
                "nonfinite": nonfinite,
            }
        )
        self.module_idx += 1

    # -- signals ------------------------------------------------------------------------------
    def install_sigterm(self) -> None:
        """Finish the trace on SIGTERM (torchrun's way of stopping workers), then die as before."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # the program handles SIGTERM itself; atexit still runs if it exits

        def on_term(signum: int, _frame: Any) -> None:
            try:
                self.finish(reason="SIGTERM")
            finally:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        signal.signal(signal.SIGTERM, on_term)
