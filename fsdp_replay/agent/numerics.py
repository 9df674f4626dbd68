"""The replay key of this process (``trace/numerics.py`` says what each part means).

``key()`` reads the device, the libraries, the numerics flags and the environment variables that
decide a kernel's bits. It initializes nothing: the GPU is described only when the program has
initialized CUDA itself, and a library's version is read from the copy already loaded.
``FlagWatch`` is the per-step part: the flags alone (a few attribute reads), and only what changed.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import os
import sys
from typing import Any

import torch

from fsdp_replay.trace.numerics import KEY_ENV, NCCL_ENV

_CUBLAS_PACKAGES = ("nvidia-cublas-cu12", "nvidia-cublas-cu13", "nvidia-cublas")
_CUDNN_PACKAGES = ("nvidia-cudnn-cu12", "nvidia-cudnn-cu13", "nvidia-cudnn")
_NCCL_PACKAGES = ("nvidia-nccl-cu12", "nvidia-nccl-cu13", "nvidia-nccl")


def key() -> dict[str, Any]:
    return {"device": device(), "libraries": libraries(), "flags": flags(), "env": env()}


def flags() -> dict[str, Any]:
    cuda = torch.backends.cuda
    cudnn = torch.backends.cudnn
    matmul = cuda.matmul
    out: dict[str, Any] = {
        "use_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "fill_uninitialized_memory": bool(torch.utils.deterministic.fill_uninitialized_memory),  # type: ignore[attr-defined]
        "matmul_allow_tf32": bool(matmul.allow_tf32),
        "cudnn_allow_tf32": bool(cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "matmul_fp16_reduced_precision_reduction": bool(matmul.allow_fp16_reduced_precision_reduction),
        "matmul_bf16_reduced_precision_reduction": bool(matmul.allow_bf16_reduced_precision_reduction),
        "cudnn_enabled": bool(cudnn.enabled),
        "cudnn_deterministic": bool(cudnn.deterministic),
        "cudnn_benchmark": bool(cudnn.benchmark),
        "sdpa_flash": cuda.flash_sdp_enabled(),
        "sdpa_mem_efficient": cuda.mem_efficient_sdp_enabled(),
        "sdpa_math": cuda.math_sdp_enabled(),
        "sdpa_cudnn": cuda.cudnn_sdp_enabled(),
        "mkldnn_enabled": bool(torch.backends.mkldnn.enabled),
        "intra_op_threads": torch.get_num_threads(),
    }
    fp16_acc = getattr(matmul, "allow_fp16_accumulation", None)
    if fp16_acc is not None:
        out["matmul_fp16_accumulation"] = bool(fp16_acc)
    if _cuda_in_use():
        with contextlib.suppress(Exception):
            out["preferred_blas_library"] = str(cuda.preferred_blas_library()).rsplit(".", 1)[-1]
    return out


def env() -> dict[str, str]:
    return {k: os.environ[k] for k in (*KEY_ENV, *NCCL_ENV) if k in os.environ}


def device() -> dict[str, Any]:
    out: dict[str, Any] = {
        "kind": "cpu",
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_model": _cpu_model(),
    }
    if _cuda_in_use():
        with contextlib.suppress(Exception):
            props = torch.cuda.get_device_properties(torch.cuda.current_device())
            out.update(
                kind="cuda",
                name=props.name,
                sm_count=props.multi_processor_count,
                capability=f"{props.major}.{props.minor}",
                driver=_driver(),
            )
    return out


def libraries() -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if not _cuda_in_use():
        return out
    with contextlib.suppress(Exception):
        out["cudnn"] = torch.backends.cudnn.version()
    with contextlib.suppress(Exception):
        v = torch.cuda.nccl.version()
        out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    out["cublas"] = _cublas_version()
    for name, packages in (
        ("cublas_package", _CUBLAS_PACKAGES),
        ("cudnn_package", _CUDNN_PACKAGES),
        ("nccl_package", _NCCL_PACKAGES),
    ):
        out[name] = _package_version(packages)
    return out


class FlagWatch:
    """The flags at the end of each step, reported when they differ from the step before."""

    def __init__(self, start: dict[str, Any]) -> None:
        self.last = dict(start)

    def changed(self) -> dict[str, Any] | None:
        now = flags()
        if now == self.last:
            return None
        diff = {k: v for k, v in now.items() if self.last.get(k) != v}
        self.last = now
        return diff


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _driver() -> str | None:
    """The kernel module's version (``/proc/driver/nvidia/version``), else the CUDA driver API's."""
    with contextlib.suppress(OSError), open("/proc/driver/nvidia/version") as f:
        for word in f.readline().split():
            if word[:1].isdigit() and "." in word:
                return word
    with contextlib.suppress(Exception):
        v = int(torch._C._cuda_getDriverVersion())  # type: ignore[attr-defined]
        return f"CUDA driver API {v // 1000}.{v % 1000 // 10}"
    return None


def _cublas_version() -> str | None:
    """``cublasGetProperty`` of the libcublas this process has loaded (found in its maps)."""
    path = _loaded("libcublas.so")
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
        parts = []
        for prop in (0, 1, 2):  # MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL
            value = ctypes.c_int()
            if lib.cublasGetProperty(prop, ctypes.byref(value)) != 0:
                return None
            parts.append(str(value.value))
        return ".".join(parts)
    except (OSError, AttributeError):
        return None


def _loaded(stem: str) -> str | None:
    if not sys.platform.startswith("linux"):
        return None
    with contextlib.suppress(OSError), open("/proc/self/maps") as f:
        for line in f:
            path = line.rstrip("\n").split(maxsplit=5)[-1]
            if os.path.basename(path).startswith(stem):
                return path
    return None


def _package_version(names: tuple[str, ...]) -> str | None:
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return None


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return None
