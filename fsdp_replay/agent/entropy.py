"""The operating system's randomness the program drew: ``os.urandom`` (``uuid.uuid4``,
``secrets``, ``random.SystemRandom``), recorded and given back in a replay.

A replay restores the Python, numpy and torch RNG states, but bytes from the OS differ in every
process: DCP's ``save`` broadcasts metadata holding a ``uuid4`` from rank 0, so a replay of it
would send other objects than recorded. The recorder wraps ``os.urandom`` (and ``random``'s
binding of it) and keeps each call's size and bytes, at most ``MAX_CALLS`` calls and
``MAX_BYTES`` bytes (the rest counted); ``take()`` returns what is new for the ``urandom`` event
written at each step's end. The replayer's wrapper returns the recorded bytes in order while the
calls ask for the sizes recorded, and the OS's from the first call that does not (with a note).
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable
from typing import Any

MAX_CALLS = 10_000
MAX_BYTES = 1 << 20

_ORIGINAL = os.urandom


def _ours() -> bool:
    """A call the agent makes (in its hooks, or on its own threads) is not the program's."""
    from fsdp_replay.agent.tape import _AGENT

    return getattr(_AGENT, "on", False) or threading.current_thread().name.startswith("fsdp-replay-")


def _install(wrapper: Callable[[int], bytes]) -> None:
    os.urandom = wrapper
    random._urandom = wrapper  # type: ignore[attr-defined]  # SystemRandom and secrets use this binding


class EntropyRecorder:
    """Keeps what ``os.urandom`` returned while ``active()``."""

    def __init__(self, active: Callable[[], bool]) -> None:
        self.active = active
        self.calls: list[list[Any]] = []
        self.nbytes = 0
        self.overflow = 0
        self._sent = 0
        self._lock = threading.Lock()

    def install(self) -> None:
        def urandom(n: int) -> bytes:
            data = _ORIGINAL(n)
            if self.active() and not _ours():
                with self._lock:
                    if len(self.calls) < MAX_CALLS and self.nbytes + len(data) <= MAX_BYTES:
                        self.calls.append([n, data.hex()])
                        self.nbytes += len(data)
                    else:
                        self.overflow += 1
            return data

        _install(urandom)

    def take(self) -> dict[str, Any] | None:
        with self._lock:
            new = self.calls[self._sent :]
            self._sent = len(self.calls)
        if not new:
            return None
        return {"calls": new, "overflow": self.overflow}


class EntropyReplay:
    """Gives the recorded bytes back, in order, while the program asks for the recorded sizes."""

    def __init__(self, recorded: dict[str, Any], notes: list[str]) -> None:
        self.calls = list(recorded.get("calls") or [])
        self.overflow = int(recorded.get("overflow") or 0)
        self.notes = notes
        self.next = 0
        self.given = 0
        self.off = False
        self._lock = threading.Lock()

    def install(self) -> None:
        _install(self.urandom)

    def urandom(self, n: int) -> bytes:
        if _ours():
            return _ORIGINAL(n)
        with self._lock:
            if not self.off and self.next < len(self.calls):
                size, data = self.calls[self.next]
                if int(size) == n:
                    self.next += 1
                    self.given += 1
                    return bytes.fromhex(data)
                self.off = True
                self.notes.append(
                    f"os.urandom call #{self.next} asked for {n} bytes; the recorded one for {size}: from "
                    "there the OS's bytes are used (the program's draws of OS randomness differ)"
                )
            elif not self.off and self.next == len(self.calls) and self.overflow:
                self.off = True
                self.notes.append(
                    f"the recording kept {len(self.calls)} os.urandom calls and not {self.overflow} more: "
                    "from there the OS's bytes are used"
                )
        return _ORIGINAL(n)
