"""One rank's CUPTI activity capture: what is enabled when, where records go, standing aside.

Imported only when the rank trains on CUDA and ``--cupti`` is not ``off`` (``agent/gpu_activity.py``),
so a CPU run never loads cupti-python. Everything here runs on the training thread at step ends
(arming, disarming, flushing: a quiescent point, never while NCCL sets a communicator up, which
happens inside the program's own calls), in our hooks (the marks, a few calls each), in CUPTI's
buffer callback (native code, ``native.py``, or cupti-python's per-record ``records.extract``
where the native reader cannot be used) and on the writer thread (``records.Decoder``, on arrays).
No method
raises into the program: a CUPTI error stops the capture (``_fail``: logged once, counted, a
``cupti_state`` event), never the recording.

While armed, CUPTI traces kernels, copies, memsets and the runtime and driver API calls that
launch them (the calls that launch nothing, which PyTorch makes around every op, are switched off:
``QUIET_API``); each API record made while an external correlation id is pushed comes with an
``EXTERNAL_CORRELATION`` record of that id (CUPTI makes those only for API records). The training
thread keeps an id pushed that encodes its step, micro-step and collective sequence number
(``records.ext_position``, replaced at each boundary); our hooks push ``records.AGENT_EXT_ID`` over
it on whichever thread they run, so that the agent's own kernels are told apart (the tape's C++
hook too, through libcupti's functions whose addresses ``marking`` gives it).

A window's records are flushed (``cuptiActivityFlushAll`` without forcing: completed records only)
at the first step end after a CUDA event recorded where the window ended has completed, so its
last kernels are whole; a capture that stays armed hands its completed buffers over every
``FLUSH_EVERY_STEPS`` steps. HW event tracing (HES) is never enabled (the one mode whose flush
PyTorch's own monitor found unsafe next to NCCL's set-up), nor CUPTI's periodic flush thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import threading
import time
from importlib import metadata
from typing import Any

import torch
from cupti import cupti  # cupti-python, the `gpu` extra

from fsdp_replay import options
from fsdp_replay.agent.config import CuptiPolicy
from fsdp_replay.agent.counters import AgentState
from fsdp_replay.agent.cupti import coexist, native, records
from fsdp_replay.agent.writer import BackgroundWriter
from fsdp_replay.trace import schema
from fsdp_replay.trace.schema import COPY_KIND_CODES

log = logging.getLogger(__name__)

NATIVE_ENV = "FSDP_REPLAY_CUPTI_NATIVE"  # 0: read CUPTI's buffers with cupti-python's callback
DETACH_ENV = "FSDP_REPLAY_CUPTI_DETACH"  # 0: keep CUPTI attached between windows (default: let it go)
DETACH_WAIT_S = 1.0  # how long a step end waits for another thread's cuptiFinalize to end
BUFFER_BYTES = 4 << 20  # per activity buffer, as Kineto's; CUPTI asks for more as they fill
FLUSH_EVERY_STEPS = 8
FINISH_WAIT_S = 2.0  # at the end, how long the last kernels get to complete before the flush
WRITER_WAIT_S = 30.0
# API calls that launch no GPU work but that PyTorch makes around every op (device guards, launch
# checks, capture queries, event polling by the NCCL watchdog): their records would outnumber the
# kernels' several times over. Names as cupti-python's enums spell them, by prefix.
QUIET_API = (
    "cudaGetDevice_",
    "cudaSetDevice_",
    "cudaGetDeviceCount",
    "cudaGetDeviceProperties",
    "cudaGetDeviceFlags",
    "cudaDeviceGetAttribute",
    "cudaGetLastError",
    "cudaPeekAtLastError",
    "cudaEventCreate",
    "cudaEventDestroy",
    "cudaEventQuery",
    "cudaStreamQuery",
    "cudaStreamIsCapturing",
    "cudaStreamGetCaptureInfo",
    "cudaThreadExchangeStreamCaptureMode",
    "cudaPointerGetAttributes",
    "cudaFuncGetAttributes",
    "cudaDriverGetVersion",
    "cudaRuntimeGetVersion",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxGetDevice",
    "cuCtxGetId",
    "cuDevicePrimaryCtxGetState",
    "cuDeviceGetAttribute",
    "cuKernelGetAttribute",
    "cuFuncGetAttribute",
    "cuPointerGetAttribute",
    "cuGetProcAddress",
    "cuEventQuery",
    "cuStreamQuery",
    "cuStreamIsCapturing",
    "cuStreamGetCaptureInfo",
)
COUNTERS = (
    "cupti_records",  # kernel and copy records received
    "cupti_kernels",  # rows written
    "cupti_copies",
    "cupti_agent_records",  # the agent's own kernels and copies, left out
    "cupti_dropped_buffer",  # CUPTI had no buffer space for them
    "cupti_dropped_incomplete",  # no device timestamps (not run when flushed)
    "cupti_dropped_subscriber",  # arrived while another profiler owned CUPTI
    "cupti_dropped_error",  # lost to an error of ours
    "cupti_steps",  # steps captured whole
    "cupti_steps_paused",  # steps of the window not captured: another profiler was tracing
    "cupti_pauses",
    "cupti_errors",
    "cupti_detaches",  # times CUPTI was finalized after a window (its interception ended)
)


def _kinds() -> tuple[records.Kinds, tuple[int, ...]]:
    """The record kinds we read (and enable), from cupti-python's enums."""
    kind, copy = cupti.ActivityKind, cupti.ActivityMemcpyKind
    kinds = records.Kinds(
        kernel=int(kind.CONCURRENT_KERNEL),
        memcpy=int(kind.MEMCPY),
        memset=int(kind.MEMSET),
        runtime=int(kind.RUNTIME),
        driver=int(kind.DRIVER),
        external=int(kind.EXTERNAL_CORRELATION),
        ext_kind=int(cupti.ExternalCorrelationKind.CUSTOM2),  # Kineto pushes on CUSTOM0 and 1
        copy_kinds={
            int(getattr(copy, name.upper())): code
            for name, code in COPY_KIND_CODES.items()
            if hasattr(copy, name.upper())
        },
    )
    enabled = (kinds.external, kinds.runtime, kinds.driver, kinds.memcpy, kinds.memset, kinds.kernel)
    return kinds, enabled


class CuptiCapture:
    """The capture of one process; ``state.gpu`` is this object while it is armed."""

    def __init__(
        self, policy: CuptiPolicy, snapshot_every: int, state: AgentState, writer: BackgroundWriter
    ) -> None:
        self.policy = policy
        self.snapshot_every = snapshot_every
        self.state = state
        self.writer = writer
        self.kinds, self._enabled = _kinds()
        self.counters = dict.fromkeys(COUNTERS, 0)
        state.gpu_counters = self.counters
        self.armed = False
        self.off = ""  # why it captures nothing more (for good)
        self.paused = ""  # the profiler it stands aside for while that traces
        self._after_pause = ""
        self._registered = False  # our buffer callbacks are CUPTI's (another profiler replaces them)
        self._lock = threading.Lock()  # the batch the callback fills, against its hand-over
        self._decode_lock = threading.Lock()
        self._batch = records.Batch()
        self._marks = records.Marks()
        self._decoder = records.Decoder()
        self._tl = threading.local()
        self._train = 0  # the training thread's ident: the one that keeps a position id pushed
        self._armed_step = -1
        self._flush_after: Any = None  # CUDA event: once complete, the ended window's records are
        self._flush_window = 0
        self._since_flush = 0
        self._window = 0
        self._records_at_arm: dict[int, int] = {}
        self._broken: BaseException | None = None  # an error seen off the training thread
        self._warned = False
        self._marking: tuple[int, int, int, int] | bool | None = None  # marking()'s, once known
        self._detach_off = coexist.detach_unsafe(torch.version.cuda)  # why CUPTI stays attached, if it does
        self._detach_pending = False  # a detach was asked for and not seen done yet
        self._detached = False  # CUPTI was finalized after the last window: nothing to flush
        self.detail = self._inspect()
        self._native = self._load_native()
        if self._native is None and not self._detach_off:
            self._detach_off = "CUPTI's buffers are read in Python (the detach needs the native library)"
        if not options.process_switch(DETACH_ENV, True):
            self._detach_off = f"{DETACH_ENV}=0"
        self.detail["detach"] = f"off: {self._detach_off}" if self._detach_off else "between windows"
        self.watch = coexist.ProfilerWatch(self.foreign_start)
        self.watch.install()
        step = state.pos.step
        injected = coexist.injected_tool(os.environ, self.detail.pop("_libraries"))
        holder = coexist.foreign_holder(self.detail["probe"])
        if injected or holder:
            self.off = f"another CUPTI client traces this process: {injected or holder}"
            log.warning("fsdp-replay: CUPTI capture off for this run: %s", self.off)
            self._state("off", self.off, step, detail=self.detail)

    # -- what is there -------------------------------------------------------------------------
    def _inspect(self) -> dict[str, Any]:
        probe = coexist.probe_subscriber(cupti)  # first: cupti-python loads libcupti on its first call
        libraries = coexist.loaded_libraries(coexist.proc_maps())
        path = coexist.library_path(libraries, "libcupti.so")
        version = coexist.libcupti_version(path)
        driver = coexist.driver_version()
        _multi, mode = coexist.multi_subscriber(cupti, version, driver)
        try:
            package = metadata.version("cupti-python")
        except metadata.PackageNotFoundError:
            package = None
        return {
            "cupti_python": package,
            "libcupti": path,
            "libcupti_version": version,
            "driver_cuda_version": driver,
            "subscriber_mode": mode,
            "probe": probe,
            "_libraries": libraries,
        }

    def _load_native(self) -> native.NativeRecords | None:
        """The native buffer reader, or None (the detail says why): cupti-python's callback then."""
        why = ""
        if not options.process_switch(NATIVE_ENV, True):
            why = f"{NATIVE_ENV}=0"
        elif not self.detail.get("libcupti"):
            why = "libcupti's path is not known"
        else:
            try:
                offsets = native.layout_from_dtypes(native.family_dtypes(cupti))
                reader = native.NativeRecords(self.detail["libcupti"], offsets, self.kinds, BUFFER_BYTES)
            except (native.NativeError, OSError) as e:
                why = str(e)[:500]
        self.detail["decoder"] = "python" if why else "native"
        if why:
            self.detail["decoder_reason"] = why
            log.info("fsdp-replay: CUPTI records read in Python (%s)", why)
            return None
        return reader

    def marking(self) -> tuple[int, int, int, int] | None:
        """What the tape's C++ hook needs to mark its own launches as the agent's, as our hooks
        do (``cxx/_tape.cpp``: ``Mark``): the addresses of libcupti's external correlation push and
        pop (of the libcupti cupti-python loaded), the kind we push on and the agent's id. None
        where that libcupti is not known or lacks them: the hook then stays off while CUPTI traces,
        and the Python kernel records the taped calls."""
        if self._marking is None:
            try:
                lib = ctypes.CDLL(self.detail["libcupti"] or "")
                push = ctypes.cast(lib.cuptiActivityPushExternalCorrelationId, ctypes.c_void_p).value
                pop = ctypes.cast(lib.cuptiActivityPopExternalCorrelationId, ctypes.c_void_p).value
                if not push or not pop:
                    raise OSError("no address for the external correlation push or pop")
                self._marking = (push, pop, self.kinds.ext_kind, records.AGENT_EXT_ID)
            except (OSError, AttributeError) as e:
                self._marking = False
                self.detail["cxx_tape_marks"] = f"off: {e}"[:300]
                log.info("fsdp-replay: the tape's C++ hook stays off while CUPTI traces: %s", e)
        return self._marking if isinstance(self._marking, tuple) else None

    def _state(self, state: str, reason: str, step: int, **extra: Any) -> None:
        self.writer.event(
            {
                "type": schema.EV_CUPTI_STATE,
                "state": state,
                "reason": reason,
                "step": step,
                "t_ns": self.state.t_ns(),
                **{k: v for k, v in extra.items() if v is not None},
            }
        )

    # -- our hooks (any thread) -----------------------------------------------------------------
    def agent(self, on: bool) -> bool:
        """The agent's own GPU work begins (``on``) or ends on this thread; returns the previous
        value, for the caller to restore."""
        tl = self._tl
        prev: bool = getattr(tl, "agent", False)
        if on == prev:
            return prev
        tl.agent = on
        try:
            if self.armed:
                self._marks.agent.append((cupti.get_timestamp(), self._tid(tl), on))
                if on:
                    self._push(tl, records.AGENT_EXT_ID)
                    return prev
            if not on:
                stack = getattr(tl, "stack", None)
                if stack and stack[-1] == records.AGENT_EXT_ID:
                    self._pop(tl)
        except Exception as e:
            self._broken = self._broken or e
        return prev

    def boundary(self) -> None:
        """Where the program is changed (a micro-step ended, a collective was issued)."""
        try:
            pos = self.state.pos
            step, micro, seq = pos.step, pos.micro, pos.seq - 1
            self._marks.positions.append((cupti.get_timestamp(), step, micro, seq))
            if threading.get_ident() == self._train:
                self._set_position(records.ext_position(step, micro, seq))
        except Exception as e:
            self._broken = self._broken or e

    def _tid(self, tl: Any) -> int:
        tid = getattr(tl, "tid", None)
        if tid is None:
            tid = tl.tid = threading.get_native_id()
        return int(tid)

    def _push(self, tl: Any, ext_id: int) -> None:
        cupti.activity_push_external_correlation_id(self.kinds.ext_kind, ext_id)
        stack = getattr(tl, "stack", None)
        if stack is None:
            stack = tl.stack = []
        stack.append(ext_id)

    def _pop(self, tl: Any) -> None:
        cupti.activity_pop_external_correlation_id(self.kinds.ext_kind)
        tl.stack.pop()

    def _clear(self, tl: Any) -> None:
        """Pop every id we pushed on this thread."""
        while getattr(tl, "stack", None):
            self._pop(tl)

    def _set_position(self, ext_id: int) -> None:
        """Replace the training thread's position id (under the agent's, when in our hook)."""
        tl = self._tl
        self._clear(tl)
        self._push(tl, ext_id)
        if getattr(tl, "agent", False):
            self._push(tl, records.AGENT_EXT_ID)

    # -- CUPTI's buffer callbacks ----------------------------------------------------------------
    def _requested(self) -> tuple[int, int]:
        return BUFFER_BYTES, 0

    def _completed(self, activities: Any) -> None:
        try:
            if self.paused or self.off:
                scratch = records.Batch()
                records.extract(activities, self.kinds, scratch)
                key = "cupti_dropped_subscriber" if self.paused else "cupti_dropped_error"
                self.counters[key] += scratch.records
                return
            with self._lock:
                records.extract(activities, self.kinds, self._batch)
        except Exception as e:
            self.counters["cupti_dropped_error"] += len(activities) if hasattr(activities, "__len__") else 0
            self._broken = self._broken or e

    # -- step ends (the training thread) ---------------------------------------------------------
    def step_end(self) -> None:
        """A step ended; ``state.pos.step`` is the step that begins."""
        step = self.state.pos.step
        try:
            if self.off:
                return
            if self._broken is not None:
                raise self._broken
            if self.armed and self._armed_step <= step - 1:
                self.counters["cupti_steps"] += 1
            if coexist.torch_profiler_active():
                if not self.paused:
                    self._pause("torch.profiler is running (seen at a step end)", step, drain=False)
                elif self.policy.includes(step, self.snapshot_every):
                    self.counters["cupti_steps_paused"] += 1
                return
            if self.paused:
                self._after_pause, self.paused = f"re-armed after {self.paused}", ""
            if not self.armed:
                self._clear(self._tl)  # an id left here when a profiler made us stand aside elsewhere
            want = self.policy.includes(step, self.snapshot_every)
            if self._flush_after is not None and self._flush_after.query():
                self._flush_after = None
                detach = not want and self._detach_allowed()
                cupti.activity_flush_all(1 if detach else 0)  # before a detach: whatever CUPTI holds
                self._hand_over(self._flush_window, final=True)
                if detach:
                    self._detach()
            if want and not self.armed:
                self._arm(step)
            elif self.armed and not want:
                self._disarm(step, "window ended")
            elif self.armed:
                self.boundary()
                self._since_flush += 1
                if self._since_flush >= FLUSH_EVERY_STEPS:
                    self._since_flush = 0
                    cupti.activity_flush_all(0)
                    self._hand_over(self._window)
        except Exception as e:
            self._fail("a step end", e)

    def _arm(self, step: int) -> None:
        self._settle_detach()
        if not self._registered:
            if self._native is not None:
                self._native.register()
                self._native.discard(False)
            else:
                cupti.activity_register_callbacks(self._requested, self._completed)
            self._registered = True
        first = self._window == 0
        if first or self._detached:  # (a finalized CUPTI forgot it)
            with contextlib.suppress(Exception):  # thread ids as threading.get_native_id gives them
                cupti.set_thread_id_type(int(cupti.ActivityThreadIdType.SYSTEM))
        self._detached = False
        for kind in self._enabled:
            cupti.activity_enable(kind)
        quieted = self._quiet()
        self._window += 1
        self._records_at_arm[self._window] = self.counters["cupti_records"]
        self._armed_step = step
        self._since_flush = 0
        self._train = threading.get_ident()
        clock = [int(cupti.get_timestamp()), self.state.t_ns()]
        self.armed = True
        self.state.gpu = self
        self.boundary()
        if first:
            self.detail["quiet_api_calls"] = quieted
        reason, self._after_pause = self._after_pause or f"--cupti {self.policy}", ""
        self._state("armed", reason, step, clock=clock, detail=self.detail if first else None)

    # -- detaching between windows ----------------------------------------------------------------
    def _detach_allowed(self) -> bool:
        return (
            self._native is not None
            and not self._detach_off
            and not self.policy.steps.everything
            and not torch.cuda.is_current_stream_capturing()
        )

    def _detach(self) -> None:
        """A window's records are all handed over and none comes next step: end CUPTI's presence
        in the process (``cuptiFinalize``). Once CUPTI has traced, every CUDA call of the process
        goes through it until then (PyTorch measured 10-20% of a training step after a profiling
        session, and made Kineto finalize CUPTI after each: pytorch/pytorch#146604). CUPTI's
        documentation allows the call only from an API callback's exit: the native library
        subscribes one, and a CUDA call of ours (a stream query) triggers it unless another
        thread's does first. Before CUPTI is used again (an arm, a drain, the end) the detach
        must be seen done (``_settle_detach``); the next arm sets CUPTI up anew."""
        assert self._native is not None
        try:
            self._native.detach()
        except native.NativeError as e:
            self._detach_off = str(e)[:300]
            log.info("fsdp-replay: CUPTI stays attached between capture windows: %s", e)
            return
        self._detach_pending = True
        torch.cuda.current_stream().query()  # an API call's exit: the callback finalizes
        self._settle_detach(wait_s=0.0)

    def _settle_detach(self, wait_s: float = DETACH_WAIT_S) -> None:
        """Whether the detach asked for has happened, waiting up to ``wait_s`` for it (another
        thread may be finalizing); past the wait a pending detach is an error (the caller's)."""
        deadline = time.monotonic() + wait_s
        while self._detach_pending:
            assert self._native is not None
            state = self._native.detached()
            if state == 3:
                self._detach_pending, self._detached = False, True
                self._registered = False  # CUPTI forgot our buffer callbacks, and every setting
                self.counters["cupti_detaches"] += 1
            elif state < 0:
                self._detach_pending = False
                raise RuntimeError(f"cuptiFinalize returned {-state}")
            elif time.monotonic() >= deadline:
                if wait_s > 0:
                    raise RuntimeError(f"CUPTI's detach did not end within {wait_s}s (state {state})")
                return
            else:
                torch.cuda.current_stream().query()  # no API exit seen yet: one more
                time.sleep(0.001)

    def _quiet(self) -> int:
        """Switch off the records of ``QUIET_API`` (after the kinds: enabling them resets it)."""
        n = 0
        for enum, switch in (
            (cupti.RuntimeApiTraceCbid, cupti.activity_enable_runtime_api),
            (cupti.DriverApiTraceCbid, cupti.activity_enable_driver_api),
        ):
            for name, cbid in enum.__members__.items():
                if name.startswith(QUIET_API):
                    try:
                        switch(int(cbid), 0)
                        n += 1
                    except Exception:  # a call this libcupti does not know: its records stay
                        continue
        return n

    def _disable(self) -> None:
        self.armed = False
        self.state.gpu = None
        for kind in self._enabled:
            cupti.activity_disable(kind)
        if threading.get_ident() == self._train:
            self._clear(self._tl)

    def _disarm(self, step: int, reason: str) -> None:
        self._disable()
        event = torch.cuda.Event()
        event.record()  # what the window launched on this stream is done when it is
        self._flush_after, self._flush_window = event, self._window
        self._state("disarmed", reason, step)

    def _hand_over(self, window: int, final: bool = False, sync: bool = False, whole: bool = False) -> None:
        """The records so far (with the marks) to the writer thread, which decodes them; ``final``
        for the flush that ends ``window``; ``whole`` (and ``final``) when every launch so far has
        its records in (the device was waited for): the decoder then lets the launches go."""
        batch: records.Batch | records.Arrays
        if self._native is not None:
            batch = self._native.take()
        else:
            with self._lock:
                batch, self._batch = self._batch, records.Batch()
        marks, self._marks = self._marks, records.Marks()
        dropped = ctypes.c_size_t(0)
        with contextlib.suppress(Exception):  # the count is reset by each read (global buffers)
            cupti.activity_get_num_dropped_records(0, 0, ctypes.addressof(dropped))
            self.counters["cupti_dropped_buffer"] += int(dropped.value)
        work = functools.partial(self._decode, batch, marks, window, final, final or whole)
        if sync:
            for _, ev in work():
                self.writer.event(ev)
        else:
            self.writer.call(work)

    def _decode(
        self,
        batch: records.Batch | records.Arrays,
        marks: records.Marks,
        window: int,
        final: bool,
        whole: bool,
    ) -> list[tuple[str, Any]]:
        """Writer thread: rows and events; an error here loses the batch (counted), and stops
        the capture at the next step end."""
        c = self.counters
        try:
            with self._decode_lock:
                if batch.dropped:  # read while we stood aside or had stopped
                    c["cupti_dropped_error" if self.off else "cupti_dropped_subscriber"] += batch.dropped
                decoded = self._decoder.decode(batch, marks)
                if whole:
                    self._decoder.forget_launches()
        except Exception as e:
            c["cupti_dropped_error"] += batch.records
            self._broken = self._broken or e
            return []
        c["cupti_records"] += batch.records
        c["cupti_kernels"] += len(decoded.kernels)
        c["cupti_copies"] += len(decoded.copies)
        c["cupti_agent_records"] += decoded.agent
        c["cupti_dropped_incomplete"] += decoded.incomplete
        out: list[tuple[str, Any]] = [("ev", ev) for ev in records.events_of(decoded)]
        # nothing at all received since the window was armed (a lower bound, taken then)
        if final and c["cupti_records"] == self._records_at_arm.pop(window, -1) and not self.paused:
            out.append(
                (
                    "ev",
                    {
                        "type": schema.EV_CUPTI_STATE,
                        "state": "lost",
                        "reason": "the window ended with no kernel or copy record: another CUPTI client "
                        "may have taken the activity buffers",
                        "step": self.state.pos.step,
                        "t_ns": self.state.t_ns(),
                    },
                )
            )
        return out

    # -- other profilers -------------------------------------------------------------------------
    def foreign_start(self, what: str) -> None:
        """A torch profiler is about to take CUPTI (``coexist.ProfilerWatch``): step aside first."""
        if self.off or self.paused:
            return
        try:
            self._pause(f"{what} started", self.state.pos.step, drain=True)
        except Exception as e:
            self._fail("standing aside", e)

    def _pause(self, reason: str, step: int, drain: bool) -> None:
        if self.armed:
            self._disable()
        self._settle_detach()  # no CUPTI call of ours while it finalizes
        if drain and self._window and not self._detached:
            self._drain()
        self.paused = reason
        self._registered = False  # the other profiler registers its own callbacks
        if self._native is not None:
            self._native.discard(True)
        self.counters["cupti_pauses"] += 1
        log.warning("fsdp-replay: CUPTI capture stands aside at step %d: %s", step, reason)
        self._state("paused", reason, step)

    def _drain(self) -> None:
        """Everything captured so far, now (before another client takes the buffers)."""
        self._flush_after = None
        self._wait_for_device(FINISH_WAIT_S)
        cupti.activity_flush_all(1)
        self._hand_over(self._window, whole=True)  # the other profiler may finalize CUPTI

    @staticmethod
    def _wait_for_device(timeout_s: float) -> None:
        if torch.cuda.is_current_stream_capturing():
            return  # no event may be recorded into a capture: the last records may come later
        event = torch.cuda.Event()
        event.record()
        deadline = time.monotonic() + timeout_s
        while not event.query() and time.monotonic() < deadline:
            time.sleep(0.005)

    # -- the end, and errors ---------------------------------------------------------------------
    def finish(self) -> None:
        """Recording ends (exit, SIGTERM): the last records, then nothing more."""
        self.watch.uninstall()
        if self.off or not self._window:
            return
        try:
            if self.armed:
                self._disable()
            self._settle_detach()
            if self.paused:
                return
            if self._detached:  # the last window's records were all handed over before the detach
                self.writer.flush(WRITER_WAIT_S)  # decoded, so that the end event's counters hold them
                return
            self._wait_for_device(FINISH_WAIT_S)
            cupti.activity_flush_all(1)
            # earlier hand-overs first, so that the end event's counters hold every batch
            self.writer.flush(WRITER_WAIT_S)
            self._flush_after = None
            self._hand_over(self._window, final=True, sync=True)
        except Exception as e:
            self._fail("finishing", e)

    def _fail(self, where: str, exc: BaseException) -> None:
        """Stop capturing after an error: logged once, counted, said in the trace."""
        self.counters["cupti_errors"] += 1
        if not self._warned:
            self._warned = True
            log.warning("fsdp-replay: CUPTI capture stopped after an error in %s: %r", where, exc)
        first = not self.off
        if self.armed:
            with contextlib.suppress(Exception):
                self._disable()
        self.armed = False
        self.state.gpu = None
        if first and self._window and not self._detached and not self._detach_pending:
            with contextlib.suppress(Exception):  # what CUPTI still holds for us, before we stop
                cupti.activity_flush_all(1)
                self._hand_over(self._window)
        self.off = f"error in {where}: {exc!r}"[:500]
        if self._native is not None:
            with contextlib.suppress(Exception):
                self._native.discard(True)
        with contextlib.suppress(Exception):
            self._clear(self._tl)
        with contextlib.suppress(Exception):
            self.watch.uninstall()
        if first:
            self._state("error", self.off, self.state.pos.step)
