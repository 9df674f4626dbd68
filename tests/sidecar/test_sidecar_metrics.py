"""The sidecar's metrics: the collector's output for synthetic spools (values computed by hand), the
per-step cost against analysis.summary.recording_cost on collected traces, NCCL counting from real
call records, process usage from real processes, and the HTTP server."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import spool_events as ev
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from fsdp_replay.sidecar.discovery import TrainingProcess
from fsdp_replay.sidecar.ebpf import nccl, records
from fsdp_replay.sidecar.ebpf.events import Event, ProbeStats
from fsdp_replay.sidecar.metrics import SidecarCollector, SidecarState, make_registry
from fsdp_replay.sidecar.ncclstats import NcclStats
from fsdp_replay.sidecar.processes import ProcessStats
from fsdp_replay.sidecar.ranks import RankState, StepCost
from fsdp_replay.sidecar.server import MetricsServer
from fsdp_replay.trace import schema, spool
from fsdp_replay.trace.follow import SpoolFollower
from fsdp_replay.trace.spool import SpoolWriter

T0 = 1_700_000_000_000_000_000
T1 = T0 + 5_000_000_000
NOW = (T0 + 7000) / 1e9 + 100.0
GARBAGE = b"\x01\x02\x03" * 9

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(registry: CollectorRegistry) -> Samples:
    from prometheus_client.exposition import generate_latest

    out: Samples = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def absent(samples: Samples, name: str) -> bool:
    return not any(n == name for n, _ in samples)


def write_synthetic_spools(root: Path) -> None:
    w0 = SpoolWriter(spool.rank_dir(root, 0), 0)
    w0.append(schema.KIND_EVENT, ev.rank_start(0, T0))
    w0.append(schema.KIND_BLOB, {"blob": 0, "nbytes": 100}, os.urandom(100))
    w0.append(schema.KIND_BLOB, {"blob": 1, "nbytes": 28}, os.urandom(28))
    for seq, (op, t, dur) in enumerate(
        [
            ("_allgather_base_", 100, 50),
            ("_allgather_base_", 300, 20),
            ("_reduce_scatter_base_", 400, 100),
            ("fancy_op_", 600, 0),
        ]
    ):
        w0.append(schema.KIND_EVENT, ev.coll(seq, op, t, dur))
    for i, (t, hooks, writer) in enumerate(
        [(1000, 100, 10), (2000, 250, 30), (3500, 450, 40), (4500, 600, 80), (6000, 1000, 90)]
    ):
        w0.append(schema.KIND_EVENT, ev.step(i, t, (hooks, writer)))
    w0.append(schema.KIND_EVENT, ev.alive(4, 6500))
    counters = {
        "blobs_dropped": 2,
        "events_dropped": 1,
        "write_errors": 3,
        "blob_bytes_dropped": 4096,
        "agent_errors": 1,
        "agent_cpu_ns": 1200,
        "writer_cpu_ns": 95,
        "agent_cpu_collectives_ns": 500,
        "agent_cpu_payloads_ns": 120,
        "agent_cpu_cxx_ns": 300,
        "payload_wait_ns": 2_500_000,
    }
    w0.append(schema.KIND_EVENT, ev.end(7000, 5, 4, **counters))
    w0.close()

    w1 = SpoolWriter(spool.rank_dir(root, 1), 1)
    w1.append(schema.KIND_EVENT, ev.rank_start(1, T1))
    w1.append(schema.KIND_EVENT, ev.step(0, 1000, (500, 60)))
    step1 = ev.step(1, 2000, (700, 80))
    step1["counters"] = {"agent_cpu_tape_ns": 400, "agent_cpu_snapshots_ns": 90}  # live, before any end
    w1.append(schema.KIND_EVENT, step1)
    w1.append(schema.KIND_EVENT, ev.agent_error())
    w1.append(schema.KIND_EVENT, ev.coll(0, "allreduce_", 2100, 10))
    w1.append(schema.KIND_EVENT, {"type": "future_event"})
    seg = w1.segment_path
    w1.close()
    with open(seg, "ab") as f:  # damage, then a whole record after it
        f.write(GARBAGE)
        f.write(
            b"".join(
                bytes(p)
                for p in spool.encode_record(
                    schema.KIND_EVENT, ev.stuck(1, "allreduce_", 2200, 2_500_000_000)
                )
            )
        )


def follow_into(state: SidecarState, root: Path) -> dict[int, SpoolFollower]:
    followers = {}
    for rank, folder in spool.spool_ranks(root).items():
        f = followers[rank] = SpoolFollower(folder)
        rs = state.ranks[rank] = RankState(rank)
        for rec in f.finish():
            rs.apply(rec)
        rs.add_damage(f.report.damage)
        rs.bytes_read, rs.disk_bytes = f.bytes_read, f.disk_bytes
    return followers


def test_collector_output_for_a_synthetic_spool(tmp_path: Path) -> None:
    root = tmp_path / "spool"
    write_synthetic_spools(root)
    state = SidecarState(info={"mode": "native", "pod_name": "trainer-0"})
    follow_into(state, root)
    s = scrape(make_registry(SidecarCollector(state, clock=lambda: NOW, own=None)))
    r0, r1 = {"rank": "0"}, {"rank": "1"}

    # Recording cost, rank 0: hooks increments 150, 200, 150, 400 -> median 175 ns; writer 20, 10,
    # 40, 10 -> 15 ns. Rank 1 has two steps: too few for a per-step figure (as in summary).
    assert value(s, "fsdp_replay_agent_hooks_cpu_per_step_seconds", **r0) == 175 / 1e9
    assert value(s, "fsdp_replay_agent_writer_cpu_per_step_seconds", **r0) == 15 / 1e9
    assert ("fsdp_replay_agent_hooks_cpu_per_step_seconds", frozenset(r1.items())) not in s
    # Cumulative: the end counters where the rank ended, else the last step's cpu_ns.
    assert value(s, "fsdp_replay_agent_hooks_cpu_seconds_total", **r0) == 1200 / 1e9
    assert value(s, "fsdp_replay_agent_writer_cpu_seconds_total", **r0) == 95 / 1e9
    assert value(s, "fsdp_replay_agent_hooks_cpu_seconds_total", **r1) == 700 / 1e9
    assert value(s, "fsdp_replay_agent_writer_cpu_seconds_total", **r1) == 80 / 1e9
    # By part: rank 0's from its end counters, rank 1's from its last step's; a part not reported is 0.
    part = "fsdp_replay_agent_hooks_part_cpu_seconds_total"
    for p, ns in (("collectives", 500), ("payloads", 120), ("cxx", 300), ("tape", 0), ("snapshots", 0)):
        assert value(s, part, rank="0", part=p) == ns / 1e9, p
    for p, ns in (("tape", 400), ("snapshots", 90), ("collectives", 0)):
        assert value(s, part, rank="1", part=p) == ns / 1e9, p
    # How long the training waited for room for payloads: rank 0's end counters; rank 1 reported none
    assert value(s, "fsdp_replay_agent_payload_wait_seconds_total", **r0) == 2_500_000 / 1e9
    assert value(s, "fsdp_replay_agent_payload_wait_seconds_total", **r1) == 0
    # Share of step time: (1000 - 100) / (6000 - 1000), (90 - 10) / 5000; rank 1: 200/1000, 20/1000.
    assert value(s, "fsdp_replay_agent_hooks_cpu_step_ratio", **r0) == 900 / 5000
    assert value(s, "fsdp_replay_agent_writer_cpu_step_ratio", **r0) == 80 / 5000
    assert value(s, "fsdp_replay_agent_hooks_cpu_step_ratio", **r1) == 200 / 1000
    assert value(s, "fsdp_replay_agent_writer_cpu_step_ratio", **r1) == 20 / 1000
    assert value(s, "fsdp_replay_spool_step_duration_seconds", **r0) == 1250 / 1e9  # 1000,1500,1000,1500
    assert value(s, "fsdp_replay_agent_errors_total", **r0) == 1  # end.counters.agent_errors
    assert value(s, "fsdp_replay_agent_errors_total", **r1) == 1  # an agent_error event
    for reason, n in (("blobs_dropped", 2), ("events_dropped", 1), ("write_errors", 3)):
        assert value(s, "fsdp_replay_agent_dropped_total", rank="0", reason=reason) == n
        assert value(s, "fsdp_replay_agent_dropped_total", rank="1", reason=reason) == 0
    assert value(s, "fsdp_replay_agent_dropped_bytes_total", **r0) == 4096

    # What was captured.
    assert value(s, "fsdp_replay_spool_records_total", rank="0", kind="event") == 12
    assert value(s, "fsdp_replay_spool_records_total", rank="0", kind="blob") == 2
    assert value(s, "fsdp_replay_spool_blob_bytes_total", **r0) == 128
    assert value(s, "fsdp_replay_spool_steps_total", **r0) == 5
    assert value(s, "fsdp_replay_spool_steps_total", **r1) == 2
    for t, n in (("rank_start", 1), ("coll", 4), ("step", 5), ("alive", 1), ("end", 1)):
        assert value(s, "fsdp_replay_spool_events_total", rank="0", type=t) == n
    assert value(s, "fsdp_replay_spool_events_total", rank="1", type="other") == 1
    assert value(s, "fsdp_replay_spool_collectives_total", rank="0", op="_allgather_base_") == 2
    assert value(s, "fsdp_replay_spool_collectives_total", rank="0", op="_reduce_scatter_base_") == 1
    assert value(s, "fsdp_replay_spool_collectives_total", rank="0", op="other") == 1
    sizes = {r: sum(p.stat().st_size for p in spool.segments(spool.rank_dir(root, r))) for r in (0, 1)}
    for r in (0, 1):
        assert value(s, "fsdp_replay_spool_read_bytes_total", rank=str(r)) == sizes[r]
        assert value(s, "fsdp_replay_spool_backlog_bytes", rank=str(r)) == sizes[r]
    assert value(s, "fsdp_replay_spool_damage_total", **r1) == 1
    assert value(s, "fsdp_replay_spool_damaged_bytes_total", **r1) == len(GARBAGE)
    assert value(s, "fsdp_replay_spool_damage_total", **r0) == 0

    # Ages from t_ns + t0_wall_ns: rank 0's last event is its end (7000), its last collective
    # completed at 600 + 0; rank 1's last is the stuck event, written at 2200 + 2.5 s.
    assert value(s, "fsdp_replay_spool_last_record_age_seconds", **r0) == pytest.approx(100.0, abs=1e-6)
    assert value(s, "fsdp_replay_spool_last_collective_age_seconds", **r0) == pytest.approx(
        NOW - (T0 + 600) / 1e9, abs=1e-6
    )
    assert value(s, "fsdp_replay_spool_last_record_age_seconds", **r1) == pytest.approx(
        NOW - (T1 + 2200 + 2_500_000_000) / 1e9, abs=1e-6
    )
    assert value(s, "fsdp_replay_spool_last_collective_age_seconds", **r1) == pytest.approx(
        NOW - (T1 + 2110) / 1e9, abs=1e-6
    )
    assert value(s, "fsdp_replay_spool_rank_stuck", **r0) == 0
    assert value(s, "fsdp_replay_spool_rank_stuck", **r1) == 1
    assert value(s, "fsdp_replay_spool_stuck_total", **r1) == 1
    assert (
        value(
            s,
            "fsdp_replay_spool_ranks",
        )
        == 2
    )
    assert value(s, "fsdp_replay_spool_ranks_ended") == 1
    assert value(s, "fsdp_replay_spool_ranks_stuck") == 1

    # The sidecar itself, without eBPF.
    assert value(s, "fsdp_replay_sidecar_ebpf_enabled") == 0
    info = {k: v for (n, labels), _ in s.items() if n == "fsdp_replay_sidecar_info" for k, v in labels}
    assert info["mode"] == "native" and info["pod_name"] == "trainer-0" and "version" in info
    assert absent(s, "fsdp_replay_nccl_calls_total") and absent(s, "fsdp_replay_sidecar_cpu_seconds_total")
    # Never a pid or a sequence number among the labels.
    assert not {k for _, labels in s for k, _ in labels} & {"pid", "seq", "tid"}


def test_a_restarted_rank_keeps_its_counters_monotonic() -> None:
    rs = RankState(0)

    def apply(obj: dict[str, Any]) -> None:
        rs.apply(spool.Record(schema.KIND_EVENT, obj, memoryview(b""), Path("x"), 0))

    apply(ev.rank_start(0, T0))
    apply(ev.step(0, 100, (10, 1)))
    apply(ev.step(1, 200, (30, 2)))
    apply(ev.end(300, 2, 0, agent_cpu_ns=40, writer_cpu_ns=3, blobs_dropped=1))
    assert (rs.hooks_cpu_ns, rs.writer_cpu_ns, rs.ended) == (40, 3, True)
    apply(ev.rank_start(0, T1))  # torchelastic restarted the worker: counters from 0 again
    apply(ev.step(0, 50, (5, 1)))
    assert (rs.hooks_cpu_ns, rs.writer_cpu_ns, rs.ended, rs.attempts) == (45, 4, False, 2)
    assert rs.end_counter("blobs_dropped") == 1
    assert rs.t0_wall_ns == T1 and rs.last_t_ns == 50


def _collect_cost(
    tmp_path: Path, steps: list[tuple[int, int] | None], restart_at: int | None, skip: int
) -> None:
    """One rank's steps through a real spool, collected into a real trace: the sidecar's figure must
    equal summary.recording_cost's, to the bit."""
    from fsdp_replay.analysis.summary import recording_cost
    from fsdp_replay.trace.collect import collect
    from fsdp_replay.trace.reader import Trace

    root = tmp_path / "spool"
    w = SpoolWriter(spool.rank_dir(root, 0), 0)
    w.append(schema.KIND_EVENT, ev.rank_start(0, T0, world_size=1))
    for i, cpu in enumerate(steps):
        if i == restart_at:
            w.append(schema.KIND_EVENT, ev.rank_start(0, T1, world_size=1))
        w.append(schema.KIND_EVENT, ev.step(i, 1000 * (i + 1), cpu))
    w.close()
    collect(root, tmp_path / "trace.zarr")
    expected = recording_cost(Trace.open(tmp_path / "trace.zarr").rank(0), skip)
    rs = RankState(0, skip_steps=skip)
    for rec in SpoolFollower(spool.rank_dir(root, 0)).finish():
        rs.apply(rec)
    got = rs.cost.per_step_ns()
    if expected is None:
        assert got is None
    else:
        assert got is not None
        assert got[0] / 1e6 == expected["agent_cpu_ms_per_step"]
        assert got[1] / 1e6 == expected["writer_cpu_ms_per_step"]


@pytest.mark.parametrize("skip", [0, 1, 3])
def test_per_step_cost_is_the_recording_cost_of_inspect(tmp_path: Path, skip: int) -> None:
    rnd = random.Random(skip)
    cases: list[tuple[str, list[tuple[int, int] | None], int | None]] = []
    hooks = writer = 0
    steps: list[tuple[int, int] | None] = []
    for _ in range(9):  # even and odd counts of increments over the cases below
        hooks += rnd.randrange(1, 5_000_000)
        writer += rnd.randrange(1, 900_000)
        steps.append((hooks, writer))
    cases.append(("plain", steps, None))
    cases.append(("one fewer", steps[:-1], None))
    cases.append(("restart", [*steps[:4], (7, 3), (900_007, 40_003), (1_500_001, 90_000)], 4))
    cases.append(("no cpu_ns at step 2", [*steps[:2], None, *steps[3:]], None))
    cases.append(("too few", steps[:2], None))
    for name, seq, restart in cases:
        case = tmp_path / name.replace(" ", "_")
        case.mkdir()
        _collect_cost(case, seq, restart, skip)


def test_step_cost_median_of_even_and_odd_counts() -> None:
    c = StepCost()
    for i, h in enumerate([0, 10, 30, 31]):  # increments 10, 20, 1 -> median 10
        c.add(h, 0, i)
    assert c.per_step_ns() == (10.0, 0.0)
    c.add(71, 0, 4)  # increments 10, 20, 1, 40 -> (10 + 20) / 2
    assert c.per_step_ns() == (15.0, 0.0)


def _record(probe_id: int, pid: int, args: list[int], **fields: Any) -> records.Record:
    rec = records.Record()
    rec.probe_id, rec.pid, rec.tid, rec.kind = probe_id, pid, pid, records.KIND_CALL
    for i, a in enumerate(args):
        rec.args[i] = a & (1 << 64) - 1
    for k, v in fields.items():
        setattr(rec, k, v)
    return rec


def test_nccl_calls_and_bytes_by_rank_op_and_comm() -> None:
    api = {s.name: i for i, s in enumerate(nccl.API)}
    stats = NcclStats(nccl.API, max_comms=3)
    got: list[Event] = []

    def call(name: str, pid: int, args: list[int], **fields: Any) -> None:
        e = Event(_record(api[name], pid, args, **fields), nccl.API[api[name]])
        got.append(e)
        stats.on_event(e)

    stats.set_rank(100, 0)
    stats.set_rank(101, 1)
    uid = 0x1234_5678_9ABC_DEF0
    # Rank 0 and 1 create one communicator (same unique id), rank 0 names another one.
    call("ncclCommInitRank", 100, [0x7000, 2, uid, 0], new_comm=0xA0, nranks=2, rank=0, latency_ns=1000)
    call("ncclCommInitRank", 101, [0x7000, 2, uid, 1], new_comm=0xB0, nranks=2, rank=1, latency_ns=1000)
    call(
        "ncclCommInitRankConfig",
        100,
        [0x7008, 2, uid + 1, 0, 0x9000],
        new_comm=0xA8,
        comm_name=b"pg-1:fsdp shard",
    )
    # sendbuff, recvbuff, count, datatype, op, comm, stream
    for _ in range(3):
        call("ncclAllReduce", 100, [1, 2, 1000, 7, 0, 0xA0, 0], latency_ns=2000)  # float32: 4000 bytes
    call("ncclAllReduce", 101, [1, 2, 1000, 9, 0, 0xB0, 0], ret=4)  # bfloat16, failed
    call("ncclAllGather", 100, [1, 2, 10, 8, 0xA8, 0])  # sendbuff, recvbuff, sendcount, float64, comm
    call("ncclGroupStart", 100, [])
    call("ncclAllReduce", 100, [1, 2, 5, 0, 0, 0xDEAD, 0])  # a communicator created before we attached
    call("ncclAllReduce", 102, [1, 2, 5, 0, 0, 0xBEEF, 0])  # no rank known, and the label limit
    call("ncclCommDestroy", 100, [0xA0])
    id_label = f"id-{__import__('zlib').crc32(uid.to_bytes(8, 'little')):08x}"
    rows = {(r.rank, r.op, r.comm): r for r in stats.series()}
    assert rows[("0", "ncclAllReduce", id_label)].calls == 3
    assert rows[("0", "ncclAllReduce", id_label)].bytes == 3 * 4000
    assert rows[("0", "ncclAllReduce", id_label)].latency_ns == 6000
    assert rows[("1", "ncclAllReduce", id_label)].bytes == 2000  # the same label on both ranks
    assert rows[("1", "ncclAllReduce", id_label)].failed == 1
    assert rows[("0", "ncclAllGather", "pg-1:fsdp_shard")].bytes == 80
    assert rows[("0", "ncclGroupStart", "")].calls == 1
    (ptr,) = [c for (r, op, c) in rows if r == "0" and c.startswith("ptr-")]
    assert rows[("0", "ncclAllReduce", ptr)].bytes == 5
    assert rows[("", "ncclAllReduce", "other")].calls == 1  # 3 labels taken: id, the name, ptr
    assert stats.comms_over_limit == 1
    assert rows[("0", "ncclCommDestroy", "")].calls == 1  # management calls: one series per rank
    assert rows[("0", "ncclCommInitRank", "")].calls == 1 and rows[("1", "ncclCommInitRank", "")].calls == 1
    assert sum(r.calls for r in rows.values()) == len(got) == stats.events
    # Exported under those labels.
    state = SidecarState()
    state.nccl = stats
    state.ebpf.enabled = True
    state.ebpf.stats = ProbeStats(
        entries=12, emitted=12, delivered=12, output_full=2, inflight_full=1, perf_lost=3, callback_errors=0,
        hits={"ncclAllReduce": 7, "ncclGroupStart": 1},
    )  # fmt: skip
    s = scrape(make_registry(SidecarCollector(state, own=None)))
    assert value(s, "fsdp_replay_nccl_calls_total", rank="0", op="ncclAllReduce", comm=id_label) == 3
    assert value(s, "fsdp_replay_nccl_bytes_total", rank="1", op="ncclAllReduce", comm=id_label) == 2000
    assert value(s, "fsdp_replay_nccl_failed_calls_total", rank="1", op="ncclAllReduce", comm=id_label) == 1
    assert (
        value(s, "fsdp_replay_nccl_host_latency_seconds_total", rank="0", op="ncclAllReduce", comm=id_label)
        == 6e-6
    )
    assert value(s, "fsdp_replay_ebpf_probe_hits_total", function="ncclAllReduce") == 7
    assert (
        value(s, "fsdp_replay_ebpf_lost_events_total", reason="buffer_full") == 3
    )  # max(output_full, perf_lost)
    assert value(s, "fsdp_replay_ebpf_lost_events_total", reason="inflight_full") == 1
    assert value(s, "fsdp_replay_sidecar_ebpf_enabled") == 1
    assert value(s, "fsdp_replay_nccl_comm_labels_over_limit_total") == 1


def test_process_usage_by_rank_keeps_the_cpu_of_exited_processes() -> None:
    busy = "import time\nt = time.process_time() + 0.3\nwhile time.process_time() < t: pass\nprint('ready', flush=True)\ntime.sleep(60)\n"
    procs = [
        subprocess.Popen([sys.executable, "-c", busy], stdout=subprocess.PIPE, text=True) for _ in range(3)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"

        def tp(p: subprocess.Popen[str], rank: int | None) -> TrainingProcess:
            return TrainingProcess(p.pid, None, "python", os.getpid(), (), {}, rank, (), ("env",))

        stats = ProcessStats()
        live = [tp(procs[0], 0), tp(procs[1], 0), tp(procs[2], None)]
        stats.update(live)
        usage = stats.usage()
        assert usage["0"].processes == 2 and usage[""].processes == 1
        assert usage["0"].cpu_s >= 0.55 and usage[""].cpu_s >= 0.28
        assert usage["0"].rss_bytes > 2 * 5_000_000
        before = usage["0"].cpu_s
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        stats.update(live[:1] + live[2:])
        usage = stats.usage()
        assert usage["0"].processes == 1 and usage["0"].cpu_s >= before  # never goes down
    finally:
        for p in procs:
            p.kill()
            p.communicate()


def test_server_serves_metrics_healthz_and_stops(tmp_path: Path) -> None:
    root = tmp_path / "spool"
    write_synthetic_spools(root)
    state = SidecarState()
    follow_into(state, root)
    registry = make_registry(SidecarCollector(state))
    with MetricsServer(registry, "127.0.0.1", 0) as server:
        base = f"http://127.0.0.1:{server.port}"
        with urllib.request.urlopen(base + "/healthz", timeout=10) as r:
            assert r.status == 200 and r.read() == b"ok\n"
        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            text = r.read().decode()
            assert r.headers["Content-Type"].startswith("text/plain")
        assert 'fsdp_replay_spool_steps_total{rank="0"} 5.0' in text
        assert "fsdp_replay_sidecar_resident_memory_bytes" in text
        req = urllib.request.Request(
            base + "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.headers["Content-Type"].startswith("application/openmetrics-text")
            assert r.read().decode().rstrip().endswith("# EOF")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(base + "/nothing", timeout=10)
        assert e.value.code == 404
        e.value.close()
        port = server.port
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2)
    MetricsServer(registry, "127.0.0.1", port).stop()  # the port is free again


def test_every_metric_is_in_docs_metrics_md(tmp_path: Path) -> None:
    """docs/metrics.md lists exactly the families the collector exports, with their types."""
    import re

    from sidecar_support import REPO

    root = tmp_path / "spool"
    write_synthetic_spools(root)
    state = SidecarState()
    follow_into(state, root)
    state.nccl = NcclStats()
    state.ebpf.stats = ProbeStats(0, 0, 0, 0, 0, 0, 0, {})
    exported = {}
    for family in SidecarCollector(state).collect():
        suffix = {"counter": "_total", "info": "_info"}.get(family.type, "")
        exported[family.name + suffix] = "info" if family.type == "info" else family.type
    doc = (REPO / "docs" / "metrics.md").read_text()
    documented = {m: t for m, t in re.findall(r"^\| `(fsdp_replay_\w+)` \| (\w+)", doc, re.M)}
    assert documented == exported
