"""Reaching step S without computing steps 0..S-1: skip the model, keep the program's control flow.

A replay from step S restores the snapshot at S; what the steps before it compute is overwritten
then. So the replay runs the program's loop up to S, but from step ``warmup`` on, without its
kernels:

- **The model is skipped.** A call of a root module (one no other module is running inside)
  returns placeholders shaped like what that module returned for the same inputs before (the
  same module, input shapes, dtypes, grad and autocast modes); a first call with new inputs runs
  its forward with every op as a placeholder (below). Outputs that require grad are leaves, so
  ``loss.backward()`` still runs, through the program's own loss code only.
- **Every other op is a placeholder** (:class:`Placeholders`, a dispatch mode): its outputs get
  their shapes from the op's meta kernel; an output of more than ``SMALL`` elements is left
  uninitialized (marked), a smaller one is zeros (so the program's checks on a loss, a norm or a
  flag read a zero: finite, not NaN, no overflow found); in-place and ``out=`` ops change
  nothing. Ops whose inputs are all small real tensors (a step counter, a loss accumulator)
  compute, as do views and collectives (the replay's fake process group answers those, leaving
  the buffers as they are: an all-reduce keeps this rank's own value).
  No kernel runs for a tensor of more than ``SMALL`` elements.
- **Batches** are served from the trace without the dataset (``serve.py``): placeholders here.
- **Values read**: the loss passed to ``backward`` is given its recorded value, so what the
  program logs from it is what the recording logged.

The first ``warmup`` steps (default 2) compute, as a replay from step 0 would, with the
collectives' recorded payloads where the trace has them and zeros otherwise: frameworks finish
their one-time set-up there (lazy initialization, DDP's bucket rebuild after the first backward,
caches a model fills at its first forward), since no snapshot holds it. At the end of step S-1
the mode is removed and the snapshot restored (parameters, optimizer state, schedulers, buffers,
RNG). ``docs/replay.md`` says what a program must not do for this to hold.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from fsdp_replay.errors import FsdpReplayError

SMALL = 4096
"""Elements: at most this many, an op's output is computed (zeros from placeholders); above, it
is a placeholder."""
MARK = "_fsdpr_placeholder"
_PLAIN = (torch.Tensor, torch.nn.Parameter)
# Ops that only change metadata or bookkeeping: run as they are.
_AS_IS = frozenset(
    {
        "aten::resize_",
        "aten::resize_as_",
        "aten::set_",
        "aten::record_stream",
        "aten::detach_",
        "aten::_version",
        "aten::requires_grad_",
        "aten::retains_grad",
        "aten::_has_compatible_shallow_copy_type",
    }
)
_COMMS = ("c10d", "_c10d_functional", "c10d_functional", "_dtensor")


class FastForwardError(FsdpReplayError):
    """The fast-forward met an op it cannot run without computing (the message says which)."""


def is_placeholder(t: torch.Tensor) -> bool:
    return bool(getattr(t, MARK, False))


def placeholder(shape: Any, dtype: torch.dtype, device: Any, stride: Any = None) -> torch.Tensor:
    """A tensor standing for one the program would have computed: zeros when small, else
    uninitialized and marked. Made below the dispatch modes (the fast-forward's own included)."""
    with torch._C._DisableTorchDispatch():
        return _placeholder(shape, dtype, device, stride)


def _placeholder(shape: Any, dtype: torch.dtype, device: Any, stride: Any) -> torch.Tensor:
    if math.prod(shape) <= SMALL:
        t = torch.zeros(shape, dtype=dtype, device=device)
        return t if stride is None or t.stride() == tuple(stride) else t.as_strided(shape, stride)
    t = (
        torch.empty(shape, dtype=dtype, device=device)
        if stride is None
        else torch.empty_strided(shape, stride, dtype=dtype, device=device)
    )
    setattr(t, MARK, True)
    return t


def _tensors(args: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, list | tuple):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


def _key(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T", tuple(x.shape), x.stride(), x.dtype, x.device.type)
    if isinstance(x, list | tuple):
        return tuple(_key(v) for v in x)
    if isinstance(x, torch.dtype | torch.device | torch.layout | torch.memory_format):
        return x
    if x is None or isinstance(x, bool | int | float | str):
        return (type(x), x)
    raise TypeError


def _meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(tuple(x.shape), x.stride(), dtype=x.dtype, device="meta")
    if isinstance(x, list | tuple):
        return type(x)(_meta(v) for v in x)
    return x


class Placeholders(TorchDispatchMode):
    """Every op a placeholder (module docstring); counts what it did."""

    def __init__(self, fail: Callable[[str, BaseException], None]) -> None:
        super().__init__()
        self.fail = fail
        self.cache: dict[Any, Any] = {}
        self._info: dict[Any, _OpInfo] = {}
        self._factories: dict[Any, bool] = {}
        self.placeholder_ops = 0
        self.small_ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if any(t not in _PLAIN for t in types):
            return NotImplemented  # a tensor subclass (DTensor): it redispatches on its local tensors
        info = self._info.get(func)
        if info is None:
            info = self._info[func] = _OpInfo(func)
        if info.as_is:
            return func(*args, **kwargs)
        tensors = _tensors(args, kwargs)
        ph = False
        big = False
        for t in tensors:
            if getattr(t, MARK, False):
                ph = big = True
                break
            if t.numel() > SMALL:
                big = True
        if info.view:
            out = func(*args, **kwargs)
            if ph:
                for o in tree_flatten(out)[0]:
                    if isinstance(o, torch.Tensor):
                        setattr(o, MARK, True)
            return out
        if not big and (tensors or not info.factory or not self._big_factory(func, args, kwargs)):
            self.small_ops += 1
            return func(*args, **kwargs)
        self.placeholder_ops += 1
        if info.mutable:
            return info.written(args, kwargs)
        if not info.returns_tensor:
            return info.default  # a value read from data the fast-forward did not compute
        try:
            return self._outputs(func, args, kwargs, tensors)
        except Exception as e:
            err = FastForwardError(
                f"fast-forward: {func} has no shape function for these inputs ({type(e).__name__}: "
                f"{str(e)[:200]}); replay with --fast-forward-warmup set to the step you replay from, "
                "which computes every step before it"
            )
            self.fail("fast-forward", err)
            raise err from e

    def _big_factory(self, func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
        """Whether an op without tensor inputs (a factory) makes a big tensor."""
        try:
            key: Any = (func, _key(args), _key(tuple(sorted(kwargs.items()))))
        except TypeError:
            key = None
        known = self._factories.get(key) if key is not None else None
        if known is not None:
            return known
        try:
            with torch._C._DisableTorchDispatch():
                out = func(*args, **{**kwargs, "device": "meta"})
            big = any(isinstance(o, torch.Tensor) and o.numel() > SMALL for o in tree_flatten(out)[0])
        except Exception:
            big = False
        if key is not None:
            self._factories[key] = big
        return big

    def _outputs(self, func: Any, args: Any, kwargs: dict[str, Any], tensors: list[torch.Tensor]) -> Any:
        try:
            key: Any = (func, _key(args), _key(tuple(sorted(kwargs.items()))))
        except TypeError:
            key = None
        spec = self.cache.get(key) if key is not None else None
        if spec is None:
            meta_kwargs = {k: _meta(v) for k, v in kwargs.items()}
            if meta_kwargs.get("device") is not None:  # a copy to a device (`.to("cuda")`): shapes on meta
                meta_kwargs["device"] = "meta"
            if meta_kwargs.get("pin_memory"):
                meta_kwargs["pin_memory"] = False
            with torch._C._DisableTorchDispatch():  # shapes only: no mode below sees meta tensors
                out = func(*_meta(args), **meta_kwargs)
            leaves, tree = tree_flatten(out)
            # (shape, stride, dtype) per output tensor; None for a value kept as it is
            made: list[Any] = [
                ((tuple(o.shape), o.stride(), o.dtype), None) if isinstance(o, torch.Tensor) else (None, o)
                for o in leaves
            ]
            spec = (tree, made)
            if key is not None:
                self.cache[key] = spec
        tree, leaves_spec = spec
        device = kwargs.get("device") or (tensors[0].device if tensors else torch.device("cpu"))
        leaves = [v if t is None else placeholder(t[0], t[2], device, t[1]) for t, v in leaves_spec]
        return tree_unflatten(leaves, tree)


class _OpInfo:
    """What the fast-forward needs to know of an op, worked out once."""

    __slots__ = ("_n_returns", "_written", "as_is", "default", "factory", "mutable", "returns_tensor", "view")

    def __init__(self, func: Any) -> None:
        schema = func._schema
        self.as_is = func.namespace in _COMMS or func.name() in _AS_IS
        self.view = bool(func.is_view)
        self.mutable = bool(schema.is_mutable)
        self.factory = any(a.name == "device" for a in schema.arguments)
        self.returns_tensor = any("Tensor" in str(r.type) for r in schema.returns)
        # What a read of a placeholder's value gives: zero, false (a placeholder stands for zeros).
        values = [
            False if str(r.type) == "bool" else 0.0 if str(r.type) == "float" else 0 for r in schema.returns
        ]
        self.default = values[0] if len(values) == 1 else tuple(values)
        self._written = [
            (i, a.name, a.kwarg_only)
            for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        ]
        self._n_returns = len(schema.returns)

    def written(self, args: Any, kwargs: dict[str, Any]) -> Any:
        """An in-place or ``out=`` op changes nothing: it returns the tensors it would have written."""
        out = []
        for i, name, kwarg_only in self._written:
            if i < len(args) and not kwarg_only:
                out.append(args[i])
            elif name in kwargs:
                out.append(kwargs[name])
        if not self._n_returns:
            return None
        if self._n_returns == 1:
            return out[0] if out else None
        return tuple(out)


# ---------------------------------------------------------------------------------------------
# Root modules


def _input_key(args: Any, kwargs: dict[str, Any]) -> Any:
    leaves, tree = tree_flatten((args, kwargs))
    key: list[Any] = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            if type(x) not in _PLAIN:
                raise TypeError
            key.append((tuple(x.shape), x.dtype, x.device, x.requires_grad))
        elif x is None or isinstance(x, bool | int | float | str):
            key.append((type(x), x))
        else:
            raise TypeError
    return (str(tree), tuple(key))


def _modes() -> Any:
    out: list[Any] = [torch.is_grad_enabled()]
    for device in ("cpu", "cuda"):
        with contextlib.suppress(TypeError, RuntimeError, AttributeError):  # an older torch's forms
            out += [torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)]
    return tuple(out)


class RootSkip:
    """Root module calls answered with placeholders (module docstring); installed while it runs."""

    def __init__(
        self,
        fail: Callable[[str, BaseException], None],
        loop_started: Callable[[], None],
        on_new_inputs: Callable[[], None],
    ) -> None:
        self.fail = fail
        self.loop_started = loop_started
        self.on_new_inputs = on_new_inputs
        self.depth = 0
        self.skipping = False
        self.cache: dict[Any, Any] = {}
        self.skipped = 0
        self.computed_calls = 0  # root calls with new input shapes while skipping: they computed
        self.uncacheable = 0
        self._original: Any = None

    def install(self) -> None:
        original = torch.nn.Module.__call__
        self._original = original
        skip = self

        def __call__(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            if skip.depth:
                skip.depth += 1
                try:
                    return original(module, *args, **kwargs)
                finally:
                    skip.depth -= 1
            skip.loop_started()
            return skip.root_call(original, module, args, kwargs)

        torch.nn.Module.__call__ = __call__  # type: ignore[method-assign]

    def uninstall(self) -> None:
        if self._original is not None:
            torch.nn.Module.__call__ = self._original  # type: ignore[method-assign]
            self._original = None

    def root_call(self, original: Any, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        try:
            key: Any = (id(module), module.training, _modes(), _input_key(args, kwargs))
        except TypeError:
            key = None
        spec = self.cache.get(key) if key is not None else None
        if spec is not None and self.skipping:
            self.skipped += 1
            return _build(spec)
        if self.skipping:
            # Inputs of a new shape: this call, and the rest of its step, compute (a step half
            # skipped would leave the framework mid-way: gradients accumulated without the
            # backward that reduces them, parameters gathered without the one that reshards).
            self.computed_calls += 1
            self.on_new_inputs()
        self.depth += 1
        try:
            out = original(module, *args, **kwargs)
        finally:
            self.depth -= 1
        if key is not None and spec is None:
            made = _spec(out)
            if made is None:
                self.uncacheable += 1
            self.cache[key] = made
        return out


def _spec(out: Any) -> Any:
    """The structure of a root module's output (None: not one placeholders can stand for)."""
    leaves, tree = tree_flatten(out)
    spec: list[Any] = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            if type(x) is not torch.Tensor:
                return None
            spec.append((tuple(x.shape), x.dtype, x.device, x.requires_grad))
        elif x is None or isinstance(x, bool | int | float | str):
            spec.append(("v", x))
        else:
            return None
    return tree, spec


def _build(spec: Any) -> Any:
    tree, leaves_spec = spec
    leaves = []
    for s in leaves_spec:
        if s[0] == "v":
            leaves.append(s[1])
            continue
        shape, dtype, device, requires_grad = s
        t = placeholder(shape, dtype, device)
        leaves.append(t.requires_grad_(True) if requires_grad and dtype.is_floating_point else t)
    return tree_unflatten(leaves, tree)


# ---------------------------------------------------------------------------------------------
# The fast-forward as a whole


class FastForward:
    """Runs steps ``warmup``..``target``-1 without kernels; says how it went (``summary``)."""

    def __init__(self, target: int, warmup: int, fail: Callable[[str, BaseException], None]) -> None:
        self.target = target
        self.warmup = min(warmup, target)
        self.fail = fail
        self.mode = Placeholders(fail)
        self.roots = RootSkip(fail, self.loop_started, self.compute_rest_of_step)
        self.paused = False  # computing the rest of a step whose model saw new inputs
        self.steps_computed_late = 0
        self.active = False  # steps warmup..target-1 are running without kernels
        self.done = target <= 0
        self.t0 = time.monotonic()
        self.t_loop: float | None = None  # the program's first batch or model call
        self.t_skip: float | None = None
        self.t_done: float | None = None
        self.seconds = 0.0
        self.steps_skipped = 0
        self.collectives_seen = 0
        self.values_served = 0
        if not self.done:
            self.roots.install()  # root outputs are learnt while the warm-up steps compute

    def at_step_end(self, finished: int) -> None:
        """Step ``finished`` ended (the optimizer step hook)."""
        if self.done:
            return
        if self.paused:
            self.paused = False
            self.steps_computed_late += 1
            if finished + 1 < self.target:
                self._skip()
        elif self.active:
            self.steps_skipped += 1
        if finished + 1 == self.warmup and finished + 1 < self.target:
            self.start_skipping()

    def compute_rest_of_step(self) -> None:
        """The model met inputs of a new shape while skipping: compute until the step ends."""
        if not self.active:
            return
        self._unskip()
        self.paused = True

    def loop_started(self) -> None:
        """The program's first batch or model call: the set-up before it is not fast-forwarded."""
        if self.t_loop is None:
            self.t_loop = time.monotonic()
        if self.warmup == 0:
            self.start_skipping()

    def start_skipping(self) -> None:
        """From here to the target no kernel runs for a big tensor."""
        if self.active or self.done or self.paused:
            return
        self.t_skip = time.monotonic()
        self._skip()

    def _skip(self) -> None:
        self.active = True
        self.roots.skipping = True
        self.mode.__enter__()

    def _unskip(self) -> None:
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        top = _get_current_dispatch_mode()
        if top is not self.mode:  # the program pushed a mode of its own and left it on
            err = FastForwardError(
                f"fast-forward: the program left a dispatch mode on ({type(top).__name__}) over the "
                "replay's: replay with --fast-forward-warmup set to the step you replay from"
            )
            self.fail("fast-forward", err)
            raise err
        self.mode.__exit__(None, None, None)
        self.active = False
        self.roots.skipping = False

    def finish(self) -> None:
        """The target step is reached: compute again (the snapshot is restored next)."""
        if self.done:
            return
        self.done = True
        if self.active:
            self._unskip()
        self.paused = False
        self.roots.skipping = False
        self.roots.uninstall()
        self.t_done = time.monotonic()
        self.seconds = self.t_done - (self.t_loop or self.t0)

    def summary(self) -> dict[str, Any]:
        def span(a: float | None, b: float | None) -> float | None:
            return round(b - a, 3) if a is not None and b is not None else None

        return {
            "to_step": self.target,
            "seconds": round(self.seconds, 3) if self.done else None,
            "setup_seconds": span(self.t0, self.t_loop),
            "computed_seconds": span(self.t_loop, self.t_skip or self.t_done),
            "skipped_seconds": span(self.t_skip, self.t_done),
            "computed_steps": self.warmup,
            "skipped_steps": self.steps_skipped,
            "steps_computed_for_new_inputs": self.steps_computed_late,
            "root_calls_skipped": self.roots.skipped,
            "root_calls_computed": self.roots.computed_calls,
            "ops_as_placeholders": self.mode.placeholder_ops,
            "small_ops_computed": self.mode.small_ops,
            "values_served": self.values_served,
        }
