"""CPU time and resident memory of the training processes discovery found, and of the sidecar.

Sampled with psutil once per poll, per process identity (pid + start time, from discovery), and
summed by rank label (the process's RANK; "" for torchrun and other processes without one). CPU
time is a counter that must never go down while torchrun restarts workers: when a process exits,
its last sample is kept in the rank's total (so up to one poll interval of its CPU is missing).

psutil reads ``psutil.PROCFS_PATH`` (one global, default /proc); the daemon points it at its proc
root once at start-up (the sidecar is its own process, so the global is its own).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import psutil

from fsdp_replay.sidecar.discovery import TrainingProcess

Identity = tuple[int, int | None]


@dataclass(frozen=True, slots=True)
class Usage:
    """What a group of processes used: CPU seconds (user + system) and resident bytes."""

    cpu_s: float
    rss_bytes: int
    processes: int


class ProcessStats:
    """Per rank label: CPU seconds (all processes ever seen) and resident memory (live ones)."""

    def __init__(self, process_factory: Callable[[int], Any] = psutil.Process) -> None:
        self._factory = process_factory
        self._handles: dict[Identity, Any] = {}
        self._live: dict[Identity, tuple[str, float, int]] = {}
        self._done_cpu_s: dict[str, float] = {}
        self.errors = 0
        """Samples that failed for another reason than the process being gone (permissions)."""

    def update(self, processes: Iterable[TrainingProcess]) -> None:
        """Sample the live training processes; fold those gone since the last call."""
        now: dict[Identity, tuple[str, float, int]] = {}
        for proc in processes:
            ident = proc.identity
            label = "" if proc.rank is None else str(proc.rank)
            sample = self._sample(ident)
            if sample is None:
                old = self._live.get(ident)
                if old is not None:
                    now[ident] = old  # unreadable this time: keep the last sample
                continue
            now[ident] = (label, *sample)
        for ident, (label, cpu_s, _rss) in self._live.items():
            if ident not in now:
                self._done_cpu_s[label] = self._done_cpu_s.get(label, 0.0) + cpu_s
                self._handles.pop(ident, None)
        self._live = now

    def _sample(self, ident: Identity) -> tuple[float, int] | None:
        handle = self._handles.get(ident)
        try:
            if handle is None:
                handle = self._handles[ident] = self._factory(ident[0])
            with handle.oneshot():
                times = handle.cpu_times()
                rss = int(handle.memory_info().rss)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            return None
        except (psutil.AccessDenied, OSError):
            self.errors += 1
            return None
        return float(times.user + times.system), rss

    def usage(self) -> dict[str, Usage]:
        """rank label -> usage (CPU of exited processes included; memory and count of live ones)."""
        out: dict[str, list[float]] = {label: [cpu, 0, 0] for label, cpu in self._done_cpu_s.items()}
        for label, cpu_s, rss in self._live.values():
            row = out.setdefault(label, [0.0, 0, 0])
            row[0] += cpu_s
            row[1] += rss
            row[2] += 1
        return {label: Usage(row[0], int(row[1]), int(row[2])) for label, row in sorted(out.items())}


def own_usage(process: Any = None) -> Usage:
    """The calling process's (the sidecar's) CPU seconds and resident memory."""
    p = process if process is not None else psutil.Process()
    with p.oneshot():
        times = p.cpu_times()
        return Usage(float(times.user + times.system), int(p.memory_info().rss), 1)
