"""The sidecar daemon: discovery -> probes, spools -> rank states, both -> ``/metrics``.

One loop, every ``poll_interval_s``:

1. ``Discovery.poll()``: training processes that started, exited, or mapped a new libnccl. Started
   and changed ones are tracked by the probe (pid filter, libraries attached), exited ones
   untracked (torchrun restarts workers under new pids); their CPU and memory are sampled.
2. Every rank folder under ``OUT/spool`` gets a ``SpoolFollower`` as it appears; the records each
   poll returns feed that rank's ``RankState``.
3. The probe's counters are copied into the state.
4. Ranks newly stuck in a collective (a hang): a dump request (``OUT/spool/dump-request``) asks
   every live rank's agent to write its state (its threads' stacks, the collective in flight);
   once each answered, or after ``hang_dump_wait_s``, the trace is collected, so that the store
   holds the hang while the job still hangs.

The probe delivers NCCL calls on its own thread (``Probe.start``) straight into ``NcclStats``; the
HTTP server answers scrapes on its own threads and reads the state under its lock. eBPF is
optional: without bcc or root the sidecar says so once, exports ``fsdp_replay_sidecar_ebpf_enabled
0`` and does everything else. SIGTERM or SIGINT stop it cleanly: a last pass over the spools, the
probes detached, then the server stopped. In ``container`` mode (a plain sidecar container, which
nothing stops) it exits 0 by itself once the training processes it saw have ended and no spool has
grown for ``exit_quiet_s`` (which also leaves Prometheus a few scrapes of the final values).

Run it as ``fsdp-replay sidecar`` or ``python -m fsdp_replay.sidecar.main``.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

import psutil

from fsdp_replay.errors import FsdpReplayError, TraceFormatError
from fsdp_replay.sidecar import procfs
from fsdp_replay.sidecar.config import MODE_CONTAINER, SidecarConfig
from fsdp_replay.sidecar.discovery import Discovery, TrainingProcess
from fsdp_replay.sidecar.ebpf import nccl
from fsdp_replay.sidecar.metrics import SidecarCollector, SidecarState, make_registry
from fsdp_replay.sidecar.ncclstats import NcclStats
from fsdp_replay.sidecar.ranks import RankState
from fsdp_replay.sidecar.server import MetricsServer
from fsdp_replay.sidecar.ship import Shipper
from fsdp_replay.trace import schema, spool
from fsdp_replay.trace.dump_request import write_request
from fsdp_replay.trace.follow import SpoolFollower
from fsdp_replay.trace.layout import dump_request_path

if TYPE_CHECKING:
    from fsdp_replay.sidecar.ebpf.probe import Probe

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PendingDump:
    """A dump request written at a hang, whose answers the next polls look for."""

    rid: int
    ranks: frozenset[int]
    """The live ranks when it was written: those expected to answer."""
    deadline: float
    asked: float


APPLY_BATCH = 2048
"""Records applied per hold of the state lock, so that a scrape never waits long behind a big poll."""
FORGET_AFTER_S = 5.0
"""How long an exited process's rank label is kept for its NCCL calls still in the probe's buffer."""


class Sidecar:
    """The daemon. ``run()`` blocks until ``stop()`` (or, where configured, the trainers' end)."""

    def __init__(self, config: SidecarConfig, *, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.state = SidecarState(
            info={
                "mode": config.mode,
                "pod_name": config.pod_name,
                "pod_namespace": config.pod_namespace,
                "pod_uid": config.pod_uid,
                "node_name": config.node_name,
                "containers": ",".join(config.containers),
            }
        )
        self.collector = SidecarCollector(self.state, clock=clock)
        self.registry = make_registry(self.collector)
        self.discovery = Discovery(config.proc_root, library_pattern=nccl.LIBRARY_PATTERN)
        self.spool_root = Path(config.out) / schema.SPOOL_DIR
        self.followers: dict[int, SpoolFollower] = {}
        self.shipper = Shipper(
            config.out,
            config.store,
            interval_s=config.collect_interval_s,
            keep_spools=config.keep_spools,
            signing_key=config.signing_key,
            stats=self.state.ship,
            lock=self.state.lock,
            clock=clock,
        )
        self.server: MetricsServer | None = None
        self.probe: Probe | None = None
        self._stop = threading.Event()
        self._broken: set[int] = set()
        self._forget: list[tuple[float, TrainingProcess]] = []
        self._quiet: tuple[float, int] | None = None
        self._hang_captured: frozenset[int] = frozenset()
        self._dump: PendingDump | None = None
        self._warned: set[str] = set()

    # -- life cycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Serve ``/metrics`` and ``/healthz`` first (readiness must not wait), then load the probe."""
        c = self.config
        self.server = MetricsServer(self.registry, c.metrics_address, c.metrics_port).start()
        log.info(
            "serving /metrics and /healthz on %s:%d; spools under %s",
            c.metrics_address,
            self.server.port,
            self.spool_root,
        )
        if c.ebpf:
            self._start_probe()
        else:
            self.state.ebpf.reason = "disabled by configuration"
            log.info("eBPF disabled by configuration")

    def _start_probe(self) -> None:
        from fsdp_replay.sidecar.ebpf.probe import Probe, ProbeError

        stats = NcclStats(nccl.API, max_comms=self.config.max_comm_labels)
        try:
            probe = Probe(
                nccl.API, stats.on_event, scope=self.config.probe_scope, proc_root=self.config.proc_root
            )
        except ProbeError as e:
            self.state.ebpf.reason = str(e)
            log.warning("fsdp-replay sidecar: eBPF unavailable, running without it: %s", e)
            return
        probe.start()
        self.probe = probe
        with self.state.lock:
            self.state.nccl = stats
            self.state.ebpf.enabled = True
        log.info("eBPF uprobes loaded (%s transport, scope %s)", probe.transport, probe.scope)

    def stop(self) -> None:
        """Ask ``run()`` to finish (safe from a signal handler or another thread)."""
        self._stop.set()

    def run(self) -> int:
        """Start, loop until stopped, shut down cleanly; returns the exit code (0)."""
        self.start()
        try:
            while not self._stop.is_set():
                try:
                    self.step()
                except Exception as e:  # one bad poll (a vanished file, a bcc error) must not end it
                    with self.state.lock:
                        self.state.loop_errors += 1
                    if f"{type(e).__name__}: {e}" not in self._warned:
                        self._warned.add(f"{type(e).__name__}: {e}")
                        log.exception("a poll failed (counted in fsdp_replay_sidecar_loop_errors_total)")
                if self.config.exits_when_trainers_end and self.trainers_done():
                    log.info("the training processes have ended and the spools are quiet: exiting")
                    break
                self._stop.wait(self.config.poll_interval_s)
        finally:
            self.shutdown()
        return 0

    def shutdown(self) -> None:
        """A last pass over the spools (their tails final if no trainer runs), probes detached,
        server stopped. Idempotent."""
        try:
            self._follow(final=not self.discovery.processes)
            self._probe_state()
            self._log_summary()
            self._ship(final=not self.discovery.processes)
        finally:
            if self.probe is not None:
                self.probe.close()  # detaches every probe point (~0.1 s each on this kernel)
                self.probe = None
                with self.state.lock:
                    self.state.ebpf.processes_tracked = self.state.ebpf.probe_points = 0
            if self.server is not None:
                self.server.stop()
                self.server = None
            for f in self.followers.values():
                f.close()

    # -- one iteration ------------------------------------------------------------------------
    def step(self, now: float | None = None) -> None:
        """Discovery, probes, process usage, spools, probe counters: one poll's worth."""
        now = time.monotonic() if now is None else now
        update = self.discovery.poll()
        for proc in update.exited:
            self._untrack(proc, now)
        for proc in (*update.started, *update.changed):
            self._track(proc)
        # The probe's state before the processes' usage: a scrape that shows a new process shows
        # it tracked and attached too.
        self._probe_state()
        live = list(self.discovery.processes.values())
        with self.state.lock:
            self.state.trainers_seen += len(update.started)
            self.state.unreadable_processes = self.discovery.unreadable
            self.state.processes.update(live)
        self._forget_exited(now)
        self._follow(final=False)
        hang = bool(live) and self._hang_to_capture()
        if hang and self.config.hang_dump_wait_s > 0 and self._ask_for_state(now):
            hang = False  # collected once the ranks answered, or at the deadline
        if self._dump is not None and self._dump_settled(now):
            hang = True
        if live and (hang or self.shipper.due(now)):
            self._ship(final=False, now=now)

    def _ship(self, *, final: bool, now: float | None = None) -> None:
        if self.shipper.ship(final=final, now=now):
            with self.state.lock:
                for rank, held in self.shipper.collected.items():
                    rs = self.state.ranks.get(rank)
                    if rs is not None:
                        rs.collected_bytes = held

    def _track(self, proc: TrainingProcess) -> None:
        if self.probe is None:
            return
        from fsdp_replay.sidecar.ebpf.probe import ProbeError

        if self.state.nccl is not None:
            self.state.nccl.set_rank(proc.pid, proc.rank)
        libraries = [procfs.host_path(proc.pid, m, self.config.proc_root) for m in proc.libraries]
        try:
            self.probe.track(proc.pid, [])
            for path in libraries:
                try:
                    att = self.probe.track(proc.pid, [path])[0]
                except ProbeError as e:
                    with self.state.lock:
                        self.state.ebpf.attach_errors += 1
                    self._warn_once(f"attach:{path}", "cannot probe %s (pid %d): %s", path, proc.pid, e)
                    continue
                log.info(
                    "pid %d (rank %s): probing %s (%d functions)", proc.pid, proc.rank, path, len(att.probed)
                )
        except (ProbeError, OSError) as e:
            self._warn_once(f"track:{proc.pid}", "cannot track pid %d: %s", proc.pid, e)

    def _untrack(self, proc: TrainingProcess, now: float) -> None:
        if self.probe is not None:
            self.probe.untrack(proc.pid)
            self._forget.append((now + FORGET_AFTER_S, proc))

    def _forget_exited(self, now: float) -> None:
        stats, keep = self.state.nccl, []
        for due, proc in self._forget:
            if due > now:
                keep.append((due, proc))
            elif stats is not None and proc.pid not in self.discovery.processes:
                stats.forget(proc.pid)  # not if the pid is already another training process's
        self._forget = keep

    def _follow(self, *, final: bool) -> None:
        for rank, folder in spool.spool_ranks(self.spool_root).items():
            if rank not in self.followers:
                self.followers[rank] = SpoolFollower(folder)
                with self.state.lock:
                    self.state.ranks[rank] = RankState(rank, skip_steps=self.config.cost_skip_steps)
                log.info("following the spool of rank %d (%s)", rank, folder)
        for rank, follower in self.followers.items():
            if rank in self._broken:
                continue
            seen = len(follower.report.damage)
            try:
                records = follower.finish() if final else follower.poll()
            except TraceFormatError as e:  # a segment of another format version
                self._broken.add(rank)
                with self.state.lock:
                    self.state.read_errors[rank] = self.state.read_errors.get(rank, 0) + 1
                log.error("rank %d: cannot read its spool, no longer following it: %s", rank, e)
                continue
            new_damage = follower.report.damage[seen:]
            for d in new_damage:
                log.warning("rank %d: damaged spool: %s", rank, d)
            rs = self.state.ranks[rank]
            for i in range(0, max(len(records), 1), APPLY_BATCH):
                with self.state.lock:
                    for rec in records[i : i + APPLY_BATCH]:
                        rs.apply(rec)
            with self.state.lock:
                rs.add_damage(new_damage)
                rs.bytes_read = follower.bytes_read
                rs.disk_bytes = follower.disk_bytes

    def _probe_state(self) -> None:
        probe = self.probe
        if probe is None:
            return
        stats = probe.stats()
        tracked, attached, points = len(probe.pids), len(probe.attachments), probe.probe_points
        with self.state.lock:
            e = self.state.ebpf
            e.stats, e.processes_tracked, e.libraries_attached, e.probe_points = (
                stats,
                tracked,
                attached,
                points,
            )

    def _hang_to_capture(self) -> bool:
        """Ranks newly stuck in a collective (their agents noted it): collect now, while the job
        hangs, so that the store's trace holds where each rank waits (``fsdp-replay desync``)."""
        with self.state.lock:
            stuck = frozenset(
                r for r, s in self.state.ranks.items() if s.stuck_seq is not None and not s.ended
            )
        if not stuck or stuck <= self._hang_captured:
            self._hang_captured &= stuck
            return False
        self._hang_captured = stuck
        log.warning(
            "ranks %s are stuck in a collective: collecting the trace%s, so that it holds the hang",
            sorted(stuck),
            " once every rank wrote its state" if self.config.hang_dump_wait_s > 0 else " now",
        )
        return True

    def _ask_for_state(self, now: float) -> bool:
        """Write a dump request (``trace/dump_request.py``) for every live rank to answer; False
        where it could not be written (then the trace is collected at once)."""
        with self.state.lock:
            live = frozenset(r for r, s in self.state.ranks.items() if not s.ended)
        if self._dump is not None:  # more ranks stuck while the last request's answers came in
            log.info("dump request %d is superseded by a new one (more ranks are stuck)", self._dump.rid)
            self._dump = None
        reason = f"sidecar: ranks {sorted(self._hang_captured)} stuck in a collective"
        try:
            req = write_request(self.config.out, reason)
        except (OSError, FsdpReplayError) as e:
            log.warning("cannot write the dump request, collecting without the ranks' state: %s", e)
            return False
        with self.state.lock:
            self.state.hang.requests += 1
        self._dump = PendingDump(req.id, live, now + self.config.hang_dump_wait_s, now)
        log.info(
            "dump request %d written (%s): waiting up to %.0f s for ranks %s to write their state",
            req.id,
            dump_request_path(self.config.out),
            self.config.hang_dump_wait_s,
            sorted(live),
        )
        return True

    def _dump_settled(self, now: float) -> bool:
        """True once every rank asked has answered the pending request (or ended), or its time is
        up: the request is closed, counted and logged, and the trace is to be collected."""
        d = self._dump
        assert d is not None
        with self.state.lock:
            ranks = self.state.ranks
            answered = sorted(r for r in d.ranks if r in ranks and d.rid in ranks[r].state_ids)
            waiting = sorted(r for r in d.ranks if r not in answered and not (r in ranks and ranks[r].ended))
            if waiting and now < d.deadline:
                return False
            h = self.state.hang
            for r in answered:
                h.answered[r] = h.answered.get(r, 0) + 1
            for r in waiting:
                h.unanswered[r] = h.unanswered.get(r, 0) + 1
        self._dump = None
        if waiting:
            log.warning(
                "dump request %d: ranks %s answered, ranks %s did not within %.0f s (their writer "
                "thread could not run: a thread holding the GIL in C code, or the process is gone); "
                "collecting the trace now",
                d.rid,
                answered,
                waiting,
                self.config.hang_dump_wait_s,
            )
        else:
            log.warning(
                "dump request %d: ranks %s wrote their state in %.1f s; collecting the trace now",
                d.rid,
                answered,
                now - d.asked,
            )
        return True

    # -- container mode -----------------------------------------------------------------------
    def trainers_done(self, now: float | None = None) -> bool:
        """True once no training process runs, one was seen (or every rank folder ended), and no
        spool has grown for ``exit_quiet_s``."""
        now = time.monotonic() if now is None else now
        ranks = list(self.state.ranks.values())
        reason = self.state.trainers_seen > 0 or (ranks and all(r.ended for r in ranks))
        if self.discovery.processes or not reason:
            self._quiet = None
            return False
        size = sum(f.disk_bytes for f in self.followers.values())
        if self._quiet is None or self._quiet[1] != size:
            self._quiet = (now, size)
        return now - self._quiet[0] >= self.config.exit_quiet_s

    # -- logging ------------------------------------------------------------------------------
    def _warn_once(self, key: str, msg: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def _log_summary(self) -> None:
        with self.state.lock:
            for rank, r in sorted(self.state.ranks.items()):
                cost = r.cost.per_step_ns()
                log.info(
                    "rank %d: %d steps, %d collectives, %d records, %d damaged spans%s%s",
                    rank,
                    r.steps,
                    r.collective_count,
                    sum(r.records.values()),
                    r.damage,
                    ""
                    if cost is None
                    else f", agent {cost[0] / 1e6:.3f} + writer {cost[1] / 1e6:.3f} ms CPU/step",
                    ", ended" if r.ended else "",
                )


def run(config: SidecarConfig) -> int:
    """Run the daemon in this process until SIGTERM/SIGINT (or the trainers' end in container mode).

    In container mode the exit code is 0 whatever happened (a failed plain sidecar would fail the
    pod, and the user's Job, over a recording problem); elsewhere an unexpected error is 1."""
    if config.proc_root != procfs.PROC_ROOT:
        psutil.PROCFS_PATH = config.proc_root  # psutil's one global; this process is ours
    sidecar = Sidecar(config)

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("signal %d: stopping", signum)
        sidecar.stop()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return sidecar.run()
    except Exception:
        if config.mode != MODE_CONTAINER:
            raise
        log.exception("fsdp-replay sidecar failed; exiting 0 (container mode must not fail the pod)")
        return 0
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


if __name__ == "__main__":
    from fsdp_replay.sidecar.cli import main

    sys.exit(main())
