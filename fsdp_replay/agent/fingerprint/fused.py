"""lin64 of a few CUDA tensors in one kernel launch (Triton): the tape's per-call fingerprint.

A taped op (``agent/tape.py``) runs in the backward of every attention layer, and the steps it
runs in are usually host-bound: what a call costs is its host time, the torch calls it makes.
The torch path (``many.py``) takes about fifteen of them per call (a concatenation, reductions,
index_add_ of the row sums) and measured 400 us of host time per call on the H200 with three
16 MB outputs. Here one Triton kernel reads each tensor once as int32 words, in tiles of whole
1024-word rows, and adds its three lin64 sums and its count of non-finite elements into one
int64 row per tensor with integer atomics, which are exact in any order; the last program to
finish writes the rows straight into pinned host memory and zeroes the sums for the next launch.
A strided output whose rows are whole words (the cuDNN attention backward's dq, dk and dv,
views of one packed gradient) is read in place, each word's address computed from its layout
(``_layout``); any other non-contiguous one is copied first. The host makes two calls (the
launch, straight into the compiled kernel after the first: ``_run``; and the event) and the
writer thread reads the values behind the event (``Pending``) from a pinned slot taken for the
call, as everywhere else.

The values are lin64's, bit for bit (``trace/fingerprint.lin64``). The non-finite flag is the
native core's: an element is NaN or infinite (its exponent bits all set), read off the words,
so a sum of finite values past the dtype's range is not a non-finite tensor here.

Where Triton is missing, disabled (``FSDP_REPLAY_TRITON=0``) or the tensors do not fit the
kernel (more than ``MAX_TENSORS``, a dtype with no bit rule, a size that is not whole words, a
misaligned start), ``lin64_fused`` returns None and the caller takes the torch path.
"""

from __future__ import annotations

import ctypes
import logging
import struct
import threading
from typing import Any

import torch

from fsdp_replay import options
from fsdp_replay.agent.fingerprint.native import KINDS
from fsdp_replay.agent.fingerprint.pending import nbytes_of
from fsdp_replay.trace.fingerprint import LIN64_ROW

log = logging.getLogger(__name__)

ENV_DISABLE = "FSDP_REPLAY_TRITON"
MAX_TENSORS = 4
_ROWS = 8  # 1024-word rows per program: 32 KiB read by each
_WORDS = _ROWS * LIN64_ROW
# no float arithmetic to fuse: said, so that Triton 3.9+ does not warn about its changing default
_OPTIONS = {"R": _ROWS, "ROW": LIN64_ROW, "enable_fp_fusion": False}

_lock = threading.Lock()
_kernel: Any = None  # the compiled entry point, False where Triton cannot be used


def _build() -> Any:
    from fsdp_replay.agent.fingerprint import _fused_kernel  # imports triton

    return _fused_kernel.lin64_kernel


def _get() -> Any:
    global _kernel
    if _kernel is None:
        with _lock:
            if _kernel is None:
                if not options.process_switch(ENV_DISABLE, default=True):
                    _kernel = False
                else:
                    try:
                        _kernel = _build()
                    except Exception as e:  # no Triton here (CPU builds of torch come without it)
                        log.debug("fused lin64 unavailable: %r", e)
                        _kernel = False
    return _kernel


def available() -> bool:
    return bool(_get())


_scratch: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}


def _scratch_of(device: torch.device, stream: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's sums and program count for launches on ``stream`` (its handle) of ``device``:
    zero between launches (the last program of each leaves them so), and launches on one stream
    never overlap; another stream gets its own."""
    key = (device, stream)
    got = _scratch.get(key)
    if got is None:
        with _lock:
            got = _scratch.get(key)
            if got is None:
                got = _scratch[key] = (
                    torch.zeros(MAX_TENSORS * 4, dtype=torch.int64, device=device),
                    torch.zeros(1, dtype=torch.int32, device=device),
                )
    return got


def launch(tensors: list[torch.Tensor], host: int, stream: int = 0) -> bool:
    """Queue the kernel on the current stream (``stream``, its handle): it writes ``MAX_TENSORS`` rows of 4 int64 at host
    address ``host`` (row i: lin64's (S, A, B) of ``tensors[i]`` and its count of non-finite
    elements). False where the kernel does not apply (the caller's torch path then does)."""
    if not tensors or len(tensors) > MAX_TENSORS:
        return False
    device = tensors[0].device
    kernel = _get()
    if not kernel:
        return False
    built = _arguments(tensors, host)
    if built is None:
        return False
    args, blocks, plain, keep = built
    if not blocks:  # only empty tensors: nothing to read
        ctypes.memset(host, 0, _SLOT_BYTES)
        return True
    acc, count = _scratch_of(device, stream)
    try:
        if device.type == "cuda" and device.index != torch.cuda.current_device():
            with torch.cuda.device(device):  # Triton launches on the current device
                _run(kernel, blocks, [acc, count, host, *args], stream, plain, device)
        else:
            _run(kernel, blocks, [acc, count, host, *args], stream, plain, device)
    except Exception as e:  # its first launch compiles it (a C compiler, a writable cache)
        _give_up(e)
        return False
    del keep
    return True


def _arguments(tensors: list[torch.Tensor], host: int) -> tuple[list[Any], int, bool, list[Any]] | None:
    """The kernel's arguments after (acc, count, host) for ``tensors`` (at most MAX_TENSORS, on
    one device), its program count, whether every argument has the integer type of the first
    launch's (``_run``), and the contiguous copies to keep alive until the launch is queued; None
    where the kernel does not apply."""
    device = tensors[0].device
    args: list[Any] = []
    keep = []  # contiguous copies (the allocator orders their reuse after the launch)
    ends: list[int] = []
    blocks = 0
    plain = host >= _I32
    for t in tensors:
        if t.device != device or t.dtype not in KINDS:
            return None
        nbytes = nbytes_of(t)
        if nbytes % 4:
            return None
        layout = _CONTIGUOUS if t.is_contiguous() else _layout_of(t)
        if layout is None:  # a layout the kernel does not read: a contiguous copy
            t = t.contiguous()
            keep.append(t)
            layout = _CONTIGUOUS
        n = nbytes // 4
        # an empty tensor's address may be 0, which Triton would type i32 (another compilation):
        # it reads nothing, so any i64 address does
        ptr = t.data_ptr() if n else host
        if ptr % 4:
            return None
        args += [ptr, n, KINDS[t.dtype], *layout]
        plain = plain and n < _I32 and ptr >= _I32
        blocks += -(-n // _WORDS)
        ends.append(blocks)
    for _ in range(MAX_TENSORS - len(tensors)):  # no programs; an address like the others' (i64)
        args += [host, 0, 0, *_CONTIGUOUS]
        ends.append(blocks)
    return [*args, *ends[:3]], blocks, plain, keep


_CONTIGUOUS = (0, 0, 0, 0, 0, 0)
_I32 = 1 << 31


_layouts: dict[tuple[Any, ...], tuple[int, ...] | None] = {}


def _layout_of(t: torch.Tensor) -> tuple[int, ...] | None:
    """``_layout``, remembered per shape, strides and element size (a taped op's outputs have the
    same ones call after call; the memo is cleared past 4096 entries)."""
    key = (t.shape, t.stride(), t.element_size())
    got = _layouts.get(key, _NOT_SEEN)
    if got is _NOT_SEEN:
        if len(_layouts) >= 4096:
            _layouts.clear()
        got = _layouts[key] = _layout(t)
    return got


_NOT_SEEN: Any = object()


def _layout(t: torch.Tensor) -> tuple[int, ...] | None:
    """A strided tensor as the kernel reads it without a copy: rows of ``w`` contiguous words in
    at most three dimensions of rows, (w, d1, d2, s0, s1, s2) (sizes of the inner two row
    dimensions, the three's strides in words; ``_one`` in ``_fused_kernel.py``), or None where it
    cannot (the last dimension not contiguous or not whole words, a stride not whole words, more
    than three row dimensions, 2**31 words or more): then it is copied. The cuDNN attention
    backward's dq, dk and dv are such views of one packed gradient."""
    merged: list[list[int]] = []  # [size, stride], innermost first; contiguous neighbours merged
    for size, stride in zip(reversed(t.shape), reversed(t.stride()), strict=True):
        if size == 1:
            continue
        if merged and stride == merged[-1][0] * merged[-1][1]:
            merged[-1][0] *= size
        else:
            merged.append([size, stride])
    es = t.element_size()
    if not merged or merged[0][1] != 1 or len(merged) > 4 or t.numel() * es // 4 >= _I32:
        return None
    w, rows = merged[0][0] * es, merged[:0:-1]  # row dimensions, outermost first
    if w % 4 or any(stride * es % 4 or stride * es >= 4 * _I32 for _, stride in rows):
        return None
    rows = [[1, 0]] * (3 - len(rows)) + rows
    return (w // 4, rows[1][0], rows[2][0], *(stride * es // 4 for _, stride in rows))


_direct: Any = None  # the compiled kernel, launched without Triton's binding of its arguments


def _run(kernel: Any, blocks: int, args: list[Any], stream: int, plain: bool, device: torch.device) -> None:
    """Launch for ``blocks`` programs. The first launch goes through Triton's JIT entry point
    (compiling the kernel, once per process and cache), which returns the compiled kernel; later
    launches call that directly, skipping the binding and specialization of 43 arguments (8 of
    the 18 us of host time a launch took on the H200). One compiled kernel serves every call:
    no argument is specialized (``do_not_specialize``), and ``plain`` says that each argument
    has the integer type it had then (addresses i64, the rest i32), else the JIT entry point
    (which compiles another variant). The direct launch is used only once it computed what the
    JIT entry point computes (``_checked``); one that fails falls back to it for good."""
    global _direct
    direct = _direct
    if direct and plain:
        try:
            direct[(blocks, 1, 1)](*args, _ROWS, LIN64_ROW, stream=stream)
            return
        except Exception as e:  # another Triton's compiled-kernel interface: the JIT entry point
            log.warning(
                "the fused fingerprint kernel's direct launch failed (%r): launched by Triton's JIT", e
            )
            _direct = False
    compiled = kernel[(blocks,)](*args, **_OPTIONS)
    if direct is None and plain:
        _direct = _checked(kernel, compiled, device)


def _checked(kernel: Any, compiled: Any, device: torch.device) -> Any:
    """``compiled`` where a direct launch of it writes the rows that Triton's JIT entry point
    writes for a probe tensor (``probe_rows``), else False."""
    if device.type != "cuda" or not (hasattr(compiled, "run") and hasattr(compiled, "__getitem__")):
        return False

    def direct(probe: torch.Tensor) -> torch.Tensor:
        rows = torch.full((_SLOT_WORDS,), -1, dtype=torch.int64, pin_memory=True)
        stream = torch.cuda.current_stream(device).cuda_stream
        acc, count = _scratch_of(device, stream)
        args, blocks, _, _ = _built([probe], rows.data_ptr())
        compiled[(blocks, 1, 1)](acc, count, rows.data_ptr(), *args, _ROWS, LIN64_ROW, stream=stream)
        return rows

    try:
        ours, jit = probe_rows(device, direct, kernel)
        if ours == jit:
            return compiled
        log.warning(
            "the fused fingerprint kernel's direct launch computed other values: launched by Triton's JIT"
        )
    except Exception as e:  # another Triton's compiled-kernel interface
        log.warning("the fused fingerprint kernel's direct launch failed (%r): launched by Triton's JIT", e)
    return False


def _built(tensors: list[torch.Tensor], host: int) -> tuple[list[Any], int, bool, list[Any]]:
    built = _arguments(tensors, host)
    assert built is not None
    return built


def probe_rows(device: torch.device, other: Any, kernel: Any = None) -> tuple[list[int], list[int]]:
    """The rows of a probe tensor (three programs and a partial one) computed by ``other(probe)``
    (another launch of the compiled kernel: the direct one, the C++ tape's; it returns the rows'
    host tensor) and by Triton's JIT entry point, on a stream of the agent's own, waited for once
    (at the first launch, which compiled the kernel: the training stream never waits)."""
    kernel = kernel or _get()
    side = torch.cuda.Stream(device=device)
    with torch.cuda.stream(side):
        probe = torch.arange(3 * _WORDS + 5, dtype=torch.float32, device=device).sin_()
        rows = torch.full((_SLOT_WORDS,), -1, dtype=torch.int64, pin_memory=True)
        acc, count = _scratch_of(device, side.cuda_stream)
        args, blocks, _, _ = _built([probe], rows.data_ptr())
        kernel[(blocks,)](acc, count, rows.data_ptr(), *args, **_OPTIONS)
        ours = other(probe)
    side.synchronize()
    jit = rows.tolist()
    if jit[0] == -1:
        raise RuntimeError("Triton's launch wrote no rows")
    return ours.tolist(), jit


class _Slots:
    """Pinned host rows the kernel writes into, taken per call and given back once the writer
    thread has read them (a slot whose values are never read stays taken: never overwritten).
    Pinned memory of one allocation for the process's life: no allocator call per fingerprint,
    and no block that the caching host allocator could hand out while a kernel writes to it."""

    def __init__(self, count: int) -> None:
        self.slab = torch.empty(count * _SLOT_WORDS, dtype=torch.int64, pin_memory=True)
        self.base = self.slab.data_ptr()
        self.free = list(range(count))
        self.lock = threading.Lock()

    def take(self) -> int | None:
        with self.lock:
            return self.free.pop() if self.free else None

    def give_back(self, i: int) -> None:
        with self.lock:
            self.free.append(i)

    def address(self, i: int) -> int:
        return self.base + i * _SLOT_BYTES

    def read(self, i: int) -> list[list[int]]:
        words = struct.unpack_from(
            f"<{_SLOT_WORDS}q", (ctypes.c_char * _SLOT_BYTES).from_address(self.address(i))
        )
        return [list(words[r * 4 : r * 4 + 4]) for r in range(MAX_TENSORS)]


_SLOT_WORDS = MAX_TENSORS * 4
_SLOT_BYTES = _SLOT_WORDS * 8
SLOTS = 4096
_slots: _Slots | None = None


class _SlotRows:
    """One call's rows: read from its slot once, by the writer thread, which then gives it back."""

    __slots__ = ("_rows", "_slot")

    def __init__(self, slot: int) -> None:
        self._slot = slot
        self._rows: list[list[int]] | None = None

    def get(self, _host: Any = None) -> list[list[int]]:
        if self._rows is None:
            assert _slots is not None
            self._rows = _slots.read(self._slot)
            _slots.give_back(self._slot)
        return self._rows


def lin64_fused(tensors: list[torch.Tensor]) -> tuple[_SlotRows, Any] | None:
    """Launch the kernel for CUDA tensors: (their rows, readable once ``event`` is done; the
    event), or None where the kernel does not apply or no slot is free."""
    global _slots
    if not tensors or tensors[0].device.type != "cuda" or not _get():
        return None
    if _slots is None:
        with _lock:
            if _slots is None:
                _slots = _Slots(SLOTS)
    slot = _slots.take()
    if slot is None:  # the writer is that far behind: the torch path
        return None
    stream = torch.cuda.current_stream(tensors[0].device)
    if not launch(tensors, _slots.address(slot), stream.cuda_stream):
        _slots.give_back(slot)
        return None
    event = torch.cuda.Event(blocking=True)
    event.record(stream)
    return _SlotRows(slot), event


def _give_up(e: BaseException) -> None:
    global _kernel
    with _lock:
        if _kernel:
            log.warning("the fused fingerprint kernel cannot run here (%r): fingerprints use torch ops", e)
        _kernel = False
