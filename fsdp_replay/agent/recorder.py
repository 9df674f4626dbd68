"""The recorder: turns what the hooks see into spool events, on the training thread's budget.

Everything here runs inside the program's own calls (a collective, ``optimizer.step``, ``next``
on a DataLoader iterator, ``backward``), so it only fingerprints, copies and enqueues: encoding
and disk I/O happen on the writer thread. Any exception of ours stops recording (``fail``):
the program's own call always runs, and its own errors always reach it unchanged.

The ``Recorder`` keeps the life cycle (start, the rank's first event, stuck detection, the end),
steps, snapshots, RNG states and module fingerprints; its parts share one ``AgentState``:
``record_collective`` (the collective hot path), ``tensor_record``, ``process_groups``,
``batches`` and ``cxx/bridge`` (the C++ kernel).
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

from fsdp_replay.agent import budget, capture, numerics
from fsdp_replay.agent.batches import BatchRecorder
from fsdp_replay.agent.budget import StepCost
from fsdp_replay.agent.compiled import CompiledWatch
from fsdp_replay.agent.config import Fault, RecordConfig
from fsdp_replay.agent.counters import AgentState, counters
from fsdp_replay.agent.cxx.bridge import KernelBridge
from fsdp_replay.agent.entropy import EntropyRecorder
from fsdp_replay.agent.files import FileLedger
from fsdp_replay.agent.fingerprint import fingerprint_many, host_values
from fsdp_replay.agent.flight import FlightRecorder, window_bound
from fsdp_replay.agent.gpu_activity import GpuActivity
from fsdp_replay.agent.liveness import Liveness
from fsdp_replay.agent.op_tap import OpRecorder
from fsdp_replay.agent.process_groups import ProcessGroups
from fsdp_replay.agent.rank_start import rank_start_event
from fsdp_replay.agent.record_collective import CollectiveRecorder
from fsdp_replay.agent.record_flight import FlightDumps
from fsdp_replay.agent.record_tape import TapeRecorder
from fsdp_replay.agent.snapshots import StateRecorder
from fsdp_replay.agent.state_dump import StateDump
from fsdp_replay.agent.tape import OpTape, start_tape, tape_ops
from fsdp_replay.agent.tensor_record import TensorRecorder
from fsdp_replay.agent.writer import BackgroundWriter
from fsdp_replay.trace import schema
from fsdp_replay.trace.redact import scrub_text
from fsdp_replay.trace.spool import SpoolWriter, rank_dir

log = logging.getLogger(__name__)
FLUSH_TIMEOUT_S = 60.0


def _uncaught_exception(redact_key: str = "") -> str | None:
    """The exception the program is dying of, when ``finish`` runs at exit after one: Python
    stores it in ``sys.last_exc``/``sys.last_value`` before printing it and running atexit. Its
    text goes through the redaction (a message may hold a URL with a password, a token)."""
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if exc is None:
        return None
    text = scrub_text(repr(exc), redact_key)
    # A long one keeps its end too: a DataLoader worker's error, re-raised here, ends with the
    # original error after the worker's traceback.
    return text if len(text) <= 500 else f"{text[:240]} ... {text[-255:]}"


class Recorder:
    """One per process: the owner the hooks call (``hooks.Hooks``)."""

    def __init__(self, config: RecordConfig) -> None:
        self.config = config
        self.pid = os.getpid()
        self.state = st = AgentState(payload_now=0 in config.payloads)
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: Recorder._forked(ref))
        self.rank = -1
        self.fault = Fault(config.inject_fault) if config.inject_fault else None
        window = config.payloads.window
        # the window's bound: (bytes, whether sized from memory), as rank_start.policy records it
        self.window_bound = window_bound(config.window_bytes, config.max_pending_bytes) if window else None
        ring = FlightRecorder(window, self.window_bound[0]) if self.window_bound else None
        # --payloads window:N
        self.flight = FlightDumps(ring, st, config.redact_key) if ring is not None else None
        self.tensors = TensorRecorder(config, st, ring)
        self.pgs = ProcessGroups(st)
        self.collectives = CollectiveRecorder(
            config, st, self.tensors, self.pgs, self._ensure_started, self.fail, self._check_fault
        )
        fault_at = self.fault.n - 1 if self.fault is not None and self.fault.where == "kernel" else -1
        self.bridge = KernelBridge(config, st, self.pgs, self._ensure_started, self.fail, fault_at)
        self.batch_recorder = BatchRecorder(st, self.tensors, self._ensure_started)
        self.states = StateRecorder(config, st, ring)
        self.tape_recorder = TapeRecorder(config, st, self.tensors, self._ensure_started, self.fail)
        self.tape: OpTape | None = None
        self.tape_error = ""
        self.losses: list[Any] = []
        self.primary: weakref.ref[torch.optim.Optimizer] | None = None
        self.roots: list[weakref.ref[torch.nn.Module]] = []
        self.names: dict[int, str] = {}
        self.initial_rng = capture.rng_state()
        self.finished = False
        self._budget_at: tuple[int, int, dict[str, int]] | None = None  # (t_ns, stored) at the last step end
        self._budget_said = False
        self.closed = False  # finish() has written everything
        self._deferred_term = 0  # a SIGTERM that came while finish() wrote the trace
        self._lock = threading.Lock()
        self.on_step_zero_done: Callable[[], None] | None = None
        self.module_idx = 0
        self._pending_marker: threading.Event | None = None
        self.tap: Any = None
        self.files = FileLedger(lambda: not self.finished, config.out)
        self.files.install()
        self.entropy = EntropyRecorder(lambda: not self.finished)
        self.entropy.install()
        self.flag_watch = numerics.FlagWatch({})
        self.compiled = CompiledWatch(
            lambda: not self.finished, [op.name for op in tape_ops(config.tape_ops)]
        )
        self.compiled.install()
        self.gpu_activity = GpuActivity(config, st)  # CUPTI's kernels and copies (agent/cupti)
        # what the writer says while idle: dump answers, the collective waited in, alive marks
        dumps = StateDump(config.out, redact_key=config.redact_key)
        self.liveness = Liveness(st, self.collectives, self.bridge, dumps, self.flight)
        self.ops: OpRecorder | None = None
        self.micro_ends: list[int] = []  # when this step's backward() calls returned (t_ns)
        self.memory: Any = None  # agent/allocations.py's MemoryRecorder, once CUDA is initialized
        if not config.op_fingerprints.empty:
            self.ops = OpRecorder(
                config.op_fingerprints, lambda: self.state.pos.step, self._ensure_started, self.fail
            )
        if not config.module_fingerprints.empty:
            from fsdp_replay.agent.modules import ModuleTap

            self.tap = ModuleTap(self._emit_module, self._tap_enabled, self.fail)
            self.tap.install()

    # -- what the hooks read ------------------------------------------------------------------
    @property
    def cpu_ns(self) -> int:
        return self.state.cpu_ns

    @cpu_ns.setter
    def cpu_ns(self, value: int) -> None:
        self.state.cpu_ns = value

    @property
    def program_ns(self) -> int:
        return self.state.program_ns

    @property
    def recording(self) -> bool:
        return self.state.recording

    @property
    def kernel(self) -> Any:
        return self.bridge.kernel

    @property
    def deferred(self) -> bool:
        """Collectives wait to be completed at the program's next wait."""
        return bool(self.collectives.deferred)

    def attach_kernel(self) -> Callable[[], None] | None:
        detach = self.bridge.attach()
        if detach is not None:
            self.collectives.drain_kernel = self.bridge.drain
        return detach

    def install_tape(self) -> OpTape | None:
        """Intercept the taped ops (``tape.py``) where the config asks for it."""
        if not self.config.tape:
            return None
        native = self._native_tape()
        self.tape, self.tape_error = start_tape(self.tape_recorder, self.config.tape_ops, self.fail, native)
        if self.tape_error:  # this torch cannot take the kernels: record without the tape, say so
            log.warning("fsdp-replay: %s; nondeterministic kernels are not taped", self.tape_error)
        elif native is not None:
            self.tape_recorder.native = native
            if self.tape is not None and self.tape.native_error:
                log.info("fsdp-replay: the C++ tape hook left some ops to Python: %s", self.tape.native_error)
            self.tape_recorder.sync_native()
        return self.tape

    def _native_tape(self) -> Any:
        """The C++ tape hook (``cxx/tape.py``) where the config names its library, else None."""
        path = self.config.cxx_tape_lib
        if not path:
            return None
        from fsdp_replay.agent.cxx.tape import NativeTape, TapeError

        try:
            return NativeTape(path)
        except TapeError as e:
            log.warning("fsdp-replay: C++ tape hook not used (%s); the Python tape records every call", e)
            return None

    def drain_kernel(self, force: bool = False) -> None:
        self.bridge.drain(force)

    def complete_deferred(self, force: bool = False) -> None:
        self.collectives.complete_deferred(force)

    def run(self, call: Any, real: Callable[[], Any]) -> Any:
        if self.tape is not None and self.tape.pending:
            self.tape.install_missing()
        return self.collectives.run(call, real)

    # -- life cycle ---------------------------------------------------------------------------
    def active(self) -> bool:
        # A forked child (DataLoader worker) inherits this object but not the writer thread:
        # _forked() turns ``recording`` off in the child.
        return self.state.recording

    @staticmethod
    def _forked(ref: weakref.ref[Recorder]) -> None:
        rec = ref()
        if rec is not None and os.getpid() != rec.pid:
            rec.state.recording = False
            rec.state.gpu = None
            if rec.kernel is not None:
                rec.kernel.state.enabled = 0
            if rec.tape_recorder.native is not None:
                rec.tape_recorder.native.state.fast = 0

    def fail(self, where: str, exc: BaseException) -> None:
        """Stop recording after an internal error: log once, count, leave the program alone."""
        st = self.state
        st.errors += 1
        if st.failed:
            return
        st.failed = True
        st.recording = False
        if self.kernel is not None:
            self.kernel.state.enabled = 0  # its calls go to the Python kernels, which pass them through
        if self.tape_recorder.native is not None:
            self.tape_recorder.native.state.fast = 0  # likewise the C++ tape hook's
        log.warning("fsdp-replay: internal error in %s, recording stopped: %r", where, exc)
        if st.writer is not None:
            key = self.config.redact_key  # the message may quote the program's own data
            st.writer.event(
                {
                    "type": schema.EV_AGENT_ERROR,
                    "where": where,
                    "message": scrub_text(repr(exc), key),
                    "traceback": scrub_text("".join(traceback.format_exception(exc)), key)[-4000:],
                    "step": st.pos.step,
                    "seq": st.pos.seq,
                }
            )

    def _check_fault(self, where: str) -> None:
        if self.fault is not None:
            self.fault.check(where)

    def _ensure_started(self) -> BackgroundWriter:
        st = self.state
        if st.writer is not None:
            return st.writer
        with self._lock:
            if st.writer is not None:
                return st.writer
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
            writer = BackgroundWriter(spool, self.fail, self.liveness.on_idle)
            key = numerics.key()
            self.flag_watch = numerics.FlagWatch(key["flags"])
            start = rank_start_event(
                self.config,
                capture.process_info(
                    rank, world, int(os.environ.get("LOCAL_RANK", 0)), self.config.redact_key
                ),
                key,
                time.time_ns() - st.t_ns(),
                tape=self.tape is not None,
                tape_error=self.tape_error,
                window_bound=self.window_bound,
                cxx_kernel=self.kernel is not None,
                cxx_tape=self.tape_recorder.native is not None,
            )

            def with_script() -> list[tuple[str, Any]]:
                return [("ev", {**start, "script": capture.script_info()})]

            writer.call(with_script)
            self.states.write_rng(writer, -1, self.initial_rng)
            st.writer = writer
            return writer

    def _counters(self, w: BackgroundWriter, agent_cpu: int) -> dict[str, int]:
        out = counters(self.state, w, agent_cpu, agent_cpu - self.state.cpu_ns)
        out.update(self.states.counters())
        out.update({f"stored_{kind}_bytes": n for kind, n in self.tensors.stored.items()})
        if self.flight is not None:
            out.update(self.flight.ring.counters())
        if self.tape is not None:
            out["tape_graph_captured"] = self.tape.captured
        native = self.tape_recorder.native
        if native is not None:
            out["tape_cxx_calls"] = native.state.calls
            out["tape_cxx_deferred"] = native.state.deferred
            out["tape_cxx_kept"] = native.state.kept
            out["tape_cxx_keep_dropped"] = native.state.keep_dropped
            # the hook's waits for room are the recording's waits as much as the ring's
            out["payload_waits"] += native.state.keep_waits
            out["payload_wait_ns"] += native.state.keep_wait_ns
            out["tape_cxx_host_allocs"] = native.state.host_allocs
            out["tape_cxx_host_reuses"] = native.state.host_reuses
            out["tape_cxx_host_bytes"] = native.state.host_bytes
            out["tape_cxx_marked"] = native.state.marks
            out["tape_cxx_mark_errors"] = native.state.mark_errors
        return out

    def agent_cpu_ns(self) -> int:
        """The agent's thread CPU time on the program's threads: the hooks', the C++ kernel's and
        the C++ tape hook's."""
        native = self.tape_recorder.native
        return self.state.cpu_ns + self.bridge.cpu_ns() + (native.state.cpu_ns if native is not None else 0)

    def finish(self, reason: str = "exit") -> None:
        """Write the end event and drain the writer (atexit, SIGTERM). Idempotent."""
        w = self.state.writer
        if self.finished or os.getpid() != self.pid or w is None:
            return
        self.finished = True
        self.gpu_activity.finish()  # first: what the agent does from here on is not traced
        try:  # a snapshot in flight: handed over if its copies are done, before a dump takes it
            self.states.settle(w, final=True)
        except Exception as e:
            self.fail("snapshot at the end", e)
        if self.flight is not None:  # a failure: the flight recorder's window goes to the writer
            try:  # before a wait below can block (a peer gone): what is held is the steps before
                dying_of = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
                self.flight.at_exit(w, reason, dying_of)
            except Exception as e:
                self.fail("flight recorder at the end", e)
        if self.collectives.deferred or self.kernel is not None:
            with contextlib.suppress(Exception):
                self.collectives.complete_deferred(force=True)
        if self.tape_recorder.native is not None:
            self.tape_recorder.native.state.fast = 0
            try:
                self.tape_recorder.drain_native()
            except Exception as e:
                self.fail("C++ tape at the end", e)
        if self.memory is not None:
            try:
                exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
                self.memory.finish(exc, self.micro_ends)
            except Exception as e:
                self.fail("CUDA allocator at the end", e)
        self.states.write_modules(w)
        self._write_files(w)
        w.event(
            {
                "type": schema.EV_END,
                "reason": reason,
                "steps": self.state.pos.step,
                "colls": self.state.pos.seq,
                "t_ns": self.state.t_ns(),
                "counters": self._counters(w, self.agent_cpu_ns()),
                "inflight": self.collectives.inflight_dict(),
                "exception": _uncaught_exception(self.config.redact_key),
            }
        )
        w.flush(FLUSH_TIMEOUT_S)
        w.close()
        self.closed = True
        if self._deferred_term:  # it came while this wrote the trace (a dump, the end): die of it now
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), self._deferred_term)

    def _write_files(self, w: Any) -> None:
        """The news of the file ledger, the OS randomness and the compiled graphs (``files.py``,
        ``entropy.py``, ``compiled.py``)."""
        new = self.files.take()
        if new is not None:
            w.event({"type": schema.EV_FILES, **new})
        drawn = self.entropy.take()
        if drawn is not None:
            w.event({"type": schema.EV_URANDOM, **drawn})
        ran = self.compiled.take(self.state.pos.step, [m for m in (r() for r in self.roots) if m is not None])
        if ran is not None:
            w.event({"type": schema.EV_COMPILED, **ran})

    # -- steps --------------------------------------------------------------------------------
    def _watch_memory(self) -> None:
        """Start watching the CUDA caching allocator once the program has initialized CUDA."""
        if self.memory is None and torch.cuda.is_initialized():
            from fsdp_replay.agent.allocations import MemoryRecorder

            self.memory = MemoryRecorder(self.config, self.state, self._ensure_started, self.fail)
            self.memory.start(self.state.pos.step)

    def on_step_begin(self, opt: torch.optim.Optimizer) -> None:
        self._watch_memory()
        if self.primary is not None and self.primary() is opt and self.state.writer is not None:
            # before the state changes: the last boundary's snapshot copies are done (on the
            # device), and the program changed nothing in place since (snapshots.py)
            self.states.probe_check()
            self.states.settle(self.state.writer)
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
        st, colls = self.state, self.collectives
        if colls.deferred or self.kernel is not None:
            colls.complete_deferred(force=True)
        self.tape_recorder.drain_native()  # the step's taped calls recorded in C++, before its end
        params = fingerprint_many([capture.local(p) for p in capture.optimizer_params(opt)])
        loss = host_values(torch.stack(self.losses)) if self.losses else []
        agent_cpu = self.agent_cpu_ns()
        w.event(
            {
                "type": schema.EV_STEP,
                "step": st.pos.step,
                "micro_steps": st.pos.micro,
                "colls": colls.step_colls + self.bridge.drained,
                "params": [[fp, nf, algo] for fp, nf, algo in params],
                "loss": loss,
                "t_ns": st.t_ns(),
                "cpu_ns": [agent_cpu, w.cpu_ns()],
                "counters": self._counters(w, agent_cpu),
                "micro_t_ns": self.micro_ends,
            }
        )
        if self.flight is not None:  # payloads held in memory: dumped if the step was not finite
            self.flight.step_end(w, st.pos.step, loss, params)
        if self.memory is not None:  # after the step's own fingerprints: their memory is the step's
            self.memory.step_end(st.pos.step, self.micro_ends)
        self.micro_ends = []
        self._say_budget(w)
        self._write_files(w)
        if (flags := self.flag_watch.changed()) is not None:
            w.event({"type": schema.EV_NUMERICS, "step": st.pos.step, "flags": flags})
        if self.ops is not None:
            self.ops.at_step(st.pos.step + 1)
        if st.pos.step == 0:
            self.states.write_modules(w)
            if self.on_step_zero_done is not None:
                self.on_step_zero_done()
        st.pos.step += 1
        st.pos.micro = 0
        colls.step_colls = self.bridge.drained = 0
        self.module_idx = 0
        self.losses = []
        step = st.pos.step
        st.payload_now = step in self.config.payloads
        self.states.write_rng(w, step, capture.rng_state())
        if self.config.snapshot_step(step):
            self._snapshot(opt)
        self.states.probe_start(opt)
        if self.flight is not None:
            self.flight.ring.advance(step)
        self._watch_memory()
        if self.config.sync_steps:
            self._sync_step(w, opt)
        self.gpu_activity.step_end(w, opt)  # arms or disarms CUPTI for the step that begins
        self.tape_recorder.sync_native()  # the step that begins: whether C++ records its taped calls

    def _say_budget(self, w: BackgroundWriter) -> None:
        """Once, rank 0, at the end of the first step from step 2 on that stored payloads: what a
        step stores and whether its writer keeps up (``budget.py``)."""
        now = (self.state.t_ns(), sum(self.tensors.stored.values()), dict(self.tensors.stored))
        before, self._budget_at = self._budget_at, now
        if self._budget_said or before is None or self.state.pos.step < 2 or self.rank not in (0, -1):
            return
        stored = {k: now[2][k] - before[2][k] for k in now[2]}
        if sum(stored.values()) <= 0:
            return
        self._budget_said = True
        c = w.counters
        cost = StepCost(
            stored,
            (now[0] - before[0]) / 1e9,
            c.blob_bytes / (c.blob_write_ns / 1e9) if c.blob_bytes > 0 and c.blob_write_ns > 0 else None,
            self.states.last_bytes,
            self.config.snapshot_interval,
        )
        bound = self.window_bound[0] if self.window_bound else 0
        line = budget.report(cost, str(self.config.payloads), bound)
        if line is not None:
            log.warning("%s", line)

    def _sync_step(self, w: BackgroundWriter, opt: torch.optim.Optimizer) -> None:
        """Crash consistency: a finished step's records reach the disk before the next step ends.

        On the CPU a step's values are final when it ends, so we wait for them now. On a GPU
        they are final only when the device has run the step: waiting now would stall the host
        until the device drains (no more running ahead), so we wait for the previous step's
        records instead, which the device has long finished.
        """
        colls = self.collectives
        if colls.on_gpu is None:
            colls.on_gpu = any(p.device.type != "cpu" for p in capture.optimizer_params(opt)[:1])
        marker = w.marker()
        wait_for = self._pending_marker if colls.on_gpu else marker
        self._pending_marker = marker
        if wait_for is not None and not wait_for.wait(FLUSH_TIMEOUT_S):
            log.warning(
                "fsdp-replay: the spool writer did not finish step %d within %.0fs",
                self.state.pos.step - (2 if colls.on_gpu else 1),
                FLUSH_TIMEOUT_S,
            )

    def _name_params(self, opt: torch.optim.Optimizer) -> None:
        for ref in self.roots:
            root = ref()
            if root is not None:
                for name, p in root.named_parameters():
                    self.names.setdefault(id(p), name)

    # -- backward, batches, modules -----------------------------------------------------------
    def _snapshot(self, opt: torch.optim.Optimizer) -> None:
        w = self._ensure_started()
        roots = [m for m in (r() for r in self.roots) if m is not None]
        self.states.snapshot(w, opt, roots, self.names)

    def on_backward(self, tensors: Any) -> None:
        if isinstance(tensors, torch.Tensor) and tensors.numel() == 1:
            self.losses.append(tensors.detach().reshape(()).to(torch.float64))

    def after_backward(self) -> None:
        self.state.pos.micro += 1
        self.tape_recorder.micro(self.state.pos.micro)
        if self.state.gpu is not None:
            self.state.gpu.boundary()
        self.micro_ends.append(self.state.t_ns())

    def before_batch(self) -> None:
        self.batch_recorder.before()

    def on_batch(self, iterator: Any, batch: Any) -> None:
        if self.tape is not None and self.tape.pending:
            self.tape.install_missing()
        self._check_fault("batch")
        self.batch_recorder.on_batch(iterator, batch)

    def on_root_forward(self, module: torch.nn.Module) -> None:
        self._watch_memory()  # before the first step's forward allocates
        if all(r() is not module for r in self.roots):
            self.roots.append(weakref.ref(module))
            if self.tap is not None:
                self.tap.name_modules(module)
            if self.ops is not None:
                self.ops.tap.name_modules(module)

    def _tap_enabled(self) -> bool:
        return self.active() and self.state.pos.step in self.config.module_fingerprints

    def _emit_module(self, name: str, kind: str, fp: int, nonfinite: bool, algo: str) -> None:
        w = self._ensure_started()
        w.event(
            {
                "type": schema.EV_MODULE_FP,
                "step": self.state.pos.step,
                "micro": self.state.pos.micro,
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
            # torchrun signals the worker's process group, so its DataLoader workers die too, and
            # the DataLoader's SIGCHLD handler would raise that into the trace's last writes
            with contextlib.suppress(ValueError, OSError):
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            if self.finished and not self.closed and os.getpid() == self.pid:
                # torchrun stops a failed rank's peers while they may be writing their own end
                # (an exception's flight-recorder dump): let that finish, then die of it
                self._deferred_term = signum
                return
            try:
                self.finish(reason="SIGTERM")
            finally:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        signal.signal(signal.SIGTERM, on_term)
