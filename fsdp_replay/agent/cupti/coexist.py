"""Other CUDA profilers in the process: who else uses CUPTI, and when the capture steps back.

With a driver older than r610 (and libcupti older than 13.3) CUPTI traces activity for one client
only: two clients that enable kinds and register buffer callbacks take each other's buffers, and
both end up with nothing (measured on the H200 machine: torch.profiler started during our capture
left both with 0 kernel records, and ours dead until re-armed). So the capture stands aside:

- for the whole run, when another CUPTI client was injected into the process: Nsight Systems,
  Nsight Compute and compute-sanitizer load their injection libraries (``FOREIGN_LIBRARIES``) or
  name one in ``CUDA_INJECTION64_PATH``;
- for a torch.profiler window: ``ProfilerWatch`` wraps the two torch entry points that hand CUPTI
  to Kineto, so that our records are flushed and our kinds switched off *before* Kineto takes
  over; at each step end ``torch_profiler_active`` says whether the window is still open. When it
  has closed, the capture registers its callbacks again (Kineto replaced them) and re-arms.

A CUPTI subscription (the callback API) is probed once, and with libcupti 13.2 and later the probe
names the holder of a subscription that refuses ours. An idle subscription does not trace: Kineto
keeps its own after a profiler window ends, and activity tracing works beside it, so only a
holder named as one of NVIDIA's tracing tools makes the capture stand aside. DCGM's profiling metrics read the GPU's
performance counters from outside the process: no activity tracing, no conflict.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

# Injection libraries of NVIDIA's tools, as their file names start (Nsight Systems, Nsight
# Compute's and compute-sanitizer's launchers, compute-sanitizer's collection library).
FOREIGN_LIBRARIES: dict[str, str] = {
    "libToolsInjection": "Nsight Systems",
    "libInterceptorInjectionTarget": "Nsight Compute",
    "libTreeLauncherTargetInjection": "Nsight Compute or compute-sanitizer",
    "libsanitizer-collection": "compute-sanitizer",
}
INJECTION_ENV = "CUDA_INJECTION64_PATH"
# Subscriber names of the tools that trace for the whole run (the probe's holder, lower case). Any
# other holder may be idle (Kineto keeps its subscription after a profiler window): activity
# tracing works beside an idle subscription, so the capture goes on and records who held it.
TRACING_SUBSCRIBERS = ("nsight", "nsys", "sanitizer")
# torch entry points that give CUPTI to Kineto (torch/autograd/profiler.py calls them by their
# module-level names, so wrapping the module attribute catches every profiler front end).
PROFILER_ENTRY_POINTS = ("_prepare_profiler", "_enable_profiler")
# libcupti and driver versions from which CUPTI traces activity for several subscribers
# (CUPTI 13.3 with an r610 driver; cuDriverGetVersion gives 1000 * major + 10 * minor).
MULTI_SUBSCRIBER_LIBCUPTI = 130300
MULTI_SUBSCRIBER_DRIVER = 13030


def loaded_libraries(maps: str) -> list[str]:
    """The shared objects in a ``/proc/PID/maps`` text, by path, once each."""
    seen: dict[str, None] = {}
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
        path = fields[5].strip() if len(fields) == 6 else ""
        if ".so" in path:
            seen.setdefault(path, None)
    return list(seen)


def injected_tool(env: Mapping[str, str], libraries: list[str]) -> str | None:
    """The other CUPTI client injected into this process, in words, or None."""
    for path in libraries:
        name = Path(path).name
        for prefix, tool in FOREIGN_LIBRARIES.items():
            if name.startswith(prefix):
                return f"{tool} ({path} is loaded)"
    injection = env.get(INJECTION_ENV, "").strip()
    if injection:
        return f"a CUPTI injection library ({INJECTION_ENV}={injection})"
    return None


def torch_profiler_active() -> bool:
    """Whether a torch profiler (Kineto, or the autograd profiler) is on in this process."""
    profiler = sys.modules.get("torch.autograd.profiler")
    if profiler is not None and getattr(profiler, "_is_profiler_enabled", False):
        return True
    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch._C._autograd._profiler_enabled())
    except Exception:  # another torch's internals: the flag above is what we have
        return False


def library_path(libraries: list[str], stem: str) -> str | None:
    """The loaded library whose file name starts with ``stem`` (``libcupti.so``), or None."""
    return next((p for p in libraries if Path(p).name.startswith(stem)), None)


def libcupti_version(path: str | None) -> int | None:
    """``cuptiGetVersion`` of the libcupti loaded from ``path`` (the one cupti-python uses)."""
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)  # already loaded: the same handle, no second CUPTI
        version = ctypes.c_uint32(0)
        return int(version.value) if lib.cuptiGetVersion(ctypes.byref(version)) == 0 else None
    except (OSError, AttributeError):
        return None


def driver_version() -> int | None:
    """``cuDriverGetVersion`` (1000 * major + 10 * minor of the CUDA the driver supports)."""
    try:
        version = ctypes.c_int(0)
        ok = ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0
        return int(version.value) if ok else None
    except (OSError, AttributeError):
        return None


def multi_subscriber(cupti: Any, libcupti: int | None, driver: int | None) -> tuple[bool, str]:
    """Whether CUPTI here traces activity for several subscribers, and why (not)."""
    missing = []
    if libcupti is None or libcupti < MULTI_SUBSCRIBER_LIBCUPTI:
        missing.append(f"libcupti {libcupti} < {MULTI_SUBSCRIBER_LIBCUPTI}")
    if driver is None or driver < MULTI_SUBSCRIBER_DRIVER:
        missing.append(f"driver CUDA version {driver} < {MULTI_SUBSCRIBER_DRIVER} (r610)")
    # cupti-python's per-subscriber activity calls came with 13.5 (activity_get_enabled_kinds):
    # 13.4's activity calls are process-wide, and a subscription alone does not separate them.
    if not hasattr(cupti, "activity_get_enabled_kinds"):
        missing.append("cupti-python without per-subscriber activity calls (13.5+)")
    if missing:
        return False, "single subscriber: " + "; ".join(missing)
    return True, "multi-subscriber"


def detach_unsafe(cuda: str | None) -> str:
    """Why CUPTI may not be finalized between capture windows with this CUDA (empty: it may):
    before 12.6, CUDA graphs launched after a finalize could crash (PyTorch kept Kineto attached
    there, pytorch/pytorch#146604)."""
    try:
        version = tuple(int(x) for x in (cuda or "").split(".")[:2])
    except ValueError:
        return f"CUDA version {cuda!r} not understood"
    if len(version) < 2:
        return f"CUDA version {cuda!r} not understood"
    return "" if version >= (12, 6) else f"CUDA {cuda}: before 12.6 graphs could crash after a finalize"


def probe_subscriber(cupti: Any) -> dict[str, Any]:
    """Subscribe to CUPTI and let go at once: ``{"probe": "ok" | "busy" | "error", "holder", ...}``.
    ``subscribe_v2`` (libcupti 13.2+) names the holder of a subscription that refuses ours."""

    def ignore(*_args: Any) -> None:
        return None

    params = None
    try:
        params = cupti.SubscriberParams()
        params.struct_size = cupti.SUBSCRIBER_PARAMS_SIZE
        params.subscriber_name = "fsdp-replay"
        handle = cupti.subscribe_v2(ignore, None, params.ptr)
    except Exception as e:  # any failure: the older call says the same
        if _is_multiple_subscribers(cupti, e):
            holder = str(getattr(params, "old_subscriber_name", "") or "")
            return {"probe": "busy", "holder": holder, "error": repr(e)[:200]}
        try:
            handle = cupti.subscribe(ignore, None)
        except Exception as e2:
            busy = _is_multiple_subscribers(cupti, e2)
            return {"probe": "busy" if busy else "error", "holder": "", "error": repr(e2)[:200]}
    try:
        cupti.unsubscribe(handle)
    except Exception as e:
        return {"probe": "ok", "holder": "", "error": f"unsubscribe: {e!r}"[:200]}
    return {"probe": "ok", "holder": ""}


def _is_multiple_subscribers(cupti: Any, e: BaseException) -> bool:
    code = getattr(cupti.Result, "ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED", None)
    status = getattr(e, "status", None)
    if status is None and e.args and isinstance(e.args[0], int):
        status = e.args[0]
    return (code is not None and status == int(code)) or "MULTIPLE_SUBSCRIBERS" in str(e)


def foreign_holder(probe: Mapping[str, Any]) -> str | None:
    """The holder of a subscription that refused ours, when it is a tool that traces, or None."""
    holder = str(probe.get("holder") or "")
    if probe.get("probe") != "busy" or not any(t in holder.lower() for t in TRACING_SUBSCRIBERS):
        return None
    return holder


class ProfilerWatch:
    """Calls ``on_start(what)`` before torch hands CUPTI to Kineto (``PROFILER_ENTRY_POINTS``);
    ``uninstall`` puts torch's functions back."""

    def __init__(self, on_start: Callable[[str], None], module: Any = None) -> None:
        self.on_start = on_start
        self.module = module
        self._originals: dict[str, Any] = {}

    def install(self) -> None:
        if self.module is None:
            import torch.autograd.profiler as module

            self.module = module
        for name in PROFILER_ENTRY_POINTS:
            original = getattr(self.module, name, None)
            if original is None or name in self._originals:
                continue
            self._originals[name] = original
            setattr(self.module, name, self._wrap(name, original))

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        on_start = self.on_start

        @functools.wraps(original)
        def entry(*args: Any, **kwargs: Any) -> Any:
            with contextlib.suppress(Exception):  # our errors are ours: the profiler always starts
                on_start(f"torch.profiler ({name})")
            return original(*args, **kwargs)

        return entry

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(self.module, name, original)
        self._originals = {}


def proc_maps(pid: str = "self", proc: str = "/proc") -> str:
    try:
        return Path(proc, pid, "maps").read_text(errors="replace")
    except OSError:
        return ""
