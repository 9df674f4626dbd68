"""The replay's own key against the recorded one (``trace/numerics.py``): the device, the
libraries and the environment when the replayed program reaches its first optimizer step (where
the recording took its key), and the flags at the end of every step. Each differing setting is
reported once, with what it means for bit-exactness; it never stops the replay."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fsdp_replay.agent import numerics
from fsdp_replay.trace.numerics import Mismatch, compare, flags_at, likely_cause

log = logging.getLogger("fsdp_replay.replay")


class KeyCheck:
    def __init__(self, meta: Mapping[str, Any], changes: list[dict[str, Any]], notes: list[str]) -> None:
        self.recorded: Mapping[str, Any] | None = meta.get("numerics")
        self.changes = changes
        self.notes = notes
        self.mismatches: list[Mismatch] = []
        self.started = False

    def at_start(self) -> None:
        if self.started:
            return
        self.started = True
        if self.recorded is None:
            self.notes.append(
                "the trace holds no replay key (recorded by an older fsdp-replay): the replay's device, "
                "libraries and numerics flags were not compared with the recording's"
            )
            return
        self._add(compare(self.recorded, numerics.key()))

    def at_step_end(self, step: int) -> None:
        if self.recorded is None or not self.started:
            return
        recorded = flags_at(self.recorded, self.changes, step)
        self._add(compare({"flags": recorded}, {"flags": numerics.flags()}, step))

    def cause(self) -> Mismatch | None:
        return likely_cause(self.mismatches)

    def as_dict(self) -> dict[str, Any]:
        return {
            "compared": self.recorded is not None and self.started,
            "mismatches": [m.as_dict() for m in self.mismatches],
        }

    def _add(self, found: list[Mismatch]) -> None:
        seen = {m.key for m in self.mismatches}
        for m in found:
            if m.key not in seen:
                seen.add(m.key)
                self.mismatches.append(m)
                log.warning("fsdp-replay: replay key differs: %s", m.line())
