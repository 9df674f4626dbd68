"""Object collectives in a replay: the recorded bytes unpickled without running code from them.

``broadcast_object_list``, ``all_gather_object`` and their kin pickle Python objects into tensors;
the receiving ranks unpickle them (``torch.distributed.distributed_c10d._unpickler``). In a replay
those bytes come from the trace, which is untrusted input, and an unpickler calls whatever the
bytes name. So in replay mode torch's unpickler is replaced by one that resolves only:

- plain data types (``builtins`` containers and scalars, ``collections``, ``datetime``, ...);
- the functions that rebuild tensors and numpy arrays (a tensor's storage is loaded with
  ``torch.load(weights_only=True)``, not the unrestricted load torch's own pickling names);
- torch's dtypes and layouts, and classes (never functions) of torch, numpy and the program's own
  modules: ``__main__`` and the local modules whose sha256 the replay checked.

Anything else is refused with an error naming it; ``replay --trust-trace`` restores torch's own
unpickler.
"""

from __future__ import annotations

import functools
import io
import pickle
from collections.abc import Iterable
from typing import Any, Final

import torch

# (module, name) of the callables the pickles of plain objects and arrays use; torch's own (its
# tensors' rebuild functions, _get_layout) are those of torch's weights-only allow-list.
_FUNCTIONS: Final = frozenset(
    {
        ("copyreg", "_reconstructor"),
        ("copyreg", "__newobj__"),
        ("copyreg", "__newobj_ex__"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy", "dtype"),
    }
)
_BUILTINS: Final = frozenset(
    {"set", "frozenset", "slice", "range", "complex", "bytearray", "bytes", "list", "dict", "tuple", "object",
     "int", "float", "str", "bool"}
)  # fmt: skip
# Modules whose classes (types only) may be named: data types with no side effects when made.
_DATA_MODULES: Final = ("collections", "datetime", "decimal", "fractions", "enum", "uuid", "pathlib")
_LIBRARY_ROOTS: Final = ("torch", "numpy")


class RefusedObjectError(pickle.UnpicklingError):
    """A replayed object collective named something the replay does not call."""


def _load_storage(data: bytes) -> Any:
    """What torch's ``torch.storage._load_from_bytes`` does, through torch's weights-only load."""
    return torch.load(io.BytesIO(data), weights_only=True)


@functools.cache
def _torch_allowed() -> dict[str, Any]:
    """What torch's ``weights_only`` unpickler resolves (``module.name`` -> object), if it says."""
    try:
        from torch import _weights_only_unpickler

        return dict(_weights_only_unpickler._get_allowed_globals())
    except (ImportError, AttributeError):  # a torch without it: the list above stands alone
        return {}


class SafeUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only what the module docstring lists."""

    program_modules: frozenset[str] = frozenset({"__main__"})

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _load_storage
        if module == "builtins" and name in _BUILTINS:
            return super().find_class(module, name)
        if (module, name) in _FUNCTIONS:
            return super().find_class(module, name)
        allowed = _torch_allowed().get(f"{module}.{name}")
        if allowed is not None:
            return allowed
        root = module.partition(".")[0]
        if root in _LIBRARY_ROOTS or root in _DATA_MODULES or module in self.program_modules:
            found = super().find_class(module, name)
            if isinstance(found, type) and not issubclass(found, BaseException):
                return found
            if root == "torch" and isinstance(found, torch.dtype | torch.layout | torch.memory_format):
                return found
        raise RefusedObjectError(
            f"a replayed object collective names {module}.{name}, which a replay does not call on bytes from "
            "a trace (only data types, tensors, arrays and the program's own classes); replay --trust-trace "
            "for a trace you made yourself"
        )


def install(program_modules: Iterable[str]) -> None:
    """Make object collectives unpickle with ``SafeUnpickler`` (this process is a replay)."""
    import torch.distributed.distributed_c10d as c10d

    class Unpickler(SafeUnpickler):
        pass

    Unpickler.program_modules = frozenset({"__main__", *program_modules})
    c10d._unpickler = Unpickler
