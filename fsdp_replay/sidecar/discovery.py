"""Find the pod's training processes, and report which started and which exited since last time.

A process is a training process when its environment enables the fsdp-replay agent
(``FSDP_REPLAY_MODE`` set and not "off", what ``boot/site/sitecustomize.py`` checks), or when it
maps an NCCL library (any framework's NCCL user). The sidecar polls: torchrun restarts workers
under new pids, and the probe's pid filter must follow (``started`` -> ``Probe.track``,
``exited`` -> ``Probe.untrack``, ``changed`` -> libraries mapped since: attach them).

The proc root is a parameter (client_python's ``ProcessCollector`` habit), so the unit tests run
on a fixture tree. The files are read directly rather than through psutil: psutil takes its
procfs path from one process-wide global (``psutil.PROCFS_PATH``) and needs ``stat`` files for
every ``Process`` it builds; here only cmdline, environ, maps and status are needed, and ``stat``
(start time: a reused pid is a new process) is used where it exists.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from fsdp_replay.sidecar import procfs

AGENT_ENV = "FSDP_REPLAY_MODE"
"""Set by the injector (or the user) in processes the in-process agent records."""
DISABLED_VALUES = ("", "off")
"""Values of a marker variable that do not enable it (sitecustomize's rule)."""
NCCL_PATTERN = "libnccl.so"

REASON_ENV = "env"
REASON_LIBRARY = "library"


@dataclass(frozen=True, slots=True)
class TrainingProcess:
    """A process the sidecar should probe, as seen at one poll."""

    pid: int
    start_ticks: int | None
    """Start time in clock ticks since boot; None where /proc/<pid>/stat is absent (fixtures)."""
    name: str
    ppid: int
    cmdline: tuple[str, ...]
    markers: dict[str, str]
    """The enabling environment variables found, with their values (e.g. FSDP_REPLAY_MODE)."""
    rank: int | None
    """RANK from its environment (torchrun sets it), if any."""
    libraries: tuple[procfs.Mapping, ...]
    """Mapped files matching the library pattern (paths in the process's mount namespace)."""
    reasons: tuple[str, ...]
    """Why it counts: "env" (a marker variable), "library" (maps the library)."""

    @property
    def identity(self) -> tuple[int, int | None]:
        return (self.pid, self.start_ticks)


@dataclass(frozen=True, slots=True)
class DiscoveryUpdate:
    """What changed between two polls."""

    started: tuple[TrainingProcess, ...]
    exited: tuple[TrainingProcess, ...]
    changed: tuple[TrainingProcess, ...]
    """Known processes that mapped new matching libraries since the last poll."""

    def __bool__(self) -> bool:
        return bool(self.started or self.exited or self.changed)


@dataclass(frozen=True, slots=True)
class _Seen:
    """What a process's environment said, kept while the process (pid + start time) lives."""

    identity: tuple[int, int | None]
    markers: dict[str, str]
    rank: int | None


class Discovery:
    """Polls ``proc_root`` for training processes."""

    def __init__(
        self,
        proc_root: str = procfs.PROC_ROOT,
        *,
        library_pattern: str | None = NCCL_PATTERN,
        env_markers: Sequence[str] = (AGENT_ENV,),
        exclude_pids: Sequence[int] | None = None,
    ) -> None:
        """``library_pattern``: substring of a mapped file's name that makes a training process
        (None: environment only). ``env_markers``: variables that make one when set to anything
        but "" or "off". ``exclude_pids``: never reported (default: this process, on the live /proc).
        """
        self.proc_root = proc_root
        self.library_pattern = library_pattern
        self.env_markers = tuple(env_markers)
        if exclude_pids is None:
            exclude_pids = (os.getpid(),) if os.path.realpath(proc_root) == "/proc" else ()
        self.exclude_pids = frozenset(exclude_pids)
        self.processes: dict[int, TrainingProcess] = {}
        """Training processes at the last poll, by pid."""
        self.unreadable = 0
        """Processes skipped at the last poll because their files could not be read (permissions)."""
        self._seen: dict[int, _Seen] = {}

    def poll(self) -> DiscoveryUpdate:
        """Scan once; returns the processes that started, exited or mapped new libraries."""
        started: list[TrainingProcess] = []
        changed: list[TrainingProcess] = []
        exited: list[TrainingProcess] = []
        current: dict[int, TrainingProcess] = {}
        seen: dict[int, _Seen] = {}
        self.unreadable = 0
        for pid in procfs.pids(self.proc_root):
            if pid in self.exclude_pids:
                continue
            try:
                proc, info = self._inspect(pid)
            except (FileNotFoundError, ProcessLookupError):
                continue  # exited while we looked
            except PermissionError:
                self.unreadable += 1
                continue
            seen[pid] = info
            if proc is None:
                continue
            current[pid] = proc
            old = self.processes.get(pid)
            if old is None or old.identity != proc.identity:
                if old is not None:
                    exited.append(old)  # same pid, another process: the old one is gone
                started.append(proc)
            elif {(m.device, m.inode) for m in proc.libraries} - {(m.device, m.inode) for m in old.libraries}:
                changed.append(proc)
        exited += [p for pid, p in self.processes.items() if pid not in current]
        self.processes = current
        self._seen = seen
        return DiscoveryUpdate(tuple(started), tuple(exited), tuple(changed))

    def _inspect(self, pid: int) -> tuple[TrainingProcess | None, _Seen]:
        root = self.proc_root
        identity = (pid, procfs.start_ticks(pid, root))
        info = self._seen.get(pid)
        if info is None or info.identity != identity:
            # The environment a process started with does not change: read it once.
            env = procfs.environ(pid, root)
            markers = {
                k: env[k] for k in self.env_markers if k in env and env[k].strip() not in DISABLED_VALUES
            }
            rank = env.get("RANK", "").strip()
            info = _Seen(identity, markers, int(rank) if rank.isdigit() else None)
        libraries: tuple[procfs.Mapping, ...] = ()
        if self.library_pattern is not None:
            known = self.processes.get(pid)
            if known is not None and known.identity == identity and known.libraries:
                libraries = known.libraries  # attached already; a second copy of NCCL is not expected
            else:
                libraries = tuple(procfs.mapped_files(pid, self.library_pattern, root))
        reasons = tuple(r for r, ok in ((REASON_ENV, info.markers), (REASON_LIBRARY, libraries)) if ok)
        if not reasons:
            return None, info
        status = procfs.status(pid, root)
        proc = TrainingProcess(
            pid=pid,
            start_ticks=identity[1],
            name=status.get("Name", ""),
            ppid=int(status.get("PPid", "0") or 0),
            cmdline=procfs.cmdline(pid, root),
            markers=dict(info.markers),
            rank=info.rank,
            libraries=libraries,
            reasons=reasons,
        )
        return proc, info
