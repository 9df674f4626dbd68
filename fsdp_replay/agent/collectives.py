"""Intercept every c10d collective at the dispatcher.

FSDP1, FSDP2, DDP and plain ``torch.distributed`` calls all end in ``torch.ops.c10d.<op>``; the
Python functions above them change between releases (``all_gather_into_tensor`` is a deprecated
wrapper in 2.13, FSDP2 calls ``all_gather_single``), the dispatcher ops do not. We register a
Python kernel for each op under the ``Autograd`` dispatch key: it runs before the backend kernel
(CPU/CUDA), hands the call to a handler, and re-dispatches below autograd to the real kernel, so
the collective itself is exactly the one the program issued.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Work

from fsdp_replay.trace import schema

log = logging.getLogger(__name__)

_IN_ARGS = frozenset({"input_tensor", "input_tensors", "inputs", "input_list"})
_OUT_ARGS = frozenset({"output_tensor", "output_tensors", "outputs", "output_lists"})
# Ops whose "tensors" argument is only sent (inputs) or only received (outputs).
_SEND_ONLY = frozenset({"send"})
_RECV_ONLY = frozenset({"recv_", "recv_any_source_"})
P2P_OPS = _SEND_ONLY | _RECV_ONLY
_EXTRA_ARGS = ("root_rank", "root_tensor", "dst", "src", "tag", "output_split_sizes", "input_split_sizes")


def _flatten(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, list | tuple):
        return [t for item in x for t in _flatten(item)]
    return []


@dataclass(slots=True)
class CollectiveCall:
    """One intercepted call, as the handler sees it."""

    op: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    bound: dict[str, Any]
    inputs: list[torch.Tensor] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        pg = self.bound.get("process_group")
        return None if pg is None else dist.ProcessGroup.unbox(pg)

    @property
    def reduce_op(self) -> str | None:
        op = self.bound.get("reduce_op")
        if op is None:
            return None
        return dist.ReduceOp.RedOpType(op.op()).name

    @property
    def extra(self) -> dict[str, Any]:
        return {k: self.bound[k] for k in _EXTRA_ARGS if k in self.bound and self.bound[k] is not None}


class Handler(Protocol):
    """What the interceptor calls; the recorder and the replayer implement it."""

    def active(self) -> bool: ...

    def run(self, call: CollectiveCall, real: Callable[[], Any]) -> Any: ...


def wait_result(result: Any) -> None:
    """Wait for the Work an op returned (on CUDA this only orders the current stream)."""
    work = result[-1] if isinstance(result, tuple) else result
    if isinstance(work, torch.ScriptObject):
        Work.unbox(work).wait()
    elif isinstance(work, Work):
        work.wait()


def work_future(result: Any) -> torch.futures.Future[Any]:
    work = result[-1] if isinstance(result, tuple) else result
    return (Work.unbox(work) if isinstance(work, torch.ScriptObject) else work).get_future()


class CollectiveInterceptor:
    """Registers the dispatcher kernels; ``uninstall`` removes them again."""

    def __init__(self, handler: Handler, on_error: Callable[[str, BaseException], None]) -> None:
        self.handler = handler
        self.on_error = on_error
        self.ops: list[str] = []
        self._lib: Any = None

    def install(self, op_names: Sequence[str] = schema.C10D_OPS) -> None:
        self._lib = torch.library.Library("c10d", "IMPL")
        for name in op_names:
            packet = getattr(torch.ops.c10d, name, None)
            if packet is None:
                continue
            try:
                overload = packet.default
            except AttributeError:
                continue
            argnames = [a.name for a in overload._schema.arguments]
            self._lib.impl(name, self._kernel(name, overload, argnames), "Autograd")
            self.ops.append(name)

    def uninstall(self) -> None:
        if self._lib is not None:
            self._lib._destroy()
            self._lib = None

    def _kernel(self, name: str, overload: Any, argnames: list[str]) -> Callable[..., Any]:
        handler = self.handler
        on_error = self.on_error
        send_only = name in _SEND_ONLY
        recv_only = name in _RECV_ONLY

        def real(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], Any]:
            return lambda: overload(*args, **kwargs)

        def kernel(*args: Any, **kwargs: Any) -> Any:
            with torch._C._AutoDispatchBelowAutograd():
                if not handler.active():
                    return overload(*args, **kwargs)
                try:
                    bound = dict(zip(argnames, args, strict=False))
                    bound.update(kwargs)
                    call = CollectiveCall(name, args, kwargs, bound)
                    for key, value in bound.items():
                        if key in _IN_ARGS:
                            call.inputs.extend(_flatten(value))
                        elif key in _OUT_ARGS:
                            call.outputs.extend(_flatten(value))
                        elif key == "tensors":
                            ts = _flatten(value)
                            if not recv_only:
                                call.inputs.extend(ts)
                            if not send_only:
                                call.outputs.extend(ts)
                except Exception as e:  # never let our bookkeeping break the program's collective
                    on_error(f"collective {name}", e)
                    return overload(*args, **kwargs)
                return handler.run(call, real(args, kwargs))

        kernel.__name__ = f"fsdp_replay_{name}"
        return kernel
