"""Start the agent from ``sitecustomize``: cheap when off, attached once the program imports torch.

Importing torch ourselves at interpreter start would cost every Python process started with the
agent's environment (torchrun's launcher, helper scripts) a second or more, so instead a one-shot
import hook waits for the program's own ``import torch`` and attaches right after it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)
_state: dict[str, Any] = {}  # the one attached agent of this process (tests reach it here)


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
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


def activate() -> None:
    """Called by sitecustomize when FSDP_REPLAY_MODE is set. Never raises."""
    try:
        from fsdp_replay.agent.config import AgentConfig

        config = AgentConfig.from_env()
    except Exception as e:  # a bad option must not stop the program from starting
        log.warning("fsdp-replay: agent disabled: %s", e)
        return
    if not config.enabled:
        return
    if "multiprocessing-fork" in " ".join(sys.argv):
        return  # a multiprocessing child (spawn/forkserver): its parent is the rank

    def on_torch(_module: types.ModuleType) -> None:
        attach(config)

    if "torch" in sys.modules:
        attach(config)
    else:
        sys.meta_path.insert(0, _AfterImport("torch", on_torch))


def attach(config: Any) -> Any:
    """Install the agent for ``config.mode``; returns it (or None after a logged failure)."""
    if "agent" in _state:
        return _state["agent"]
    try:
        if config.mode == "record":
            import atexit

            from fsdp_replay.agent.hooks import Hooks
            from fsdp_replay.agent.recorder import Recorder

            agent: Any = Recorder(config)
            hooks = Hooks(agent)
            hooks.install()
            agent.install_sigterm()
            atexit.register(agent.finish)
            _state.update(agent=agent, hooks=hooks)
            return agent
        if config.mode == "replay":
            import os

            if config.live and "RANK" not in os.environ:
                return None  # torchrun's launcher in an all-rank replay: only its workers replay
            from fsdp_replay.replayer.agent import attach_replay

            agent = attach_replay(config)
            _state.update(agent=agent)
            return agent
    except Exception as e:
        log.warning("fsdp-replay: agent failed to attach, the program runs unrecorded: %r", e)
    return None


def current() -> Any:
    return _state.get("agent")
