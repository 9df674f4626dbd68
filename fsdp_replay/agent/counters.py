"""What the recorder's parts share: where the program is, what recording costs it, its counters.

``AgentState`` is one object per recording process, handed to each part of the recorder (the
collective hot path, tensor records, process groups, the C++-kernel bridge, batches) instead of
each part calling back into the recorder. ``counters`` is the one counters dict that step and end
events carry (``step.counters``, ``end.counters``): what the sidecar's metrics read.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fsdp_replay.agent.writer import BackgroundWriter
from fsdp_replay.trace import schema


class Position:
    """The next collective's sequence number, the step and the micro-step. When the C++ kernel is
    attached, its shared state (same fields) takes this one's place: both number from one counter."""

    __slots__ = ("micro", "seq", "step")

    def __init__(self, seq: int = 0, step: int = 0, micro: int = 0) -> None:
        self.seq, self.step, self.micro = seq, step, micro


CPU_PARTS = tuple(p for p in schema.AGENT_CPU_PARTS if p != "cxx")
"""Where the hooks' CPU time goes (``AgentState.cpu_parts``, counters ``agent_cpu_<part>_ns``):
the collectives' hot path and the tape's Python path (each its whole hook), and, inside any hook,
keeping payloads' bytes (stored or held) and snapshots. The rest of ``agent_cpu_ns`` is the
module, step and batch hooks' and the C++ parts' (``agent_cpu_cxx_ns``)."""


class AgentState:
    __slots__ = (
        "batches",
        "cpu_ns",
        "cpu_parts",
        "errors",
        "failed",
        "gpu",
        "gpu_counters",
        "payload_now",
        "pos",
        "program_ns",
        "recording",
        "snapshots",
        "t0",
        "writer",
    )

    def __init__(self, payload_now: bool) -> None:
        self.pos: Any = Position()
        self.t0 = time.monotonic_ns()
        self.recording = True  # False after an internal error, and in a forked child
        self.failed = False
        self.errors = 0
        self.cpu_ns = 0  # thread CPU time spent in our hooks, on the program's threads
        self.program_ns = 0  # of which the program's own work they ran (not counted in cpu_ns)
        # Parts of ``cpu_ns`` (ns): CPU_PARTS; "payloads" and "snapshots" are inside the others.
        self.cpu_parts = dict.fromkeys(CPU_PARTS, 0)
        self.payload_now = payload_now  # the current step's payloads are stored
        self.writer: BackgroundWriter | None = None  # started with the rank's first record
        self.batches = 0
        self.snapshots = 0
        # The CUPTI capture (agent/cupti) while it is armed, else None: our hooks tell it where
        # the program is and which GPU work is ours. Its counters stay after it is disarmed.
        self.gpu: Any = None
        self.gpu_counters: dict[str, int] | None = None

    def t_ns(self) -> int:
        """Monotonic ns since the agent started: the ``t_ns`` of events."""
        return time.monotonic_ns() - self.t0

    def program(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run the program's own work (the collective, its wait) inside our hooks, timed apart."""
        t0 = time.thread_time_ns()
        gpu = self.gpu
        ours = gpu.agent(False) if gpu is not None else False  # the program's kernels, not ours
        try:
            return fn(*args)
        finally:
            if gpu is not None:
                gpu.agent(ours)
            self.program_ns += time.thread_time_ns() - t0


def counters(
    state: AgentState, writer: BackgroundWriter, agent_cpu_ns: int, cxx_cpu_ns: int = 0
) -> dict[str, int]:
    """The agent's counters so far: the writer's (events, blobs, drops, write errors), the
    agent's errors, batches and snapshots, and the CPU time recording has cost (ns): in all, by
    part (``CPU_PARTS``), and of it the C++ kernel's and tape hook's (``cxx_cpu_ns``)."""
    out = writer.counters.as_dict()
    out.update(
        agent_errors=state.errors,
        agent_cpu_ns=agent_cpu_ns,
        writer_cpu_ns=writer.cpu_ns(),
        batches=state.batches,
        snapshots=state.snapshots,
        agent_cpu_cxx_ns=cxx_cpu_ns,
    )
    out.update({f"agent_cpu_{part}_ns": ns for part, ns in state.cpu_parts.items()})
    if state.gpu_counters is not None:
        out.update(state.gpu_counters)
    return out
