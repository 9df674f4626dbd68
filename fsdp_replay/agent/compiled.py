"""The ``torch.compile`` graphs the program ran: which Inductor graphs, how often in each step, the
kernels Inductor generated for them, and the modules that ran compiled.

Inside an Inductor graph the ops become kernels Inductor generated itself (Triton on CUDA, C++
on CPU): they never reach the dispatcher, so neither the nondeterministic-kernel tape nor the op
fingerprints see them (matmuls, attention and other ops Inductor calls back into aten still do).
The trace says where that happened, so a replay can say what its verdict covers.

Inductor runs each compiled graph through ``CompiledFxGraph.__call__``; the watch wraps that
method when Inductor's runtime module is imported (an import hook: a program that never compiles
never imports it) and counts the calls. A graph is described once, from its generated source: the
AOT id (``0_forward``, ``0_backward``), the generated kernels, the ops it calls back, and the
generated kernels named after an op on the tape (their atomics make them nondeterministic).
"""

from __future__ import annotations

import logging
import re
import sys
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch

from fsdp_replay.agent.after_import import AfterImport

log = logging.getLogger(__name__)
_RUNTIME = "torch._inductor.output_code"
_KEY_ATTR = "_fsdp_replay_graph"
_AOT_ID = re.compile(r"AOT ID: \['([^']+)'\]")
_KERNEL = re.compile(r"^(\w+) = async_compile\.\w+\(", re.M)
_CALLBACK = re.compile(r"(?:extern_kernels|torch\.ops\.aten|aten)\.(\w+)")
MAX_KERNELS = 200


class CompiledWatch:
    def __init__(self, active: Callable[[], bool], taped: Iterable[str]) -> None:
        self.active = active
        # "index_add" for aten::index_add: a generated kernel named after it does its work
        self.taped = sorted({name.split("::")[-1].strip("_") for name in taped}, key=len, reverse=True)
        self.calls: dict[str, int] = {}
        self.new: list[dict[str, Any]] = []
        self.n_graphs = 0
        self.modules_reported = False
        self.error: str | None = None

    def install(self) -> None:
        mod = sys.modules.get(_RUNTIME)
        if mod is not None:
            self._wrap(mod)
        else:
            sys.meta_path.insert(0, AfterImport(_RUNTIME, self._wrap))

    def _wrap(self, mod: types.ModuleType) -> None:
        cls = getattr(mod, "CompiledFxGraph", None)
        call = vars(cls).get("__call__") if isinstance(cls, type) else None
        if cls is None or call is None:
            self.error = f"{_RUNTIME} has no CompiledFxGraph.__call__ in torch {torch.__version__}"
            log.warning("fsdp-replay: compiled graphs are not tracked: %s", self.error)
            return
        if getattr(call, "_fsdp_replay", False):
            return
        watch = self

        def __call__(graph: Any, inputs: Any) -> Any:
            if watch.active():
                watch.ran(graph)
            return call(graph, inputs)

        __call__._fsdp_replay = True  # type: ignore[attr-defined]
        cls.__call__ = __call__

    def ran(self, graph: Any) -> None:
        try:
            key = graph.__dict__.get(_KEY_ATTR)
            if key is None:
                key = self._describe(graph)
            self.calls[key] = self.calls.get(key, 0) + 1
        except Exception as e:  # never let bookkeeping break the program's compiled code
            self.error = f"{type(e).__name__}: {e}"

    def _describe(self, graph: Any) -> str:
        src = str(getattr(graph, "source_code", "") or "")
        m = _AOT_ID.search(src)
        self.n_graphs += 1
        key = f"{m.group(1) if m else 'graph'}#{self.n_graphs}"
        graph.__dict__[_KEY_ATTR] = key
        kernels = _KERNEL.findall(src)
        risky = sorted({f"{k} ({op})" for k in kernels for op in self.taped if f"_{op}_" in f"_{k}_"})
        devices = set(getattr(graph, "device_types", None) or ()) or {
            "cuda" if k.startswith("triton_") else "cpu" for k in kernels if k.startswith(("triton_", "cpp_"))
        }
        self.new.append(
            {
                "graph": key,
                "devices": sorted(str(d) for d in devices),
                "kernels": kernels[:MAX_KERNELS],
                "n_kernels": len(kernels),
                "aten_calls": sorted(set(_CALLBACK.findall(src)) - {"default"})[:MAX_KERNELS],
                "nondeterministic": risky,
            }
        )
        return key

    def take(self, step: int, roots: Iterable[torch.nn.Module]) -> dict[str, Any] | None:
        """The ``compiled`` event of the step that ended (None when no compiled graph ran)."""
        if not self.calls and not self.new:
            return None
        ev: dict[str, Any] = {"step": step, "calls": self.calls, "graphs": self.new}
        if not self.modules_reported:
            self.modules_reported = True
            ev["modules"] = compiled_modules(roots)
        if self.error:
            ev["error"] = self.error
        self.calls, self.new = {}, []
        return ev


def compiled_modules(roots: Iterable[torch.nn.Module]) -> list[str]:
    """Named modules that run compiled: ``torch.compile(m)``'s wrappers and ``m.compile()``."""
    out = []
    for root in roots:
        for name, m in root.named_modules():
            if type(m).__name__ == "OptimizedModule" or getattr(m, "_compiled_call_impl", None) is not None:
                out.append(name or type(m).__name__)
    return sorted(set(out))[:MAX_KERNELS]
