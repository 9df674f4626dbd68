"""When the flight recorder dumps (``flight.py``): the failures the recorder sees, and the dump's writing.

A dump is taken (``FlightRecorder.take``) where the failure is seen and written by the writer
thread, through one ``BackgroundWriter.call``: the window's snapshot, every held payload under the
id its events already name, then the ``flight_dump`` event. The failures:

- ``nonfinite``: a non-finite loss (of any micro-step's backward) or parameter at a step's end,
  once per run. On the CPU the values are on the host at the step end and the dump is taken
  there; on a GPU they are read by the writer thread when the device has run the step (the
  training thread never waits for it), which can be two steps later: the ring keeps two more
  steps there (``FlightRecorder.lag``) so the window still reaches N steps before the failure;
- ``exception`` (``oom`` for ``torch.OutOfMemoryError``): the program dies of an uncaught
  exception (``Recorder.finish`` at exit);
- ``sigterm``: the process is stopped by SIGTERM (torchrun's way of stopping the other ranks);
- ``stuck``: the rank has waited in one collective for ``STUCK_DUMP_AFTER_NS`` (the ``stuck``
  event is written after ``schema.STUCK_AFTER_NS``, 2 s, which a healthy run also reaches: a
  barrier while one rank writes a checkpoint).
"""

from __future__ import annotations

import math
from typing import Any, Final

import torch

from fsdp_replay.agent.counters import AgentState
from fsdp_replay.agent.fingerprint import Pending
from fsdp_replay.agent.flight import Dump, FlightRecorder
from fsdp_replay.agent.snapshots import snapshot_items
from fsdp_replay.agent.writer import BackgroundWriter
from fsdp_replay.trace import schema
from fsdp_replay.trace.redact import scrub_text

STUCK_DUMP_AFTER_NS: Final = 60_000_000_000
# A device's values reach the host this many steps after the training thread ended the step
# at most, with --sync-steps (it waits for the previous step's records at each step end).
DEVICE_LAG_STEPS: Final = 2


def _value(x: Any) -> Any:
    return x.value() if isinstance(x, Pending) else x


def nonfinite(loss: Any, flags: list[Any]) -> str | None:
    """What was not finite at a step end (host values), or None."""
    if any(not math.isfinite(x) for x in loss):
        return "a non-finite loss"
    if any(flags):
        return "non-finite parameters"
    return None


class FlightDumps:
    """The recorder's side of the flight recorder: it watches for failures and dumps."""

    def __init__(self, ring: FlightRecorder, state: AgentState, redact_key: str = "") -> None:
        self.ring = ring
        self.state = state
        self.redact_key = redact_key  # an exception's message is redacted with it
        self.stuck_seq = -1  # the collective a stuck dump was taken for

    def step_end(self, w: BackgroundWriter, step: int, loss: Any, params: list[Any]) -> None:
        """After the step event of ``step`` (training thread): drops, then the non-finite check."""
        count, nbytes, ring_full = self.ring.take_drops()
        if count:
            reason = "the flight recorder's memory bound (--window-bytes) or no host memory left"
            if ring_full:
                reason = (
                    f"{ring_full} of them: no room in the GPU's payload ring (--payload-ring-bytes), "
                    f"the rest: {reason}"
                    if ring_full < count
                    else "no room in the GPU's payload ring (--payload-ring-bytes)"
                )
            w.event(
                {
                    "type": schema.EV_DROP,
                    "what": "payloads",
                    "count": count,
                    "nbytes": nbytes,
                    "reason": reason,
                }
            )
        if "nonfinite" in self.ring.fired:
            return
        flags = [p[1] for p in params]
        if isinstance(loss, Pending) or any(isinstance(f, Pending) for f in flags):
            self.ring.lag = DEVICE_LAG_STEPS  # checked when they reach the host, steps later
            w.call(lambda: self._check_later(step, loss, flags))
            return
        what = nonfinite(loss, flags)
        if what is not None:
            self.ring.fired.add("nonfinite")
            self.dump(w, "nonfinite", f"{what} at the end of step {step}", at_step=step)

    def _check_later(self, step: int, loss: Any, flags: list[Any]) -> list[tuple[str, Any]]:
        """The non-finite check on the writer thread, once the device values are on the host."""
        if "nonfinite" in self.ring.fired or not self.state.recording:
            return []
        what = nonfinite(_value(loss), [_value(f) for f in flags])
        if what is None:
            return []
        self.ring.fired.add("nonfinite")
        dump = self.ring.take("nonfinite", f"{what} at the end of step {step}", at_step=step)
        return self.items(dump, self.state.t_ns())

    def at_exit(self, w: BackgroundWriter, reason: str, exc: BaseException | None) -> None:
        """``Recorder.finish``: dump for SIGTERM or an uncaught exception, never for a good end."""
        if reason == "SIGTERM":
            self.dump(w, "sigterm", "the process was stopped by SIGTERM")
        elif exc is not None:
            oom = isinstance(exc, torch.OutOfMemoryError)
            why = scrub_text(f"{type(exc).__name__}: {exc}", self.redact_key)[:300]
            self.dump(w, "oom" if oom else "exception", why)

    def idle(self, w: BackgroundWriter, inflight: tuple[int, int, str, int, int] | None) -> None:
        """The writer's idle tick: a collective waited in for STUCK_DUMP_AFTER_NS dumps, once."""
        if inflight is None or inflight[0] == self.stuck_seq:
            return
        waited = self.state.t_ns() - inflight[4]
        if waited >= STUCK_DUMP_AFTER_NS:
            self.stuck_seq = inflight[0]
            seq, step, op = inflight[:3]
            self.dump(w, "stuck", f"collective #{seq} ({op}, step {step}) waited {waited / 1e9:.0f} s")

    def dump(self, w: BackgroundWriter, reason: str, detail: str, at_step: int | None = None) -> None:
        """Take what the ring holds now; the writer writes it after what is queued before it."""
        if not self.state.recording:
            return
        dump = self.ring.take(reason, detail, at_step)
        t_ns = self.state.t_ns()
        w.call(lambda: self.items(dump, t_ns))

    @staticmethod
    def items(dump: Dump, t_ns: int) -> list[tuple[str, Any]]:
        """The writer items of a dump (writer thread): snapshot, payloads, then the event."""
        snap = dump.snapshot
        out = (
            snapshot_items(snap.step, snap.state, snap.metas, snap.ready, snap.let_go)
            if snap is not None
            else []
        )
        nbytes = sum(len(item[1][1]) for item in out if item[0] == "payload")
        blobs = 0
        for held in dump.blobs:
            if held.data is None:  # an RNG state the writer never encoded (recording stopped)
                continue
            out.append(("held", (held.id, held.data, held.nbytes, held.ready)))
            blobs += 1
            nbytes += held.nbytes
        ev: dict[str, Any] = {
            "type": schema.EV_FLIGHT_DUMP,
            "reason": dump.reason,
            "detail": dump.detail,
            "first_step": dump.first_step,
            "last_step": dump.last_step,
            "snapshot_step": dump.snapshot_step,
            "blobs": blobs,
            "nbytes": nbytes,
            "dropped": dump.dropped,
            "t_ns": t_ns,
        }
        if dump.hole_step >= 0:
            ev["hole_step"] = dump.hole_step
            ev["detail"] = (
                f"{dump.detail}; no complete window: step {dump.hole_step}'s payloads did not fit in the "
                "flight recorder's memory (--window-bytes), and no snapshot was taken after it yet"
            )
        out.append(("ev", ev))
        return out
