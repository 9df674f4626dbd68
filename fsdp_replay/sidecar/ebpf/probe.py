"""Attach the uprobes with bcc, keep the pid filter current, deliver decoded records.

A uprobe belongs to a file (an inode), not to a process: attached without a pid it fires in
every process that maps that file. So by default (scope "file") each distinct library is attached
once, whichever process it was found in, and the kernel-side pid filter decides whose calls are
recorded; scope "process" attaches per tracked process instead, which keeps the breakpoints out of
everyone else's memory. The library a process uses is the one in its ``/proc/<pid>/maps`` (torch
loads the pip copy ``nvidia/nccl/lib/libnccl.so.2`` through its RPATH, not the system one), opened
through ``/proc/<pid>/root`` so that a library inside another container's mount namespace is the
one attached.

bcc is imported here, and only inside functions: importing this module needs neither bcc nor root.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any

from fsdp_replay.errors import FsdpReplayError
from fsdp_replay.sidecar import procfs
from fsdp_replay.sidecar.ebpf import elf, nccl, programs, records
from fsdp_replay.sidecar.ebpf.events import Attachment, Callback, Event, ProbeStats
from fsdp_replay.sidecar.ebpf.signatures import Signature

__all__ = ["Attachment", "Callback", "Event", "Probe", "ProbeError", "ProbeStats"]

log = logging.getLogger(__name__)

AUTO = "auto"
SCOPE_FILE = "file"
"""One attachment per library file: its breakpoints fire in every process on the node that maps
it, and the kernel pid filter drops the calls of untracked ones (they still pay the trap)."""
SCOPE_PROCESS = "process"
"""One attachment per (file, tracked process): breakpoints only in tracked processes' memory."""


class ProbeError(FsdpReplayError, RuntimeError):
    """The probes could not be compiled, loaded or attached (not root, no bcc, no headers...)."""


class Probe:
    """Uprobes on ``signatures`` in the libraries of tracked processes, records to ``callback``.

    Typical use in the sidecar: ``probe.track(pid)`` for each new training process (adds it to
    the kernel pid filter, attaches its libraries not attached yet), ``probe.untrack(pid)`` when
    it exits, ``probe.poll()`` in a loop. Needs root (CAP_BPF/CAP_PERFMON/CAP_SYS_ADMIN) and bcc.

    ``scope``: "file" (default) attaches each library file once; every process on the node that
    maps that file then takes the breakpoint (measured ~2 us per call with uprobe+uretprobe, even
    when the pid filter drops it). "process" attaches per tracked process, so that untracked ones
    (another pod on the node sharing the image layer) pay nothing, at the price of two perf
    events per function per process (bcc's default limit: 1000, ``BCC_PROBE_LIMIT``).

    ``pid_namespace``: whose pids ``track`` takes and records carry. "auto" (default): the
    namespace of ``proc_root``'s processes, so that a sidecar in a pod (shareProcessNamespace) filters
    and reports the pod's pids, and the host's ids where that is the host's namespace.
    """

    def __init__(
        self,
        signatures: Sequence[Signature] = nccl.API,
        callback: Callback | None = None,
        *,
        library_pattern: str = nccl.LIBRARY_PATTERN,
        pid_filter: bool = True,
        returns: bool = True,
        scope: str = SCOPE_FILE,
        transport: str = AUTO,
        ringbuf_pages: int = 1024,
        perf_pages: int = 256,
        perf_wakeup_events: int = 32,
        proc_root: str = procfs.PROC_ROOT,
        pid_namespace: tuple[int, int] | str | None = AUTO,
    ) -> None:
        self.signatures = tuple(signatures)
        self.library_pattern = library_pattern
        self.pid_filter = pid_filter
        self.returns = returns
        self.proc_root = proc_root
        self._callback = callback
        if scope not in (SCOPE_FILE, SCOPE_PROCESS):
            raise ValueError(f"scope must be {SCOPE_FILE!r} or {SCOPE_PROCESS!r}, not {scope!r}")
        self.scope = scope
        self._attachments: dict[tuple[int, int], Attachment] = {}
        self._targets: dict[tuple[int, int], list[tuple[int, elf.Symbol]]] = {}
        self._attached: set[tuple[tuple[int, int], int | None]] = set()
        self._pid_events: dict[int, list[bytes]] = {}
        self._pids: set[int] = set()
        self._delivered = 0
        self._perf_lost = 0
        self._callback_errors = 0
        self._first_error: BaseException | None = None
        self._lock = threading.Lock()
        self._attach_lock = threading.Lock()
        self._poll_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._bpf: Any = None
        self.transport = ""
        if transport not in (AUTO, *programs.TRANSPORTS):
            raise ValueError(f"transport must be auto, ringbuf or perf, not {transport!r}")
        tries = programs.TRANSPORTS if transport == AUTO else (transport,)
        if pid_namespace == AUTO:
            pid_namespace = procfs.pid_namespace(proc_root)
        elif isinstance(pid_namespace, str):
            raise ValueError(f"pid_namespace must be auto, None or (device, inode), not {pid_namespace!r}")
        self.pid_namespace = pid_namespace
        bpf_class = _bcc()
        errors: list[str] = []
        for t in tries:
            text = programs.build_program(
                self.signatures,
                pid_filter=pid_filter,
                returns=returns,
                transport=t,
                ringbuf_pages=ringbuf_pages,
                pid_namespace=pid_namespace,
            )
            try:
                self._bpf = _compile(bpf_class, text)
            except ProbeError as e:
                errors.append(f"{t}: {e}")
                continue
            self.transport = t
            break
        else:
            raise ProbeError("could not load the BPF program: " + "; ".join(errors))
        events = self._table(programs.MAP_EVENTS)
        if self.transport == programs.RINGBUF:
            events.open_ring_buffer(self._on_ringbuf)
        else:
            # Waking the reader for every record costs the traced thread (the wakeup is raised in
            # its context): ~22 us per call flat out with wakeup_events=1, against 5-7 us with 32
            # (tests/sidecar/helpers/overhead.py). poll() drains the remainder below the threshold.
            events.open_perf_buffer(
                self._on_perf, page_cnt=perf_pages, lost_cb=self._on_lost, wakeup_events=perf_wakeup_events
            )

    def _table(self, name: str) -> Any:
        return self._bpf[name.encode()]  # bcc warns (an error under pytest) on str names

    # -- libraries --------------------------------------------------------------------------
    def attach_library(self, path: str, pid: int | None = None) -> Attachment:
        """Attach every signature that ``path`` defines.

        Scope "file": once per distinct file (``pid`` is ignored). Scope "process": once per
        (file, ``pid``), so that the breakpoints exist only in that process's memory."""
        try:
            st = os.stat(path)
        except OSError as e:
            raise ProbeError(f"cannot open {path}: {e}") from e
        file_id = (st.st_dev, st.st_ino)
        owner = pid if self.scope == SCOPE_PROCESS else None
        if self.scope == SCOPE_PROCESS and pid is None:
            raise ValueError('scope="process" attaches per process: pass the pid')
        with self._attach_lock:
            att = self._attachments.get(file_id)
            if att is None:
                att, targets = self._resolve(path, file_id)
                self._attachments[file_id] = att
                self._targets[file_id] = targets
                log.info(
                    "%s: %d functions to probe (absent: %s)",
                    path,
                    len(att.probed),
                    ", ".join(att.missing) or "none",
                )
            if (file_id, owner) not in self._attached:
                self._attach_targets(path, self._targets[file_id], owner)
                self._attached.add((file_id, owner))
            return att

    def _resolve(
        self, path: str, file_id: tuple[int, int]
    ) -> tuple[Attachment, list[tuple[int, elf.Symbol]]]:
        wanted = [s for sig in self.signatures for s in sig.symbols]
        try:
            symbols = elf.function_symbols(path, wanted)
        except (OSError, elf.ElfError) as e:
            raise ProbeError(f"cannot read the symbols of {path}: {e}") from e
        probed: dict[str, str] = {}
        missing: list[str] = []
        aliases: dict[str, str] = {}
        at_address: dict[int, str] = {}
        targets: list[tuple[int, elf.Symbol]] = []
        for probe_id, sig in enumerate(self.signatures):
            sym = next((symbols[s] for s in sig.symbols if s in symbols), None)
            if sym is None:
                missing.append(sig.name)
                continue
            if sym.address in at_address:  # ncclX and pncclX: one probe point
                aliases[sig.name] = at_address[sym.address]
                continue
            at_address[sym.address] = sig.name
            targets.append((probe_id, sym))
            probed[sig.name] = sym.name
        return Attachment(path, file_id, probed, tuple(missing), aliases), targets

    def _attach_targets(self, path: str, targets: list[tuple[int, elf.Symbol]], pid: int | None) -> None:
        name = os.fsencode(path)
        before = set(self._bpf.uprobe_fds)
        try:
            for probe_id, sym in targets:
                entry = programs.event_func(probe_id).encode()
                self._bpf.attach_uprobe(name=name, addr=sym.address, fn_name=entry, pid=pid or -1)
                if self.returns:
                    ret = programs.return_func(probe_id).encode()
                    self._bpf.attach_uretprobe(name=name, addr=sym.address, fn_name=ret, pid=pid or -1)
        except Exception as e:  # bcc raises bare Exception
            raise ProbeError(f"cannot attach to {path}: {e}") from e
        finally:
            if pid is not None:
                # Remember the events, to detach them by name once the process is gone (bcc's
                # detach_uprobe re-reads the file, which may have gone with the process).
                self._pid_events.setdefault(pid, []).extend(set(self._bpf.uprobe_fds) - before)

    @property
    def attachments(self) -> list[Attachment]:
        """One per distinct library file found so far."""
        with self._attach_lock:
            return list(self._attachments.values())

    @property
    def probe_points(self) -> int:
        """uprobes and uretprobes attached now (one perf event each; scope "process": per process)."""
        with self._attach_lock:
            return len(self._bpf.uprobe_fds) if self._bpf is not None else 0

    # -- processes --------------------------------------------------------------------------
    def track(self, pid: int, libraries: Sequence[str] | None = None) -> list[Attachment]:
        """Record ``pid`` from now on, attaching the libraries it maps (or ``libraries``: host paths)."""
        self.allow(pid)
        if libraries is None:
            try:
                found = procfs.mapped_files(pid, self.library_pattern, self.proc_root)
            except OSError:
                return []  # exited meanwhile
            libraries = [procfs.host_path(pid, m, self.proc_root) for m in found]
        return [self.attach_library(p, pid) for p in libraries]

    def allow(self, pid: int) -> None:
        """Add ``pid`` (a tgid) to the kernel pid filter."""
        if self.pid_filter:
            table = self._table(programs.MAP_PIDS)
            table[ctypes.c_uint32(pid)] = ctypes.c_uint8(1)
        with self._lock:
            self._pids.add(pid)

    def untrack(self, pid: int) -> None:
        """Stop recording ``pid``: remove it from the filter, detach its probes (scope "process"),
        and forget its calls still in flight (it exited mid-call)."""
        if self.pid_filter:
            table = self._table(programs.MAP_PIDS)
            with contextlib.suppress(KeyError):
                del table[ctypes.c_uint32(pid)]
        with self._attach_lock:
            for ev_name in self._pid_events.pop(pid, []):
                with contextlib.suppress(Exception):  # bcc raises bare Exception
                    self._bpf.detach_uprobe_event(ev_name)
            self._attached = {(f, owner) for f, owner in self._attached if owner != pid}
        if self.returns:
            inflight = self._table(programs.MAP_INFLIGHT)
            for key, value in list(inflight.items()):
                if value.pid == pid:
                    with contextlib.suppress(KeyError):  # returned meanwhile
                        del inflight[key]
        with self._lock:
            self._pids.discard(pid)

    @property
    def pids(self) -> set[int]:
        with self._lock:
            return set(self._pids)

    # -- delivery ---------------------------------------------------------------------------
    def _deliver(self, data: int, size: int) -> None:
        try:
            rec = records.Record()
            ctypes.memmove(ctypes.addressof(rec), data, min(size, records.RECORD_SIZE))
            self._delivered += 1
            if self._callback is not None:
                self._callback(Event(rec, self.signatures[rec.probe_id]))
        except Exception as e:  # never let it unwind into bcc's C loop
            self._callback_errors += 1
            if self._first_error is None:
                self._first_error = e

    def _on_ringbuf(self, _ctx: Any, data: int, size: int) -> int:
        self._deliver(data, size)
        return 0

    def _on_perf(self, _cpu: int, data: int, size: int) -> None:
        self._deliver(data, size)

    def _on_lost(self, lost: int) -> None:
        self._perf_lost += int(lost)

    def poll(self, timeout_ms: int = 100) -> int:
        """Deliver what is buffered (waiting up to ``timeout_ms``); returns how many records.

        An exception raised by the callback is re-raised here, once, after the batch. Safe to
        call from several threads (polls are serialized)."""
        with self._poll_lock:
            before = self._delivered
            if self.transport == programs.RINGBUF:
                self._bpf.ring_buffer_poll(timeout_ms)
            else:
                self._bpf.perf_buffer_poll(timeout_ms)
                self._bpf.perf_buffer_consume()
            delivered = self._delivered - before
            err, self._first_error = self._first_error, None
        if err is not None:
            raise err
        return delivered

    def drain(self, quiet_ms: int = 200, timeout_s: float = 30.0) -> int:
        """Poll until nothing arrives for ``quiet_ms``; returns how many records were delivered."""
        total = 0
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            n = self.poll(quiet_ms)
            total += n
            if n == 0:
                break
        return total

    def start(self, timeout_ms: int = 100) -> None:
        """Poll in a background thread (the callback then runs there) until ``stop()``."""
        if self._thread is not None:
            return
        self._stop.clear()

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.poll(timeout_ms)
                except Exception:
                    log.exception("sidecar probe callback failed")

        self._thread = threading.Thread(target=loop, name="fsdp-replay-probe", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    # -- state ------------------------------------------------------------------------------
    def in_flight(self) -> list[Event]:
        """Calls entered and not returned yet (a hang inside NCCL shows up here)."""
        if not self.returns:
            return []
        out = []
        for _key, value in self._table(programs.MAP_INFLIGHT).items():
            rec = records.Record()
            ctypes.memmove(ctypes.addressof(rec), ctypes.addressof(value), records.RECORD_SIZE)
            rec.kind = records.KIND_INFLIGHT
            out.append(Event(rec, self.signatures[rec.probe_id]))
        return sorted(out, key=lambda e: e.ts_ns)

    def stats(self) -> ProbeStats:
        stats = self._table(programs.MAP_STATS)
        hits = self._table(programs.MAP_HITS)

        def total(table: Any, i: int) -> int:
            return int(sum(table[ctypes.c_int(i)]))

        values = {name: total(stats, i) for i, name in enumerate(programs.STAT_NAMES)}
        return ProbeStats(
            entries=values["entries"],
            emitted=values["emitted"],
            delivered=self._delivered,
            output_full=values["output_full"],
            inflight_full=values["inflight_full"],
            perf_lost=self._perf_lost,
            callback_errors=self._callback_errors,
            hits={sig.name: total(hits, i) for i, sig in enumerate(self.signatures)},
        )

    def close(self) -> None:
        """Detach every probe and free the program."""
        self.stop()
        if self._bpf is not None:
            self._bpf.cleanup()
            self._bpf = None

    def __enter__(self) -> Probe:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _bcc() -> Any:
    try:
        from bcc import BPF
    except ImportError as e:
        raise ProbeError(
            "the bcc Python bindings are not importable (Debian python3-bpfcc; "
            "scripts/install-ebpf.sh VENV makes them visible to a virtualenv)"
        ) from e
    return BPF


def _compile(bpf_class: Any, text: str) -> Any:
    try:
        return bpf_class(text=text.encode())
    except Exception as e:  # bcc raises bare Exception for compile and load errors
        raise ProbeError(f"bcc could not compile or load the program: {e}") from e
