"""The replayed rank's process groups: torch's fake backend, so that it talks to nobody.

``init_process_group`` and ``new_group`` are redirected to the ``fake`` backend (rank R of N, no
peers, no network); a program asking for another world size or rank is refused. The fake
backend's Work completes with no value; ``completed_work`` gives the program one whose future
holds the op's outputs (the recorded bytes by then), as a real backend's does: DDP's reducer and
``work.get_future().then(...)`` read it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def redirect_to_fake_pg(
    replay_world: int, replay_rank: int, refuse: Callable[[str], None], backends: dict[str, str] | None = None
) -> None:
    """``backends``: the recorded backend of each group, by group name: ``get_backend`` answers
    with it (frameworks choose how to reduce by it: Lightning divides after a gloo SUM)."""
    import torch.distributed.distributed_c10d as c10d
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    original_init = c10d.init_process_group
    original_new_group = c10d.new_group
    original_get_backend = c10d.get_backend
    recorded = dict(backends or {})
    asked: list[str] = []

    def init_process_group(
        backend: Any = None,
        init_method: Any = None,
        timeout: Any = None,
        world_size: int = -1,
        rank: int = -1,
        store: Any = None,
        **kwargs: Any,
    ) -> None:
        ws = world_size if world_size and world_size > 0 else int(os.environ.get("WORLD_SIZE", replay_world))
        rk = rank if rank is not None and rank >= 0 else int(os.environ.get("RANK", replay_rank))
        if ws != replay_world:
            refuse(f"the program asks for world size {ws}; the trace was recorded with {replay_world}")
        if rk != replay_rank:
            refuse(f"the program asks for rank {rk}; this replay plays rank {replay_rank}")
        if backend is not None:
            asked.append(str(backend))
        kwargs.pop("device_id", None)  # no eager communicator: there is nothing to connect to
        kwargs.pop("pg_options", None)
        args: dict[str, Any] = {
            "backend": "fake",
            "store": FakeStore(),
            "world_size": replay_world,
            "rank": replay_rank,
        }
        if timeout is not None:
            args["timeout"] = timeout
        original_init(**args, **kwargs)

    def new_group(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("backend", None)
        kwargs.pop("pg_options", None)
        if len(args) > 2:
            args = (*args[:2], None, *args[3:])
        return original_new_group(*args, **kwargs)

    def get_backend(group: Any = None) -> Any:
        real = original_get_backend(group)
        if str(real) != "fake":
            return real
        pg = group if group is not None else c10d._get_default_group()
        name = getattr(pg, "group_name", None)
        found = (
            recorded.get(str(name)) or next(iter(recorded.values()), None) or (asked[0] if asked else None)
        )
        return dist.Backend(found) if found else real

    for mod in (dist, c10d):
        setattr(mod, "init_process_group", init_process_group)  # noqa: B010
        setattr(mod, "new_group", new_group)  # noqa: B010
        setattr(mod, "get_backend", get_backend)  # noqa: B010


def completed_work(result: Any) -> Any:
    """``result`` (an op's return: ``(outputs, work)`` or ``work``) with its Work replaced by one
    already completed whose future's value is the outputs, as gloo and NCCL set it."""
    from torch._C._distributed_c10d import Work, _create_work_from_future  # type: ignore[attr-defined]

    boxed = result[-1] if isinstance(result, tuple) else result
    work = Work.unbox(boxed) if isinstance(boxed, torch.ScriptObject) else boxed
    if not isinstance(work, Work):
        return result  # a functional collective, or a backend that returned no Work
    if work.get_future().value() is not None:
        return result
    future: torch.futures.Future[Any] = torch.futures.Future()
    future.set_result(result[0] if isinstance(result, tuple) and len(result) > 1 else [])
    done = _create_work_from_future(future)
    replaced = done.boxed() if isinstance(boxed, torch.ScriptObject) else done
    return (*result[:-1], replaced) if isinstance(result, tuple) else replaced
