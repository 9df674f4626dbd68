"""Real uprobes (bcc, root) on the real libnccl.so.2 of the nvidia-nccl-cu13 wheel.

No GPU is needed: a helper process calls the host API with known arguments; NCCL rejects them
(a zeroed communicator, no CUDA driver) after the probe point, so every call is a real entry into
the real library. The ABI finding on ncclCommInitRankConfig (rank in rdx, config in rcx, the
128-byte id on the stack) is checked here from the caller's side and in
test_sidecar_program.py from the callee's machine code.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from sidecar_support import Waiting, nccl_calls_cmd, parse_loop_output

from fsdp_replay.sidecar.ebpf import nccl, records
from fsdp_replay.sidecar.ebpf.probe import Event, Probe
from fsdp_replay.sidecar.ebpf.signatures import INT, Param, Signature, struct_digest

pytestmark = [pytest.mark.ebpf, pytest.mark.usefixtures("bcc_works")]

THROUGHPUT_RATE = 60_000  # calls/s the load generator is paced to (the requirement: 50,000+)
THROUGHPUT_SECONDS = 3


@pytest.mark.slow
def test_every_call_is_counted_and_decoded(libnccl: Path) -> None:
    events: list[Event] = []
    with Probe(callback=events.append) as probe:
        helper = Waiting(nccl_calls_cmd(libnccl, "--wait-stdin"))
        try:
            (att,) = probe.track(helper.pid)
            helper.go()
            report = json.loads(helper.finish())
        finally:
            helper.kill()
        probe.drain()
        stats = probe.stats()

    assert att.path == f"/proc/{helper.pid}/root{libnccl}"
    absent = {c["name"] for c in report["calls"] if c.get("absent")}
    assert set(att.missing) == absent and set(att.probed) == {s.name for s in nccl.API} - absent
    assert att.aliases == {}
    assert all(sym == name for name, sym in att.probed.items())  # ncclX found first, pncclX not needed
    calls = [c for c in report["calls"] if not c.get("absent")]
    # ncclBcast is recorded as the ncclBroadcast(buff, buff, ...) it makes.
    expected = []
    for c in calls:
        if c["name"] == "ncclBcast":
            buff, count, dtype, root, comm, stream = c["args"]
            c = {**c, "name": "ncclBroadcast", "args": [buff, buff, count, dtype, root, comm, stream]}
        expected.append(c)
    assert [e.function for e in events] == [c["name"] for c in expected]
    uid_digest = struct_digest(bytes.fromhex(report["uid_hex"]))
    for e, c in zip(events, expected, strict=True):
        sig = e.signature
        want = {p.name: (0 if v is None else v) for p, v in zip(sig.params, c["args"], strict=True)}
        if "commId" in want:
            want["commId"] = uid_digest  # the id travels by value: the probe stores its digest
        assert e.args == want, e.function
        assert e.ret == c["ret"], e.function
        assert (e.pid, e.tid) == (report["pid"], report["tid"])
        assert e.kind == records.KIND_CALL and e.flags == 0, (e.function, e.flags)
        assert e.latency_ns > 0 and e.ts_ns > 0
    by_name = {e.function: e for e in events}
    init = by_name["ncclCommInitRankConfig"]
    assert (init.nranks, init.rank, init.comm_name) == (4, 3, report["comm_name"])
    assert (by_name["ncclCommInitRank"].nranks, by_name["ncclCommInitRank"].rank) == (6, 5)
    assert by_name["ncclCommInitRank"].comm_name == ""
    assert (by_name["ncclCommInitAll"].nranks, by_name["ncclCommInitAll"].rank) == (2, -1)
    split = by_name["ncclCommSplit"]
    assert split.args["color"] == -5 and split.comm_name == report["comm_name"]
    assert by_name["ncclAllReduce"].nranks == -1 and by_name["ncclAllReduce"].comm_name == ""
    for c in expected:  # read through the out-pointer at return: what the caller found there
        if "new_comm" in c:
            assert by_name[c["name"]].new_comm == c["new_comm"], c["name"]
    assert stats.lost == 0 and stats.entries == stats.emitted == stats.delivered == len(expected)
    assert stats.hits == {s.name: 0 for s in nccl.API} | Counter(c["name"] for c in expected)


def test_library_attached_once_per_file_missing_and_aliases_reported(libnccl: Path, tmp_path: Path) -> None:
    sigs = (
        *nccl.by_name("ncclAllReduce"),
        Signature("ncclNotInAnyVersion", symbols=("ncclNotInAnyVersion", "pncclNotInAnyVersion")),
        Signature("pncclAllReduce", symbols=("pncclAllReduce",)),  # same address as ncclAllReduce
    )
    link = tmp_path / "libnccl-link.so.2"
    link.symlink_to(libnccl)
    with Probe(sigs) as probe:
        att = probe.attach_library(str(libnccl))
        assert att.probed == {"ncclAllReduce": "ncclAllReduce"}
        assert att.missing == ("ncclNotInAnyVersion",)
        assert att.aliases == {"pncclAllReduce": "ncclAllReduce"}
        assert probe.attach_library(str(link)) is att  # one inode, one set of probes
        assert len(probe.attachments) == 1


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["ringbuf", "perf"])
def test_throughput_no_event_lost(libnccl: Path, nccl_loop: Path, transport: str) -> None:
    """A C loop calls ncclAllReduce 60,000 times a second for 3 s; every call arrives exactly once."""
    n = THROUGHPUT_RATE * THROUGHPUT_SECONDS
    seen = bytearray(n)  # the loop passes its index as `count`

    def count(e: Event) -> None:
        seen[e.record.args[2]] += 1

    with Probe(nccl.by_name("ncclAllReduce"), count, transport=transport, ringbuf_pages=4096) as probe:
        assert probe.transport == transport
        loop = Waiting([str(nccl_loop), str(libnccl), str(n), "wait", str(THROUGHPUT_RATE)])
        try:
            probe.track(loop.pid)
            probe.start(timeout_ms=50)
            loop.go()
            result = parse_loop_output(loop.finish())
        finally:
            loop.kill()
            probe.stop()
        probe.drain()
        stats = probe.stats()
    print(
        f"\n[{transport}] {result['calls']:.0f} calls at {result['rate']:.0f}/s "
        f"({result['ns_per_call']:.0f} ns/call incl. pacing): entries={stats.entries} "
        f"delivered={stats.delivered} lost={stats.lost}"
    )
    assert result["rate"] >= 50_000, "the load generator did not reach 50,000 calls/s"
    assert stats.lost == 0 and stats.perf_lost == 0
    assert stats.entries == stats.emitted == stats.delivered == n
    assert seen.count(1) == n, f"{n - seen.count(1)} calls missing or duplicated"


@pytest.mark.parametrize("transport", ["ringbuf", "perf"])
def test_overflow_is_counted_exactly(libnccl: Path, nccl_loop: Path, transport: str) -> None:
    """A one-page buffer nobody reads while 10,000 calls arrive: what is not delivered is lost."""
    n = 10_000
    with Probe(
        nccl.by_name("ncclAllReduce"), lambda e: None, transport=transport, ringbuf_pages=1, perf_pages=1
    ) as probe:
        loop = Waiting([str(nccl_loop), str(libnccl), str(n), "wait"])
        try:
            probe.track(loop.pid)
            loop.go()
            loop.finish()
        finally:
            loop.kill()
        probe.drain()
        stats = probe.stats()
    assert stats.entries == n
    assert 0 < stats.delivered < n
    assert stats.output_full == n - stats.emitted
    assert stats.delivered + stats.lost == n, stats
    # perf reports the same records to the reader later, in a "lost" record written before the
    # next one that fits: here none follows, so it may never come.
    assert stats.perf_lost <= stats.output_full


@pytest.mark.slow
@pytest.mark.parametrize(
    ("scope", "pid_filter"),
    [("file", True), ("process", True), ("process", False)],
    ids=["file-scope", "process-scope", "process-scope-no-map-filter"],
)
def test_pid_filter_records_only_tracked_processes(
    libnccl: Path, nccl_loop: Path, scope: str, pid_filter: bool
) -> None:
    """Two processes call the same library at once; only the tracked one is recorded.

    With scope="process" the breakpoints are only in the tracked process, so even without the
    kernel map filter the other one is not seen (and does not pay for the probes)."""
    n, rate = 40_000, 20_000
    pids: Counter[int] = Counter()
    with Probe(
        nccl.by_name("ncclAllReduce"), lambda e: pids.update([e.pid]), scope=scope, pid_filter=pid_filter
    ) as probe:
        tracked = Waiting([str(nccl_loop), str(libnccl), str(n), "wait", str(rate)])
        other = Waiting([str(nccl_loop), str(libnccl), str(n), "wait", str(rate)])
        try:
            probe.track(tracked.pid)
            assert probe.pids == {tracked.pid}
            probe.start(timeout_ms=50)
            other.go()
            tracked.go()
            both = [parse_loop_output(p.finish()) for p in (tracked, other)]
        finally:
            tracked.kill()
            other.kill()
            probe.stop()
        probe.drain()
        stats = probe.stats()
        probe.untrack(tracked.pid)
        assert probe.pids == set()
    assert [r["calls"] for r in both] == [n, n]
    assert pids == Counter({tracked.pid: n})
    assert pids[other.pid] == 0
    assert stats.entries == n  # filtered in the kernel, before anything is counted or copied
    assert stats.lost == 0


@pytest.mark.slow
def test_pid_filter_off_records_everyone(libnccl: Path, nccl_loop: Path) -> None:
    pids: Counter[int] = Counter()
    with Probe(nccl.by_name("ncclAllReduce"), lambda e: pids.update([e.pid]), pid_filter=False) as probe:
        probe.attach_library(str(libnccl))
        loops = [Waiting([str(nccl_loop), str(libnccl), "1000", "wait"]) for _ in range(2)]
        try:
            for loop in loops:
                loop.go()
                loop.finish()
        finally:
            for loop in loops:
                loop.kill()
        probe.drain()
    assert pids == Counter({loops[0].pid: 1000, loops[1].pid: 1000})


def test_process_scope_detaches_on_untrack(libnccl: Path, nccl_loop: Path) -> None:
    got: list[Event] = []
    with Probe(nccl.by_name("ncclAllReduce", "ncclAllGather"), got.append, scope="process") as probe:
        with pytest.raises(ValueError, match="pass the pid"):
            probe.attach_library(str(libnccl))
        loop = Waiting([str(nccl_loop), str(libnccl), "100", "wait"])
        try:
            (att,) = probe.track(loop.pid)
            assert set(att.probed) == {"ncclAllReduce", "ncclAllGather"}
            assert len(probe._bpf.uprobe_fds) == 4  # 2 functions x (uprobe + uretprobe), for this pid
            loop.go()
            loop.finish()
        finally:
            loop.kill()
        probe.drain()
        probe.untrack(loop.pid)  # the process is gone: detach by event name
        assert len(probe._bpf.uprobe_fds) == 0 and probe.attachments == [att]
    assert len(got) == 100


def test_call_in_flight_is_visible_and_forgotten_on_untrack() -> None:
    """Any library's symbols: libc's clock_nanosleep, entered by time.sleep() and not returned."""
    sleep = Signature(
        "clock_nanosleep",
        (Param("clockid", INT), Param("flags", INT), Param("request"), Param("remain")),
    )
    delivered: list[Event] = []
    with Probe([sleep], delivered.append, library_pattern="libc.so") as probe:
        sleeper = Waiting(
            [
                sys.executable,
                "-S",
                "-c",
                "import sys, time; print('ready', flush=True); sys.stdin.readline(); time.sleep(60)",
            ]
        )
        try:
            (att,) = probe.track(sleeper.pid)
            assert att.probed == {"clock_nanosleep": "clock_nanosleep"}
            sleeper.go()
            deadline = time.monotonic() + 10
            while not probe.in_flight() and time.monotonic() < deadline:
                time.sleep(0.05)
            (call,) = probe.in_flight()
            assert call.function == "clock_nanosleep" and call.pid == sleeper.pid
            assert call.kind == records.KIND_INFLIGHT and call.latency_ns == 0
            assert call.args["clockid"] == 1  # CLOCK_MONOTONIC
            assert call.args["request"] != 0
            probe.untrack(sleeper.pid)
            assert probe.in_flight() == [] and probe.pids == set()
        finally:
            sleeper.kill()
        probe.drain(quiet_ms=100)
    assert delivered == []  # the call never returned while tracked


def test_program_with_wrong_layout_is_rejected_by_the_compiler() -> None:
    """The layout asserts are compiled by bcc's clang too: a drifted struct cannot load."""
    from bcc import BPF

    from fsdp_replay.sidecar.ebpf import programs

    text = programs.build_program(nccl.by_name("ncclGroupStart"))
    BPF(text=text.encode()).cleanup()
    drifted = text.replace("u32 flags;", "u64 flags;", 1)
    with pytest.raises(Exception, match=r"(?s)fr_record.*differs from records\.py|Failed to compile"):
        BPF(text=drifted.encode())


def test_poll_reraises_callback_errors(libnccl: Path, nccl_loop: Path) -> None:
    def broken(e: Event) -> None:
        raise RuntimeError("callback bug")

    with Probe(nccl.by_name("ncclAllReduce"), broken) as probe:
        loop = Waiting([str(nccl_loop), str(libnccl), "10", "wait"])
        try:
            probe.track(loop.pid)
            loop.go()
            loop.finish()
        finally:
            loop.kill()
        with pytest.raises(RuntimeError, match="callback bug"):
            probe.drain()
        probe.drain()
        stats = probe.stats()
    assert stats.delivered == 10 and stats.callback_errors == 10
