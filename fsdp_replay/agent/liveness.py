"""What the writer thread says of the rank while it has nothing else to write.

About once a second of idleness (``BackgroundWriter``'s idle tick) the writer asks ``on_idle``
for events: the answer to a new dump request (``state_dump.py``), a flight recorder's dump for a
collective stuck past its timeout (``record_flight.py``), then a ``stuck`` event for the
collective this rank has waited in for ``schema.STUCK_AFTER_NS`` (once per collective), else an
``alive`` mark of how far the rank got. The collective in flight is the C++ kernel's or the
Python path's, whichever recorded it.
"""

from __future__ import annotations

from typing import Any

from fsdp_replay.agent.counters import AgentState
from fsdp_replay.agent.cxx.bridge import KernelBridge
from fsdp_replay.agent.record_collective import CollectiveRecorder
from fsdp_replay.agent.record_flight import FlightDumps
from fsdp_replay.agent.state_dump import StateDump
from fsdp_replay.trace import schema


def waited(inflight: tuple[Any, ...], now: int) -> dict[str, Any]:
    """``inflight`` (seq, step, op, pg, t_ns) as events name it, with how long it has been waited in."""
    return {
        **dict(zip(("seq", "step", "op", "pg", "t_ns"), inflight, strict=True)),
        "waited_ns": now - int(inflight[4]),
    }


class Liveness:
    def __init__(
        self,
        state: AgentState,
        collectives: CollectiveRecorder,
        bridge: KernelBridge,
        state_dump: StateDump,
        flight: FlightDumps | None,
    ) -> None:
        self.state = state
        self.collectives = collectives
        self.bridge = bridge
        self.state_dump = state_dump
        self.flight = flight

    def on_idle(self) -> list[dict[str, Any]]:
        """Writer thread: the events to write now (see the module's docstring). Once recording
        stopped after an internal error, only dump answers: the stacks are still the process's,
        but an ``alive`` mark would claim a record that is not kept."""
        st = self.state
        out = []
        dump = self.state_dump.poll(self.position)
        if dump is not None:
            out.append(dump)
        if st.failed:
            return out
        if self.flight is not None and st.writer is not None:
            self.flight.idle(st.writer, self.inflight())
        stuck = self.stuck()
        if stuck is not None:
            return [*out, stuck]
        return [*out, {"type": schema.EV_ALIVE, "seq": st.pos.seq, "step": st.pos.step, "t_ns": st.t_ns()}]

    def inflight(self) -> tuple[Any, ...] | None:
        """The collective being waited in (seq, step, op, pg, t_ns): the C++ kernel's or ours."""
        return self.bridge.inflight(self.state.pos.step) or self.collectives.inflight

    def position(self) -> dict[str, Any]:
        """Where the rank is, for a ``state`` event: position, recording, the collective in flight."""
        st = self.state
        now = st.t_ns()
        inflight = self.inflight()
        return {
            "t_ns": now,
            "step": st.pos.step,
            "micro": st.pos.micro,
            "seq": st.pos.seq,
            "recording": st.recording and not st.failed,
            "inflight": None if inflight is None else waited(inflight, now),
        }

    def stuck(self) -> dict[str, Any] | None:
        """The collective this rank has waited in for a while, once."""
        colls = self.collectives
        inflight = self.inflight()
        if inflight is None or colls.stuck_reported:
            return None
        held = waited(inflight, self.state.t_ns())
        if held["waited_ns"] < schema.STUCK_AFTER_NS:
            return None
        colls.stuck_reported = True
        return {"type": schema.EV_STUCK, **held}
