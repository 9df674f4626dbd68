"""Reading other processes' /proc entries, with the proc root as a parameter.

Like prometheus/client_python's ``ProcessCollector``: every function takes ``proc_root`` (default
``/proc``), so tests run on a fixture tree (``tests/sidecar/fixtures/proc``). The sidecar runs in
another container than the trainer: paths a process has mapped are paths in *its* mount
namespace, reached from ours through ``<proc_root>/<pid>/root``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC_ROOT = "/proc"
_DELETED = " (deleted)"
PF_KTHREAD = 0x00200000
"""Flag of a kernel thread in /proc/<pid>/stat (field 9): they exist in the initial pid namespace only."""


@dataclass(frozen=True, slots=True)
class Mapping:
    """One file-backed line of /proc/<pid>/maps."""

    start: int
    end: int
    perms: str
    device: str
    """major:minor, hex, as the kernel prints it."""
    inode: int
    path: str
    """As mapped, in the process's mount namespace, without the " (deleted)" marker."""
    deleted: bool


def pids(proc_root: str = PROC_ROOT) -> list[int]:
    """Process ids (thread-group leaders) listed under ``proc_root``."""
    try:
        names = os.listdir(proc_root)
    except FileNotFoundError:
        return []
    return sorted(int(n) for n in names if n.isdigit())


def read_bytes(pid: int, name: str, proc_root: str = PROC_ROOT) -> bytes:
    """A /proc/<pid>/<name> file. Raises OSError (FileNotFoundError: the process is gone)."""
    with open(os.path.join(proc_root, str(pid), name), "rb") as f:
        return f.read()


def cmdline(pid: int, proc_root: str = PROC_ROOT) -> tuple[str, ...]:
    raw = read_bytes(pid, "cmdline", proc_root)
    return tuple(a.decode("utf-8", "replace") for a in raw.split(b"\0") if a)


def environ(pid: int, proc_root: str = PROC_ROOT) -> dict[str, str]:
    """The environment the process started with (later setenv calls are not visible)."""
    env: dict[str, str] = {}
    for item in read_bytes(pid, "environ", proc_root).split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key:
            env[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return env


def status(pid: int, proc_root: str = PROC_ROOT) -> dict[str, str]:
    """/proc/<pid>/status as key -> value text (Name, PPid, Tgid, Uid, ...)."""
    out: dict[str, str] = {}
    for line in read_bytes(pid, "status", proc_root).decode("utf-8", "replace").splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key] = value.strip()
    return out


def start_ticks(pid: int, proc_root: str = PROC_ROOT) -> int | None:
    """Start time (clock ticks since boot, /proc/<pid>/stat field 22): with the pid, it tells a
    restarted worker from a reused pid. None where the file is absent (fixture trees)."""
    try:
        raw = read_bytes(pid, "stat", proc_root)
    except FileNotFoundError:
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = raw[raw.rfind(b")") + 2 :].split()
    return int(fields[19]) if len(fields) > 19 else None


def maps(pid: int, proc_root: str = PROC_ROOT) -> list[Mapping]:
    """The file-backed mappings of a process."""
    out: list[Mapping] = []
    for line in read_bytes(pid, "maps", proc_root).decode("utf-8", "replace").splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or not parts[5].startswith("/"):
            continue  # anonymous, [heap], [stack], [vdso] ...
        span, perms, _offset, device, inode, path = parts
        deleted = path.endswith(_DELETED)
        if deleted:
            path = path[: -len(_DELETED)]
        start, _, end = span.partition("-")
        out.append(Mapping(int(start, 16), int(end, 16), perms, device, int(inode), path, deleted))
    return out


def mapped_files(pid: int, pattern: str, proc_root: str = PROC_ROOT) -> list[Mapping]:
    """One mapping per distinct file whose basename contains ``pattern`` (e.g. "libnccl.so")."""
    seen: set[tuple[str, int]] = set()
    out: list[Mapping] = []
    for m in maps(pid, proc_root):
        if pattern in os.path.basename(m.path) and (m.device, m.inode) not in seen:
            seen.add((m.device, m.inode))
            out.append(m)
    return out


def host_path(pid: int, mapping: Mapping, proc_root: str = PROC_ROOT) -> str:
    """A path to the mapped file that works from this process's mount namespace.

    ``<proc_root>/<pid>/root/<path>`` crosses into the process's container; a file deleted or
    replaced since it was mapped is still reachable through ``map_files`` (root only)."""
    if mapping.deleted:
        return os.path.join(proc_root, str(pid), "map_files", f"{mapping.start:x}-{mapping.end:x}")
    return str(Path(proc_root, str(pid), "root", mapping.path.lstrip("/")))


def pid_namespace(proc_root: str = PROC_ROOT) -> tuple[int, int] | None:
    """The pid namespace whose pids ``proc_root`` lists, as (device, inode) the way
    ``bpf_get_ns_current_pid_tgid`` takes them (the kernel's dev_t: major << 20 | minor); None when
    it is the initial (host) namespace, whose pids are the kernel's own.

    Inside a pod with ``shareProcessNamespace`` the pids /proc shows are the pod's, while
    ``bpf_get_current_pid_tgid`` gives the host's. The initial namespace is told by its kernel
    threads (kthreadd is pid 2 there and nowhere else): the namespace's inode number is no constant
    on recent kernels (6.18 here)."""
    try:
        raw = read_bytes(2, "stat", proc_root)
        flags = int(raw[raw.rfind(b")") + 2 :].split()[6])
        if flags & PF_KTHREAD:
            return None
    except (OSError, IndexError, ValueError):
        pass
    for path in (os.path.join(proc_root, "1", "ns", "pid"), "/proc/self/ns/pid"):
        try:
            st = os.stat(path)
        except OSError:
            continue
        return (os.major(st.st_dev) << 20) | os.minor(st.st_dev), st.st_ino
    return None
