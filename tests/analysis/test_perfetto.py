"""``fsdp-replay export --perfetto`` on a real recording (the example, 2 CPU ranks, 3 steps): the
document is valid trace-event JSON, and every step, micro-step and collective of the trace is on
its rank's timeline, with its sequence number, process group, bytes and fingerprints, at the
trace's times."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness import CLI, record, run
from trace_events import check, schema_validate

from fsdp_replay.analysis import perfetto
from fsdp_replay.trace import schema
from fsdp_replay.trace.reader import RankTrace, Trace

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rec(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out, _ = record(tmp_path_factory.mktemp("perfetto"), 2, "--cpu", "--steps", "3")
    return out


@pytest.fixture(scope="module")
def exported(rec: Path) -> dict[str, Any]:
    out = rec / "timeline.json.gz"
    proc = run([*CLI, "export", "--perfetto", str(rec), "-o", str(out)])
    assert "trace events of ranks [0, 1]" in proc.stdout
    return json.loads(gzip.decompress(out.read_bytes()))


def _us(r: RankTrace, t_ns: int, origin: int) -> float:
    return (int(r.meta["t0_wall_ns"]) + t_ns - origin) / 1000


def test_the_export_is_valid_trace_event_json(exported: dict[str, Any]) -> None:
    counts = check(exported)
    assert counts["X"] > 100 and counts["M"] >= 2 * 2 * 2, counts
    assert schema_validate(exported), "jsonschema is a test dependency (pyproject's test extra)"
    assert not [e for e in exported["traceEvents"] if e.get("cat") in ("kernel", "copy")]  # a CPU trace


def test_every_step_micro_step_and_collective_is_on_the_timeline(rec: Path, exported: dict[str, Any]) -> None:
    trace = Trace.open(rec / schema.TRACE_DIR)
    origin = exported["otherData"]["origin_ns"]
    events = exported["traceEvents"]
    for rank in trace.ranks:
        r = trace.rank(rank)
        mine = [e for e in events if e["pid"] == rank and e["ph"] == "X"]
        # steps: one slice each, ending at the step's end
        steps = [e for e in mine if e["cat"] == "step"]
        s = r.steps
        assert [e["args"]["step"] for e in steps] == s["step"].tolist()
        ends = [_us(r, t, origin) for t in s["t_ns"].tolist()]
        assert [e["ts"] + e["dur"] for e in steps] == pytest.approx(ends, abs=1e-3)
        assert [e["ts"] for e in steps[1:]] == pytest.approx(ends[:-1], abs=1e-3)
        # micro-steps: each backward's end, then the optimizer, inside their step
        micro = [e for e in mine if e["cat"] == "micro"]
        assert len(micro) == int(s["micro_steps"].sum()) + len(s)
        m = r.table("micro_steps")
        backward_ends = [_us(r, t, origin) for t in m["t_ns"].tolist()]
        assert [e["ts"] + e["dur"] for e in micro if e["name"] != "optimizer"] == pytest.approx(
            backward_ends, abs=1e-3
        )
        for e in micro:
            step = steps[e["args"]["step"]]
            assert step["ts"] - 1e-3 <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"] + 1e-3, e
        # collectives: every row once, with its seq, process group, op, bytes and fingerprints
        colls = sorted((e for e in mine if e["cat"] == "collective"), key=lambda e: e["args"]["seq"])
        c, t = r.collectives, r.tensors
        assert [e["args"]["seq"] for e in colls] == c["seq"].tolist()
        ops, algos = r.names("op"), r.names("algo")
        pg_names = {g["pg"]: g["name"] for g in r.attrs["process_groups"]}
        for e, row in zip(colls, range(len(c)), strict=True):
            a = e["args"]
            assert e["name"] == a["op"] == ops[int(c["op"][row])]
            assert (a["pg"], a["step"], a["micro"]) == (
                int(c["pg"][row]),
                int(c["step"][row]),
                int(c["micro"][row]),
            )
            assert a["pg_name"] == pg_names[a["pg"]]
            assert e["ts"] == pytest.approx(_us(r, int(c["t_ns"][row]), origin), abs=1e-3)
            assert e["dur"] == pytest.approx(int(c["dur_ns"][row]) / 1000, abs=1e-3)
            rows = np.arange(
                int(c["tensor_start"][row]), int(c["tensor_start"][row]) + int(c["tensor_count"][row])
            )
            outs = rows[t["role"][rows] == schema.ROLE_OUTPUT]
            assert a["bytes"] == int(t["nbytes"][outs].sum())
            assert a["fingerprints"]["out"] == [
                f"{algos[int(t['algo'][i])]}:{int(t['fp'][i]):016x}" for i in outs
            ]
        # timestamp order: the timeline's order is the trace's issue order
        by_time = sorted(colls, key=lambda e: (e["ts"], e["args"]["seq"]))
        order = np.lexsort((c["seq"], c["t_ns"]))
        assert [e["args"]["seq"] for e in by_time] == c["seq"][order].tolist()
        # each process group's track (lanes when collectives overlap) is named for it
        names = {
            (e["pid"], e["tid"]): e["args"]["name"]
            for e in events
            if e["ph"] == "M" and e["name"] == "thread_name"
        }
        for e in colls:
            assert names[(rank, e["tid"])].startswith(f"collectives pg {e['args']['pg']}"), names[
                (rank, e["tid"])
            ]


def test_one_rank_and_the_exit_codes(rec: Path, tmp_path: Path) -> None:
    doc = perfetto.export(Trace.open(rec / schema.TRACE_DIR), [1])
    check(doc)
    assert {e["pid"] for e in doc["traceEvents"]} == {1}
    out = tmp_path / "t.json"
    assert (
        run([*CLI, "export", "--perfetto", str(tmp_path / "nothing"), "-o", str(out)], check=False).returncode
        == 3
    )
    assert run([*CLI, "export", "--perfetto", str(rec)], check=False).returncode == 2  # no -o
    both = [*CLI, "export", "--perfetto", str(rec), "--memory-snapshot", str(rec), "-o", str(out)]
    assert run(both, check=False).returncode == 2
    proc = run([*CLI, "export", "--memory-snapshot", str(rec), "-o", str(out)], check=False)
    assert proc.returncode == 3 and "no rank recorded an out-of-memory error" in proc.stderr
    assert not out.exists()
    # never into the trace; a folder that is not there yet is made
    inside = rec / schema.TRACE_DIR / "t.json"
    proc = run([*CLI, "export", "--perfetto", str(rec), "-o", str(inside)], check=False)
    assert proc.returncode == 2 and "is inside the trace" in proc.stderr and not inside.exists()
    run([*CLI, "export", "--perfetto", str(rec), "-o", str(tmp_path / "new" / "t.json")])
    check(json.loads((tmp_path / "new" / "t.json").read_text()))
