"""The nondeterministic-kernel tape: the ops whose results a recording keeps and a replay injects.

Most CUDA kernels compute the same bits every time; a few do not when deterministic mode is off
(atomics in ``index_add_``, ``scatter_add_``, the SDPA backward kernels, ``cumsum``, ...). Users
rarely pay for deterministic mode (2.1x step time on the H200 here), so instead of requiring it
the agent intercepts exactly those ops at the CUDA dispatch key: a recording fingerprints (and,
under the payload policy, stores) what each call computed; a replay runs the op, compares, and
where it differs puts the recorded result in its place, saying how many it injected.

The table below is data, per op with where it comes from (GPU-AND-NCCL-NOTES.md section 1: the
docs of ``torch.use_deterministic_algorithms``, the functions that branch on
``deterministicAlgorithms()``, the ``alertNotDeterministic`` call sites, and run-to-run
measurements on the H200 with torch 2.11). Every overload of a listed op that has a kernel for
the dispatch key is taped, forward and backward ops by their own names. Users add their own ops
(a custom CUDA extension registered with ``torch.library``: ``--tape-ops ns::op``), on both the
CPU and CUDA keys, since their kernels are the likeliest to race. Calls made while deterministic
mode is on are not taped: their kernels are the deterministic ones.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TapeOp:
    name: str
    """``namespace::op`` (an overload packet: every overload of it is taped)."""
    source: str
    """Why it is on the tape."""
    keys: tuple[str, ...] = ("CUDA",)
    """The dispatch keys whose kernels are intercepted."""


_ATOMICS = "CUDA kernel with atomic adds; switches to a deterministic one only in deterministic mode"
_ALERT = "calls alertNotDeterministic on CUDA (raises in deterministic mode): no deterministic kernel"
NONDETERMINISTIC_CUDA_OPS: tuple[TapeOp, ...] = (
    TapeOp("aten::index_add", f"{_ATOMICS} (index_add_cuda_impl; measured 20 of 20 runs distinct)"),
    TapeOp("aten::index_add_", f"{_ATOMICS} (index_add_cuda_impl; measured 20 of 20 runs distinct)"),
    TapeOp("aten::scatter_add", f"{_ATOMICS} (structured_scatter_add; measured 20 of 20 runs distinct)"),
    TapeOp("aten::scatter_add_", f"{_ATOMICS} (structured_scatter_add; measured 20 of 20 runs distinct)"),
    TapeOp("aten::scatter_reduce", f"{_ATOMICS} (sum and mean; prod alerts)"),
    TapeOp("aten::scatter_reduce_", f"{_ATOMICS} (sum and mean; prod alerts)"),
    TapeOp("aten::index_reduce", _ALERT + " (index_reduce_cuda)"),
    TapeOp("aten::index_reduce_", _ALERT + " (index_reduce_cuda)"),
    TapeOp(
        "aten::cumsum",
        "launch_cumsum_cuda_kernel branches on deterministic mode (20 of 20 distinct, 16M f32)",
    ),
    TapeOp("aten::cumsum_", "launch_cumsum_cuda_kernel branches on deterministic mode"),
    TapeOp("aten::embedding_dense_backward", "embedding_backward_cuda_kernel branches on deterministic mode"),
    TapeOp(
        "aten::_flash_attention_backward", "flash backward runs with deterministic=false (20 of 20 distinct)"
    ),
    TapeOp(
        "aten::_efficient_attention_backward", "memory-efficient backward splits keys unless deterministic"
    ),
    TapeOp(
        "aten::_scaled_dot_product_cudnn_attention_backward",
        "cuDNN SDPA backward (6 of 20 distinct; the only source in a whole GPT step on the H200)",
    ),
    TapeOp("aten::_cudnn_attention_backward", "cuDNN attention backward only warns under warn_only"),
    TapeOp("aten::nll_loss2d_forward", _ALERT + " (nll_loss2d_forward_out_cuda_template; 3 of 20 distinct)"),
    TapeOp("aten::bincount", _ALERT + " with weights (_bincount_cuda; 20 of 20 distinct)"),
    TapeOp("aten::histc", _ALERT + " (floating point input)"),
    TapeOp("aten::put_", _ALERT),
    TapeOp("aten::grid_sampler_2d_backward", _ALERT),
    TapeOp("aten::grid_sampler_3d_backward", _ALERT),
    TapeOp("aten::upsample_linear1d_backward", _ALERT),
    TapeOp("aten::upsample_bilinear2d_backward", _ALERT),
    TapeOp("aten::upsample_bicubic2d_backward", _ALERT),
    TapeOp("aten::upsample_trilinear3d_backward", _ALERT),
    TapeOp("aten::_upsample_bilinear2d_aa_backward", _ALERT),
    TapeOp("aten::_upsample_bicubic2d_aa_backward", _ALERT),
    TapeOp("aten::_adaptive_avg_pool2d_backward", _ALERT),
    TapeOp("aten::_adaptive_avg_pool3d_backward", _ALERT),
    TapeOp("aten::adaptive_max_pool2d_backward", _ALERT),
    TapeOp("aten::avg_pool3d_backward", _ALERT),
    TapeOp("aten::max_pool3d_with_indices_backward", _ALERT),
    TapeOp("aten::fractional_max_pool2d_backward", _ALERT),
    TapeOp("aten::fractional_max_pool3d_backward", _ALERT),
    TapeOp("aten::reflection_pad1d_backward", _ALERT),
    TapeOp(
        "aten::reflection_pad2d_backward",
        "reflection_pad2d_backward_out_template branches on deterministic mode",
    ),
    TapeOp("aten::reflection_pad3d_backward", _ALERT),
    TapeOp("aten::replication_pad1d_backward", _ALERT),
    TapeOp("aten::replication_pad2d_backward", _ALERT),
    TapeOp("aten::replication_pad3d_backward", _ALERT),
    TapeOp("aten::_ctc_loss_backward", _ALERT),
    TapeOp("aten::_embedding_bag_dense_backward", _ALERT + " (mode='max')"),
    TapeOp("aten::median", _ALERT + " (with indices)"),
)


def user_ops(spec: str) -> tuple[TapeOp, ...]:
    """``ns::op,ns2::other`` (``--tape-ops``): ops of the user's own, taped on CPU and CUDA."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    return tuple(TapeOp(n, "named by the user (--tape-ops)", ("CPU", "CUDA")) for n in names)


def tape_ops(extra: str) -> tuple[TapeOp, ...]:
    return NONDETERMINISTIC_CUDA_OPS + user_ops(extra)


def overloads(op: TapeOp) -> list[Any]:
    """The overloads of ``op`` that this torch has (none when the op does not exist here)."""
    namespace, _, name = op.name.partition("::")
    try:
        packet = getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return []
    found = []
    for ov in packet.overloads():
        try:
            found.append(getattr(packet, ov))
        except (AttributeError, RuntimeError):
            continue
    return found


# Replacing a kernel registered from Python needs allow_override where it exists (torch 2.11:
# off by default; 2.13: on); older torch has no such option and overrides with a warning.
_IMPL_OPTIONS: dict[str, bool] = {"with_keyset": True} | (
    {"allow_override": True}
    if "allow_override" in inspect.signature(torch.library.Library.impl).parameters
    else {}
)


def has_kernel(overload: Any, key: str) -> bool:
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(overload.name(), key))


# The agent's own work (its hooks, fingerprinting a taped op's outputs) runs ops of the tape too
# (fingerprint_many adds rows with index_add_): those calls are the agent's, not the program's.
_AGENT = threading.local()
# The C++ tape hook's count of the agent's work on this thread (``cxx/tape.py``), while stacked
_native_agent: Callable[[int], Any] | None = None


@contextlib.contextmanager
def agent_work() -> Iterator[None]:
    """Taped ops called inside this block are the agent's own: they pass straight through."""
    outer = getattr(_AGENT, "on", False)
    _AGENT.on = True
    native = _native_agent
    if native is not None:
        native(1)
    try:
        yield
    finally:
        _AGENT.on = outer
        if native is not None:
            native(-1)


class TapeHandler(Protocol):
    def active(self) -> bool: ...

    def taped(self, name: str, call: Callable[[], Any]) -> Any:
        """Run ``call()`` (the op's own kernel) and return its result (possibly corrected)."""
        ...


@dataclass(slots=True)
class Installed:
    name: str
    key: str


def capturing() -> bool:
    """A CUDA graph is being captured on this thread's current stream. Taped calls made then are
    not taped, on both sides: their kernels run later, at each launch of the graph, outside the
    dispatcher (what the capture computes is not known yet), so a record or a replay of them would
    read bytes that are not there. They are counted (``OpTape.captured``) and said."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


class OpTape:
    """Wraps the kernels of the taped ops; ``uninstall`` puts the originals back."""

    def __init__(
        self,
        handler: TapeHandler,
        ops: Sequence[TapeOp],
        fail: Callable[[str, BaseException], None],
        native: Any = None,
    ):
        self.handler = handler
        self.native = native  # the C++ hook stacked on our kernels (cxx/tape.py), or None
        self.native_error = ""  # why an op's C++ hook could not be stacked (its calls: Python's)
        self.ops = ops
        self.fail = fail
        self.captured = 0  # taped calls made while a CUDA graph was captured: not taped
        self.installed: list[Installed] = []
        self._libs: list[Any] = []
        self.pending: list[TapeOp] = []  # the user's ops not defined yet when the tape was installed

    def install(self) -> list[Installed]:
        for op in self.ops:
            if not self._install(op) and "CPU" in op.keys:
                self.pending.append(op)
        return self.installed

    def install_missing(self) -> None:
        """Install the user's ops that exist by now: a program defines its ops (or loads its C++
        extension) after importing torch, where the agent attaches. Called at the program's first
        collective and first batch, which come at the same points of a recorded and a replayed run."""
        self.pending = [op for op in self.pending if not self._install(op)]

    def _install(self, op: TapeOp) -> bool:
        namespace = op.name.partition("::")[0]
        lib = None
        found = overloads(op)
        for overload in found:
            for key in op.keys:
                if not has_kernel(overload, key):
                    continue
                if lib is None:
                    lib = torch.library.Library(namespace, "IMPL")
                    self._libs.append(lib)
                original = torch.library.get_kernel(overload, key)
                label = overload.name().removeprefix(f"{namespace}::")
                native = self._native_snapshot(overload.name(), key)
                with warnings.catch_warnings():  # "overriding a previously registered kernel": ours
                    warnings.simplefilter("ignore")
                    lib.impl(label, self._wrapper(overload.name(), original), key, **_IMPL_OPTIONS)
                self.installed.append(Installed(overload.name(), key))
                if native is not None:
                    self._native_install(native)
        return bool(found)

    def _native_snapshot(self, name: str, key: str) -> int | None:
        if self.native is None:
            return None
        try:
            return int(self.native.snapshot(name, key))
        except Exception as e:  # that op's calls go to the Python kernel
            self.native_error = self.native_error or str(e)
            return None

    def _native_install(self, i: int) -> None:
        try:
            self.native.install(i)
        except Exception as e:
            self.native_error = self.native_error or str(e)

    def _wrapper(self, name: str, original: Any) -> Callable[..., Any]:
        handler = self.handler

        def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
            def call() -> Any:
                return original.call_boxed(keyset, *args, **kwargs)

            # Deterministic mode picks deterministic kernels: nothing to keep.
            if (
                getattr(_AGENT, "on", False)
                or not handler.active()
                or torch.are_deterministic_algorithms_enabled()
            ):
                return call()
            if capturing():
                self.captured += 1
                return call()
            with agent_work():
                return handler.taped(name, call)

        return kernel

    def uninstall(self) -> None:
        global _native_agent
        if self.native is not None:  # first: its kernels call ours below them
            self.native.uninstall()
            if _native_agent is self.native.agent:
                _native_agent = None
        for lib in self._libs:
            lib._destroy()
        self._libs = []
        self.installed = []


def start_tape(
    handler: TapeHandler, extra: str, fail: Callable[[str, BaseException], None], native: Any = None
) -> tuple[OpTape | None, str]:
    """Install the tape's kernels (with ``native``, the C++ hook on top of each): the tape, or
    None and why this torch refused them."""
    global _native_agent
    tape = OpTape(handler, tape_ops(extra), fail, native)
    if native is not None:
        _native_agent = native.agent
    try:
        tape.install()
    except Exception as e:
        tape.uninstall()
        return None, f"the nondeterministic-kernel tape could not be installed: {e!r}"
    return tape, ""


def outputs_of(result: Any) -> list[torch.Tensor]:
    """The tensors an op returned (a tensor, or a tuple/list holding tensors and other values)."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, list | tuple):
        return [t for t in result if isinstance(t, torch.Tensor)]
    return []
