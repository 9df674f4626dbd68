"""The CUPTI capture's CPU side (issue #13): its policy, the decoding of CUPTI-shaped records into
rows, the rows through a real spool -> collect -> reader round trip, the torch.profiler watch, and a
CPU recording with ``--cupti always`` that says the capture is off and never imports cupti.

cupti-python is not needed (CI does not install the ``gpu`` extra): ``agent/cupti/records.py``
takes CUPTI's enum values as parameters, and the records here are objects with the attributes
cupti-python's record classes have (``ActivityKernel11``, ``ActivityAPI``, ``ActivityMemcpy6``,
``ActivityMemset4``, ``ActivityExternalCorrelation``). The GPU side is ``tests/system/test_cupti_gpu.py``.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from harness import CLI, REPO, child_env, run

from fsdp_replay.agent.config import CuptiPolicy, RecordConfig, StepSet
from fsdp_replay.agent.cupti import coexist, records
from fsdp_replay.agent.cupti.records import AGENT_EXT_ID, Batch, Decoder, Kinds, Marks, ext_position
from fsdp_replay.analysis.kernels import cupti_lines, cupti_summary
from fsdp_replay.errors import ConfigError
from fsdp_replay.trace import schema, spool
from fsdp_replay.trace.collect import collect
from fsdp_replay.trace.reader import Trace

WORKLOADS = Path(__file__).parents[1] / "workloads"

# CUPTI's C enum values (cupti_activity.h): CUpti_ActivityKind, CUpti_ExternalCorrelationKind,
# CUpti_ActivityMemcpyKind. On a GPU the agent takes them from cupti-python's enums.
KIND_MEMCPY, KIND_MEMSET, KIND_DRIVER, KIND_RUNTIME = 1, 2, 4, 5
KIND_CONCURRENT_KERNEL, KIND_OVERHEAD, KIND_EXTERNAL_CORRELATION = 10, 17, 39
EXT_CUSTOM0, EXT_CUSTOM2 = 3, 5
MEMCPY_HTOD, MEMCPY_DTOH, MEMCPY_HTOA, MEMCPY_DTOD = 1, 2, 3, 8
KINDS = Kinds(
    kernel=KIND_CONCURRENT_KERNEL,
    memcpy=KIND_MEMCPY,
    memset=KIND_MEMSET,
    runtime=KIND_RUNTIME,
    driver=KIND_DRIVER,
    external=KIND_EXTERNAL_CORRELATION,
    ext_kind=EXT_CUSTOM2,
    copy_kinds={MEMCPY_HTOD: 1, MEMCPY_DTOH: 2, MEMCPY_DTOD: 3},
)
TRAIN, AUTOGRAD = 4101, 4102  # thread ids as CUPTI reports them (gettid)


def kernel(corr: int, start: int, end: int, name: str, stream: int = 7) -> Any:
    return SimpleNamespace(
        kind=KIND_CONCURRENT_KERNEL,
        correlation_id=corr,
        start=start,
        end=end,
        device_id=0,
        stream_id=stream,
        name=name,
        grid_x=1,
        block_x=128,
    )


def api(corr: int, start: int, tid: int, driver: bool = False) -> Any:
    kind = KIND_DRIVER if driver else KIND_RUNTIME
    return SimpleNamespace(
        kind=kind, correlation_id=corr, start=start, end=start + 5, thread_id=tid, process_id=1, cbid=211
    )


def ext(corr: int, ext_id: int, kind: int = EXT_CUSTOM2) -> Any:
    return SimpleNamespace(
        kind=KIND_EXTERNAL_CORRELATION, correlation_id=corr, external_kind=kind, external_id=ext_id
    )


def memcpy(corr: int, start: int, end: int, copy_kind: int, nbytes: int) -> Any:
    return SimpleNamespace(
        kind=KIND_MEMCPY,
        correlation_id=corr,
        start=start,
        end=end,
        device_id=0,
        stream_id=7,
        copy_kind=copy_kind,
        bytes=nbytes,
        src_kind=1,
        dst_kind=3,
    )


def memset(corr: int, start: int, end: int, nbytes: int) -> Any:
    return SimpleNamespace(
        kind=KIND_MEMSET,
        correlation_id=corr,
        start=start,
        end=end,
        device_id=0,
        stream_id=7,
        bytes=nbytes,
        value=0,
    )


# -- the policy ---------------------------------------------------------------------------------
def test_policy_parses_and_decides_the_steps() -> None:
    assert str(CuptiPolicy.parse("always")) == "always" and CuptiPolicy.parse("always").includes(5, 0)
    assert CuptiPolicy.parse("off").off and CuptiPolicy.parse("none").off
    steps = CuptiPolicy.parse("steps:2-3,10")
    assert [s for s in range(12) if steps.includes(s, 0)] == [2, 3, 10]
    assert str(CuptiPolicy.parse("4-5")) == "steps:4-5"
    # step 0 is never captured: NCCL sets its communicators up then
    assert not CuptiPolicy.parse("steps:0-1").includes(0, 0) and not CuptiPolicy.parse("always").includes(
        0, 0
    )
    default = RecordConfig(out="x").cupti
    assert str(default) == "snapshots"
    assert [s for s in range(10) if default.includes(s, 0)] == [1]
    assert [s for s in range(10) if default.includes(s, 3)] == [1, 2, 5, 8]  # the step before each snapshot
    for bad in ("sometimes", "window:3", "steps:5-2", ""):
        with pytest.raises(ConfigError):
            CuptiPolicy.parse(bad)
    env = RecordConfig(out="x", cupti=CuptiPolicy(StepSet(((3, None),)))).to_env()
    assert env["FSDP_REPLAY_CUPTI"] == "steps:3-"
    assert str(RecordConfig.from_env({**env}).cupti) == "steps:3-"
    with pytest.raises(ConfigError, match="FSDP_REPLAY_CUPTI"):
        RecordConfig.from_env({**env, "FSDP_REPLAY_CUPTI": "everything"})


def test_external_ids_encode_the_position_and_the_agents_own_work() -> None:
    for step, micro, seq in ((0, 0, -1), (1, 2, 0), (123456, 17, 9_999_999)):
        assert records.position_of(ext_position(step, micro, seq)) == (step, micro, seq)
    assert records.position_of(AGENT_EXT_ID) is None
    assert ext_position(1, 300, 5) == records.UNENCODABLE  # too many micro-steps: placed by time
    assert records.position_of(records.UNENCODABLE) is None
    assert ext_position(3, 1, 4) < AGENT_EXT_ID


# -- decoding -------------------------------------------------------------------------------------
def _window() -> tuple[list[Any], Marks, list[Any]]:
    """Step 1 of a program: forward on the training thread, backward on the autograd thread (which
    issues collective 5 and runs one of our hooks), the optimizer back on the training thread."""
    marks = Marks(
        positions=[(1000, 1, 0, 4), (2500, 1, 0, 5), (4000, 1, 1, 5)],
        agent=[(2600, AUTOGRAD, True), (2700, AUTOGRAD, False), (4100, TRAIN, True), (4200, TRAIN, False)],
    )
    first = [
        api(10, 1100, TRAIN),
        ext(10, ext_position(1, 0, 4)),
        ext(10, 77, kind=EXT_CUSTOM0),  # another client's kind: not ours
        api(11, 1200, TRAIN),
        ext(11, ext_position(1, 0, 4)),
        api(12, 1300, TRAIN),
        ext(12, ext_position(1, 0, 4)),
        api(13, 2000, AUTOGRAD),  # backward: no id pushed there, placed by time
        api(14, 2550, AUTOGRAD, driver=True),  # NCCL's launch of collective 5
        api(15, 2650, AUTOGRAD),  # inside our hook on the autograd thread
        ext(15, AGENT_EXT_ID),
        api(16, 2680, AUTOGRAD),  # our hook again, but its id was not seen: the marks say ours
        api(17, 4150, TRAIN),  # our step-end fingerprints on the training thread
        ext(17, AGENT_EXT_ID),
        kernel(10, 5000, 5100, "_Z4gemmv"),
        memcpy(11, 5100, 5200, MEMCPY_HTOD, 4096),
        kernel(12, 5200, 5300, "_Z4gemmv"),
        kernel(13, 5300, 5400, "_Z8gemm_bwdv"),
        kernel(14, 5400, 5900, "ncclDevKernel_AllReduce", stream=9),
        kernel(15, 5900, 5950, "fp_kernel"),
        kernel(16, 5950, 5990, "fp_kernel"),
        SimpleNamespace(kind=KIND_OVERHEAD, correlation_id=0, start=1, end=2),
    ]
    second = [
        memset(18, 0, 0, 64),  # never timed: dropped, counted
        kernel(17, 6000, 6010, "fp_kernel"),
        kernel(19, 6100, 6200, "_Z6adam_stepv"),  # its launch record was not delivered: placed after 17's
        memcpy(20, 6300, 6400, MEMCPY_DTOH, 4),
        memcpy(21, 6400, 6410, MEMCPY_HTOA, 8),
        api(20, 4400, TRAIN),
        ext(20, ext_position(2, 0, 5)),
        api(21, 4500, TRAIN),
        ext(21, ext_position(2, 0, 5)),
    ]
    return first, marks, second


def test_records_become_rows_placed_by_their_launch() -> None:
    first, marks, second = _window()
    batch = Batch()
    records.extract(first, KINDS, batch)
    assert (len(batch.kernels), len(batch.copies), len(batch.api), len(batch.ext), batch.other) == (
        6,
        1,
        8,
        5,
        1,
    )
    decoder = Decoder()
    d1 = decoder.decode(batch, marks)
    assert d1.agent == 2 and d1.incomplete == 0 and d1.name_base == 0
    assert d1.names == ["_Z4gemmv", "_Z8gemm_bwdv", "ncclDevKernel_AllReduce"]
    rows = [(r[3], tuple(r[:3]), d1.names[r[8]]) for r in d1.kernels]
    assert rows == [
        (10, (1, 0, 4), "_Z4gemmv"),
        (12, (1, 0, 4), "_Z4gemmv"),
        (13, (1, 0, 4), "_Z8gemm_bwdv"),  # by time: before collective 5
        (14, (1, 0, 5), "ncclDevKernel_AllReduce"),  # launched after the collective's mark
    ]
    assert d1.by_time == 2  # 13 and 14 (16 was placed by time too, and found to be ours)
    assert d1.kernels[3][6:8] == [0, 9]  # device, stream
    assert d1.copies == [[1, 0, 4, 11, 5100, 5200, 0, 7, schema.COPY_KIND_CODES["htod"], 4096]]

    batch2 = Batch()
    records.extract(second, KINDS, batch2)
    d2 = decoder.decode(batch2, Marks(positions=[(4300, 2, 0, 5)]))
    assert d2.incomplete == 1 and d2.agent == 1  # 17: its launch came in the first batch
    assert d2.name_base == 3 and d2.names == ["_Z6adam_stepv"]
    assert [(r[3], tuple(r[:3]), r[8]) for r in d2.kernels] == [(19, (1, 1, 5), 3)]  # 17's place: the agent's
    assert [(r[3], tuple(r[:3]), schema.COPY_KINDS[r[8]], r[9]) for r in d2.copies] == [
        (20, (2, 0, 5), "dtoh", 4),
        (21, (2, 0, 5), "other", 8),
    ]
    events = records.events_of(d2)
    assert [e["name_base"] for e in events] == [3] and events[0]["type"] == schema.EV_CUPTI


def test_a_window_ended_lets_its_launches_go_so_restarted_correlation_ids_are_placed_anew() -> None:
    """Once CUPTI is finalized between windows (or by another profiler) its correlation ids
    start over: a launch kept from the last window must not claim the next window's kernel of the
    same id. Before ``forget_launches`` it did (on the H200, 99 kernels of step 4 were placed in
    step 1 of a two-window capture)."""
    decoder = Decoder()
    window1 = Batch()
    records.extract(
        [api(1, 1000, TRAIN), ext(1, ext_position(1, 0, 3)), kernel(1, 1100, 1200, "_Z4gemmv")],
        KINDS,
        window1,
    )
    (row,) = decoder.decode(window1, Marks(positions=[(900, 1, 0, 3)])).kernels
    assert tuple(row[:3]) == (1, 0, 3)
    decoder.forget_launches()  # the window's final batch: everything it launched has run
    window2 = Batch()  # after a finalize, ids from 1 again
    records.extract(
        [api(1, 5000, TRAIN), ext(1, ext_position(4, 0, 9)), kernel(1, 5100, 5200, "_Z4gemmv")],
        KINDS,
        window2,
    )
    (row,) = decoder.decode(window2, Marks(positions=[(4900, 4, 0, 9)])).kernels
    assert tuple(row[:3]) == (4, 0, 9)
    # without letting go, the first window's launch of id 1 would have won (the older one first)
    stale = Decoder()
    stale.decode(window1, Marks(positions=[(900, 1, 0, 3)]))
    (row,) = stale.decode(window2, Marks(positions=[(4900, 4, 0, 9)])).kernels
    assert tuple(row[:3]) == (1, 0, 3)


def test_long_batches_are_cut_into_events_and_names_stay_numbered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(records, "ROWS_PER_EVENT", 2)
    batch = Batch()
    acts = []
    for i in range(5):
        acts += [
            api(100 + i, 10 + i, TRAIN),
            ext(100 + i, ext_position(1, 0, -1)),
            kernel(100 + i, 50 + i, 60 + i, f"k{i}"),
        ]
    records.extract(acts, KINDS, batch)
    events = records.events_of(Decoder().decode(batch, Marks(positions=[(0, 1, 0, -1)])))
    assert [len(e["kernels"]) for e in events] == [2, 2, 1]
    assert [(e["name_base"], e["names"]) for e in events] == [
        (0, ["k0", "k1", "k2", "k3", "k4"]),
        (5, []),
        (5, []),
    ]
    assert records.events_of(Decoder().decode(Batch(), Marks())) == []


# -- the round trip -------------------------------------------------------------------------------
def _rank_start(rank: int) -> dict[str, Any]:
    return {
        "type": schema.EV_RANK_START,
        "format_version": schema.FORMAT_VERSION,
        "rank": rank,
        "world_size": 1,
        "local_rank": 0,
        "pid": 1,
        "host": "test",
        "argv": ["train.py"],
        "orig_argv": ["python", "train.py"],
        "executable": "python",
        "cwd": "/",
        "env": {},
        "versions": {},
        "threads": {},
        "determinism": {},
        "script": {"path": None, "sha256": None},
        "policy": {"cupti": "always"},
        "start_ns": 1,
        "fingerprint_algos": {},
    }


def _state(state: str, reason: str, step: int, **extra: Any) -> dict[str, Any]:
    return {
        "type": schema.EV_CUPTI_STATE,
        "state": state,
        "reason": reason,
        "step": step,
        "t_ns": 10,
        **extra,
    }


def _step(step: int) -> dict[str, Any]:
    return {
        "type": schema.EV_STEP,
        "step": step,
        "micro_steps": 1,
        "colls": 0,
        "params": [],
        "loss": [],
        "t_ns": 9,
    }


def test_rows_go_through_a_real_spool_collect_and_reader(tmp_path: Path) -> None:
    first, marks, second = _window()
    decoder = Decoder()
    b1, b2 = Batch(), Batch()
    records.extract(first, KINDS, b1)
    records.extract(second, KINDS, b2)
    d1 = decoder.decode(b1, marks)
    d2 = decoder.decode(b2, Marks(positions=[(4300, 2, 0, 5)]))
    # a second process attempt (a restart) numbers its kernel names from 0 again
    again = Batch()
    records.extract(
        [api(3, 100, TRAIN), ext(3, ext_position(0, 0, -1)), kernel(3, 200, 300, "_Z6restartv")], KINDS, again
    )
    d3 = Decoder().decode(again, Marks(positions=[(50, 0, 0, -1)]))
    w = spool.SpoolWriter(spool.rank_dir(tmp_path / schema.SPOOL_DIR, 0), 0)
    events = [
        _rank_start(0),
        _state("armed", "--cupti always", 1, clock=[900, 1000], detail={"libcupti_version": 130000}),
        _step(0),
        *records.events_of(d2),  # out of order, as CUPTI may deliver: the collector sorts
        *records.events_of(d1),
        _state("paused", "torch.profiler (_prepare_profiler) started", 2),
        _step(1),
        _rank_start(0),
        _state("armed", "--cupti always", 1, clock=[5, 7]),
        *records.events_of(d3),
    ]
    for ev in events:
        w.append(schema.KIND_EVENT, json.dumps(ev).encode())
    w.close()
    report = collect(tmp_path / schema.SPOOL_DIR, tmp_path / schema.TRACE_DIR)
    assert not report.damaged
    r = Trace.open(tmp_path / schema.TRACE_DIR).rank(0)
    k, c = r.table("kernels"), r.table("copies")
    names = r.names("kernel")
    # codes in the order the collector met the names (a process's codes map to the rank's)
    assert names == ["_Z6adam_stepv", "_Z4gemmv", "_Z8gemm_bwdv", "ncclDevKernel_AllReduce", "_Z6restartv"]
    assert k["corr"].tolist() == [10, 12, 13, 14, 19, 3]  # attempt, then launch order
    assert [names[n] for n in k["name"].tolist()] == [
        "_Z4gemmv",
        "_Z4gemmv",
        "_Z8gemm_bwdv",
        "ncclDevKernel_AllReduce",
        "_Z6adam_stepv",
        "_Z6restartv",
    ]
    assert k["seq"].tolist() == [4, 4, 4, 5, 5, -1] and k["step"].tolist() == [1, 1, 1, 1, 1, 0]
    assert (k["end_ns"] - k["start_ns"]).tolist() == [100, 100, 100, 500, 100, 100]
    assert {col: str(k[col].dtype) for col in schema.TABLES["kernels"]} == schema.TABLES["kernels"]
    assert c["corr"].tolist() == [11, 20, 21] and c["bytes"].tolist() == [4096, 4, 8]
    assert [schema.COPY_KINDS[x] for x in c["kind"].tolist()] == ["htod", "dtoh", "other"]
    cupti = r.attrs[schema.CUPTI_ATTR]
    assert [s["state"] for s in cupti["states"]] == ["armed", "paused", "armed"]
    assert cupti["clock"] == [[900, 1000, 0], [5, 7, 1]]
    summary = cupti_summary(r)
    assert summary is not None
    assert (summary["kernels"], summary["copies"], summary["kernels_per_step"]) == (6, 3, {0: 1, 1: 5})
    assert summary["pauses"][0]["reason"].startswith("torch.profiler")
    text = cupti_lines(0, summary)
    assert "6 kernels (5 distinct) and 3 copies over steps 0..1" in text[0]
    assert "step 2: paused: torch.profiler" in text[1]
    assert "let go" not in text[0]  # no detach counted (this trace has no end event)
    assert r.read_all() > 0  # every array, kernels and copies included, matches the array list
    # windows with CUPTI let go between them: the steps named, not a range, and the detaches said
    windows = {**summary, "steps": [1, 4, 9], "detaches": 2}
    assert (
        "over 3 steps (1, 4, 9); 0 of the agent's own left out; CUPTI let go between windows 2 times"
        in (cupti_lines(0, windows)[0])
    )


# -- other profilers --------------------------------------------------------------------------------
def test_the_watch_sees_torch_profiler_start_before_kineto_and_lets_go() -> None:
    import torch
    import torch.autograd.profiler as autograd_profiler
    from torch.profiler import ProfilerActivity, profile

    seen: list[tuple[str, bool]] = []
    original = autograd_profiler._prepare_profiler
    watch = coexist.ProfilerWatch(lambda what: seen.append((what, coexist.torch_profiler_active())))
    watch.install()
    try:
        assert not coexist.torch_profiler_active()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            assert coexist.torch_profiler_active()
            torch.ones(4).add_(1)
        assert not coexist.torch_profiler_active()
        assert any(e.name == "aten::add_" for e in prof.events())  # the profiler got its data
    finally:
        watch.uninstall()
    assert autograd_profiler._prepare_profiler is original
    # told before Kineto was prepared (and before it was enabled), while it was not yet on
    assert seen[0] == ("torch.profiler (_prepare_profiler)", False)
    assert [w for w, _ in seen] == ["torch.profiler (_prepare_profiler)", "torch.profiler (_enable_profiler)"]


def test_injected_cupti_clients_are_found_by_library_or_variable() -> None:
    maps = (
        "7f0000000000-7f0000001000 r-xp 00000000 08:01 123 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
        "7f0000002000-7f0000003000 r-xp 00000000 08:01 124 /opt/nsys/target-linux-x64/libToolsInjection64.so\n"
        "7f0000004000-7f0000005000 rw-p 00000000 00:00 0 \n"
    )
    libs = coexist.loaded_libraries(maps)
    assert libs == [
        "/usr/lib/x86_64-linux-gnu/libc.so.6",
        "/opt/nsys/target-linux-x64/libToolsInjection64.so",
    ]
    assert "Nsight Systems" in (coexist.injected_tool({}, libs) or "")
    assert coexist.injected_tool({}, libs[:1]) is None
    found = coexist.injected_tool({"CUDA_INJECTION64_PATH": "/opt/tool/libinject.so"}, libs[:1])
    assert found is not None and "CUDA_INJECTION64_PATH=/opt/tool/libinject.so" in found
    ours = coexist.loaded_libraries(coexist.proc_maps())
    assert any("libpython" in p or "torch" in p for p in ours) and coexist.injected_tool({}, ours) is None
    assert coexist.foreign_holder({"probe": "busy", "holder": "CUPTI for Kineto"}) is None
    assert coexist.foreign_holder({"probe": "busy", "holder": ""}) is None  # a legacy subscriber: maybe idle
    assert coexist.foreign_holder({"probe": "busy", "holder": "Nsight Systems"}) == "Nsight Systems"
    assert coexist.foreign_holder({"probe": "ok", "holder": ""}) is None


def test_cupti_is_finalized_between_windows_only_from_cuda_12_6() -> None:
    """Before CUDA 12.6 a CUDA graph launched after ``cuptiFinalize`` could crash: CUPTI stays
    attached there, and the reason is said; a version that cannot be read is not trusted."""
    assert coexist.detach_unsafe("13.0") == "" and coexist.detach_unsafe("12.6") == ""
    assert "before 12.6" in coexist.detach_unsafe("12.4")
    assert "not understood" in coexist.detach_unsafe(None)
    assert "not understood" in coexist.detach_unsafe("13")
    assert "not understood" in coexist.detach_unsafe("13.x")


# -- a CPU recording ----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_a_cpu_recording_with_cupti_always_says_it_is_off_and_never_imports_cupti(tmp_path: Path) -> None:
    out, modules = tmp_path / "rec", tmp_path / "modules.json"
    run(
        [
            *CLI,
            "record",
            "--out",
            str(out),
            "--cupti",
            "always",
            "--",
            sys.executable,
            str(WORKLOADS / "modules_at_exit.py"),
            str(WORKLOADS / "tiny_train.py"),
            "--steps",
            "3",
        ],
        # one process, no torchrun: the rendezvous comes from the environment (seconds saved)
        env=child_env(
            MODULES_OUT=str(modules),
            MODULES_MATCH="cupti",
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        ),
        cwd=REPO,
    )
    # neither cupti-python nor our package (torch has a module of its own named after CUPTI)
    ours = [m for m in json.loads(modules.read_text()) if m.split(".")[0] == "cupti" or "agent.cupti" in m]
    assert ours == []
    r = Trace.open(out / schema.TRACE_DIR).rank(0)
    assert r.meta["policy"]["cupti"] == "always"
    states = r.attrs[schema.CUPTI_ATTR]["states"]
    assert [(s["state"], s["reason"].split(" (")[0]) for s in states] == [("off", "no CUDA device in use")]
    assert len(r.table("kernels")) == 0 and len(r.table("copies")) == 0 and r.names("kernel") == []
    assert len(r.steps) == 3 and r.attrs["agent_errors"] == []
    assert "cupti_kernels" not in r.attrs["end"]["counters"]
    summary = json.loads(run([*CLI, "inspect", str(out), "--json"]).stdout)["per_rank"][0]["cupti"]
    assert summary["off"].startswith("no CUDA device in use")
    assert cupti_lines(0, summary) == []  # inspect's text does not dwell on a CPU rank's lack of kernels
    assert sys.modules.get("cupti") is None  # nor here, in the test process
