"""A replay never writes over the recorded job's files, and sees the files as its run began.

The replayed program runs in the recorded working directory (it reads its data and configs
there), under a copy-on-write view built from the file ledger of the recording
(``agent/files.py``) in Python's file functions:

- every write (``open`` for writing, ``os.open`` with write flags, ``torch.save`` to a path,
  ``mkdir``, ``rename``/``replace``, ``remove``/``unlink``/``rmdir``, ``shutil.rmtree``, ``utime``,
  ``chmod``, ``truncate``) goes to the replay's private folder ``REPORT/files/<absolute path>``;
  a file opened for appending or updating is copied there first;
- a read (``open``, ``os.open``, ``stat``, ``listdir``, ``scandir``, ``torch.load``) sees the
  replay's own copy where it wrote one; a file any rank of the recorded job created (it did not
  exist when that rank first wrote it: the ledgers of all ranks, ``JobFiles``) is absent until the
  replay writes it, as it was when the recorded run began; what the replay removed is absent;
- a file that existed and that the recorded job changed cannot be shown as it was (the ledger keeps
  no content): the view shows it as it is now, and a read of a file last modified after the recorded
  run began is listed (``Overlay.late``), for the report to name it where the replay diverges;
- the Python installation, ``/proc``, ``/sys``, ``/dev``, the replay's report folder and the
  shared caches (``~/.cache``, torch.compile's and Triton's) are used as they are.

Code that opens files from C or C++ (a native extension's own I/O, a subprocess) is not seen:
``replayed_writes`` lists what went through the view, and the docs say where it ends.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import hashlib
import io
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdp_replay.agent.files import excluded_roots, is_write

_real: dict[str, Any] = {}


def _o(name: str) -> Any:
    return _real.get(name) or getattr(os, name)


def _lexists(p: str) -> bool:
    try:
        _o("lstat")(p)
    except (OSError, ValueError):
        return False
    return True


def _isdir(p: str) -> bool:
    try:
        return stat.S_ISDIR(_o("stat")(p).st_mode)
    except (OSError, ValueError):
        return False


def _cache_roots() -> list[str]:
    home = os.path.expanduser("~")
    roots = [os.path.join(home, ".cache"), os.path.join(home, ".triton")]
    for var in ("XDG_CACHE_HOME", "HF_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TORCH_HOME"):
        if os.environ.get(var):
            roots.append(os.environ[var])
    tmp = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        roots += [os.path.join(tmp, n) for n in os.listdir(tmp) if n.startswith(("torchinductor_", "triton"))]
    user = os.environ.get("USER") or os.environ.get("LOGNAME") or ""
    roots.append(os.path.join(tmp, f"torchinductor_{user or 'root'}"))
    return roots


def _absent(path: Any) -> OSError:
    return FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.fsdecode(path))


class Ghosts:
    """What the recorded run saw of files that are gone where the replay runs: the folders it
    listed (names, sizes, times) and the files it read (size, time), never their content. A
    dataset's constructor that lists and sizes its folder works the same; its data is never read,
    since the replay serves the recorded batches (``serve.py``)."""

    def __init__(self, ledger: dict[str, Any]) -> None:
        self.dirs: dict[str, list[list[Any]]] = {}
        self.files: dict[str, tuple[int, int]] = {}
        for d in ledger.get("listed", []):
            self.dirs[d["path"]] = d["entries"]
            for name, is_dir, size, mtime_ns in d["entries"]:
                path = os.path.join(d["path"], name)
                if is_dir:
                    self.dirs.setdefault(path, [])
                else:
                    self.files[path] = (int(size), int(mtime_ns))
        for r in ledger.get("read", []):
            self.files.setdefault(r["path"], (int(r["size"]), int(r["mtime_ns"])))
        self.served: set[str] = set()  # paths answered from the record (the report lists them)

    def known(self, p: str) -> bool:
        return p in self.files or p in self.dirs or any(d.startswith(p + os.sep) for d in self.dirs)

    def stat(self, p: str) -> os.stat_result | None:
        if p in self.files:
            size, mtime_ns = self.files[p]
            mode = stat.S_IFREG | 0o444
        elif p in self.dirs or any(d.startswith(p + os.sep) for d in self.dirs):
            size, mtime_ns, mode = 0, 0, stat.S_IFDIR | 0o555
        else:
            return None
        self.served.add(p)
        t = mtime_ns / 1e9
        return os.stat_result(
            (mode, 0, 0, 1, 0, 0, size, t, t, t),
            {"st_atime_ns": mtime_ns, "st_mtime_ns": mtime_ns, "st_ctime_ns": mtime_ns},
        )

    def names(self, p: str) -> list[str] | None:
        entries = self.dirs.get(p)
        if entries is None:
            return None
        self.served.add(p)
        return [e[0] for e in entries]


class _GhostEntry:
    """An ``os.DirEntry`` of a recorded folder that is gone here."""

    def __init__(self, folder: str, name: str, ghosts: Ghosts) -> None:
        self.name = name
        self.path = os.path.join(folder, name)
        self._ghosts = ghosts

    def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
        st = self._ghosts.stat(self.path)
        if st is None:
            raise _absent(self.path)
        return st

    def is_dir(self, *, follow_symlinks: bool = True) -> bool:
        return self.path in self._ghosts.dirs

    def is_file(self, *, follow_symlinks: bool = True) -> bool:
        return self.path in self._ghosts.files

    def is_symlink(self) -> bool:
        return False

    def inode(self) -> int:
        return 0

    def __fspath__(self) -> str:
        return self.path


class _RecordedOnly(FileNotFoundError):
    """A file the recorded run read that is gone where the replay runs."""


@dataclass(slots=True)
class JobFiles:
    """What the recorded job's ranks did to the files, from every rank's ledger: a program finds a
    file another rank wrote (rank 0's checkpoint) as readily as its own."""

    created: set[str] = field(default_factory=set)
    """Paths some rank created (absent when it first wrote them): hidden until the replay writes
    them."""
    writers: dict[str, list[int]] = field(default_factory=dict)
    """Every path a rank wrote, created, renamed or removed, and the ranks that did."""
    known: set[str] = field(default_factory=set)
    """Every path a rank read, wrote or listed (the temp folder is the replay's own elsewhere)."""
    shown: set[str] = field(default_factory=set)
    """Paths another rank created that the replayed rank read in the recorded run: it met them
    there, at a time the ledgers do not say, so a replay of it alone sees them as they are now."""
    as_read: dict[str, dict[str, Any]] = field(default_factory=dict)
    """What the replayed rank read of files made while the job ran (size, mtime, sha256): reading
    the same bytes again is no cause for a divergence."""
    start_ns: int | None = None
    """When the recording began (wall-clock Unix ns, the earliest rank's)."""


def job_files(
    ledgers: Mapping[int, dict[str, Any]], rank: int, *, start_ns: int | None, live: bool
) -> JobFiles:
    """The view's knowledge of what the job did, from the ledgers of its ranks (``ledgers[rank]``
    the replayed rank's). ``live``: every rank runs again (``replay --all-ranks``) and makes what
    the others read, so nothing a rank created is shown before it is made again."""
    job = JobFiles(start_ns=start_ns)
    for r, ledger in sorted(ledgers.items()):
        for w in ledger.get("written", []):
            ranks = job.writers.setdefault(w["path"], [])
            if r not in ranks:
                ranks.append(r)
            if not w.get("existed"):
                job.created.add(w["path"])
        job.known |= {e["path"] for key in ("read", "written", "listed") for e in ledger.get(key, [])}
    own = ledgers.get(rank) or {}
    job.as_read = {e["path"]: e for e in own.get("read", []) if e.get("during_run")}
    if not live:
        job.shown = {e["path"] for e in own.get("read", [])} & job.created
        job.created -= job.shown
    return job


def _sha256(path: str) -> str | None:
    try:
        with (_real.get("open") or builtins.open)(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


class Overlay:
    """The replay's view of the files (module docstring)."""

    def __init__(
        self,
        root: Path,
        created: set[str],
        known: set[str],
        keep: list[str],
        ghosts: Ghosts | None = None,
        job: JobFiles | None = None,
    ) -> None:
        self.ghosts = ghosts or Ghosts({})
        self.job = job or JobFiles()
        self.root = os.path.realpath(root)
        self.created = created  # by the recorded job: absent until the replay writes them
        # another rank's files this rank met (``JobFiles.shown``), and the folders that lead to them
        self.shown = set(self.job.shown)
        for q in self.job.shown:
            while (q := os.path.dirname(q)) and q != os.sep:
                self.shown.add(q)
        self.removed: set[str] = set()  # by the replay
        self.keep = tuple(sorted(os.path.realpath(k).rstrip(os.sep) + os.sep for k in keep))
        self.writes: list[str] = []
        # reads of the recorded job's files made or changed after its run began, as they are now
        self.late: list[dict[str, Any]] = []
        self._checked: set[str] = set()
        # The temp folder is the replay's own, except where the recorded run kept files.
        self.tmp = os.path.realpath(tempfile.gettempdir()) + os.sep
        self.tmp_tops = {k[len(self.tmp) :].split(os.sep)[0] for k in known if k.startswith(self.tmp)}

    # -- mapping -------------------------------------------------------------------------------
    def _path(self, path: Any) -> str | None:
        if isinstance(path, int) or path is None:
            return None
        p = os.path.abspath(os.fsdecode(path))
        if (p + os.sep).startswith(self.keep) or p == self.root or p.startswith(self.root + os.sep):
            return None
        if p.startswith(self.tmp) and p[len(self.tmp) :].split(os.sep)[0] not in self.tmp_tops:
            return None
        return p

    def upper(self, p: str) -> str:
        return self.root + p

    def hidden(self, p: str) -> bool:
        if p in self.removed:
            return True
        if p in self.shown:
            return False
        q = p
        while q and q != os.sep:
            if q in self.created or q in self.removed:
                return True
            q = os.path.dirname(q)
        return False

    def exists_below(self, p: str) -> bool:
        return not self.hidden(p) and _lexists(p)

    def read(self, path: Any, content: bool = False) -> Any:
        """The path to read ``path`` from; raises FileNotFoundError where the view has none.
        ``content``: the caller reads the file's bytes (not only its metadata)."""
        p = self._path(path)
        if p is None:
            return path
        u = self.upper(p)
        if _lexists(u):
            return u
        if self.hidden(p):
            raise _absent(path)
        if content:
            self._check_late(p)
        return path

    def _check_late(self, p: str) -> None:
        """The replay reads the recorded job's file ``p`` as it is now: listed in ``late`` when it
        was last modified after the recorded run began, unless it holds what the replayed rank read
        of it then."""
        start = self.job.start_ns
        if start is None or p in self._checked:
            return
        try:
            st = _o("stat")(p)
        except (OSError, ValueError):
            return
        self._checked.add(p)
        if not stat.S_ISREG(st.st_mode) or st.st_mtime_ns < start:
            return
        then = self.job.as_read.get(p)
        if then is not None and int(then.get("size", -1)) == st.st_size:
            if then.get("sha256") and then["sha256"] == _sha256(p):
                return
            if not then.get("sha256") and int(then.get("mtime_ns", -1)) == st.st_mtime_ns:
                return
        self.late.append({"path": p, "mtime_ns": st.st_mtime_ns, "written_by": self.job.writers.get(p, [])})

    def _gone(self, path: Any) -> str | None:
        """The absolute path when ``path`` is one the recorded run saw and is gone here."""
        p = self._path(path)
        if p is None or self.hidden(p) or _lexists(self.upper(p)) or _lexists(p):
            return None
        return p if self.ghosts.known(p) else None

    def _content_gone(self, path: Any) -> None:
        p = self._gone(path)
        if p is not None and p in self.ghosts.files:
            raise _RecordedOnly(
                errno.ENOENT,
                "the recorded run read this file, which is not where the replay runs: the trace keeps its "
                "size and time, not its content (the replay serves the recorded batches; a program that "
                "reads its data outside a DataLoader needs it here)",
                os.fsdecode(path),
            )

    def write(self, path: Any, copy_up: bool = False) -> Any:
        """The path to write ``path`` at (in the private folder); copies the file up first when
        ``copy_up`` (appending, updating)."""
        p = self._path(path)
        if p is None:
            return path
        u = self.upper(p)
        _o("makedirs")(os.path.dirname(u), exist_ok=True)
        if copy_up and not _lexists(u) and self.exists_below(p) and not _isdir(p):
            shutil.copy2(p, u)
        self.removed.discard(p)
        if p not in self.writes:
            self.writes.append(p)
        return u

    # -- the patched functions -----------------------------------------------------------------
    def open(self, file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if is_write(mode, None):
            target = self.write(file, copy_up="a" in mode or "+" in mode)
        else:
            self._content_gone(file)
            target = self.read(file, content=True)
        return _real["open"](target, mode, *args, **kwargs)

    def os_open(self, path: Any, flags: int, mode: int = 0o777, *, dir_fd: Any = None) -> int:
        if dir_fd is not None:
            return int(_real["os.open"](path, flags, mode, dir_fd=dir_fd))
        if is_write(None, flags):
            target = self.write(path, copy_up=not flags & os.O_TRUNC)
        else:
            self._content_gone(path)
            target = self.read(path, content=True)
        return int(_real["os.open"](target, flags, mode))

    def stat_like(self, name: str) -> Callable[..., Any]:
        real = _real[name]

        def stat(path: Any, *args: Any, dir_fd: Any = None, **kwargs: Any) -> Any:
            if dir_fd is not None:
                return real(path, *args, dir_fd=dir_fd, **kwargs)
            try:
                return real(self.read(path), *args, **kwargs)
            except FileNotFoundError:
                p = self._gone(path)
                if p is None:
                    raise
                return self.ghosts.stat(p)

        return stat

    def listdir(self, path: Any = ".") -> list[Any]:
        p = self._path(path)
        if p is None:
            return list(_real["listdir"](path))
        names = [n for n in self._lower_names(p) if not self.hidden(os.path.join(p, n))]
        u = self.upper(p)
        if _isdir(u):
            names += [n for n in _real["listdir"](u) if n not in names]
        elif not self.exists_below(p):
            recorded = self.ghosts.names(p) if self._gone(path) else None
            if recorded is None:
                raise _absent(path)
            names = recorded
        return [os.fsencode(n) for n in names] if isinstance(path, bytes) else names

    def _lower_names(self, p: str) -> list[str]:
        if not self.exists_below(p) or not _isdir(p):
            return []
        return list(_real["listdir"](p))

    def scandir(self, path: Any = ".") -> Any:
        p = self._path(path)
        if p is None:
            return _real["scandir"](path)
        entries: dict[str, Any] = {}
        u = self.upper(p)
        if self.exists_below(p) and _isdir(p):
            with _real["scandir"](p) as it:
                entries.update((e.name, e) for e in it if not self.hidden(os.path.join(p, e.name)))
        if _isdir(u):
            with _real["scandir"](u) as it:
                entries.update((e.name, e) for e in it)
        elif not self.exists_below(p):
            recorded = self.ghosts.names(p) if self._gone(path) else None
            if recorded is None:
                raise _absent(path)
            entries = {n: _GhostEntry(p, n, self.ghosts) for n in recorded}
        return _Entries(list(entries.values()))

    def mkdir(self, path: Any, mode: int = 0o777, *, dir_fd: Any = None) -> None:
        if dir_fd is not None or self._path(path) is None:
            _real["mkdir"](path, mode, **({"dir_fd": dir_fd} if dir_fd is not None else {}))
            return
        p = self._path(path)
        assert p is not None
        if _lexists(self.upper(p)) or self.exists_below(p):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fsdecode(path))
        _real["mkdir"](self.write(path), mode)

    def rename_like(self, name: str) -> Callable[..., Any]:
        real = _real[name]

        def rename(src: Any, dst: Any, *, src_dir_fd: Any = None, dst_dir_fd: Any = None) -> None:
            if src_dir_fd is not None or dst_dir_fd is not None:
                real(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
                return
            s, d = self._path(src), self._path(dst)
            if s is None and d is None:
                real(src, dst)
                return
            source = self.read(src)
            target = self.write(dst)
            if s is not None and source == src:  # the recorded job's file: copied, never moved
                if _isdir(source):
                    shutil.copytree(source, target, dirs_exist_ok=name == "replace")
                else:
                    shutil.copy2(source, target)
            else:
                real(source, target)
            if s is not None:
                self.removed.add(s)

        return rename

    def remove_like(self, name: str) -> Callable[..., Any]:
        real = _real[name]

        def remove(path: Any, *, dir_fd: Any = None) -> None:
            if dir_fd is not None:
                real(path, dir_fd=dir_fd)
                return
            p = self._path(path)
            if p is None:
                real(path)
                return
            u = self.upper(p)
            if _lexists(u):
                real(u)
            elif not self.exists_below(p):
                raise _absent(path)
            self.removed.add(p)

        return remove

    def rmtree(self, path: Any, *args: Any, **kwargs: Any) -> None:
        p = self._path(path)
        if p is None:
            _real["rmtree"](path, *args, **kwargs)
            return
        u = self.upper(p)
        if _lexists(u):
            _real["rmtree"](u, *args, **kwargs)
        elif not self.exists_below(p):
            raise _absent(path)
        self.removed.add(p)

    def modify_like(self, name: str) -> Callable[..., Any]:
        real = _real[name]

        def modify(path: Any, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("dir_fd") is not None or isinstance(path, int):
                return real(path, *args, **kwargs)
            return real(self.write(path, copy_up=True), *args, **kwargs)

        return modify

    def torch_save(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(f, str | os.PathLike):
                f = self.write(f)
            return original(obj, f, *args, **kwargs)

        return save

    def torch_load(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def load(f: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(f, str | os.PathLike):
                f = self.read(f, content=True)
            return original(f, *args, **kwargs)

        return load


class _Entries:
    """What ``os.scandir`` returns: an iterator of entries that is also a context manager."""

    def __init__(self, entries: list[Any]) -> None:
        self._it: Iterator[Any] = iter(entries)

    def __iter__(self) -> _Entries:
        return self

    def __next__(self) -> Any:
        return next(self._it)

    def __enter__(self) -> _Entries:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._it = iter(())


def originals() -> dict[str, Any]:
    """The functions the view replaces, as they are before it is installed."""
    return {
        "open": builtins.open,
        "os.open": os.open,
        "stat": os.stat,
        "lstat": os.lstat,
        "listdir": os.listdir,
        "scandir": os.scandir,
        "mkdir": os.mkdir,
        "makedirs": os.makedirs,
        "rename": os.rename,
        "replace": os.replace,
        "remove": os.remove,
        "unlink": os.unlink,
        "rmdir": os.rmdir,
        "rmtree": shutil.rmtree,
        "utime": os.utime,
        "chmod": os.chmod,
        "truncate": os.truncate,
    }


def install(root: Path, ledger: dict[str, Any], keep: list[str], job: JobFiles | None = None) -> Overlay:
    """Put the view in place for this process (the replayed program); returns it. ``ledger``: the
    replayed rank's; ``job``: what all ranks did (``job_files``; default: this rank's ledger alone)."""
    import torch
    import torch.serialization

    if job is None:
        job = job_files({0: ledger}, 0, start_ns=None, live=True)
    # the temp folder is the replay's own, except where the recorded job kept, read or listed files
    keep = [*excluded_roots(), *_cache_roots(), *keep]
    view = Overlay(root, set(job.created), job.known, keep, Ghosts(ledger), job)
    Path(view.root).mkdir(parents=True, exist_ok=True)
    _real.update(originals())
    builtins.open = io.open = view.open
    os.open = view.os_open
    os.stat = view.stat_like("stat")
    os.lstat = view.stat_like("lstat")
    os.listdir = view.listdir
    os.scandir = view.scandir
    os.mkdir = view.mkdir
    os.rename = view.rename_like("rename")
    os.replace = view.rename_like("replace")
    os.remove = view.remove_like("remove")
    os.unlink = view.remove_like("unlink")
    os.rmdir = view.remove_like("rmdir")
    shutil.rmtree = view.rmtree  # type: ignore[assignment]
    os.utime = view.modify_like("utime")
    os.chmod = view.modify_like("chmod")
    os.truncate = view.modify_like("truncate")
    torch.save = torch.serialization.save = view.torch_save(torch.serialization.save)
    torch.load = torch.serialization.load = view.torch_load(torch.serialization.load)
    return view


def map_ledger(ledger: dict[str, Any], pairs: list[tuple[str, str]]) -> dict[str, Any]:
    """The ledger with the recorded run's folders where they are here (``replay --cwd/--map``)."""
    from fsdp_replay.replayer.launch import mapped

    if not pairs:
        return ledger
    out = dict(ledger)
    for key in ("read", "written", "listed"):
        out[key] = [{**e, "path": mapped(e["path"], pairs)} for e in ledger.get(key, [])]
    return out


def changed_inputs(ledger: dict[str, Any]) -> list[dict[str, Any]]:
    """The files the recorded run read (before writing them) that are not as they were then."""
    from fsdp_replay.agent.files import identity

    changed = []
    for rec in ledger.get("read", []):
        if rec.get("during_run"):  # made while the job ran (by its native code): not its input
            continue
        now = identity(rec["path"])
        if now is None:
            changed.append({"path": rec["path"], "what": "missing"})
        elif now["size"] != rec["size"]:
            # not the sizes: a crafted ledger must not make a replay tell any file's size here
            changed.append({"path": rec["path"], "what": "its size differs from the recorded one"})
        elif rec.get("sha256") and now.get("sha256") and now["sha256"] != rec["sha256"]:
            changed.append({"path": rec["path"], "what": "its content differs (sha256)"})
        elif not rec.get("sha256") and now["mtime_ns"] != rec["mtime_ns"]:
            changed.append({"path": rec["path"], "what": "modified since (mtime; too large to hash)"})
    return changed


def isolate(
    ledger: dict[str, Any], root: Path, keep: list[str], notes: list[str], job: JobFiles | None = None
) -> tuple[Overlay, list[dict[str, Any]]]:
    """Check the recorded inputs, then put the view in place: (the view, the changed inputs)."""
    changed = changed_inputs(ledger)
    if changed:
        listed = ", ".join(f"{c['path']} ({c['what']})" for c in changed[:5])
        more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
        notes.append(f"files the recorded run read have changed since the recording: {listed}{more}")
    if ledger.get("overflow"):
        notes.append(f"the recording's file ledger was full: {ledger['overflow']} paths were not kept")
    for c in changed:  # changed by the recorded job itself: its old content is in no trace
        if job is not None and c["path"] in job.writers:
            c["written_by"] = job.writers[c["path"]]
    if job is not None and job.shown:
        shown = sorted(job.shown)
        notes.append(
            f"{len(shown)} file{'s' if len(shown) > 1 else ''} another rank created while the job ran "
            f"({', '.join(shown[:3])}{' ...' if len(shown) > 3 else ''}) "
            f"{'are' if len(shown) > 1 else 'is'} shown as now: the recorded rank read "
            f"{'them' if len(shown) > 1 else 'it'} at a time the ledgers do not keep (replay --all-ranks "
            "makes them again)"
        )
    return install(root, ledger, keep, job), changed
