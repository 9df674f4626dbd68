"""What the agent reads off the process: environment, RNG states, and snapshots of rank state.

Functions here run on the training thread and only read or copy; turning the copies into bytes
happens on the writer thread (``encode_*``).
"""

from __future__ import annotations

import base64
import ctypes
import functools
import gc
import hashlib
import json
import os
import platform
import random
import sys
import threading
import weakref
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import torch

import fsdp_replay
from fsdp_replay.agent import snapshot_blob
from fsdp_replay.trace import command
from fsdp_replay.trace.redact import redact_argv, redact_env

# ---------------------------------------------------------------------------------------------
# Environment


def versions() -> dict[str, Any]:
    out: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "fsdp_replay": fsdp_replay.__version__,
        "platform": platform.platform(),
        "nccl": None,
    }
    if "numpy" in sys.modules:
        out["numpy"] = sys.modules["numpy"].__version__
    if torch.cuda.is_available():
        try:
            v = torch.cuda.nccl.version()
            out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception:  # NCCL absent from this build
            out["nccl"] = None
    return out


def determinism() -> dict[str, Any]:
    """The flags that decide whether kernels are reproducible (torchtitan's set_determinism list)."""
    cudnn = torch.backends.cudnn
    return {
        "use_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_enabled": bool(cudnn.enabled),
        "cudnn_deterministic": bool(cudnn.deterministic),
        "cudnn_benchmark": bool(cudnn.benchmark),
        "cudnn_allow_tf32": bool(cudnn.allow_tf32),
        "matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "env": {
            k: os.environ[k]
            for k in ("CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO", "NCCL_PROTO", "PYTHONHASHSEED")
            if k in os.environ
        },
    }


def threads() -> dict[str, int]:
    return {"intra_op": torch.get_num_threads(), "inter_op": torch.get_num_interop_threads()}


def process_info(rank: int, world_size: int, local_rank: int, redact_key: str = "") -> dict[str, Any]:
    """What the process is, its argv and environment redacted (with the run's key, if any)."""
    return {
        "rank": rank,
        "world_size": world_size,
        "local_rank": local_rank,
        "pid": os.getpid(),
        "host": platform.node(),
        "argv": redact_argv(sys.argv, redact_key),
        "orig_argv": redact_argv(getattr(sys, "orig_argv", sys.argv), redact_key),
        "executable": sys.executable,
        "cwd": os.getcwd(),
        "env": redact_env(os.environ, redact_key),
        "versions": versions(),
        "threads": threads(),
        "determinism": determinism(),
    }


def sha256_file(path: str) -> str | None:
    try:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()
    except OSError:
        return None


def script_info() -> dict[str, Any]:
    """The program's script (``sys.argv[0]``) by path and sha256; where the interpreter started
    another file (a wrapper that rewrote ``sys.argv`` and ran the script with runpy), that one too
    (``started``): a replay runs only files the record identifies."""
    path = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] not in ("", "-c", "-m") else None
    info: dict[str, Any] = {
        "path": path,
        "sha256": sha256_file(path) if path and os.path.isfile(path) else None,
    }
    started = command.parse(list(getattr(sys, "orig_argv", [])[1:])).script
    if started and started != "-":
        first = os.path.abspath(started)
        if first != path and os.path.isfile(first):
            info["started"] = {"path": first, "sha256": sha256_file(first)}
    return info


def local_modules(roots: Iterable[str]) -> list[tuple[str, str]]:
    """(name, file) of imported modules whose source lives under one of ``roots`` (not site-packages)."""
    roots = tuple(os.path.join(os.path.abspath(r), "") for r in roots if r)
    out = []
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        if (
            not isinstance(f, str)
            or not os.path.isabs(f)
            or "site-packages" in f
            or "dist-packages" in f
            or name.startswith("fsdp_replay")
        ):
            continue
        f = os.path.abspath(f)
        if f.startswith(roots):
            out.append((name, f))
    return sorted(out)


# ---------------------------------------------------------------------------------------------
# RNG states


def rng_state() -> dict[str, Any]:
    """Copies of every RNG state the process has: python, numpy (if imported), torch CPU, CUDA."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = sys.modules.get("numpy")
    if np is not None:
        state["numpy"] = np.random.get_state(legacy=True)
    if torch.cuda.is_initialized():  # (is_available() would ask the driver every step)
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _b64(t: torch.Tensor) -> str:
    t = t.contiguous()
    return base64.b64encode(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())).decode()


class _LastPieces:
    """The last encoded piece of each RNG component and its crc32: most programs draw from some
    generators only (python's and numpy's often stay put for a whole run), and encoding the
    625-word Mersenne Twister states as JSON is most of ``encode_rng``'s cost. One per process,
    used by the writer thread (and the replayer's): a lock keeps concurrent users correct."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[Any, str, int]] = {}
        self._lock = threading.Lock()

    def get(self, name: str, key: Any, encode: Callable[[], str]) -> tuple[str, int]:
        with self._lock:
            last = self._last.get(name)
            if last is not None and last[0] == key:
                return last[1], last[2]
        piece = encode()
        crc = zlib.crc32(piece.encode())
        with self._lock:
            self._last[name] = (key, piece, crc)
        return piece, crc


_RNG_PIECES = _LastPieces()


def encode_rng(state: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """(fingerprints per component, JSON bytes of the whole state) on the writer thread.

    Each step's states are encoded (the replay checks their fingerprints), so this is on the
    recording's per-step budget: each component is serialized once, and the document is joined
    from those pieces (the same bytes as ``json.dumps(doc, separators=(",", ":"))``)."""
    pieces: dict[str, str] = {}
    fps: dict[str, Any] = {}
    version, internal, gauss = state["python"]
    pieces["python"], fps["python"] = _RNG_PIECES.get(
        "python",
        state["python"],
        lambda: json.dumps([version, list(internal), gauss], separators=(",", ":")),
    )
    pieces["torch"], fps["torch"] = _RNG_PIECES.get(
        "torch", state["torch"].numpy().tobytes(), lambda: json.dumps(_b64(state["torch"]))
    )
    if "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        key = (name, keys.tobytes() if hasattr(keys, "tobytes") else tuple(keys), pos, has_gauss, cached)

        def numpy_piece() -> str:
            k = keys.tolist() if hasattr(keys, "tolist") else [int(x) for x in keys]
            return json.dumps([name, k, int(pos), int(has_gauss), float(cached)], separators=(",", ":"))

        pieces["numpy"], fps["numpy"] = _RNG_PIECES.get("numpy", key, numpy_piece)
    if "cuda" in state:
        cuda = [json.dumps(_b64(t)) for t in state["cuda"]]
        fps["cuda"] = [zlib.crc32(x.encode()) for x in cuda]
        pieces["cuda"] = "[" + ",".join(cuda) + "]"
    body = ",".join(f"{json.dumps(k)}:{v}" for k, v in pieces.items())
    return fps, ("{" + body + "}").encode()


def decode_rng(data: bytes) -> dict[str, Any]:
    """The inverse of encode_rng: states ready for the set_*state functions."""
    doc = json.loads(data)
    out: dict[str, Any] = {
        "python": (doc["python"][0], tuple(doc["python"][1]), doc["python"][2]),
        "torch": torch.frombuffer(bytearray(base64.b64decode(doc["torch"])), dtype=torch.uint8),
    }
    if "numpy" in doc:
        import numpy as np

        name, keys, pos, has_gauss, cached = doc["numpy"]
        out["numpy"] = (name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached)
    if "cuda" in doc:
        out["cuda"] = [
            torch.frombuffer(bytearray(base64.b64decode(x)), dtype=torch.uint8) for x in doc["cuda"]
        ]
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state and "numpy" in sys.modules:
        sys.modules["numpy"].random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


# ---------------------------------------------------------------------------------------------
# Snapshots of a rank's own state


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of a (possibly DTensor) tensor this rank holds (its data, outside autograd)."""
    if type(t) is torch.Tensor:
        return t
    inner = getattr(t, "_local_tensor", None)  # DTensor: what to_local() returns, without autograd
    if isinstance(inner, torch.Tensor):
        return inner
    if isinstance(t, torch.nn.Parameter) and type(t.data) is torch.Tensor:
        return t
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``t``'s local values, complete when it returns."""
    return local(t).detach().to("cpu", copy=True)


def _copy(x: Any, tensor: Callable[[torch.Tensor], torch.Tensor] = host_copy) -> Any:
    if isinstance(x, torch.Tensor):
        return tensor(x)
    if isinstance(x, dict):
        return {k: _copy(v, tensor) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_copy(v, tensor) for v in x)
    return x


def _scheduler_kinds() -> tuple[type, ...]:
    kinds: tuple[type, ...] = (torch.optim.lr_scheduler.LRScheduler,)
    plateau = getattr(torch.optim.lr_scheduler, "ReduceLROnPlateau", None)
    if plateau is not None and not issubclass(plateau, kinds):
        kinds += (plateau,)
    return kinds


_SCHEDULERS: weakref.WeakSet[Any] = weakref.WeakSet()  # every scheduler made since tracking began
_SCANNED: weakref.WeakSet[Any] = weakref.WeakSet()  # optimizers whose older schedulers were looked for
_TRACKING = False


def _track_schedulers() -> None:
    """From now on every LR scheduler made is registered as it is made (through its class's
    ``__new__``, which subclasses inherit, whether or not their ``__init__`` calls their base's)."""
    global _TRACKING
    if _TRACKING:
        return
    _TRACKING = True
    for kind in _scheduler_kinds():
        if "__new__" in vars(kind):  # a scheduler class of its own making: the heap scan covers it
            continue

        def new(cls: type, *args: Any, **kwargs: Any) -> Any:
            obj: Any = object.__new__(cls)
            _SCHEDULERS.add(obj)
            return obj

        kind.__new__ = new  # type: ignore[method-assign,assignment]


def _scan_for_schedulers(optimizer: torch.optim.Optimizer, kinds: tuple[type, ...]) -> list[Any]:
    """The schedulers referring to ``optimizer``, through the garbage collector (a walk of the
    whole heap: tens of milliseconds in a large program)."""
    found = [r for r in gc.get_referrers(optimizer) if isinstance(r, kinds)]
    # get_referrers sees the instance __dict__, not always the instance: look one level up.
    for d in gc.get_referrers(optimizer):
        if isinstance(d, dict) and d.get("optimizer") is optimizer:
            found.extend(r for r in gc.get_referrers(d) if isinstance(r, kinds))
    return found


def schedulers_of(optimizer: torch.optim.Optimizer) -> list[Any]:
    """LR schedulers driving this optimizer (snapshots only). The first call for an optimizer
    walks the heap for those made before tracking began; every scheduler made since is
    registered as it is made, so later calls only filter the registry."""
    kinds = _scheduler_kinds()
    _track_schedulers()
    found = [s for s in list(_SCHEDULERS) if getattr(s, "optimizer", None) is optimizer]
    if optimizer not in _SCANNED:
        _SCANNED.add(optimizer)
        older = _scan_for_schedulers(optimizer, kinds)
        for s in older:
            _SCHEDULERS.add(s)
        found += older
    unique: dict[int, Any] = {id(s): s for s in found if isinstance(s, kinds)}
    return sorted(unique.values(), key=lambda s: type(s).__name__)


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def snapshot_state(
    optimizers: list[torch.optim.Optimizer],
    roots: list[torch.nn.Module],
    names: dict[int, str],
    step: int,
    tensor: Callable[[torch.Tensor], Any] = host_copy,
    buffer_tensor: Callable[[torch.Tensor], Any] | None = None,
) -> dict[str, Any]:
    """CPU copies of this rank's state at a step boundary (training thread: copies only), each
    tensor's made by ``tensor`` (a copy complete on return unless it says otherwise), the
    modules' buffers' by ``buffer_tensor`` where given."""
    copy = functools.partial(_copy, tensor=tensor)
    copy_buffer = copy if buffer_tensor is None else functools.partial(_copy, tensor=buffer_tensor)
    opts = []
    for opt in optimizers:
        params = optimizer_params(opt)
        opts.append(
            {
                "type": type(opt).__name__,
                "param_names": [names.get(id(p), f"param{i}") for i, p in enumerate(params)],
                "params": [copy(p) for p in params],
                "state": [copy(opt.state.get(p, {})) for p in params],
                "param_groups": [
                    {k: copy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups
                ],
                "schedulers": [
                    {"type": type(s).__name__, "state": copy(s.state_dict())} for s in schedulers_of(opt)
                ],
            }
        )
    buffers = {}
    for i, root in enumerate(roots):
        for name, buf in root.named_buffers():
            buffers[f"{i}.{name}"] = copy_buffer(buf)
    return {"format": 1, "step": step, "optimizers": opts, "buffers": buffers}


def encode_snapshot(state: dict[str, Any]) -> bytes:
    """A snapshot's blob: raw tensor bytes behind a JSON index, never a pickle (snapshot_blob.py)."""
    return snapshot_blob.encode(state)


def decode_snapshot(data: bytes, *, trusted: bool = False) -> dict[str, Any]:
    """A snapshot blob's state, decoded without running anything from the trace (an older agent's
    pickle loads with ``weights_only=True`` unless ``trusted``)."""
    return snapshot_blob.decode(data, trusted=trusted).state
