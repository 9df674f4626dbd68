"""Process groups as events name them: a small id per group, its ``pg`` event written once."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fsdp_replay.agent.counters import AgentState
from fsdp_replay.trace import schema


class ProcessGroups:
    def __init__(self, state: AgentState) -> None:
        self.state = state
        self.by_name: dict[str, int] = {}
        self._ids: dict[int, tuple[Any, int]] = {}  # id(pg) -> (pg, pg id); holds pg alive
        self._by_address: dict[int, int] = {}  # the C++ kernel's process group pointers

    def id_of(self, pg: dist.ProcessGroup | None) -> int:
        """The group's id (0, 1, ... in order of first use; -1 for none), writing its event once."""
        if pg is None:
            return -1
        got = self._ids.get(id(pg))
        if got is not None and got[0] is pg:
            return got[1]
        pid = self._new(pg)
        self._ids[id(pg)] = (pg, pid)  # holds pg: its id is never reused while cached
        return pid

    def id_of_address(self, address: int) -> int:
        """The id of the group the C++ kernel names by its address."""
        pid = self._by_address.get(address)
        if pid is None:
            group = dist.ProcessGroup.unbox(torch.ops.fsdpr.pg_of(address))
            pid = self._by_address[address] = self.id_of(group)
        return pid

    def known_address(self, address: int) -> int:
        """The id of a group the C++ kernel named before, or -1 (no torch call: any thread)."""
        return self._by_address.get(address, -1)

    def _new(self, pg: dist.ProcessGroup) -> int:
        name = pg.group_name
        if name in self.by_name:
            return self.by_name[name]
        pid = len(self.by_name)
        self.by_name[name] = pid
        try:
            ranks = dist.get_process_group_ranks(pg)
        except Exception:  # a group created outside the world's registry
            ranks = []
        try:
            backend = str(dist.get_backend(pg))
        except Exception:
            backend = pg.name()
        assert self.state.writer is not None
        self.state.writer.event(
            {
                "type": schema.EV_PROCESS_GROUP,
                "pg": pid,
                "name": name,
                "ranks": ranks,
                "backend": backend,
                "size": pg.size(),
                "group_rank": pg.rank(),
            }
        )
        return pid
