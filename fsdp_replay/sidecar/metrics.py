"""The sidecar's Prometheus metrics: its own ``CollectorRegistry`` and one custom Collector.

The daemon keeps everything the metrics show in a ``SidecarState`` (rank states from the spools,
NCCL totals from the probe, process usage, eBPF counters); ``SidecarCollector.collect()`` turns
a consistent view of it (under ``state.lock``) into metric families at scrape time, so nothing is
computed between scrapes that nobody reads. Never the global registry (client_python's habit for
a component that may share a process).

Names are ``fsdp_replay_<subsystem>_<what>_<unit>[_total]``; labels are bounded: ``rank`` (a rank
folder, or a process's RANK), ``op`` (a c10d op or an NCCL function), ``comm`` (a communicator
label, limited, see ``ncclstats``), ``reason``, ``kind``, ``type`` and ``function`` (closed sets
from the schema and the NCCL table); never a pid or a sequence number. ``docs/metrics.md`` lists
every metric.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from fsdp_replay import __version__
from fsdp_replay.sidecar.ebpf.events import ProbeStats
from fsdp_replay.sidecar.ncclstats import NcclStats
from fsdp_replay.sidecar.processes import ProcessStats, Usage, own_usage
from fsdp_replay.sidecar.ranks import DROP_REASONS, PAYLOAD_WAIT, RankState
from fsdp_replay.sidecar.ship import ShipStats
from fsdp_replay.trace import schema
from fsdp_replay.trace.redact import scrub_text

PREFIX = "fsdp_replay_"
NS_PER_S = 1e9


@dataclass(slots=True)
class EbpfState:
    """What the daemon knows about its probe (all zero while eBPF is off)."""

    enabled: bool = False
    reason: str = ""
    """Why eBPF is off (no bcc, not root, disabled), empty when on."""
    stats: ProbeStats | None = None
    processes_tracked: int = 0
    libraries_attached: int = 0
    probe_points: int = 0
    attach_errors: int = 0


@dataclass(slots=True)
class HangStats:
    """Dump requests made at hangs (``main.Sidecar``), and which ranks answered them in time."""

    requests: int = 0
    answered: dict[int, int] = field(default_factory=dict)
    """Per rank: requests it answered before the collection."""
    unanswered: dict[int, int] = field(default_factory=dict)
    """Per rank: requests it was live for and did not answer within ``hang_dump_wait_s``."""


@dataclass(slots=True)
class SidecarState:
    """Everything the metrics show. The daemon writes it and the collector reads it under ``lock``."""

    info: dict[str, str] = field(default_factory=dict)
    """Labels of fsdp_replay_sidecar_info (pod identity, mode, containers)."""
    ranks: dict[int, RankState] = field(default_factory=dict)
    read_errors: dict[int, int] = field(default_factory=dict)
    """Per rank: spool reads that failed (a segment of another format version)."""
    nccl: NcclStats | None = None
    ebpf: EbpfState = field(default_factory=EbpfState)
    processes: ProcessStats = field(default_factory=ProcessStats)
    trainers_seen: int = 0
    """Training processes (pid + start time) discovered since start-up."""
    unreadable_processes: int = 0
    loop_errors: int = 0
    """Polls of the daemon's loop that raised (logged once per distinct error)."""
    ship: ShipStats = field(default_factory=ShipStats)
    """The collection of the trace into the store (``ship.py``)."""
    hang: HangStats = field(default_factory=HangStats)
    started_s: float = field(default_factory=time.time)
    lock: threading.RLock = field(default_factory=threading.RLock)


def _name(subsystem: str, what: str) -> str:
    return f"{PREFIX}{subsystem}_{what}"


class SidecarCollector(Collector):
    """Metric families from a ``SidecarState``, built at each scrape."""

    def __init__(
        self,
        state: SidecarState,
        *,
        clock: Callable[[], float] = time.time,
        own: Callable[[], Usage] | None = own_usage,
    ) -> None:
        """``clock``: wall-clock seconds (the ages are relative to it). ``own``: the sidecar's own
        usage (None: not exported, for tests whose numbers must not depend on this process)."""
        self.state = state
        self.clock = clock
        self.own = own

    def collect(self) -> Iterator[Metric]:
        with self.state.lock:
            families = [
                *self._sidecar(),
                *self._store(),
                *self._hang(),
                *self._agent(),
                *self._spool(),
                *self._ebpf(),
                *self._nccl(),
                *self._trainers(),
            ]
        yield from families

    # -- store --------------------------------------------------------------------------------
    def _store(self) -> Iterable[Metric]:
        s = self.state.ship
        yield CounterMetricFamily(
            _name("store", "collections"),
            "Collections of the trace into the store that succeeded.",
            value=s.collections,
        )
        yield CounterMetricFamily(
            _name("store", "collection_failures"),
            "Collections that failed (the store unreachable, the disk full): the spools were kept.",
            value=s.failures,
        )
        yield GaugeMetricFamily(
            _name("store", "last_collection_timestamp_seconds"),
            "When the last successful collection ended (seconds since the epoch; 0: none yet).",
            value=s.last_success_s,
        )
        yield GaugeMetricFamily(
            _name("store", "last_collection_seconds"),
            "How long the last successful collection took.",
            value=s.last_seconds,
        )
        yield CounterMetricFamily(
            _name("store", "spools_deleted"),
            "Rank spools deleted after the store's copy read back whole.",
            value=s.spools_deleted,
        )
        yield CounterMetricFamily(
            _name("store", "rows_written"),
            "Rows the collections wrote into the trace's column arrays (appended, or rewritten after a late row).",
            value=s.rows_written,
        )
        yield CounterMetricFamily(
            _name("store", "blob_written_bytes"),
            "Payload bytes the collections wrote into the store as new blobs (before compression).",
            value=s.blob_bytes_written,
        )
        yield CounterMetricFamily(
            _name("store", "rank_rebuilds"),
            "Rank groups collected again from their spool's start: the store's copy could not be resumed.",
            value=s.rebuilds,
        )

    # -- hang capture -------------------------------------------------------------------------
    def _hang(self) -> Iterable[Metric]:
        h = self.state.hang
        yield CounterMetricFamily(
            _name("hang", "dump_requests"),
            "Dump requests written at a hang (ranks newly stuck), before collecting the trace.",
            value=h.requests,
        )
        answered = CounterMetricFamily(
            _name("hang", "dumps_answered"),
            "Dump requests the rank answered (its state event) before the collection.",
            labels=["rank"],
        )
        unanswered = CounterMetricFamily(
            _name("hang", "dumps_unanswered"),
            "Dump requests the live rank did not answer within hang_dump_wait_s (its writer thread "
            "could not run, or the process is gone).",
            labels=["rank"],
        )
        for rank in sorted({*h.answered, *h.unanswered}):
            answered.add_metric([str(rank)], h.answered.get(rank, 0))
            unanswered.add_metric([str(rank)], h.unanswered.get(rank, 0))
        yield answered
        yield unanswered

    # -- sidecar ------------------------------------------------------------------------------
    def _sidecar(self) -> Iterable[Metric]:
        s = self.state
        yield InfoMetricFamily(
            PREFIX + "sidecar",
            "The sidecar's version, mode and pod identity.",
            # pod identity from the environment: redacted like everything the tool writes
            value={"version": __version__, **{k: scrub_text(v) for k, v in s.info.items()}},
        )
        yield GaugeMetricFamily(
            _name("sidecar", "start_time_seconds"),
            "When the sidecar started (seconds since the epoch).",
            value=s.started_s,
        )
        yield GaugeMetricFamily(
            _name("sidecar", "ebpf_enabled"),
            "1 when the eBPF uprobes on libnccl are loaded, 0 when the sidecar runs without them.",
            value=1.0 if s.ebpf.enabled else 0.0,
        )
        yield GaugeMetricFamily(
            _name("sidecar", "unreadable_processes"),
            "Processes skipped at the last discovery poll because their /proc files could not be read.",
            value=s.unreadable_processes,
        )
        yield CounterMetricFamily(
            _name("sidecar", "loop_errors"),
            "Polls of the sidecar's loop that failed (logged once each).",
            value=s.loop_errors,
        )
        if self.own is not None:
            usage = self.own()
            yield CounterMetricFamily(
                _name("sidecar", "cpu_seconds"),
                "CPU time (user + system) the sidecar used.",
                value=usage.cpu_s,
            )
            yield GaugeMetricFamily(
                _name("sidecar", "resident_memory_bytes"),
                "The sidecar's resident memory.",
                value=usage.rss_bytes,
            )

    # -- agent (what recording costs, as the agents measure it) -------------------------------
    def _agent(self) -> Iterable[Metric]:
        ranks = sorted(self.state.ranks.items())
        per_step = {
            part: GaugeMetricFamily(
                _name("agent", f"{part}_cpu_per_step_seconds"),
                f"Median {label} CPU time per step: the median increment of step.cpu_ns after the "
                "skipped steps, as fsdp-replay inspect's recording_cost.",
                labels=["rank"],
            )
            for part, label in (("hooks", "agent-hooks"), ("writer", "writer-thread"))
        }
        totals = {
            part: CounterMetricFamily(
                _name("agent", f"{part}_cpu_seconds"),
                f"{label} CPU time so far, all attempts (step.cpu_ns, then end.counters).",
                labels=["rank"],
            )
            for part, label in (("hooks", "Agent-hooks"), ("writer", "Writer-thread"))
        }
        ratios = {
            part: GaugeMetricFamily(
                _name("agent", f"{part}_cpu_step_ratio"),
                f"{label} CPU time over wall-clock step time, summed over the steps after the skipped ones.",
                labels=["rank"],
            )
            for part, label in (("hooks", "Agent-hooks"), ("writer", "Writer-thread"))
        }
        waited = CounterMetricFamily(
            _name("agent", "payload_wait_seconds"),
            "Wall time the training waited for room for payloads so far (step/end counters "
            "payload_wait_ns: the writer, the pending bound or a GPU payload ring full, --when-full wait); "
            "all attempts.",
            labels=["rank"],
        )
        by_part = CounterMetricFamily(
            _name("agent", "hooks_part_cpu_seconds"),
            "Agent-hooks CPU time so far by part (step/end counters agent_cpu_<part>_ns): "
            "collectives and tape (their hooks, whole), payloads and snapshots (inside any hook), "
            "cxx (the C++ kernel and tape hook); all attempts.",
            labels=["rank", "part"],
        )
        errors = CounterMetricFamily(
            _name("agent", "errors"),
            "Internal errors of the agent (it stops recording at the first).",
            labels=["rank"],
        )
        dropped = CounterMetricFamily(
            _name("agent", "dropped"),
            "What the agent gave up, by reason (end.counters: blobs_dropped, events_dropped, write_errors).",
            labels=["rank", "reason"],
        )
        dropped_bytes = CounterMetricFamily(
            _name("agent", "dropped_bytes"),
            "Payload bytes the agent dropped (end.counters.blob_bytes_dropped).",
            labels=["rank"],
        )
        for rank, r in ranks:
            lab = [str(rank)]
            cost = r.cost.per_step_ns()
            if cost is not None:
                per_step["hooks"].add_metric(lab, cost[0] / NS_PER_S)
                per_step["writer"].add_metric(lab, cost[1] / NS_PER_S)
            totals["hooks"].add_metric(lab, r.hooks_cpu_ns / NS_PER_S)
            totals["writer"].add_metric(lab, r.writer_cpu_ns / NS_PER_S)
            for part in schema.AGENT_CPU_PARTS:
                by_part.add_metric([*lab, part], r.cpu_part_ns(part) / NS_PER_S)
            waited.add_metric(lab, r.cpu_part_ns(PAYLOAD_WAIT) / NS_PER_S)
            if r.cost.wall_ns_sum > 0:
                ratios["hooks"].add_metric(lab, r.cost.hooks_ns_sum / r.cost.wall_ns_sum)
                ratios["writer"].add_metric(lab, r.cost.writer_ns_sum / r.cost.wall_ns_sum)
            errors.add_metric(lab, r.agent_errors)
            for reason in DROP_REASONS:
                dropped.add_metric([*lab, reason], r.end_counter(reason))
            dropped_bytes.add_metric(lab, r.end_counter("blob_bytes_dropped"))
        yield from (
            *per_step.values(),
            *totals.values(),
            by_part,
            waited,
            *ratios.values(),
            errors,
            dropped,
            dropped_bytes,
        )

    # -- spool (what was captured) ------------------------------------------------------------
    def _spool(self) -> Iterable[Metric]:
        now = self.clock()
        s = self.state

        def counter(what: str, doc: str, *labels: str) -> CounterMetricFamily:
            return CounterMetricFamily(_name("spool", what), doc, labels=["rank", *labels])

        def gauge(what: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(_name("spool", what), doc, labels=["rank"])

        records = counter("records", "Whole spool records read, by kind (event, blob).", "kind")
        events = counter(
            "events", "Events read from the spool, by type (schema event types, else other).", "type"
        )
        colls = counter("collectives", "Collectives recorded, by c10d op.", "op")
        steps = counter("steps", "Optimizer steps recorded (step events).")
        read_bytes = counter("read_bytes", "Spool bytes read: segment headers, records and damaged spans.")
        blob_bytes = counter("blob_bytes", "Raw bytes of blob records (payloads, snapshots, RNG states).")
        damage = counter("damage", "Damaged spans found in the spool (each skipped, the rest read).")
        damaged_bytes = counter("damaged_bytes", "Spool bytes in damaged spans.")
        read_errors = counter("read_errors", "Spool reads that failed (a segment of another format version).")
        unusable = counter(
            "unusable_events", "Events whose keys or values are not the schema's (counted by type only)."
        )
        stuck_total = counter("stuck", "Collectives the rank waited in for more than 2 s (stuck events).")
        backlog = gauge("backlog_bytes", "Spool bytes on disk not collected into the trace yet.")
        step_s = gauge(
            "step_duration_seconds", "Median wall-clock time between steps (after the skipped steps)."
        )
        record_age = gauge(
            "last_record_age_seconds",
            "Seconds since the time of the rank's latest event (t_ns + rank_start.t0_wall_ns).",
        )
        coll_age = gauge(
            "last_collective_age_seconds", "Seconds since the rank's latest collective completed."
        )
        rank_stuck = gauge("rank_stuck", "1 while the rank's latest stuck collective has not completed.")
        for rank, r in sorted(s.ranks.items()):
            lab = [str(rank)]
            for kind in ("event", "blob"):
                records.add_metric([*lab, kind], r.records[kind])
            for kind, n in sorted(r.events.items()):
                events.add_metric([*lab, kind], n)
            for op, n in sorted(r.collectives.items()):
                colls.add_metric([*lab, op], n)
            steps.add_metric(lab, r.steps)
            read_bytes.add_metric(lab, r.bytes_read)
            blob_bytes.add_metric(lab, r.blob_bytes)
            damage.add_metric(lab, r.damage)
            damaged_bytes.add_metric(lab, r.damage_bytes)
            read_errors.add_metric(lab, s.read_errors.get(rank, 0))
            unusable.add_metric(lab, r.unusable_events)
            stuck_total.add_metric(lab, r.stuck_events)
            backlog.add_metric(lab, r.backlog_bytes)
            median_step = r.cost.step_ns.value()
            if median_step is not None:
                step_s.add_metric(lab, median_step / NS_PER_S)
            last = r.last_record_wall_s()
            if last is not None:
                record_age.add_metric(lab, max(0.0, now - last))
            last = r.last_collective_wall_s()
            if last is not None:
                coll_age.add_metric(lab, max(0.0, now - last))
            rank_stuck.add_metric(lab, 1.0 if r.stuck else 0.0)
        yield from (
            records,
            events,
            colls,
            steps,
            read_bytes,
            blob_bytes,
            damage,
            damaged_bytes,
            read_errors,
            unusable,
        )
        yield from (stuck_total, backlog, step_s, record_age, coll_age, rank_stuck)
        yield GaugeMetricFamily(_name("spool", "ranks"), "Rank folders followed.", value=len(s.ranks))
        yield GaugeMetricFamily(
            _name("spool", "ranks_ended"),
            "Ranks whose latest attempt wrote its end event.",
            value=sum(r.ended for r in s.ranks.values()),
        )
        yield GaugeMetricFamily(
            _name("spool", "ranks_stuck"),
            "Ranks stuck in a collective.",
            value=sum(r.stuck for r in s.ranks.values()),
        )

    # -- eBPF ---------------------------------------------------------------------------------
    def _ebpf(self) -> Iterable[Metric]:
        e = self.state.ebpf
        hits = CounterMetricFamily(
            _name("ebpf", "probe_hits"),
            "Calls of each probed function that passed the pid filter.",
            labels=["function"],
        )
        lost = CounterMetricFamily(
            _name("ebpf", "lost_events"),
            "Call records lost: buffer_full (ring or perf buffer), inflight_full (in-flight map).",
            labels=["reason"],
        )
        delivered = CounterMetricFamily(
            _name("ebpf", "delivered_events"), "Call records delivered to the sidecar."
        )
        callback_errors = CounterMetricFamily(
            _name("ebpf", "callback_errors"), "Call records the sidecar failed to count."
        )
        if e.stats is not None:
            for function, n in sorted(e.stats.hits.items()):
                hits.add_metric([function], n)
            lost.add_metric(["buffer_full"], max(e.stats.output_full, e.stats.perf_lost))
            lost.add_metric(["inflight_full"], e.stats.inflight_full)
            delivered.add_metric([], e.stats.delivered)
            callback_errors.add_metric([], e.stats.callback_errors)
        yield from (hits, lost, delivered, callback_errors)
        yield GaugeMetricFamily(
            _name("ebpf", "processes_tracked"),
            "Processes in the probe's pid filter.",
            value=e.processes_tracked,
        )
        yield GaugeMetricFamily(
            _name("ebpf", "libraries_attached"), "Distinct library files probed.", value=e.libraries_attached
        )
        yield GaugeMetricFamily(
            _name("ebpf", "probe_points"), "uprobes and uretprobes attached now.", value=e.probe_points
        )
        yield CounterMetricFamily(
            _name("ebpf", "attach_errors"), "Libraries that could not be probed.", value=e.attach_errors
        )

    def _nccl(self) -> Iterable[Metric]:
        labels = ["rank", "op", "comm"]
        calls = CounterMetricFamily(
            _name("nccl", "calls"), "NCCL host-API calls seen by the uprobes.", labels=labels
        )
        nbytes = CounterMetricFamily(
            _name("nccl", "bytes"), "Bytes the NCCL calls named: count x dtype size.", labels=labels
        )
        failed = CounterMetricFamily(
            _name("nccl", "failed_calls"),
            "NCCL calls that returned something else than ncclSuccess.",
            labels=labels,
        )
        latency = CounterMetricFamily(
            _name("nccl", "host_latency_seconds"),
            "Host-side time in NCCL calls, entry to return (the enqueue, not the GPU's work).",
            labels=labels,
        )
        over = CounterMetricFamily(
            _name("nccl", "comm_labels_over_limit"),
            'Communicators counted under comm="other" (label limit reached).',
        )
        stats = self.state.nccl
        if stats is not None:
            for row in stats.series():
                lab = [row.rank, row.op, row.comm]
                calls.add_metric(lab, row.calls)
                nbytes.add_metric(lab, row.bytes)
                failed.add_metric(lab, row.failed)
                latency.add_metric(lab, row.latency_ns / NS_PER_S)
            over.add_metric([], stats.comms_over_limit)
        yield from (calls, nbytes, failed, latency, over)

    # -- trainer processes --------------------------------------------------------------------
    def _trainers(self) -> Iterable[Metric]:
        s = self.state
        cpu = CounterMetricFamily(
            _name("trainer", "cpu_seconds"),
            'CPU time (user + system) of the training processes, by RANK ("": torchrun and others).',
            labels=["rank"],
        )
        rss = GaugeMetricFamily(
            _name("trainer", "resident_memory_bytes"),
            "Resident memory of the live training processes.",
            labels=["rank"],
        )
        procs = GaugeMetricFamily(_name("trainer", "processes"), "Live training processes.", labels=["rank"])
        for label, usage in s.processes.usage().items():
            cpu.add_metric([label], usage.cpu_s)
            rss.add_metric([label], usage.rss_bytes)
            procs.add_metric([label], usage.processes)
        yield from (cpu, rss, procs)
        yield CounterMetricFamily(
            _name("trainer", "processes_seen"),
            "Training processes discovered since the sidecar started.",
            value=s.trainers_seen,
        )


def make_registry(collector: Collector) -> CollectorRegistry:
    """A registry of the sidecar's own, holding ``collector`` only (never the global REGISTRY)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry
