"""The Perfetto export's kernels and copies, without a GPU: ``cupti`` and ``cupti_state`` events
as the CUPTI capture writes them (``docs/trace-format.md``) go through a real spool and the
collector; every row must be on its stream's track, named, at its device time mapped to the rank's
clock by the armed clock pair, and the document must stay valid trace-event JSON. The GPU tests
(``tests/system/test_gpu_memory.py``) export a trace with real CUPTI rows when the capture ran.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from trace_events import check, schema_validate

from fsdp_replay.analysis.perfetto import export
from fsdp_replay.trace import schema, spool
from fsdp_replay.trace.collect import collect
from fsdp_replay.trace.reader import Trace

T0_WALL = 1_800_000_000_000_000_000
CUPTI_AT_ARM, T_NS_AT_ARM = 5_000_000_000_000, 2_000_000  # the pair read together when armed
STREAMS = (7, 13)
# [step, micro, seq, corr, start_ns, end_ns, device, stream, name]: device times on CUPTI's clock
KERNELS = [
    [1, 0, 3, 100, CUPTI_AT_ARM + 1_000, CUPTI_AT_ARM + 9_000, 0, 7, 0],
    [1, 0, 3, 101, CUPTI_AT_ARM + 9_500, CUPTI_AT_ARM + 20_000, 0, 7, 1],
    [1, 1, 4, 104, CUPTI_AT_ARM + 30_000, CUPTI_AT_ARM + 35_000, 0, 13, 2],
]
# [step, micro, seq, corr, start_ns, end_ns, device, stream, kind, bytes]
COPIES = [
    [1, 0, 3, 99, CUPTI_AT_ARM + 200, CUPTI_AT_ARM + 900, 0, 7, schema.COPY_KIND_CODES["htod"], 4096],
    [
        1,
        1,
        4,
        103,
        CUPTI_AT_ARM + 21_000,
        CUPTI_AT_ARM + 22_000,
        0,
        13,
        schema.COPY_KIND_CODES["memset"],
        512,
    ],
]
NAMES = ["ampere_sgemm_128x64_tn", "vectorized_elementwise_kernel", "ncclDevKernel_AllReduce_Sum_f32"]


def _rank_start() -> dict[str, Any]:
    keys = schema.EVENT_KEYS[schema.EV_RANK_START]
    ev: dict[str, Any] = {k: None for k in keys}
    ev.update(
        type=schema.EV_RANK_START,
        format_version=schema.FORMAT_VERSION,
        rank=0,
        world_size=1,
        local_rank=0,
        pid=1,
        host="gpu0",
        argv=[],
        orig_argv=[],
        env={},
        versions={},
        threads={},
        determinism={},
        policy={},
        start_ns=T0_WALL,
        fingerprint_algos={},
        t0_wall_ns=T0_WALL,
    )
    return ev


def record(out: Path, clock: bool) -> Trace:
    """A one-rank trace whose step 1 CUPTI captured (``clock``: with the pair read when armed)."""
    w = spool.SpoolWriter(spool.rank_dir(out / schema.SPOOL_DIR, 0), 0)
    armed: dict[str, Any] = {
        "type": schema.EV_CUPTI_STATE,
        "state": "armed",
        "reason": "step 1 is in the window",
        "step": 1,
        "t_ns": T_NS_AT_ARM,
    }
    if clock:
        armed["clock"] = [CUPTI_AT_ARM, T_NS_AT_ARM]
    for ev in (
        _rank_start(),
        {
            "type": schema.EV_STEP,
            "step": 0,
            "micro_steps": 0,
            "colls": 0,
            "params": [],
            "loss": [],
            "t_ns": 1_000_000,
        },
        armed,
        # rows arrive in completion order; the collector sorts them by correlation id
        {"type": schema.EV_CUPTI, "kernels": KERNELS[::-1], "copies": COPIES, "names": NAMES, "name_base": 0},
        {
            "type": schema.EV_STEP,
            "step": 1,
            "micro_steps": 2,
            "colls": 0,
            "params": [],
            "loss": [],
            "t_ns": 3_000_000,
        },
        {"type": schema.EV_END, "reason": "exit", "steps": 2, "colls": 0, "t_ns": 3_100_000, "counters": {}},
    ):
        w.append(schema.KIND_EVENT, ev)
    w.close()
    report = collect(out / schema.SPOOL_DIR, out / schema.TRACE_DIR)
    assert not report.damaged, report
    return Trace.open(out / schema.TRACE_DIR)


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Trace:
    return record(tmp_path_factory.mktemp("device"), clock=True)


def test_kernels_and_copies_are_on_their_streams_at_the_mapped_times(trace: Trace) -> None:
    r = trace.rank(0)
    assert len(r.table("kernels")) == len(KERNELS) and len(r.table("copies")) == len(COPIES)
    doc = export(trace)
    check(doc)
    assert schema_validate(doc)
    origin = doc["otherData"]["origin_ns"]
    threads = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    kernels = [e for e in doc["traceEvents"] if e.get("cat") == "kernel"]
    copies = [e for e in doc["traceEvents"] if e.get("cat") == "copy"]
    assert sorted(e["args"]["corr"] for e in kernels) == [100, 101, 104]
    assert sorted(e["args"]["corr"] for e in copies) == [99, 103]

    def host_us(cupti_ns: int) -> float:  # start_ns - cupti_ns + t_ns, on the wall clock
        return (T0_WALL + cupti_ns - CUPTI_AT_ARM + T_NS_AT_ARM - origin) / 1000

    for rows, events, label in ((KERNELS, kernels, lambda row: NAMES[row[8]]), (COPIES, copies, None)):
        by_corr = {e["args"]["corr"]: e for e in events}
        for row in rows:
            e = by_corr[row[3]]
            assert e["ts"] == pytest.approx(host_us(row[4]), abs=1e-3)
            assert e["dur"] == pytest.approx((row[5] - row[4]) / 1000, abs=1e-3)
            assert (e["args"]["step"], e["args"]["micro"], e["args"]["seq"]) == tuple(row[:3])
            assert threads[e["tid"]] == f"cuda stream {row[7]} (device {row[6]})"
            if label is not None:
                assert e["name"] == label(row)
            else:
                assert e["name"] == schema.COPY_KINDS[row[8]] and e["args"]["bytes"] == row[9]
    assert {threads[e["tid"]] for e in kernels + copies} == {f"cuda stream {s} (device 0)" for s in STREAMS}
    # the device's work lies inside the step it belongs to on the timeline
    (step1,) = [e for e in doc["traceEvents"] if e.get("cat") == "step" and e["args"]["step"] == 1]
    for e in kernels + copies:
        assert step1["ts"] <= e["ts"] and e["ts"] + e["dur"] <= step1["ts"] + step1["dur"]


def test_without_a_clock_pair_the_device_rows_are_left_out_and_said_so(tmp_path: Path) -> None:
    doc = export(record(tmp_path, clock=False))
    check(doc)
    assert not [e for e in doc["traceEvents"] if e.get("cat") in ("kernel", "copy")]
    assert any("no device-to-host clock pair" in n for n in doc["otherData"]["notes"])


def test_a_restarted_process_rows_go_by_its_own_clock_pair(tmp_path: Path) -> None:
    """Two process attempts: each armed with its own pair; the second's rows (corr starting low
    again) are mapped by the second pair, not the first."""
    later, t_later = CUPTI_AT_ARM + 60_000_000_000, 700_000  # a minute on, in a new process
    w = spool.SpoolWriter(spool.rank_dir(tmp_path / schema.SPOOL_DIR, 0), 0)
    rows_second = [[0, 0, -1, 5, later + 1_000, later + 4_000, 0, 7, 0]]
    for cupti_ns, t_ns, rows in ((CUPTI_AT_ARM, T_NS_AT_ARM, KERNELS[:1]), (later, t_later, rows_second)):
        for ev in (
            _rank_start(),
            {
                "type": schema.EV_CUPTI_STATE,
                "state": "armed",
                "reason": "window",
                "step": 0,
                "t_ns": t_ns,
                "clock": [cupti_ns, t_ns],
            },
            {"type": schema.EV_CUPTI, "kernels": rows, "copies": [], "names": NAMES[:1], "name_base": 0},
        ):
            w.append(schema.KIND_EVENT, ev)
    w.close()
    assert not collect(tmp_path / schema.SPOOL_DIR, tmp_path / schema.TRACE_DIR).damaged
    doc = export(Trace.open(tmp_path / schema.TRACE_DIR))
    check(doc)
    origin = doc["otherData"]["origin_ns"]
    got = {e["args"]["corr"]: e["ts"] for e in doc["traceEvents"] if e.get("cat") == "kernel"}
    first, second = KERNELS[0], rows_second[0]
    assert got[first[3]] == pytest.approx((T0_WALL + first[4] - CUPTI_AT_ARM + T_NS_AT_ARM - origin) / 1000)
    assert got[second[3]] == pytest.approx((T0_WALL + second[4] - later + t_later - origin) / 1000)
    assert any("started 2 times" in note for note in doc["otherData"]["notes"])
