"""The CUDA caching allocator, step by step: its actions, its counters, its state at an OOM.

Imported by the recorder only once the process has initialized CUDA. Three things, by cost:

- **counters at every step end** (``torch.cuda.memory_stats``: allocated, reserved and requested
  bytes now, torch's peaks, retries, OOMs): one call, tens of microseconds. The peaks are read,
  never reset: a program that reads ``max_memory_allocated`` itself sees what it would see
  unrecorded, and a step's own peak is torch's peak wherever it grew during the step.
- **the allocator's actions in the ``--alloc-history`` steps** (allocations, frees, segments, from
  torch's allocator history, ``torch.cuda.memory._record_memory_history``): torch notes each
  action in a ring as it happens (no Python); at the step's end ``_snapshot()`` turns the ring and
  every segment into Python objects, the ring is cleared, and the writer thread turns the entries
  into rows. The training thread pays the snapshot, about 1 us per entry and block (a few ms for
  the ~3,600 actions of the reference step: see ``docs/trace-format.md#memory``), only in those
  steps; the default window is the first two steps. ``--alloc-stacks`` adds torch's Python stack
  per allocation (its docs: ~2 us each) for the row's ``site``.
- **a snapshot at an out-of-memory error**: an observer that torch calls before it raises
  ``torch.OutOfMemoryError`` takes ``torch.cuda.memory._snapshot()`` (segments, blocks and, in a
  history step, the actions leading up to it) into the spool as a JSON blob with an ``oom``
  event. Free until an OOM happens.

Nothing here raises into the program: the OOM observer runs inside torch's allocator, where an
exception would replace the program's own error.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fsdp_replay.agent.config import RecordConfig
from fsdp_replay.agent.counters import AgentState
from fsdp_replay.agent.writer import BackgroundWriter, BlobRef
from fsdp_replay.trace import schema

log = logging.getLogger(__name__)

# Entries torch keeps per history step: beyond this the ring overwrites its oldest (the event
# then says ``full``). ~100 bytes each in torch's C++ ring without stacks.
MAX_ENTRIES = 200_000
# Snapshots written per process: a program that catches OOMs (a batch-size search) gets the
# first few whole, and an ``oom`` event without a snapshot for each later one.
MAX_OOM_SNAPSHOTS = 3
# torch's counters in a ``memory`` event's ``stats``, from ``memory_stats_as_nested_dict``.
STATS: dict[str, tuple[str, ...]] = {
    "allocated": ("allocated_bytes", "all", "current"),
    "reserved": ("reserved_bytes", "all", "current"),
    "requested": ("requested_bytes", "all", "current"),
    "allocated_peak": ("allocated_bytes", "all", "peak"),
    "reserved_peak": ("reserved_bytes", "all", "peak"),
    "alloc_retries": ("num_alloc_retries",),
    "ooms": ("num_ooms",),
}
# torch 2.11 and later name it at the top level; torch.cuda's name is the older alias
OUT_OF_MEMORY: type[BaseException] = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
# A stack frame in these folders is torch's or ours: a row's site is the innermost other one.
# (as imported and with links resolved: frames name files as they were imported)
_LIBRARY_DIRS = tuple(
    {
        str(folder) + os.sep
        for lib in (Path(torch.__file__).parent, Path(__file__).parents[1])
        for folder in (Path(os.path.abspath(lib)), lib.resolve())
    }
)


def read_stats(device: int) -> dict[str, int]:
    """torch's allocator counters for ``device`` (``STATS``), without resetting anything."""
    nested = torch.cuda.memory_stats_as_nested_dict(device)
    out = {}
    for name, path in STATS.items():
        value: Any = nested
        for key in path:
            value = value.get(key, 0) if isinstance(value, dict) else 0
        out[name] = int(value)
    return out


def site_of(frames: list[dict[str, Any]] | None) -> str | None:
    """``file:line function`` of the innermost frame outside torch and fsdp_replay (torch lists
    the innermost first), or None without frames."""
    if not frames:
        return None
    for f in frames:
        filename = str(f.get("filename", ""))
        if filename and not os.path.abspath(filename).startswith(_LIBRARY_DIRS):
            return f"{filename}:{f.get('line')} {f.get('name')}"
    f = frames[0]
    return f"{f.get('filename')}:{f.get('line')} {f.get('name')}"


def action_rows(
    traces: list[list[dict[str, Any]]], t0_wall_ns: int, micro_ends: list[int], stacks: bool
) -> tuple[list[list[int]], list[str]]:
    """torch's trace entries (one list per device) as ``memory.actions`` rows
    ``[micro, t_ns, action, addr, bytes, stream, device, site]``, and the sites they index."""
    rows: list[list[int]] = []
    sites: list[str] = []
    site_index: dict[str, int] = {}
    codes = schema.ALLOC_ACTION_CODES
    for device, entries in enumerate(traces):
        for e in entries:
            code = codes.get(str(e.get("action")))
            if code is None:  # an action this version does not know: left out, never misread
                continue
            t_us = e.get("time_us")
            # torch stamps entries with its approximate clock converted to Unix microseconds
            t_ns = int(t_us) * 1000 - t0_wall_ns if isinstance(t_us, int) and t_us > 0 else -1
            micro = bisect.bisect_right(micro_ends, t_ns) if t_ns >= 0 else -1
            site = -1
            if stacks:
                name = site_of(e.get("frames"))
                if name is not None:
                    site = site_index.setdefault(name, len(sites))
                    if site == len(sites):
                        sites.append(name)
            rows.append(
                [
                    micro,
                    t_ns,
                    code,
                    int(e.get("addr", -1)),
                    int(e.get("size", 0)),
                    int(e.get("stream", 0)),
                    device,
                    site,
                ]
            )
    return rows, sites


def snapshot_json(snapshot: dict[str, Any]) -> bytes:
    """torch's snapshot as JSON (tuples become lists; anything else not JSON becomes its str)."""
    return json.dumps(snapshot, separators=(",", ":"), default=str).encode()


class MemoryRecorder:
    """The allocator's part of one rank's record (``recorder.Recorder`` owns it)."""

    def __init__(
        self,
        config: RecordConfig,
        state: AgentState,
        ensure_started: Callable[[], BackgroundWriter],
        fail: Callable[[str, BaseException], None],
        device: int | None = None,
    ) -> None:
        self.window = config.alloc_history
        self.stacks = config.alloc_stacks
        self.state = state
        self._ensure_started = ensure_started
        self._fail = fail
        self.device = torch.cuda.current_device() if device is None else device
        # torch stamps history entries in Unix time: this is the Unix ns of our t_ns == 0
        self.t0_wall_ns = time.time_ns() - state.t_ns()
        self.history_on = False
        self.history_error = ""  # why this process records no history (set once, logged once)
        self.base: dict[str, int] | None = None  # the counters when the current step's history began
        self.ooms = 0
        self.done = False

    # -- life cycle -----------------------------------------------------------------------
    def start(self, step: int) -> None:
        """Watch for OOMs, and start the history if ``step`` is in the window."""
        try:
            read_stats(self.device)
            # An observer cannot be detached: it checks ``done`` (and the recorder's state) instead.
            torch._C._cuda_attach_out_of_memory_observer(self._on_oom)  # type: ignore[attr-defined]
        except (RuntimeError, AttributeError, NotImplementedError) as e:
            # another allocator (torch.cuda.memory.change_current_allocator) may have neither
            self.done = True
            log.warning("fsdp-replay: CUDA memory is not recorded: this allocator does not tell (%s)", e)
            return
        if step in self.window:
            self._history(True)

    def step_end(self, step: int, micro_ends: list[int]) -> None:
        """The step's counters, and its actions when it had history; then the next step's.
        ``micro_ends``: when the step's ``backward()`` calls returned (t_ns), for the rows' micro."""
        if self.done:
            return
        w = self._ensure_started()
        had_history = self.history_on
        before = read_stats(self.device) if had_history else None
        traces = self._read_history() if had_history else None
        following = step + 1 in self.window
        if self.history_on or following:
            self._history(following)  # on again clears the ring; off clears it too
        stats = read_stats(self.device)  # right after the clear: the next step's base too
        # Another thread (NCCL's watchdog frees the tensors a collective held) may allocate or
        # free between the read and the clear: its actions are in neither step's history.
        moved = before is not None and any(
            before[k] != stats[k] for k in ("allocated", "reserved", "requested")
        )
        self.write_step(w, step, stats, traces, micro_ends, final=False, moved=moved)
        self.base = stats if self.history_on else None

    def finish(self, exception: BaseException | None, micro_ends: list[int]) -> None:
        """At the end of recording: the actions of the step in progress, a snapshot for an
        uncaught OOM the observer did not see, and the history switched off."""
        if self.done:
            return
        self.done = True
        w = self.state.writer
        if w is None:
            return
        if isinstance(exception, OUT_OF_MEMORY) and self.ooms == 0:
            self._snapshot_oom(w, self.device, -1, -1, -1)
        if self.history_on:
            traces = self._read_history()
            self._history(False)
            self.write_step(w, self.state.pos.step, read_stats(self.device), traces, micro_ends, final=True)

    # -- torch's history ------------------------------------------------------------------
    def _history(self, on: bool) -> None:
        """Turn torch's history on (with an empty ring) or off (which empties it)."""
        if self.history_error:
            return
        record = torch.cuda.memory._record_memory_history
        try:
            if not on:
                record(None, context=None, stacks="python")
            else:
                if not self.history_on and self._foreign_history():
                    return
                # stacks="python": "all" would first warm up C++ unwinding (slow, and unused here)
                context = "alloc" if self.stacks else None
                if self.history_on:
                    record(None, context=None, stacks="python")  # empties the ring, in every torch
                record("all", context=context, stacks="python", max_entries=MAX_ENTRIES)
        except (RuntimeError, TypeError, AttributeError) as e:
            # an allocator without a history (cudaMallocAsync), or a torch without these arguments
            self.history_error = f"torch's allocator history is not available here: {e}"
            log.warning("fsdp-replay: %s; allocations are not recorded", self.history_error)
            on = False
        self.history_on = on
        if on and self.base is None:
            self.base = read_stats(self.device)

    def _foreign_history(self) -> bool:
        """Whether the program records the allocator's history itself: then it is left alone."""
        enabled = getattr(torch._C, "_cuda_isHistoryEnabled", None)
        if enabled is not None:
            foreign = bool(enabled())
        else:
            foreign = any(torch.cuda.memory._snapshot().get("device_traces") or [])
        if foreign:
            self.history_error = (
                "the program records the allocator history itself; fsdp-replay leaves it alone"
            )
            log.warning("fsdp-replay: %s (no allocations in the trace)", self.history_error)
            return True
        return False

    def _read_history(self) -> list[list[dict[str, Any]]]:
        return list(torch.cuda.memory._snapshot().get("device_traces") or [])

    def write_step(
        self,
        w: BackgroundWriter,
        step: int,
        stats: dict[str, int],
        traces: list[list[dict[str, Any]]] | None,
        micro_ends: list[int],
        *,
        final: bool,
        moved: bool = False,
    ) -> None:
        """A ``memory`` event for ``step``: torch's counters at its end and, given ``traces``
        (the snapshot's ``device_traces``), its actions; encoded on the writer thread."""
        base, micro_ends, stacks = self.base, list(micro_ends), self.stacks
        t0_wall_ns = self.t0_wall_ns
        device, error = self.device, self.history_error

        def encoded() -> list[tuple[str, Any]]:
            ev: dict[str, Any] = {"type": schema.EV_MEMORY, "step": step, "device": device, "stats": stats}
            if traces is not None:
                rows, sites = action_rows(traces, t0_wall_ns, micro_ends, stacks)
                ev.update(actions=rows, sites=sites, full=any(len(t) >= MAX_ENTRIES for t in traces))
                if base is not None:
                    ev["base"] = {"requested": base["requested"], "reserved": base["reserved"]}
            if moved:
                ev["moved"] = True
            if error:
                ev["error"] = error
            if final:
                ev["final"] = True
            return [("ev", ev)]

        w.call(encoded)

    # -- out of memory --------------------------------------------------------------------
    def _on_oom(self, device: int, requested: int, device_total: int, device_free: int) -> None:
        """torch's OOM observer: called with the allocator's lock released, before it raises."""
        try:
            if self.done or not self.state.recording:
                return
            w = self._ensure_started()
            self._snapshot_oom(w, device, requested, device_total, device_free)
        except BaseException as e:  # inside torch's allocator: never an exception of ours
            self._fail("out-of-memory observer", e)

    def _snapshot_oom(
        self, w: BackgroundWriter, device: int, requested: int, device_total: int, device_free: int
    ) -> None:
        self.ooms += 1
        device = device if device >= 0 else self.device
        stats = read_stats(device)
        snapshot = torch.cuda.memory._snapshot() if self.ooms <= MAX_OOM_SNAPSHOTS else None
        where = {"step": self.state.pos.step, "micro": self.state.pos.micro, "t_ns": self.state.t_ns()}
        # The program is about to see torch.OutOfMemoryError and usually dies of it: the end
        # event's flush (atexit, SIGTERM) writes this first.
        self.write_oom(w, where, device, (requested, device_total, device_free), stats, snapshot)

    @staticmethod
    def write_oom(
        w: BackgroundWriter,
        where: dict[str, int],
        device: int,
        sizes: tuple[int, int, int],
        stats: dict[str, int],
        snapshot: dict[str, Any] | None,
    ) -> None:
        """An ``oom`` event (``where``: step, micro, t_ns; ``sizes``: requested, device total,
        device free), with ``snapshot`` as a JSON blob, encoded on the writer thread."""

        def encoded() -> list[tuple[str, Any]]:
            ref = BlobRef()
            out: list[tuple[str, Any]] = []
            data = b"" if snapshot is None else snapshot_json(snapshot)
            if snapshot is not None:
                out.append(("raw", (ref, data)))
            requested, total, free = sizes
            ev = {
                "type": schema.EV_OOM,
                "step": where["step"],
                "micro": where["micro"],
                "t_ns": where["t_ns"],
                "device": device,
                "requested": requested,
                "device_total": total,
                "device_free": free,
                "stats": stats,
                "blob": ref,
                "nbytes": len(data),
            }
            return [*out, ("ev", ev)]

        w.call(encoded)
