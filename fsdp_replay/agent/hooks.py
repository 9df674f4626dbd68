"""Attach the recorder to torch: every hook is reversible and guarded.

- collectives: dispatcher kernels (``collectives.py``);
- step boundaries: the global optimizer step pre/post hooks;
- micro-steps and loss: ``torch.autograd.backward`` (which ``Tensor.backward`` calls);
- batches: ``_BaseDataLoaderIter.__next__`` (single- and multi-process loaders);
- root modules (for names and buffers): global forward pre/post hooks, during step 0 only;
- object collectives (``broadcast_object_list``...): what each rank sends, canonically (``objects.py``).

A guard turns any exception of ours into ``recorder.fail`` and lets the program's call proceed.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.autograd
from torch.nn.modules import module as nn_module
from torch.optim import optimizer as optim_module
from torch.utils.data import dataloader

from fsdp_replay.agent import objects
from fsdp_replay.agent.collectives import CollectiveInterceptor, Handler
from fsdp_replay.agent.cxx.kernel import DRAIN_AT
from fsdp_replay.agent.tape import agent_work


def _state_init_step() -> bool:
    """Whether this optimizer step is torch's own, made to create an optimizer's state (DCP's
    ``get_state_dict``/``set_state_dict`` step a new optimizer once with zero gradients): not a
    training step. The program's steps are its own; one frame walk per step."""
    frame = sys._getframe(1)
    for _ in range(16):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "_init_optim_state" and "checkpoint" in code.co_filename:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _dynamo_compiled() -> bool:
    """Whether ``torch.compile`` has compiled a frame in this process (without importing Dynamo)."""
    utils = sys.modules.get("torch._dynamo.utils")
    try:
        return utils is not None and int(utils.counters["frames"]["ok"]) > 0
    except Exception:  # another torch's counters: assume it did
        return True


class Guarded:
    """Calls ``fn`` only while the recorder is active, and never lets it raise. The thread CPU
    time it takes, less the program's own work it ran (``owner.program_ns``), is added to
    ``owner.cpu_ns``: what the agent costs the program."""

    def __init__(self, owner: Any, where: str, *, outside_compile: bool = False) -> None:
        self.owner = owner
        self.where = where
        self.outside_compile = outside_compile

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        owner, where, outside_compile = self.owner, self.where, self.outside_compile
        is_compiling = torch.compiler.is_compiling
        # The recorder's shared state: while CUPTI captures (agent/cupti), ``state.gpu`` is told
        # that the GPU work our hooks launch is ours, so that it is left out of the kernel rows.
        state = getattr(owner, "state", None)

        @functools.wraps(fn)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            # Dynamo inlines module hooks into the graphs it traces: a hook that ran there would
            # break the program's graph at every module (recording must not change what is
            # compiled). Dynamo folds this test to True, so the hook vanishes from the graph.
            if outside_compile and is_compiling():
                return None
            if not owner.active():
                return None
            t0, p0 = time.thread_time_ns(), owner.program_ns
            gpu = getattr(state, "gpu", None)
            ours = gpu.agent(True) if gpu is not None else False
            try:
                with agent_work():  # the ops our hooks run are ours, not the program's (tape.py)
                    return fn(*args, **kwargs)
            except Exception as e:
                owner.fail(where, e)
                return None
            finally:
                if gpu is not None:
                    gpu.agent(ours)
                owner.cpu_ns += time.thread_time_ns() - t0 - (owner.program_ns - p0)

        return guarded


class Hooks:
    """Installs the hooks for one owner (a Recorder, or the replayer's agent); ``remove`` undoes it."""

    def __init__(self, owner: Any, handler: Handler | None = None) -> None:
        self.owner = owner
        self.handler = handler or owner
        self._undo: list[Callable[[], None]] = []
        self._module_hooks: list[Any] = []
        self.interceptor: CollectiveInterceptor | None = None

    def install(self) -> None:
        owner = self.owner
        self.interceptor = CollectiveInterceptor(self.handler, owner.fail)
        self.interceptor.install()
        self._undo.append(self.interceptor.uninstall)
        attach = getattr(owner, "attach_kernel", None)
        detach = attach() if attach is not None else None
        if detach is not None:
            self._undo.append(detach)

        begin = Guarded(owner, "optimizer step pre-hook")(
            lambda opt, _a, _k: None if _state_init_step() else owner.on_step_begin(opt)
        )
        end = Guarded(owner, "optimizer step post-hook")(
            lambda opt, _a, _k: None if _state_init_step() else owner.on_step_end(opt)
        )
        for handle in (
            optim_module.register_optimizer_step_pre_hook(begin),
            optim_module.register_optimizer_step_post_hook(end),
        ):
            self._undo.append(handle.remove)

        self._patch(torch.autograd, "backward", self._backward)
        for mod, name in objects.patch_targets():
            self._patch(mod, name, functools.partial(objects.wrap, name, active=owner.active))
        if hasattr(owner, "complete_deferred"):
            from torch._C._distributed_c10d import Work

            self._patch(Work, "wait", self._wait)
        self._patch(dataloader._BaseDataLoaderIter, "__next__", self._next)

        depth = [0]

        def pre(module: torch.nn.Module, _args: Any) -> None:
            if depth[0] == 0:
                owner.on_root_forward(module)
            depth[0] += 1

        def post(_module: torch.nn.Module, _args: Any, _out: Any) -> None:
            depth[0] = max(0, depth[0] - 1)

        self._module_hooks = [
            nn_module.register_module_forward_pre_hook(
                Guarded(owner, "forward pre-hook", outside_compile=True)(pre)
            ),
            nn_module.register_module_forward_hook(
                Guarded(owner, "forward hook", outside_compile=True)(post)
            ),
        ]
        owner.on_step_zero_done = self.remove_module_hooks
        self._undo.append(self.remove_module_hooks)

    def remove_module_hooks(self) -> None:
        if _dynamo_compiled():
            # Dynamo guards on the number of global module hooks: removing ours would make it
            # recompile every compiled graph. Kept, they cost a call per eager module forward.
            return
        for h in self._module_hooks:
            h.remove()
        self._module_hooks = []

    def _patch(self, obj: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        original = getattr(obj, name)
        wrapper = make(original)
        functools.update_wrapper(wrapper, original)
        setattr(obj, name, wrapper)
        self._undo.append(lambda: setattr(obj, name, original))

    def _backward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        owner = self.owner
        before = Guarded(owner, "backward")(owner.on_backward)
        after = Guarded(owner, "backward")(owner.after_backward)

        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            before(tensors)
            result = original(tensors, *args, **kwargs)
            after()
            return result

        return backward

    def _wait(self, original: Callable[..., Any]) -> Callable[..., Any]:
        owner = self.owner
        done = Guarded(owner, "Work.wait")(owner.complete_deferred)
        kernel = getattr(owner, "kernel", None)  # the C++ kernel's all-gathers complete here too
        drain = Guarded(owner, "Work.wait")(owner.drain_kernel) if kernel is not None else None

        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(work, *args, **kwargs)
            # completes the kernel's all-gathers; a program without optimizer steps drains here too
            if kernel is not None and owner.recording and kernel.complete() >= DRAIN_AT:
                drain()  # type: ignore[misc]
            if owner.deferred:
                done()
            return result

        return wait

    def _next(self, original: Callable[..., Any]) -> Callable[..., Any]:
        owner = self.owner
        seen = Guarded(owner, "DataLoader batch")(owner.on_batch)
        # the recorder notes the process's RNG before a fetch, to record it after one that drew
        before = (
            Guarded(owner, "DataLoader batch")(owner.before_batch) if hasattr(owner, "before_batch") else None
        )

        def __next__(it: Any) -> Any:
            if before is not None:
                before()
            # The fetch's ops are the data pipeline's (a collate's stack, a transform): not taped,
            # not op-fingerprinted, since a replay serves the batch without running them.
            with agent_work():
                batch = original(it)
            replacement = seen(it, batch)  # the replayer feeds recorded batches this way
            return batch if replacement is None else replacement

        return __next__

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()
