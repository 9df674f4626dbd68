"""Intercept every c10d collective at the dispatcher.

FSDP1, FSDP2, DDP and plain ``torch.distributed`` calls all end in ``torch.ops.c10d.<op>``; the
Python functions above them change between releases (``all_gather_into_tensor`` is a deprecated
wrapper in 2.13, FSDP2 calls ``all_gather_single``), the dispatcher ops do not. Functional
collectives (``torch.ops._c10d_functional.*``: DTensor redistribution, ``clip_grad_norm_`` on
FSDP2 parameters, torch.compile'd code) call the backend without passing through those ops, so
they are intercepted too, under their own names (``_c10d_functional.all_reduce``...).

We register a Python kernel for each op under the ``Autograd`` dispatch key: it runs before the backend kernel
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

from fsdp_replay.agent.tape import agent_work
from fsdp_replay.trace import schema
from fsdp_replay.trace.ops import FUNCTIONAL_NAMESPACE, FUNCTIONAL_OPS

log = logging.getLogger(__name__)

# The c10d ops' names for their tensor arguments (alltoall_base_'s are "input" and "output").
_IN_ARGS = frozenset({"input_tensor", "input_tensors", "inputs", "input_list", "input"})
_OUT_ARGS = frozenset({"output_tensor", "output_tensors", "outputs", "output_lists", "output"})
# Ops whose "tensors" argument is only sent (inputs) or only received (outputs).
_SEND_ONLY = schema.SEND_OPS
_RECV_ONLY = schema.RECV_OPS
P2P_OPS = schema.P2P_OPS
# Async collectives whose outputs the recorder takes when the program waits for them, not when
# they are issued (FSDP2's prefetched all-gathers; the program only reads their outputs).
DEFERRABLE_OPS = frozenset({"_allgather_base_", "allgather_into_tensor_coalesced_"})
_EXTRA_ARGS = ("root_rank", "root_tensor", "dst", "src", "tag", "output_split_sizes", "input_split_sizes")


# Functional collectives (trace/ops.py): the result is the output; its data is valid after wait_tensor.
_FUNCTIONAL_IN_ARGS = frozenset({"input", "inputs"})


_COMPOSITE = torch._C.DispatchKey.CompositeExplicitAutograd
# The backend kernels of the c10d ops, reached straight from our Autograd kernel (see _backend_call).
_BACKEND_KEYS = {
    "cpu": torch._C.DispatchKeySet(torch._C.DispatchKey.CPU),
    "cuda": torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA),
}
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None)
_REDUCE_OP_NAMES: dict[int, str] = {}


def reduce_op_name(code: int) -> str:
    """``SUM``, ``AVG``, ...: the name of a ``ReduceOp.RedOpType`` value."""
    name = _REDUCE_OP_NAMES.get(code)
    if name is None:
        name = _REDUCE_OP_NAMES[code] = dist.ReduceOp.RedOpType(code).name
    return name


def _overload(namespace: Any, name: str) -> Any:
    packet = getattr(namespace, name, None)
    if packet is None:
        return None  # not in this torch version
    return getattr(packet, "default", None)


def _backend_call(overload: Any) -> Callable[..., Any]:
    """Calls a c10d op's real kernel from our kernel (below autograd).

    Calling the op again goes through Python's OpOverload wrapper and the whole dispatcher, which
    costs ~30 us a collective on a small VM. For the common case (positional arguments, plain
    strided CPU or CUDA tensors, no TorchDispatchMode active) we redispatch straight to the
    backend key that the dispatcher would pick next: the c10d ops have only backend kernels
    (CPU, CUDA, PrivateUse1, Sparse*, Meta) below Autograd. Anything else takes the full path.
    """
    first = next(
        (i for i, a in enumerate(overload._schema.arguments) if str(a.type).startswith("Tensor")), None
    )
    redispatch = overload._handle.redispatch_boxed

    def call(*args: Any, **kwargs: Any) -> Any:
        if (
            not kwargs
            and first is not None
            and first < len(args)
            and (_dispatch_modes is None or not _dispatch_modes())
        ):
            t = args[first]
            while type(t) is list and t:
                t = t[0]
            if type(t) in _PLAIN_TENSORS and t.layout == torch.strided:
                keys = _BACKEND_KEYS.get(t.device.type)
                if keys is not None:
                    return redispatch(keys, *args)
        return overload(*args, **kwargs)

    return call


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
    functional: bool = False
    """A functional collective: outputs are the op's result, known after it returns."""
    extra_names: tuple[str, ...] = _EXTRA_ARGS
    """The arguments of ``_EXTRA_ARGS`` the op has (the kernel knows them from the schema)."""

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        if self.functional:
            from torch.distributed.distributed_c10d import _resolve_process_group

            name = self.bound.get("group_name")
            return name if isinstance(name, dist.ProcessGroup) else _resolve_process_group(name)  # type: ignore[arg-type]
        pg = self.bound.get("process_group")
        return None if pg is None else dist.ProcessGroup.unbox(pg)

    @property
    def reduce_op(self) -> str | None:
        op = self.bound.get("reduce_op")
        if op is None:
            return None
        if isinstance(op, str):
            return op.upper()
        return reduce_op_name(op.op())

    def set_outputs(self, result: Any) -> None:
        """For functional collectives: the outputs are what the op returned."""
        if self.functional:
            self.outputs = _flatten(result)

    @property
    def extra(self) -> dict[str, Any]:
        b = self.bound
        return {k: b[k] for k in self.extra_names if b.get(k) is not None}

    @property
    def root(self) -> Any:
        b = self.bound
        return b.get("root_rank", b.get("dst", b.get("src")))


class Handler(Protocol):
    """What the interceptor calls; the recorder and the replayer implement it."""

    def active(self) -> bool: ...

    def run(self, call: CollectiveCall, real: Callable[[], Any]) -> Any: ...


def work_of(result: Any) -> Work | None:
    """The Work an op returned, or None: a synchronous NCCL op (torch >= 2.10) may return none."""
    work = result[-1] if isinstance(result, tuple) else result
    if isinstance(work, torch.ScriptObject):
        work = Work.unbox(work)
    return work if isinstance(work, Work) else None


def wait_result(result: Any, call: CollectiveCall | None = None) -> None:
    """Wait for an op's result (on CUDA this only orders the current stream after the op)."""
    if call is not None and call.functional:
        for t in call.outputs:
            torch.ops._c10d_functional.wait_tensor(t)
        return
    work = work_of(result)
    if work is not None:
        work.wait()


def tensor_roles(name: str, argnames: Sequence[str], functional: bool) -> list[tuple[str, str]]:
    """The arguments of an op's schema that the kernel reads tensors from, and what they are:
    "i" sent, "o" received, "io" both (in place). A functional op's outputs are its result (its
    ``out`` argument, where it has one, is that result), so only its inputs are named here."""
    in_args = _FUNCTIONAL_IN_ARGS if functional else _IN_ARGS
    roles = []
    for a in argnames:
        if a in in_args:
            roles.append((a, "i"))
        elif a in _OUT_ARGS:
            roles.append((a, "o"))
        elif a == "tensors":
            roles.append((a, "i" if name in _SEND_ONLY else "o" if name in _RECV_ONLY else "io"))
    return roles


class CollectiveInterceptor:
    """Registers the dispatcher kernels; ``uninstall`` removes them again."""

    def __init__(self, handler: Handler, on_error: Callable[[str, BaseException], None]) -> None:
        self.handler = handler
        self.on_error = on_error
        self.ops: list[str] = []
        self._libs: list[Any] = []

    def install(
        self, op_names: Sequence[str] = schema.C10D_OPS, functional_ops: Sequence[str] = FUNCTIONAL_OPS
    ) -> None:
        # c10d ops: our kernel under Autograd, the real one reached by re-dispatching below it.
        lib = torch.library.Library("c10d", "IMPL")
        self._libs = [lib]
        for name in op_names:
            overload = _overload(torch.ops.c10d, name)
            if overload is not None:
                lib.impl(name, self._kernel(name, overload, False), "Autograd")
                self.ops.append(name)
        # Functional ops run below autograd (inside DTensor's dispatch), so they are taken at the
        # backend keys; their real kernel is the one registered for CompositeExplicitAutograd.
        lib = torch.library.Library(FUNCTIONAL_NAMESPACE, "IMPL")
        self._libs.append(lib)
        for name in functional_ops:
            overload = _overload(getattr(torch.ops, FUNCTIONAL_NAMESPACE), name)
            if overload is None or not overload.has_kernel_for_dispatch_key(_COMPOSITE):
                continue
            label = f"{FUNCTIONAL_NAMESPACE}.{name}"
            kernel = self._kernel(label, overload, True)
            for key in ("CPU", "CUDA"):
                lib.impl(name, kernel, key)
            self.ops.append(label)

    def uninstall(self) -> None:
        for lib in self._libs:
            lib._destroy()
        self._libs = []

    def _kernel(self, name: str, overload: Any, functional: bool) -> Callable[..., Any]:
        argnames = [a.name for a in overload._schema.arguments]
        handler = self.handler
        on_error = self.on_error
        roles = tensor_roles(name, argnames, functional)
        extra_names = tuple(k for k in _EXTRA_ARGS if k in argnames)

        if functional:

            def call_real(*args: Any, **kwargs: Any) -> Any:
                return overload._op_dk(_COMPOSITE, *args, **kwargs)
        else:
            call_real = _backend_call(overload)

        def real(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[], Any]:
            return lambda: call_real(*args, **kwargs)

        def kernel(*args: Any, **kwargs: Any) -> Any:
            with torch._C._AutoDispatchBelowAutograd():
                if not handler.active():
                    return call_real(*args, **kwargs)
                try:
                    bound = dict(zip(argnames, args, strict=False))
                    if kwargs:
                        bound.update(kwargs)
                    inputs: list[torch.Tensor] = []
                    outputs: list[torch.Tensor] = []
                    for key, role in roles:
                        value = bound.get(key)
                        ts: list[torch.Tensor] = [value] if type(value) in _PLAIN_TENSORS else _flatten(value)  # type: ignore[list-item]
                        if role != "o":
                            inputs += ts
                        if role != "i":
                            outputs += ts
                    call = CollectiveCall(name, args, kwargs, bound, inputs, outputs, functional, extra_names)
                except Exception as e:  # never let our bookkeeping break the program's collective
                    on_error(f"collective {name}", e)
                    return call_real(*args, **kwargs)
                with agent_work():  # what the handler computes is the agent's (tape, op fingerprints)
                    return handler.run(call, real(args, kwargs))

        kernel.__name__ = f"fsdp_replay_{name}"
        return kernel
