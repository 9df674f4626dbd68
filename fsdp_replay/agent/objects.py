"""Object collectives: ``broadcast_object_list``, ``all_gather_object`` and their kin.

They pickle Python objects into uint8 tensors and send those through ordinary collectives. The
pickled bytes of a tensor embed its storage's address (``torch.storage._load_from_bytes`` of the
legacy format), so the same objects give other bytes in every process: comparing the collective's
input fingerprints would call every replay of such a program diverged. While one of these
functions runs, ``current()`` holds the objects this rank sends, serialized canonically with
``torch.save`` (its zip format names storages by number, not address: the same objects give the
same bytes in every process). The recorder adds that as an entry of role ``"j"`` to each
collective the function issues, and the replayer compares it instead of the pickled bytes
(``replayer/verify.py``). A rank that only receives sends nothing: its entry has no bytes, and
marks the collective's received bytes as pickles all the same.
"""

from __future__ import annotations

import contextvars
import functools
import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


@dataclass(frozen=True, slots=True)
class ObjectSend:
    """The object collective running now, and the canonical bytes of what this rank sends."""

    function: str
    sent: torch.Tensor  # uint8: torch.save of the objects; empty on a rank that only receives

    @property
    def sends(self) -> bool:
        return self.sent.numel() > 0


_CURRENT: contextvars.ContextVar[ObjectSend | None] = contextvars.ContextVar(
    "fsdp_replay_objects", default=None
)


def current() -> ObjectSend | None:
    return _CURRENT.get()


def canonical_bytes(objects: Any) -> torch.Tensor:
    """``objects`` serialized the same way in every process (uint8, on the CPU)."""
    buf = io.BytesIO()
    try:
        torch.save(objects, buf)
    except Exception as e:  # not serializable by torch.save: compare what can be said about it
        buf = io.BytesIO(f"unserializable {type(objects).__name__}: {type(e).__name__}".encode())
    data = bytearray(buf.getvalue())
    return torch.frombuffer(data, dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


def _global(group: Any, group_rank: Any, global_rank: Any) -> int | None:
    if group_rank is not None:
        return int(dist.get_global_rank(group or c10d._get_default_group(), group_rank))
    return None if global_rank is None else int(global_rank)


def _is_me(group: Any, group_rank: Any, global_rank: Any) -> bool:
    return _global(group, group_rank, global_rank) == dist.get_rank()


# For each function: what this rank sends, from its bound arguments (None: it sends nothing).
def _sent_broadcast(a: dict[str, Any]) -> Any:
    return a["object_list"] if _is_me(a.get("group"), a.get("group_src"), a.get("src")) else None


def _sent_scatter(a: dict[str, Any]) -> Any:
    src = _is_me(a.get("group"), a.get("group_src"), a.get("src"))
    return a.get("scatter_object_input_list") if src else None


SENT: dict[str, Callable[[dict[str, Any]], Any]] = {
    "broadcast_object_list": _sent_broadcast,
    "all_gather_object": lambda a: [a["obj"]],
    "gather_object": lambda a: [a["obj"]],
    "scatter_object_list": _sent_scatter,
    "send_object_list": lambda a: a["object_list"],
    "recv_object_list": lambda a: None,
}


def wrap(name: str, original: Callable[..., Any], active: Callable[[], bool]) -> Callable[..., Any]:
    """``original`` (one of ``SENT``'s functions) run with ``current()`` set, while ``active()``."""
    import inspect

    signature = inspect.signature(original)
    sent_of = SENT[name]

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _CURRENT.get() is not None or not active():
            return original(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            objects = sent_of(dict(bound.arguments))
            send = ObjectSend(
                name, torch.zeros(0, dtype=torch.uint8) if objects is None else canonical_bytes(objects)
            )
        except Exception:  # arguments the function itself will reject: let it say so
            return original(*args, **kwargs)
        token = _CURRENT.set(send)
        try:
            return original(*args, **kwargs)
        finally:
            _CURRENT.reset(token)

    return wrapper


def patch_targets() -> list[tuple[Any, str]]:
    """Where the object collectives are looked up: ``torch.distributed`` and ``distributed_c10d``."""
    return [(mod, name) for name in SENT for mod in (dist, c10d) if hasattr(mod, name)]
