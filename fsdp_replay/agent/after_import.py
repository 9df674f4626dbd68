"""A one-shot import hook: run a callback right after a module has executed, without importing it
ourselves (``boot/attach.py`` waits for the program's ``import torch``; ``agent/compiled.py`` for
Inductor's runtime, which most programs never import)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any


class AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``name`` through the other finders and runs ``callback`` once it has executed."""

    def __init__(self, name: str, callback: Callable[[types.ModuleType], None]) -> None:
        self.name = name
        self.callback = callback
        self._loader: Any = None

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        self.callback(module)
