"""The files a recorded program read and wrote: their identity, for the replay to check.

An audit hook (``sys.addaudithook``: the interpreter calls it before each ``open``, ``os.open``,
rename, remove and mkdir, in any thread) sees the program's file operations; ``torch.save`` to a
path writes from C++, so it is wrapped too. For each file the program read before writing it: its
path, size, mtime and, up to ``HASH_LIMIT`` bytes, the sha256 of its content. For each path it
wrote, created or removed: whether it existed before. The Python installation, the run folder's
spool and trace, the compilers' caches (Inductor's, Triton's, torch extensions') and ``/proc``,
``/sys``, ``/dev`` are left out; a file last modified after recording started is marked
``during_run`` (the program's own product through native code or a subprocess, such as Triton's
compiled launchers: not an input a replay needs), and at most ``MAX_FILES`` paths are kept (the rest
counted). ``take()`` returns what is new since the last call; the recorder writes it as a
``files`` event at each step's end. A replay hides what the recorded run created and sends its
own writes to a private folder (``replayer/overlay.py``), and names an input that changed since
the recording (``replayer/report.py``).
"""

from __future__ import annotations

import functools
import getpass
import hashlib
import os
import stat
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from typing import Any

HASH_LIMIT = 1 << 20
MAX_FILES = 4096
MAX_LISTED = 20000  # entries kept of one listed folder
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def excluded_roots(run_dir: str = "") -> tuple[str, ...]:
    """Paths whose files are the environment's, not the program's data."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # fsdp_replay itself
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, "/proc", "/sys", "/dev", package, *_cache_roots()}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            roots.add(path)
    if run_dir:  # the agent's own files there; the program's own (run.json aside) are its data
        from fsdp_replay.trace import schema

        roots.update(os.path.join(run_dir, d) for d in (schema.SPOOL_DIR, schema.TRACE_DIR))
    return tuple(sorted(os.path.realpath(r) + os.sep for r in roots if r))


def _cache_roots() -> list[str]:
    """Where torch's compilers keep what they built: rebuilt on any machine that lacks it."""
    import tempfile

    try:
        user = getpass.getuser()
    except Exception:  # no user name in this container
        user = str(os.getuid())
    home = os.path.expanduser("~")
    return [
        os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        or os.path.join(tempfile.gettempdir(), f"torchinductor_{user}"),
        os.environ.get("TRITON_CACHE_DIR") or os.path.join(home, ".triton"),
        os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(home, ".cache", "torch_extensions"),
        os.path.join(home, ".cache", "fsdp-replay"),
    ]


def is_write(mode: Any, flags: Any) -> bool:
    if isinstance(mode, str) and mode:
        return any(c in mode for c in "wax+")
    return isinstance(flags, int) and bool(flags & _WRITE_FLAGS)


def identity(path: str) -> dict[str, Any] | None:
    """A file's size, mtime and (small files) sha256; None if it is not a regular file now."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    digest = None
    if st.st_size <= HASH_LIMIT:
        try:
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            digest = None
    return {"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}


class FileLedger:
    """What the program read and wrote, from the audit hook, while ``active()``."""

    def __init__(self, active: Callable[[], bool], run_dir: str = "") -> None:
        self.active = active
        self.started_ns = time.time_ns()
        self.skip = excluded_roots(os.path.realpath(run_dir) if run_dir else "")
        self.seen: set[tuple[str, bool]] = set()
        self.read: list[dict[str, Any]] = []
        self.written: list[dict[str, Any]] = []
        self.listed: list[dict[str, Any]] = []
        self._listed_paths: set[str] = set()
        self.overflow = 0
        self._sent = (0, 0, 0)
        self._lock = threading.Lock()
        self._inside = threading.local()  # our own stat/open do not count

    def install(self) -> None:
        sys.addaudithook(self._audit)  # cannot be removed: it does nothing once inactive
        import torch
        import torch.serialization

        save = self.wrap_torch_save(torch.serialization.save)
        torch.save = torch.serialization.save = save

    def wrap_torch_save(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(f, str | os.PathLike):
                self.note(f, write=True)
            return original(obj, f, *args, **kwargs)

        return save

    def _audit(self, event: str, args: tuple[Any, ...]) -> None:
        if event == "open":
            path, mode, flags = (*args, None, None, None)[:3]
            if path is not None and not isinstance(path, int):
                self.note(path, write=is_write(mode, flags))
        elif event in ("os.rename", "os.replace"):
            self.note(args[0], write=True)
            self.note(args[1], write=True)
        elif event in ("os.remove", "os.mkdir", "os.rmdir", "os.truncate") and not isinstance(args[0], int):
            self.note(args[0], write=True)
        elif (
            event in ("os.listdir", "os.scandir") and args and isinstance(args[0], str | bytes | os.PathLike)
        ):
            self.listing(args[0])

    def note(self, path: Any, write: bool) -> None:
        if getattr(self._inside, "busy", False) or not self.active():
            return
        self._inside.busy = True
        try:
            p = os.path.abspath(os.fsdecode(path))
            if p.startswith(self.skip) or p + os.sep in self.skip:
                return
            key = (p, write)
            with self._lock:
                # a file it wrote before reading is its own output, not an input
                if key in self.seen or (not write and (p, True) in self.seen):
                    return
                if len(self.seen) >= MAX_FILES:
                    self.overflow += 1
                    return
                self.seen.add(key)
            if write:
                self.written.append({"path": p, "existed": os.path.lexists(p)})
            else:
                ident = identity(p)
                if ident is not None:
                    if ident["mtime_ns"] >= self.started_ns:
                        ident["during_run"] = True
                    self.read.append(ident)
        except Exception:  # never the program's problem
            pass
        finally:
            self._inside.busy = False

    def listing(self, path: Any) -> None:
        """A folder the program lists: its entries as they are now (a dataset's folder, listed by its
        constructor, so that a replay where the folder is gone lists it the same)."""
        if getattr(self._inside, "busy", False) or not self.active():
            return
        self._inside.busy = True
        try:
            p = os.path.abspath(os.fsdecode(path))
            if p.startswith(self.skip) or p + os.sep in self.skip:
                return
            with self._lock:
                if p in self._listed_paths:
                    return
                if len(self._listed_paths) >= MAX_FILES:
                    self.overflow += 1
                    return
                self._listed_paths.add(p)
            entries: list[list[Any]] = []
            truncated = False
            with os.scandir(p) as it:
                for e in it:
                    if len(entries) >= MAX_LISTED:
                        truncated = True
                        break
                    try:
                        st = e.stat()
                        entries.append([e.name, e.is_dir(), st.st_size, st.st_mtime_ns])
                    except OSError:
                        continue
            self.listed.append({"path": p, "entries": entries, "truncated": truncated})
        except Exception:  # never the program's problem
            pass
        finally:
            self._inside.busy = False

    def take(self) -> dict[str, Any] | None:
        """The entries new since the last call, as a ``files`` event body; None when nothing is."""
        with self._lock:
            r0, w0, l0 = self._sent
            read, written, listed = self.read[r0:], self.written[w0:], self.listed[l0:]
            self._sent = (len(self.read), len(self.written), len(self.listed))
        if not read and not written and not listed:
            return None
        return {"read": read, "written": written, "listed": listed, "overflow": self.overflow}
