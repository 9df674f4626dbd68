"""The payload flight recorder (issue #13): ``record --payloads window:4`` keeps the last steps'
payloads in memory and writes them only when the run fails.

A run whose rank 1 meets a NaN at step 9 (and then raises, ``--stop-on-nan``): only metadata for
the healthy steps 0..3, the payloads and the snapshot of the window written at the failure, and a
replay of rank 1 over those steps BIT-EXACT (the NaN included: the recorded run had it, so a
faithful replay reproduces it). A run that ends well writes no payload at all.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
from harness import CLI, record, run

from fsdp_replay.trace import schema
from fsdp_replay.trace.reader import RankTrace, Trace

pytestmark = pytest.mark.slow
SMALL = ("--layers", "2", "--d-model", "64", "--seq-len", "32")
NAN_STEP = 9
# window:4 with a snapshot every 2 steps: for a failure in step 9 the window reaches step 5 and
# starts at the newest snapshot at or before it, step 4.
WINDOW_START = 4
WINDOW_BYTES = 256 << 20  # given: the NaN run's bound (the run that ends well sizes its own)


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rec, proc = record(
        tmp_path_factory.mktemp("flight"),
        2,
        "--steps",
        "12",
        *SMALL,
        "--nan-at-step",
        str(NAN_STEP),
        "--nan-rank",
        "1",
        "--stop-on-nan",
        record_args=("--payloads", "window:4", "--snapshot-every", "2", "--window-bytes", str(WINDOW_BYTES)),
        check=False,
    )
    assert proc.returncode != 0 and "FloatingPointError" in proc.stderr, proc.stderr[-3000:]
    return rec


def _payload_steps(rt: RankTrace) -> tuple[set[int], set[int], set[int]]:
    """Steps with a stored collective output, without one, and with a stored batch."""
    c, t, b, bt = rt.collectives, rt.tensors, rt.batches, rt.batch_tensors
    outs = t["role"] == schema.ROLE_OUTPUT
    steps = c["step"][t["coll"]]
    stored = set(steps[outs & (t["payload"] >= 0)].tolist())
    missing = set(steps[outs & (t["payload"] < 0)].tolist())
    return stored, missing, set(b["step"][bt["batch"][bt["payload"] >= 0]].tolist())


def test_a_nan_writes_the_window_only_and_its_steps_replay_bit_exact(nan_run: Path) -> None:
    trace = Trace.open(nan_run / schema.TRACE_DIR)
    for rank in (0, 1):
        rt = trace.rank(rank)
        dumps = rt.attrs["flight_dumps"]
        # the NaN at the end of step 9 (rank 1: its loss; rank 0: its parameters, after the
        # gradients' reduce-scatter), then the end in step 10, continuing that dump: the rank's
        # own FloatingPointError, or torchrun's SIGTERM when its peer died of it first
        assert [d["reason"] for d in dumps][:1] == ["nonfinite"] and len(dumps) == 2, dumps
        assert [(d["first_step"], d["last_step"], d["snapshot_step"]) for d in dumps] == [
            (WINDOW_START, NAN_STEP, WINDOW_START),
            (WINDOW_START, NAN_STEP + 1, WINDOW_START),
        ]
        assert dumps[1]["reason"] == "sigterm" or "FloatingPointError" in dumps[1]["detail"], dumps
        assert dumps[0]["blobs"] > 0 and dumps[0]["dropped"] == dumps[1]["dropped"] == 0
        stored, missing, batches = _payload_steps(rt)
        assert stored == set(range(WINDOW_START, NAN_STEP + 2)), stored
        assert missing == set(range(WINDOW_START)), missing  # the healthy steps: metadata only
        assert batches == set(range(WINDOW_START, NAN_STEP + 1))
        assert len(rt.steps) == NAN_STEP + 1 and bool(rt.steps["nonfinite"][NAN_STEP])
        assert [(s["step"], s["payload"] >= 0) for s in rt.attrs["snapshots"]] == [(WINDOW_START, True)]
        rng = rt.table("rng")
        kept = set(rng["step"][rng["payload"] >= 0].tolist())
        assert -1 in kept and WINDOW_START in kept and not kept & set(range(1, WINDOW_START))
        assert rt.attrs["flight_unwritten"] > 0 and rt.attrs["payload_missing"] == 0
        policy = rt.meta["policy"]
        assert (policy["window_bytes"], policy["window_bytes_auto"]) == (WINDOW_BYTES, False), policy
    summary = json.loads(run([*CLI, "inspect", str(nan_run), "--json"]).stdout)
    (shown,) = [f for f in summary["findings"] if f["kind"] == "flight" and f["rank"] == 1]
    assert f"steps {WINDOW_START}..{NAN_STEP + 1} and the snapshot of step {WINDOW_START}" in shown["message"]
    assert "nonfinite" in shown["message"]
    command = shlex.split(shown["next"])
    assert command[:2] == ["fsdp-replay", "replay"]
    assert command[-4:] == ["--from-step", str(WINDOW_START), "--to-step", str(NAN_STEP)]
    report = nan_run / "replay-window"
    proc = run([*CLI, *command[1:], "--report", str(report)], check=False)  # as the finding says
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    doc = json.loads((report / "report.json").read_text())
    assert doc["status"] == "bit-exact", out[-4000:]
    assert doc["restored_snapshot"] == WINDOW_START
    assert doc["verified_steps"] == list(range(WINDOW_START, NAN_STEP + 1)), out[-4000:]
    assert f"BIT-EXACT over steps {WINDOW_START}..{NAN_STEP}" in out


def test_a_run_that_ends_well_writes_no_payload(tmp_path: Path) -> None:
    rec, _ = record(tmp_path, 2, "--steps", "6", *SMALL, record_args=("--payloads", "window:4"))
    found = re.search(r"^MemTotal:\s*(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
    assert found is not None
    total = int(found.group(1)) * 1024
    trace = Trace.open(rec / schema.TRACE_DIR)
    for rank in (0, 1):
        rt = trace.rank(rank)
        assert len(rt.steps) == 6 and rt.completeness["complete"]
        for table in ("tensors", "batch_tensors", "tape_tensors"):
            assert np.all(rt.table(table)["payload"] < 0), table
        assert rt.attrs["snapshots"] == [] and rt.attrs["flight_dumps"] == []
        # what the trace holds is metadata: the RNG states at process start, nothing else
        rng = rt.table("rng")
        assert rng["step"][rng["payload"] >= 0].tolist() == [-1]
        assert len(rt.payloads) == 1
        counters = rt.attrs["end"]["counters"]
        assert counters["flight_dumps"] == 0 and counters["flight_blobs_dropped"] == 0
        assert counters["flight_held_bytes"] > 0  # it did hold the window, to the end
        # its bound, sized from this host's memory for torchrun's two local ranks: at least the
        # writer's (1 GiB), and at most a quarter of all memory shared by two
        policy = rt.meta["policy"]
        assert policy["window_bytes_auto"] is True, policy
        assert 1 << 30 <= policy["window_bytes"] <= max(1 << 30, total // 8), (policy, total)
    summary = json.loads(run([*CLI, "inspect", str(rec), "--json"]).stdout)
    (note,) = [f for f in summary["findings"] if f["kind"] == "flight"]
    assert "wrote no payloads" in note["message"] and note["next"].endswith("--all-ranks")
