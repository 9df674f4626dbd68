"""The replay key: the settings that decide which bits a kernel computes, and what a difference
in each one means for a replay.

The agent records the key (``agent/numerics.py``) in ``rank_start.numerics`` when the rank starts
recording (the first optimizer step, when the program has set its flags), and a ``numerics``
event at the end of any step whose flags differ from the step before. A replay computes its own
key at the same points and compares them here. ``compare`` is pure: the replayer reports what it
returns, ``diff`` uses it between two recordings.

The key is a nested dict (``device``, ``libraries``, ``flags``, ``env``) compared leaf by leaf
under dotted names (``device.name``, ``flags.matmul_allow_tf32``, ``env.NCCL_ALGO``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Final, NamedTuple

# What kind of setting a key is, most consequential first: the order ranks the likely cause of
# a divergence when several differ.
DEVICE: Final = "device"
LIBRARY: Final = "library"
FLAG: Final = "flag"
ENV: Final = "env"
INFO: Final = "info"
"""Recorded for the reader; rarely changes bits by itself (the driver, the CPU's model name)."""
COLLECTIVE: Final = "collective"
"""Settings of NCCL: a one-rank replay serves every collective from the trace, so they cannot
change its bits; they matter when the job is run again on all ranks (``diff`` of two runs)."""
KIND_ORDER: Final = (DEVICE, LIBRARY, FLAG, ENV, INFO, COLLECTIVE)

_GPU_KERNEL_CHOICE: Final = (
    "cuBLAS, cuDNN and the fused attention kernels choose their kernels (tile shapes, split-K, "
    "reduction order) by GPU model and SM count, so matmuls, convolutions and attention are "
    "expected to differ in their last bits: a divergence here says little about the program; "
    "replay on the recorded GPU model for a bit-exact verdict"
)
_FLAG_MEANING: Final = (
    "the program set this flag otherwise in the replay (an environment variable, a config file or "
    "a library default that differs): kernels take another path, so bits may differ"
)

KEYS: Final[dict[str, tuple[str, str]]] = {
    "device.kind": (
        DEVICE,
        "the replay runs on another kind of device: every op runs another implementation, so its "
        "bits are not expected to match the recording",
    ),
    "device.name": (DEVICE, f"another GPU model: {_GPU_KERNEL_CHOICE}"),
    "device.sm_count": (DEVICE, f"another number of SMs: {_GPU_KERNEL_CHOICE}"),
    "device.capability": (DEVICE, f"another compute capability: {_GPU_KERNEL_CHOICE}"),
    "device.cpu_capability": (
        DEVICE,
        "ATen's vectorized CPU kernels (sums, norms, softmax) use another instruction set here "
        "(ATEN_CPU_CAPABILITY or another CPU): float reductions add in another order",
    ),
    "device.cpu_model": (
        INFO,
        "another CPU model: oneDNN and MKL choose kernels by instruction set, which can change float "
        "results of CPU matmuls and convolutions",
    ),
    "device.driver": (
        INFO,
        "another GPU driver: usually the same bits; kernels the driver compiles from PTX at load time can differ",
    ),
    "libraries.torch": (LIBRARY, "another torch: kernels differ between versions"),
    "libraries.cuda": (LIBRARY, "another CUDA runtime: its libraries' kernels differ between versions"),
    "libraries.cublas": (
        LIBRARY,
        "another cuBLAS: its heuristics pick other GEMM kernels between versions, so matmul results differ",
    ),
    "libraries.cublas_package": (
        LIBRARY,
        "another cuBLAS package: its heuristics pick other GEMM kernels between versions",
    ),
    "libraries.cudnn": (
        LIBRARY,
        "another cuDNN: convolution and attention kernels differ between versions",
    ),
    "libraries.cudnn_package": (
        LIBRARY,
        "another cuDNN package: convolution and attention kernels differ between versions",
    ),
    "libraries.nccl": (COLLECTIVE, "another NCCL"),
    "libraries.nccl_package": (COLLECTIVE, "another NCCL package"),
    "flags.use_deterministic_algorithms": (
        FLAG,
        "deterministic mode differs: ops switch to other (deterministic or atomic) kernels",
    ),
    "flags.fill_uninitialized_memory": (
        FLAG,
        "torch.utils.deterministic.fill_uninitialized_memory differs: a program that reads memory it "
        "never wrote sees other values",
    ),
    "flags.matmul_allow_tf32": (FLAG, "TF32 for float32 matmuls differs: results differ in their low bits"),
    "flags.cudnn_allow_tf32": (FLAG, "TF32 for cuDNN convolutions differs: results differ in their low bits"),
    "flags.float32_matmul_precision": (
        FLAG,
        "torch.set_float32_matmul_precision differs: float32 matmuls use TF32 or bf16 passes or not",
    ),
    "flags.matmul_fp16_reduced_precision_reduction": (
        FLAG,
        "reduced-precision reductions (split-K in half precision) for fp16 GEMMs differ",
    ),
    "flags.matmul_bf16_reduced_precision_reduction": (
        FLAG,
        "reduced-precision reductions (split-K in half precision) for bf16 GEMMs differ",
    ),
    "flags.matmul_fp16_accumulation": (FLAG, "fp16 accumulation in fp16 GEMMs differs"),
    "flags.cudnn_benchmark": (
        FLAG,
        "cudnn.benchmark differs: cuDNN times candidate kernels and may choose another one",
    ),
    "flags.sdpa_flash": (
        FLAG,
        "the flash attention backend is enabled in one run only: attention takes another kernel",
    ),
    "flags.sdpa_mem_efficient": (
        FLAG,
        "the memory-efficient attention backend is enabled in one run only: attention takes another kernel",
    ),
    "flags.sdpa_math": (FLAG, "the math attention backend is enabled in one run only"),
    "flags.sdpa_cudnn": (
        FLAG,
        "the cuDNN attention backend is enabled in one run only: attention takes another kernel",
    ),
    "flags.preferred_blas_library": (FLAG, "another BLAS library for CUDA matmuls (cuBLAS or cuBLASLt)"),
    "flags.mkldnn_enabled": (FLAG, "oneDNN is enabled in one run only: CPU convolutions take other kernels"),
    "flags.intra_op_threads": (
        FLAG,
        "another number of intra-op threads: CPU reductions split their work differently, so float sums "
        "add in another order",
    ),
    "env.CUBLAS_WORKSPACE_CONFIG": (
        ENV,
        "another cuBLAS workspace: cuBLAS may choose other (split-K) kernels with another workspace size",
    ),
    "env.CUBLASLT_WORKSPACE_SIZE": (ENV, "another cuBLASLt workspace: cuBLASLt may choose other kernels"),
    "env.NVIDIA_TF32_OVERRIDE": (
        ENV,
        "NVIDIA_TF32_OVERRIDE forces TF32 on or off for every library in one run only",
    ),
    "env.TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": (ENV, "TF32 for float32 matmuls is forced on in one run only"),
    "env.TORCH_BLAS_PREFER_CUBLASLT": (ENV, "another BLAS library for CUDA matmuls"),
    "env.ATEN_CPU_CAPABILITY": (ENV, "ATen's CPU kernels are limited to another instruction set"),
    "env.ONEDNN_MAX_CPU_ISA": (ENV, "oneDNN is limited to another instruction set"),
    "env.DNNL_MAX_CPU_ISA": (ENV, "oneDNN is limited to another instruction set"),
    "env.MKL_CBWR": (ENV, "MKL's conditional bitwise reproducibility mode differs"),
    "env.TORCHINDUCTOR_DETERMINISTIC": (
        ENV,
        "Inductor's deterministic mode differs: compiled code may be tuned and generated otherwise",
    ),
}
KEY_ENV: Final = tuple(k.removeprefix("env.") for k in KEYS if k.startswith("env."))
"""The environment variables the key holds (when set), besides ``NCCL_ENV``."""
NCCL_ENV: Final = (
    "NCCL_ALGO",
    "NCCL_PROTO",
    "NCCL_NVLS_ENABLE",
    "NCCL_MIN_NCHANNELS",
    "NCCL_MAX_NCHANNELS",
    "NCCL_MIN_CTAS",
    "NCCL_MAX_CTAS",
    "NCCL_BUFFSIZE",
)


class Mismatch(NamedTuple):
    key: str
    recorded: Any
    replay: Any
    kind: str
    meaning: str
    step: int | None
    """The step at whose end the flag differed (None: from the start)."""

    def as_dict(self) -> dict[str, Any]:
        return self._asdict()

    def line(self) -> str:
        when = "" if self.step is None else f" (from step {self.step})"
        return f"{self.key}: recorded {self.recorded!r}, here {self.replay!r}{when}: {self.meaning}"


def describe(key: str) -> tuple[str, str]:
    """(kind, meaning) of a dotted key."""
    if key in KEYS:
        return KEYS[key]
    if key.startswith("env.NCCL_"):
        return COLLECTIVE, "another NCCL setting"
    if key.startswith("flags."):
        return FLAG, _FLAG_MEANING
    if key.startswith("libraries."):
        return LIBRARY, "another version of a library the kernels come from"
    return INFO, "another setting"


def flatten(key: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in key.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, f"{name}."))
        else:
            out[name] = v
    return out


def compare(
    recorded: Mapping[str, Any], here: Mapping[str, Any], step: int | None = None, only: str | None = None
) -> list[Mismatch]:
    """The leaves of two keys that differ (``only``: under that top-level part, e.g. "flags").

    A variable of ``env`` set on one side only differs; a leaf missing on one side of another
    part does not (older agents record fewer keys)."""
    a, b = flatten(recorded), flatten(here)
    out = []
    for name in sorted(set(a) | set(b)):
        if only is not None and not name.startswith(f"{only}."):
            continue
        if (name not in a or name not in b) and not name.startswith("env."):
            continue
        va, vb = a.get(name), b.get(name)
        if va != vb:
            kind, meaning = describe(name)
            out.append(Mismatch(name, va, vb, kind, meaning, step))
    return out


def flags_at(start: Mapping[str, Any], changes: Iterable[Mapping[str, Any]], step: int) -> dict[str, Any]:
    """The recorded flags in effect at the end of ``step``: the start's, updated by every
    ``numerics`` event up to that step."""
    flags = dict(start.get("flags") or {})
    for ev in changes:
        if int(ev["step"]) <= step:
            flags.update(ev.get("flags") or {})
    return flags


def likely_cause(mismatches: Iterable[Mismatch]) -> Mismatch | None:
    """The mismatch most likely to explain a divergence of a one-rank replay (NCCL's cannot)."""
    ranked = [m for m in mismatches if m.kind != COLLECTIVE]
    if not ranked:
        return None
    return min(ranked, key=lambda m: KIND_ORDER.index(m.kind))


def summary_line(key: Mapping[str, Any]) -> str:
    """One line for ``inspect``: the device, its libraries, the flags that matter most."""
    dev, lib, fl = (key.get(p) or {} for p in ("device", "libraries", "flags"))
    if dev.get("kind") == "cuda":
        where = f"{dev.get('name')} ({dev.get('sm_count')} SMs, sm_{str(dev.get('capability')).replace('.', '')}, driver {dev.get('driver')})"
        libs = f"cuda {lib.get('cuda')}, cuBLAS {lib.get('cublas') or lib.get('cublas_package')}, cuDNN {lib.get('cudnn')}"
    else:
        where = f"CPU {dev.get('cpu_model')} ({dev.get('cpu_capability')})"
        libs = f"torch {lib.get('torch')}"
    tf32 = fl.get("matmul_allow_tf32")
    det = fl.get("use_deterministic_algorithms")
    return f"{where}; {libs}; TF32 matmul {tf32}; deterministic algorithms {det}; intra-op threads {fl.get('intra_op_threads')}"
