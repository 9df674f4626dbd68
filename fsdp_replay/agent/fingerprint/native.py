"""The agent's native fingerprint core: ``_fpcore.c``, loaded with ctypes when it was built.

``pip install`` compiles it (``setup.py``; optional: an install without a C compiler still
succeeds). It is a plain C library, not a Python extension, so the copy that the Kubernetes
injector puts into a pod works with whatever Python the pod runs. Where it is missing, or
disabled with ``FSDP_REPLAY_NATIVE=0``, the agent computes the same fingerprints with torch.

It computes sk64 of a contiguous CPU tensor in one pass over its bytes (the torch path takes
three, plus a few Python-level calls that cost more than the reductions below a megabyte), and
its non-finite flag exactly: an element is NaN or infinite. The torch path flags a tensor whose
float sum is not finite, which also happens when finite elements sum past the dtype's range.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
from pathlib import Path
from typing import Any

import torch

from fsdp_replay import options

log = logging.getLogger(__name__)

ENV_DISABLE = "FSDP_REPLAY_NATIVE"
_ABI = 32002  # fsdpr_abi() of the C source this module is written for
# Element kinds of the non-finite check (the C enum); complex numbers are pairs of their real type.
KINDS: dict[torch.dtype, int] = {
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float32: 3,
    torch.float64: 4,
    torch.complex64: 3,
    torch.complex128: 4,
    torch.complex32: 1,
}
# Integer and bool dtypes: no value of theirs is non-finite.
PLAIN_DTYPES = frozenset(
    [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]
    + [getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n)]
)
KINDS.update(dict.fromkeys(PLAIN_DTYPES, 0))
# float8 and other float formats are not in the table: the torch path takes them.

_SLOTS = 64  # slices a call can take without allocating its output arrays
HOLD_GIL_MAX_BYTES = 8 << 20  # calls reading more release the GIL (about 1 ms at in-process speeds)


class FreedStorageError(RuntimeError):
    """A tensor whose storage was freed (``untyped_storage().resize_(0)``, as FSDP does with
    unsharded parameters) before it was fingerprinted: reading it would crash the process."""

    def __init__(self, t: torch.Tensor) -> None:
        super().__init__(
            f"a {tuple(t.shape)} {t.dtype} tensor's storage was freed before it was fingerprinted"
        )


class _Core:
    """The library's functions, each in two flavours: through ``ctypes.PyDLL``, which keeps the
    GIL during the call, and through ``ctypes.CDLL``, which releases it.

    The training thread calls the core in the middle of its collectives. Releasing the GIL for a
    call of 100 us invites the writer thread to take it, and the training thread then waits for
    the writer to give it back before it can continue (measured: about 3% of the example's CPU
    step, ``bench/README.md``). So calls that read up to ``HOLD_GIL_MAX_BYTES`` keep the GIL;
    longer ones release it, so that other Python threads are not held up for more than about a
    millisecond.
    """

    def __init__(self, lib: ctypes.CDLL, held: ctypes.PyDLL, path: Path) -> None:
        self.path = path
        self.sk64, self.sk64_released = (self._sk64(h) for h in (held, lib))
        self.sk64_many, self.sk64_many_released = (self._sk64_many(h) for h in (held, lib))
        self.crc32 = lib.fsdpr_crc32
        self.crc32.restype = ctypes.c_uint32
        self.crc32.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        self.local = threading.local()

    @staticmethod
    def _sk64(lib: ctypes.CDLL) -> Any:
        fn = lib.fsdpr_sk64
        fn.restype = ctypes.c_int
        fn.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_void_p,
        ]
        return fn

    @staticmethod
    def _sk64_many(lib: ctypes.CDLL) -> Any:
        fn = lib.fsdpr_sk64_many
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_size_t, *[ctypes.c_void_p] * 5]
        return fn

    def buffers(self, n: int) -> tuple[Any, Any]:
        if n > _SLOTS:
            return (ctypes.c_uint64 * n)(), (ctypes.c_uint8 * n)()
        local = self.local
        try:
            return local.fps, local.nfs
        except AttributeError:
            local.fps, local.nfs = (ctypes.c_uint64 * _SLOTS)(), (ctypes.c_uint8 * _SLOTS)()
            return local.fps, local.nfs


_core: _Core | None = None
_loaded = False
_lock = threading.Lock()


def library_path() -> Path | None:
    """The built library next to this module, if any."""
    here = Path(__file__).resolve().parent
    for p in sorted(here.glob("_fpcore*.so")):
        return p
    return None


def _load() -> _Core | None:
    if not options.process_switch(ENV_DISABLE, default=True):
        return None
    if sys.byteorder != "little":
        return None
    path = library_path()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
        lib.fsdpr_abi.restype = ctypes.c_int
        abi = lib.fsdpr_abi()
        if abi != _ABI:
            log.warning(
                "fsdp-replay: %s is from another version (abi %d, want %d); not used", path, abi, _ABI
            )
            return None
        return _Core(lib, ctypes.PyDLL(str(path)), path)
    except (OSError, AttributeError) as e:
        log.warning("fsdp-replay: cannot load %s (%s); fingerprints use torch", path, e)
        return None


def core() -> _Core | None:
    """The loaded library, or None (not built, disabled, or not loadable): loaded on first use."""
    global _core, _loaded
    if not _loaded:
        with _lock:
            if not _loaded:
                _core = _load()
                _loaded = True
    return _core


def available() -> bool:
    return core() is not None


def reload() -> None:
    """Forget the loaded state, so the next call reads FSDP_REPLAY_NATIVE again (tests)."""
    global _core, _loaded
    with _lock:
        _core, _loaded = None, False


def sk64(t: torch.Tensor, slices: int = 1) -> list[tuple[int, bool]] | None:
    """[(sk64, nonfinite) of the whole tensor, then of each of its ``slices`` equal slices] of a
    contiguous CPU tensor, or None where the native core does not apply (not built, another
    device, strided, a dtype without a non-finite rule here, slices not of whole rows)."""
    c = _core if _loaded else core()
    if c is None or t.device.type != "cpu" or not t.is_contiguous():
        return None
    kind = KINDS.get(t.dtype)
    if kind is None:
        return None
    nbytes = t.numel() * t.element_size()
    ptr = t.data_ptr()
    if nbytes and not ptr:
        raise FreedStorageError(t)
    fps, nfs = c.buffers(slices + 1)
    fn = c.sk64 if nbytes <= HOLD_GIL_MAX_BYTES else c.sk64_released
    if fn(ptr if nbytes else None, nbytes, slices, kind, fps, nfs):
        return None  # slices that are not whole rows, or no memory for the row sums
    return [(fps[i], bool(nfs[i])) for i in range(slices + 1)]


class _ManyArgs:
    """The argument arrays of the last ``sk64_many`` call, reused when it is called again with the
    same tensor objects at the same addresses and sizes (a step's parameters, every step): in a
    training process each tensor attribute read costs microseconds, so rereading dtype, device
    and layout of every parameter each step is most of the call."""

    __slots__ = ("kinds", "nbytes", "ptrs", "sizes", "take", "tensors", "total")

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.sizes: list[tuple[int, int, torch.dtype]] = []  # (data_ptr, numel, dtype) per tensor taken
        self.take: list[int] = []
        self.ptrs: Any = None
        self.nbytes: Any = None
        self.kinds: Any = None
        self.total = 0  # bytes a call reads

    def matches(self, tensors: list[torch.Tensor]) -> bool:
        mine = self.tensors
        if len(mine) != len(tensors) or any(a is not b for a, b in zip(mine, tensors, strict=True)):
            return False
        return all(
            (tensors[i].data_ptr(), tensors[i].numel()) == s
            for i, s in zip(self.take, self.sizes, strict=True)
        )


_MANY = threading.local()


def sk64_many(tensors: list[torch.Tensor]) -> list[tuple[int, bool] | None] | None:
    """[(sk64, nonfinite) or None] for each tensor (None where ``sk64`` would return None), in
    one native call; None when the core is not loaded."""
    c = _core if _loaded else core()
    if c is None:
        return None
    args: _ManyArgs | None = getattr(_MANY, "args", None)
    if args is None or not args.matches(tensors):
        args = _MANY.args = _ManyArgs()
        ptrs: list[int] = []
        sizes: list[int] = []
        kinds: list[int] = []
        for i, t in enumerate(tensors):
            kind = KINDS.get(t.dtype)
            if kind is None or t.device.type != "cpu" or not t.is_contiguous():
                continue
            n, ptr = t.numel() * t.element_size(), t.data_ptr()
            if n and not ptr:
                raise FreedStorageError(t)
            args.take.append(i)
            args.sizes.append((ptr, t.numel(), t.dtype))
            ptrs.append(ptr if n else 0)
            sizes.append(n)
            kinds.append(kind)
        k = len(ptrs)
        args.tensors = list(tensors)
        args.ptrs = (ctypes.c_uint64 * k)(*ptrs)
        args.nbytes = (ctypes.c_uint64 * k)(*sizes)
        args.kinds = (ctypes.c_int32 * k)(*kinds)
        args.total = sum(sizes)
    out: list[tuple[int, bool] | None] = [None] * len(tensors)
    k = len(args.take)
    if not k:
        return out
    fps, nfs = (ctypes.c_uint64 * k)(), (ctypes.c_uint8 * k)()
    fn = c.sk64_many if args.total <= HOLD_GIL_MAX_BYTES else c.sk64_many_released
    if fn(k, args.ptrs, args.nbytes, args.kinds, fps, nfs):
        return None
    for j, i in enumerate(args.take):
        out[i] = (fps[j], bool(nfs[j]))
    return out
