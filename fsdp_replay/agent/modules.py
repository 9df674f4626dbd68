"""Module-level fingerprints: each module's output in forward and its gradient in backward.

Taken for a window of steps (``--module-fingerprints steps:SPEC``) by a global forward hook, and
by a hook on each output tensor for its gradient; both only read. The replayer takes the same
fingerprints in the same order and names the first module whose output differs: the place below
the collective where a divergence started.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules import module as nn_module
from torch.utils._pytree import tree_flatten

from fsdp_replay.agent.fingerprint import Pending, fingerprint
from fsdp_replay.trace.fingerprint import splitmix64

FORWARD, BACKWARD = "fwd", "bwd"


def _value(x: Any) -> Any:
    return x.value() if isinstance(x, Pending) else x


def combined_fingerprint(tensors: list[torch.Tensor]) -> tuple[int, bool, str]:
    """One fingerprint for a module's tensors (in order); values are resolved (syncs on CUDA)."""
    h, nonfinite, algo = 0, False, ""
    for t in tensors:
        fp, nf, algo = fingerprint(t.detach())
        h = splitmix64(h ^ int(_value(fp)))
        nonfinite = nonfinite or bool(_value(nf))
    return h, nonfinite, algo


class ModuleTap:
    """Calls ``emit(name, kind, fp, nonfinite, algo)`` for module outputs and their gradients."""

    def __init__(
        self,
        emit: Callable[[str, str, int, bool, str], None],
        enabled: Callable[[], bool],
        on_error: Callable[[str, BaseException], None],
    ) -> None:
        self.emit = emit
        self.enabled = enabled
        self.on_error = on_error
        self.names: dict[int, str] = {}
        self._handle: Any = None

    def name_modules(self, root: torch.nn.Module) -> None:
        for name, m in root.named_modules():
            self.names.setdefault(id(m), name or type(root).__name__)

    def install(self) -> None:
        self._handle = nn_module.register_module_forward_hook(self._forward)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _forward(self, module: torch.nn.Module, _args: Any, output: Any) -> None:
        if torch.compiler.is_compiling() or not self.enabled():  # not inside compiled graphs (hooks.py)
            return
        try:
            leaves = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
            if not leaves:
                return
            name = self.names.get(id(module), type(module).__name__)
            fp, nf, algo = combined_fingerprint(leaves)
            self.emit(name, FORWARD, fp, nf, algo)
            first = leaves[0]
            if first.requires_grad and torch.is_grad_enabled():
                first.register_hook(self._grad_hook(name))
        except Exception as e:  # a tap never breaks the forward pass
            self.on_error("module fingerprint", e)

    def _grad_hook(self, name: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if not self.enabled():
                return
            try:
                fp, nf, algo = combined_fingerprint([grad])
                self.emit(name, BACKWARD, fp, nf, algo)
            except Exception as e:
                self.on_error("module gradient fingerprint", e)

        return hook
