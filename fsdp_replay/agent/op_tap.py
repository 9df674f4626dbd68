"""Op-level fingerprints: every op's inputs and outputs in a window of steps (``--op-fingerprints``).

A ``TorchDispatchMode`` pushed for the window's steps only (a mode on the stack sends every op
through Python: it costs, so it is there only when asked for) sees each op below autograd, in
forward and backward, and calls ``emit(name, module, in_fp, out_fp)``: one fingerprint over the
op's input tensors (those it does not write into: an ``out=`` or in-place argument's old bytes
are not an input, and are often uninitialized) and one over its outputs. The replayer takes the
same fingerprints in the same order and names the first op whose inputs matched the record and
whose outputs did not: a racy kernel, an uninitialized read, a faulty device. Collectives are
left out (their outputs are the replay's recorded payloads, checked by the collective path), and
so are FSDP's buffer ops, views (they compute nothing), the agent's own ops (``agent_work``) and
factories whose bytes are uninitialized; a buffer an op returns is not counted as its input.
Fingerprints are taken on the device and read at once (a sync per op on CUDA: the window costs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules import module as nn_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fsdp_replay.agent import capture
from fsdp_replay.agent.modules import combined_fingerprint
from fsdp_replay.agent.tape import _AGENT
from fsdp_replay.trace.fingerprint import splitmix64

# Collectives, FSDP's buffer management (its all-gather buffers hold bytes the collective fills
# later), the agent's own and the profiler's markers.
SKIP_NAMESPACES = frozenset({"c10d", "_c10d_functional", "_dtensor", "fsdp", "fsdpr", "profiler"})
UNINITIALIZED = frozenset(
    {
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "resize_",
        "set_",
        "_local_scalar_dense",
    }
)


def _is_view(func: Any) -> bool:
    """A view computes nothing: its output aliases its input without writing it."""
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


def _storage(t: torch.Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except Exception:  # a tensor without storage (meta, a wrapper): never a destination
        return -id(t)


def _tensors(x: Any) -> list[torch.Tensor]:
    return [capture.local(t) for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


class OpTap(TorchDispatchMode):
    """The window's dispatch mode. ``at_step(step)`` pushes or pops it as the step enters or
    leaves ``steps``; ``module()`` names the module running (forward), "" in backward."""

    def __init__(
        self,
        steps: Any,
        emit: Callable[[str, str, int, int], None],
        on_error: Callable[[str, BaseException], None],
        names: dict[int, str],
    ) -> None:
        super().__init__()
        self.steps = steps
        self.emit = emit
        self.on_error = on_error
        self.names = names
        self.stack: list[str] = []
        self.pushed = False
        self._hooks: list[Any] = []

    def name_modules(self, root: torch.nn.Module) -> None:
        for name, m in root.named_modules():
            self.names.setdefault(id(m), name or type(root).__name__)

    # -- the window ----------------------------------------------------------------------------
    def at_step(self, step: int) -> None:
        want = step in self.steps
        if want and not self.pushed:
            self._hooks = [
                nn_module.register_module_forward_pre_hook(self._enter_module),
                nn_module.register_module_forward_hook(self._leave_module),
            ]
            self.__enter__()
            self.pushed = True
        elif not want and self.pushed:
            self.__exit__(None, None, None)
            self.pushed = False
            for h in self._hooks:
                h.remove()
            self._hooks, self.stack = [], []

    def _enter_module(self, module: torch.nn.Module, _args: Any) -> None:
        self.stack.append(self.names.get(id(module), type(module).__name__))

    def _leave_module(self, _module: torch.nn.Module, _args: Any, _out: Any) -> None:
        if self.stack:
            self.stack.pop()

    # -- each op -------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        packet = func.overloadpacket.__name__
        if (
            getattr(_AGENT, "on", False)
            or func.namespace in SKIP_NAMESPACES
            or packet in UNINITIALIZED
            or _is_view(func)
        ):
            return func(*args, **kwargs)
        try:
            written = {
                i for i, a in enumerate(func._schema.arguments) if a.alias_info and a.alias_info.is_write
            }
            names = [a.name for a in func._schema.arguments]
            read = [a for i, a in enumerate(args) if i not in written]
            read += [v for k, v in kwargs.items() if k not in names or names.index(k) not in written]
            inputs = [(_storage(t), combined_fingerprint([t])[0]) for t in _tensors(read)]
        except Exception as e:  # the tap never breaks the program's op
            self.on_error("op fingerprint", e)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        try:
            outputs = _tensors(out)
            # A buffer the op returns is its destination, whatever its schema says (custom ops
            # rarely declare their out= buffers): its old bytes, often torch.empty's, are no input.
            dest = {_storage(t) for t in outputs}
            in_fp = 0
            for where, fp in inputs:
                if where not in dest:
                    in_fp = splitmix64(in_fp ^ fp)
            out_fp = combined_fingerprint(outputs)[0]
            self.emit(func.name(), self.stack[-1] if self.stack else "", in_fp, out_fp)
        except Exception as e:
            self.on_error("op fingerprint", e)
        return out


class OpRecorder:
    """Record mode: each op of the window as an ``aop`` event (step, its number in the step)."""

    def __init__(
        self,
        steps: Any,
        step_now: Callable[[], int],
        start: Callable[[], Any],
        fail: Callable[[str, BaseException], None],
    ) -> None:
        self.step_now = step_now
        self.start = start
        self.idx = 0
        self.tap = OpTap(steps, self.emit, fail, {})

    def emit(self, name: str, module: str, in_fp: int, out_fp: int) -> None:
        from fsdp_replay.trace import schema

        self.start().event(
            {
                "type": schema.EV_OP_FP,
                "step": self.step_now(),
                "idx": self.idx,
                "name": name,
                "module": module,
                "in_fp": in_fp,
                "out_fp": out_fp,
            }
        )
        self.idx += 1

    def at_step(self, step: int) -> None:
        """The program is now in ``step`` (0 at attach): numbering restarts; the window opens or closes."""
        self.idx = 0
        self.tap.at_step(step)
