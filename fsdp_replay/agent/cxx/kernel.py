"""The recorder's C++ kernel for the hot CPU collectives (``_kernel.cpp``): build, load, drain.

``fsdp-replay record`` uses it for runs that store no payloads (``--payloads none``; or with
``--cxx-kernel``): it builds the library and passes its path to the ranks in
``FSDP_REPLAY_CXX_KERNEL_LIB``. It is built against the installed torch with the system's C and
C++ compilers, once per torch version and source, into a cache folder. Where it cannot be built
or loaded, the Python kernels record everything, as without it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fsdp_replay import options

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "_kernel.cpp"
CORE = HERE.parent / "fingerprint" / "_fpcore.c"
ABI = 1  # FSDPR_KERNEL_ABI of the source this module is written for
OPS = ("_allgather_base_", "_reduce_scatter_base_", "allreduce_")
# _kernel.cpp's dtype codes
DTYPES = {
    1: torch.float16,
    2: torch.bfloat16,
    3: torch.float32,
    4: torch.float64,
    5: torch.uint8,
    6: torch.int8,
    7: torch.int16,
    8: torch.int32,
    9: torch.int64,
    10: torch.bool,
}
MAXDIM = 8
DRAIN = 256  # records taken per native call
DRAIN_AT = 32  # completed records that the program's next wait turns into events (between step ends)


class KernelError(RuntimeError):
    """The kernel could not be built or loaded (the message says why)."""


class TensorRecord(ctypes.Structure):
    _fields_ = [
        ("shape", ctypes.c_int64 * MAXDIM),
        ("fp", ctypes.c_uint64),
        ("ndim", ctypes.c_int32),
        ("role", ctypes.c_int8),
        ("dtype", ctypes.c_int8),
        ("nf", ctypes.c_uint8),
        ("pad", ctypes.c_uint8),
    ]


class Record(ctypes.Structure):
    _fields_ = [
        ("seq", ctypes.c_int64),
        ("step", ctypes.c_int64),
        ("micro", ctypes.c_int64),
        ("t_ns", ctypes.c_int64),
        ("dur_ns", ctypes.c_int64),
        ("pg", ctypes.c_int64),
        ("op", ctypes.c_int32),
        ("reduce_op", ctypes.c_int32),
        ("ntensors", ctypes.c_int32),
        ("pad", ctypes.c_int32),
        ("t", TensorRecord * 4),
    ]


class State(ctypes.Structure):
    """The state the kernel shares with the recorder (``fsdpr_state``)."""

    _fields_ = [
        ("seq", ctypes.c_int64),
        ("step", ctypes.c_int64),
        ("micro", ctypes.c_int64),
        ("t0", ctypes.c_int64),
        ("inflight_seq", ctypes.c_int64),
        ("inflight_t_ns", ctypes.c_int64),
        ("fault_at", ctypes.c_int64),
        ("inflight_pg", ctypes.c_int64),
        ("cpu_ns", ctypes.c_int64),
        ("inflight_op", ctypes.c_int32),
        ("enabled", ctypes.c_int32),
        ("failed", ctypes.c_int32),
        ("pad", ctypes.c_int32),
        ("error", ctypes.c_char * 512),
    ]


def _torch_dir() -> Path:
    return Path(torch.__file__).resolve().parent


def build_key(source: Path = SOURCE) -> str:
    """What the built library depends on: our sources, torch's version and C++ ABI."""
    h = hashlib.sha256()
    for p in (source, CORE):
        h.update(p.read_bytes())
    h.update(f"{torch.__version__}|{int(torch._C._GLIBCXX_USE_CXX11_ABI)}|{_torch_dir()}".encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    base = options.process_setting("FSDP_REPLAY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fsdp-replay"
    )
    return Path(base) / "kernels"


def library_path(source: Path = SOURCE) -> Path:
    return cache_dir() / build_key(source) / f"{source.stem}.so"


def build(verbose: bool = False, source: Path = SOURCE) -> Path:
    """The library of ``source`` (this kernel's, or the tape's: ``tape.py``) for the installed
    torch, compiled first if it is not in the cache (~10 s), with the native core linked in."""
    target = library_path(source)
    if target.exists():
        return target
    cc, cxx = shutil.which("gcc") or shutil.which("cc"), shutil.which("g++") or shutil.which("c++")
    if cc is None or cxx is None:
        raise KernelError("no C and C++ compiler (gcc and g++) on PATH")
    tdir = _torch_dir()
    include = tdir / "include"
    if not (include / "torch" / "csrc" / "distributed" / "c10d" / "Work.hpp").exists():
        raise KernelError(f"torch's C++ headers are not installed under {include}")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)

    def steps(tmp: Path, out: Path) -> list[list[str]]:
        core_o = tmp / "_fpcore.o"
        return [
            [cc, "-O3", "-std=gnu11", "-fPIC", "-c", str(CORE), "-o", str(core_o)],
            [
                cxx,
                "-O2",
                "-std=c++20",
                "-shared",
                "-fPIC",
                f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                f"-I{include}",
                f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}",
                str(source),
                str(core_o),
                f"-L{tdir / 'lib'}",
                "-lc10",
                "-ltorch_cpu",
                "-ltorch",
                "-ldl",
                f"-Wl,-rpath,{tdir / 'lib'}",
                "-o",
                str(out),
            ],
        ]

    return compile_into(target, steps, KernelError, verbose)


def compile_into(
    target: Path,
    steps: Callable[[Path, Path], list[list[str]]],
    error: type[Exception],
    verbose: bool = False,
) -> Path:
    """Run the compiler commands ``steps(scratch folder, output)`` and move the output to
    ``target`` (atomically: concurrent builds of the same key agree); ``error`` says why not."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        for cmd in steps(Path(tmp), out):
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if verbose:
                print(proc.stdout + proc.stderr)
            if proc.returncode != 0:
                tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
                raise error(f"{Path(cmd[0]).name} failed (exit {proc.returncode}):\n{tail}")
        os.replace(out, target)
    return target


def open_library(
    path: str, prefix: str, abi: int, structs: tuple[type[ctypes.Structure], ...], error: type[Exception]
) -> tuple[Any, Any]:
    """Load one of our C++ libraries (its torch ops too): (calls holding the GIL, calls releasing
    it), after checking its ABI number (``{prefix}_abi``) and the sizes of the structures it
    shares with Python (``{prefix}_sizes(i)``); ``error`` says why not."""
    try:
        torch.ops.load_library(path)
        held = ctypes.PyDLL(path)
        released = ctypes.CDLL(path)
    except OSError as e:
        raise error(f"cannot load {path}: {e}") from e
    got = getattr(held, f"{prefix}_abi")()
    if got != abi:
        raise error(f"{path} is from another version (abi {got}, want {abi})")
    sizes = getattr(held, f"{prefix}_sizes")  # small values: read as a C int whatever its width
    if tuple(sizes(i) for i in range(len(structs))) != tuple(ctypes.sizeof(c) for c in structs):
        raise error(f"{path}: record layout differs from Python's")
    return held, released


class Kernel:
    """The loaded library. ``install`` registers the kernels; ``uninstall`` removes them."""

    def __init__(self, path: str | Path) -> None:
        path = str(path)
        held, released = open_library(path, "fsdpr_kernel", ABI, (State, Record), KernelError)  # fsdpr::pg_of
        held.fsdpr_kernel_state.restype = ctypes.c_void_p
        self.path = path
        self.state = State.from_address(held.fsdpr_kernel_state())
        self._held = held
        self._complete_waiting = released.fsdpr_kernel_complete  # may block: releases the GIL
        self._buf = (Record * DRAIN)()

    def install(self) -> None:
        if self._held.fsdpr_kernel_install() != 0:
            raise KernelError(self.error())
        self.state.enabled = 1

    def uninstall(self) -> None:
        self._held.fsdpr_kernel_uninstall()

    def complete(self, force: bool = False) -> int:
        """Complete the deferred all-gathers that are done (all, waiting, with ``force``); returns
        how many completed records wait to be drained, or -1 when a wait failed (``error()``)."""
        fn = self._complete_waiting if force else self._held.fsdpr_kernel_complete
        return int(fn(int(force)))

    def drain(self) -> list[Any]:
        """The completed records, oldest first (copies)."""
        out: list[Any] = []
        while True:
            n = self._held.fsdpr_kernel_drain(self._buf, DRAIN)
            out += [Record.from_buffer_copy(self._buf[i]) for i in range(n)]
            if n < DRAIN:
                return out

    def error(self) -> str:
        return self.state.error.decode(errors="replace")
