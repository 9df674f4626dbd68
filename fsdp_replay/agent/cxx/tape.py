"""The tape's C++ hook (``_tape.cpp``): load it, stack it on the Python tape, drain its records.

``fsdp-replay record`` builds the library (``kernel.build``, once per torch version and source)
and passes its path to the ranks in ``FSDP_REPLAY_CXX_TAPE_LIB``. The Python tape (``agent/tape.py``)
then registers each taped op's Python kernel as before, and this library's kernel on top of it:
on a step that stores no payloads, a call is recorded in C++ (the op's own kernel, the fused
fingerprint launched through the driver, an event, a fixed-size record), and everything else
goes down to the Python kernel. ``TapeRecorder`` (``record_tape.py``) turns the records into the
``kop`` events the Python kernel writes, before each step's end. Where the library cannot be
built, loaded or stacked, the Python tape records every call, as without it.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any

import torch

from fsdp_replay.agent.cxx import kernel as builder

log = logging.getLogger(__name__)

SOURCE = builder.HERE / "_tape.cpp"
ABI = 6  # FSDPR_TAPE_ABI of the source this module is written for
MAXT = 4
MAXDIM = 8
SLOT_WORDS = 16
DRAIN = 256
KEYS = {"CPU": 0, "CUDA": 1}


class TapeError(RuntimeError):
    """The library could not be built, loaded or stacked (the message says why)."""


class State(ctypes.Structure):
    """``fsdpr_tape_state``."""

    _fields_ = [
        ("step", ctypes.c_int64),
        ("micro", ctypes.c_int64),
        ("small_limit", ctypes.c_int64),
        ("cpu_ns", ctypes.c_int64),
        ("calls", ctypes.c_int64),
        ("deferred", ctypes.c_int64),
        ("fast", ctypes.c_int32),
        ("failed", ctypes.c_int32),
        ("error", ctypes.c_char * 512),
        ("keep_limit", ctypes.c_int64),
        ("keep_live", ctypes.c_int64),
        ("kept", ctypes.c_int64),
        ("keep_dropped", ctypes.c_int64),
        ("keep", ctypes.c_int32),
        ("keep_sm", ctypes.c_int32),
        ("mark_push", ctypes.c_uint64),
        ("mark_pop", ctypes.c_uint64),
        ("mark_id", ctypes.c_uint64),
        ("mark_kind", ctypes.c_int32),
        ("mark", ctypes.c_int32),
        ("marks", ctypes.c_int64),
        ("mark_errors", ctypes.c_int64),
        ("host_allocs", ctypes.c_int64),
        ("host_reuses", ctypes.c_int64),
        ("host_bytes", ctypes.c_int64),
        ("keep_wait", ctypes.c_int32),
        ("pad_wait", ctypes.c_int32),
        ("keep_waits", ctypes.c_int64),
        ("keep_wait_ns", ctypes.c_int64),
    ]


class TensorRecord(ctypes.Structure):
    _fields_ = [
        ("shape", ctypes.c_int64 * MAXDIM),
        ("nbytes", ctypes.c_int64),
        ("fp", ctypes.c_uint64),
        ("ndim", ctypes.c_int32),
        ("dtype", ctypes.c_int8),
        ("cuda", ctypes.c_int8),
        ("nf", ctypes.c_uint8),
        ("pad", ctypes.c_uint8),
    ]


class Record(ctypes.Structure):
    _fields_ = [
        ("seq", ctypes.c_int64),
        ("step", ctypes.c_int64),
        ("micro", ctypes.c_int64),
        ("event", ctypes.c_int64),
        ("ready", ctypes.c_int64),
        ("op", ctypes.c_int32),
        ("slot", ctypes.c_int32),
        ("ntensors", ctypes.c_int32),
        ("deferred", ctypes.c_int32),
        ("kept", ctypes.c_int32),
        ("pad", ctypes.c_int32),
        ("t", TensorRecord * MAXT),
    ]


def build() -> Path:
    """The library for the installed torch (compiled first where it is not in the cache)."""
    try:
        return builder.build(source=SOURCE)
    except builder.KernelError as e:
        raise TapeError(str(e)) from e


def library_path() -> Path:
    return builder.library_path(SOURCE)


# c10::ScalarType codes of the dtypes the library records (c10/core/ScalarType.h)
_SCALAR_TYPES = {
    0: torch.uint8,
    1: torch.int8,
    2: torch.int16,
    3: torch.int32,
    4: torch.int64,
    5: torch.float16,
    6: torch.float32,
    7: torch.float64,
    8: torch.complex32,
    9: torch.complex64,
    10: torch.complex128,
    11: torch.bool,
    15: torch.bfloat16,
}
_SCALAR_TYPES.update(
    {n: getattr(torch, name) for n, name in ((27, "uint16"), (28, "uint32"), (29, "uint64"))}
)


def dtype_of(code: int) -> torch.dtype:
    return _SCALAR_TYPES[code]


class NativeTape:
    """The loaded library: ``snapshot``/``install`` stack its kernels on the Python tape's."""

    def __init__(self, path: str | Path) -> None:
        path = str(path)
        # registers fsdpr_tape::take and ::probe
        held, released = builder.open_library(path, "fsdpr_tape", ABI, (State, Record), TapeError)
        held.fsdpr_tape_state_ptr.restype = ctypes.c_void_p
        held.fsdpr_tape_next_seq.restype = ctypes.c_int64
        held.fsdpr_tape_agent.argtypes = [ctypes.c_int]
        held.fsdpr_tape_snapshot.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
        held.fsdpr_tape_install.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
        held.fsdpr_tape_set_kernel.argtypes = [
            ctypes.c_uint64,
            ctypes.c_int,
            ctypes.c_uint,
            ctypes.c_uint,
            ctypes.c_uint64,
            ctypes.c_char_p,
            ctypes.c_size_t,
        ]
        released.fsdpr_tape_rows.argtypes = [ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p]
        held.fsdpr_tape_event_query.argtypes = [ctypes.c_int64]
        held.fsdpr_tape_event_release.argtypes = [ctypes.c_int64]
        released.fsdpr_tape_event_sync.argtypes = [ctypes.c_int64]
        self.path = path
        self.state = State.from_address(held.fsdpr_tape_state_ptr())
        self._held = held
        self._rows = released.fsdpr_tape_rows  # waits for an event: releases the GIL
        self.agent = held.fsdpr_tape_agent
        self._event_query = held.fsdpr_tape_event_query
        self._event_release = held.fsdpr_tape_event_release
        self._event_sync = released.fsdpr_tape_event_sync  # waits: releases the GIL
        self.next_seq = held.fsdpr_tape_next_seq
        self.names: list[str] = []  # the ops' names, by the number the library gave them
        self.cuda = False  # the fused kernel launches from C++ (set_kernel, checked)
        self._buf = (Record * DRAIN)()

    def snapshot(self, name: str, key: str) -> int:
        """Before the Python tape registers its kernel: keep the op's own. Returns the op's number."""
        err = ctypes.create_string_buffer(512)
        i = int(self._held.fsdpr_tape_snapshot(name.encode(), KEYS[key], err, 512))
        if i < 0:
            raise TapeError(f"{name}: {err.value.decode(errors='replace')}")
        while len(self.names) <= i:
            self.names.append("")
        self.names[i] = name
        return i

    def install(self, i: int) -> None:
        """After the Python tape registered its kernel for op ``i``: ours on top of it."""
        err = ctypes.create_string_buffer(512)
        if self._held.fsdpr_tape_install(i, err, 512) != 0:
            raise TapeError(f"{self.names[i]}: {err.value.decode(errors='replace')}")

    def uninstall(self) -> None:
        self._held.fsdpr_tape_uninstall()
        self.names = []

    def set_kernel(self, compiled: Any, device: torch.device) -> None:
        """Launch the fused kernel (Triton's compiled kernel for ``device``) from C++, once a probe
        launched from here computed what Triton's own launch computes; TapeError where not."""
        from fsdp_replay.agent.fingerprint import fused

        meta = compiled.metadata
        if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
            raise TapeError("the fused kernel needs scratch memory: launched by Python")
        if getattr(meta, "num_ctas", 1) != 1 or getattr(meta, "launch_cooperative_grid", False):
            raise TapeError(
                "the fused kernel launches with clusters or a cooperative grid: launched by Python"
            )
        function = compiled.function
        if not function:
            raise TapeError("the compiled fused kernel has no function handle")
        err = ctypes.create_string_buffer(512)
        stream = torch.cuda.current_stream(device).cuda_stream
        rc = self._held.fsdpr_tape_set_kernel(
            int(function), device.index or 0, 32 * meta.num_warps, meta.shared, stream, err, 512
        )
        if rc != 0:
            raise TapeError(err.value.decode(errors="replace"))
        try:
            ours, triton = fused.probe_rows(device, torch.ops.fsdpr_tape.probe)
        except Exception as e:
            self._held.fsdpr_tape_cuda_off()
            raise TapeError(f"the fused kernel's launch from C++ failed its check: {e!r}") from e
        if ours != triton:
            self._held.fsdpr_tape_cuda_off()
            raise TapeError(f"the fused kernel's launch from C++ computed {ours}, Triton's {triton}")
        self.cuda = True

    def drain(self) -> list[Record]:
        """The queued records, oldest first (copies)."""
        out: list[Record] = []
        while True:
            n = self._held.fsdpr_tape_drain(self._buf, DRAIN)
            out += [Record.from_buffer_copy(self._buf[i]) for i in range(n)]
            if n < DRAIN:
                return out

    def rows(self, slot: int, event: int) -> list[list[int]]:
        """A record's rows of (S, A, B, nonfinite), once its event is done (waits)."""
        buf = (ctypes.c_int64 * SLOT_WORDS)()
        if self._rows(slot, event, buf) != 0:
            raise TapeError("waiting for a taped call's fingerprint event failed")
        words = list(buf)
        return [list(words[r * 4 : r * 4 + 4]) for r in range(MAXT)]

    def take(self, seq: int) -> list[torch.Tensor]:
        """The clones of a deferred call's outputs."""
        return list(torch.ops.fsdpr_tape.take(seq))

    def kept(self, seq: int, ready: int) -> tuple[list[torch.Tensor], KeptEvent]:
        """A kept call's (``record.kept == 1``) pinned uint8 copies of its outputs, and its
        ``record.ready`` event, after which they are complete."""
        return list(torch.ops.fsdpr_tape.kept(seq)), KeptEvent(self, ready)

    def error(self) -> str:
        return self.state.error.decode(errors="replace")


class KeptEvent:
    """A kept call's ready event (``record.ready``), as the writer and the flight recorder use a
    ``torch.cuda.Event``: ``query``, ``synchronize``; given back to the library when dropped."""

    __slots__ = ("_handle", "_native")

    def __init__(self, native: NativeTape, handle: int) -> None:
        self._native, self._handle = native, handle

    def query(self) -> bool:
        rc = self._native._event_query(self._handle)
        if rc < 0:
            raise TapeError("querying a kept call's copy event failed")
        return rc == 0

    def synchronize(self) -> None:
        if self._native._event_sync(self._handle) != 0:
            raise TapeError("waiting for a kept call's copy event failed")

    def __del__(self) -> None:
        if self._handle:
            self._native._event_release(self._handle)
            self._handle = 0
