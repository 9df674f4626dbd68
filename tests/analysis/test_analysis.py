"""Post-mortem analysis: where a NaN started, where a hang desynchronised, where two runs diverged."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness import CLI, EXAMPLE, REPO, child_env, record, torchrun_cmd

from fsdp_replay.analysis.desync import desync_report
from fsdp_replay.analysis.diff import diff_traces
from fsdp_replay.analysis.nonfinite import nonfinite_origin
from fsdp_replay.analysis.payloads import decode, magnitude
from fsdp_replay.analysis.plots import plot_drift
from fsdp_replay.cli.render import jsonable as _jsonable
from fsdp_replay.trace import schema
from fsdp_replay.trace.reader import Trace

# Small enough to start fast; gradient accumulation stays at the example's 2 micro-batches.
SMALL = ("--steps", "6", "--layers", "2", "--d-model", "64", "--seq-len", "32")
NO_PAYLOADS = ("--payloads", "none")
NAN_SHARD = REPO / "tests" / "workloads" / "nan_shard.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """Run ``fsdp-replay ARGV`` in process (main() maps errors to exit codes); (code, stdout)."""
    from fsdp_replay.cli import main

    capsys.readouterr()
    code = main(list(argv))
    return code, " ".join(capsys.readouterr().out.split())


def open_trace(run_dir: Path) -> Trace:
    return Trace.open(run_dir / schema.TRACE_DIR)


# -- fast ---------------------------------------------------------------------------------------
def test_analysis_never_imports_torch() -> None:
    code = (
        "import sys, fsdp_replay.analysis.desync, fsdp_replay.analysis.diff, fsdp_replay.analysis.nonfinite, fsdp_replay.analysis.summary, fsdp_replay.cli.analyze; "
        "assert 'torch' not in sys.modules, 'torch imported'; assert 'matplotlib' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=child_env())


def test_magnitude_float32() -> None:
    a = np.array([1.0, 2.0, 3.0, 4.0], dtype="<f4")
    b = a.copy()
    b[2] = 3.5
    b[3] = -4.0
    m = magnitude(a.tobytes(), b.tobytes(), "float32")
    assert m is not None
    assert m["numel"] == 4 and m["n_differing"] == 2 and m["first_index"] == 2
    assert m["a_value"] == 3.0 and m["b_value"] == 3.5
    assert m["max_abs_diff"] == pytest.approx(8.0)
    assert m["max_rel_diff"] == pytest.approx(2.0)
    assert magnitude(a.tobytes(), a.tobytes(), "float32")["n_differing"] == 0  # type: ignore[index]


def test_magnitude_bfloat16_and_nonfinite() -> None:
    f = np.array([1.0, -2.5, 0.0, 100.0], dtype=np.float32)
    bf = (f.view(np.uint32) >> 16).astype("<u2")  # exact in bfloat16
    vals, raw = decode(bf.tobytes(), "bfloat16")  # type: ignore[misc]
    assert vals.tolist() == [1.0, -2.5, 0.0, 100.0] and raw.dtype == np.dtype("<u2")
    other = bf.copy()
    other[1] = 0x7FC0  # NaN
    m = magnitude(bf.tobytes(), other.tobytes(), "bfloat16")
    assert m is not None
    assert m["n_differing"] == 1 and m["first_index"] == 1
    assert m["nonfinite_b"] == 1 and m["nonfinite_a"] == 0
    assert m["max_abs_diff"] == 0.0  # over the elements finite in both
    assert math_isnan(m["b_value"])


def math_isnan(x: Any) -> bool:
    return isinstance(x, float) and x != x


def test_json_output_is_strict() -> None:
    out = json.dumps(_jsonable({"a": [float("nan"), float("inf"), -float("inf"), 1.5]}), allow_nan=False)
    assert json.loads(out) == {"a": ["NaN", "Infinity", "-Infinity", 1.5]}


def test_plot_of_an_empty_result_is_a_png(tmp_path: Path) -> None:
    result = {
        "ranks": [
            {
                "rank": 0,
                "first": None,
                "drift": {"step": [0, 1], "params_differing": [0, 0], "loss_abs_diff": [0.0, 0.0]},
            }
        ]
    }
    path = plot_drift(result, str(tmp_path / "d.png"))
    assert Path(path).read_bytes()[:8] == PNG_MAGIC


def test_unusable_input_exits_3(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        ["nan", str(tmp_path / "nope")],
        ["desync", str(tmp_path)],
        ["diff", str(tmp_path), str(tmp_path)],
    ):
        code, _ = cli(capsys, *argv)
        assert code == 3, argv


# -- recorded runs --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two clean recordings of the same run and one with wall-clock noise on rank 1 at step 2."""
    tmp = tmp_path_factory.mktemp("diff")
    clean_a, _ = record(tmp, 2, *SMALL, name="clean_a")
    clean_b, _ = record(tmp, 2, *SMALL, name="clean_b")
    noisy, _ = record(tmp, 2, *SMALL, "--wallclock-noise-at-step", "2", "--noise-rank", "1", name="noisy")
    return {"a": clean_a, "b": clean_b, "noisy": noisy}


@pytest.mark.slow
def test_nan_origin_is_the_poisoned_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir, _ = record(tmp_path, 2, *SMALL, "--nan-at-step", "3", "--nan-rank", "1", record_args=NO_PAYLOADS)
    origin = nonfinite_origin(open_trace(run_dir))
    assert origin is not None
    assert (origin["rank"], origin["step"]) == (1, 3), origin
    # rank 1's forward made the loss NaN (micro-batch 0); rank 0 only received it later, through
    # the reduce-scatter of the last micro-batch (its output; rank 1's input)
    assert origin["kind"] == "loss" and origin["micro"] == 0
    assert origin["ranks_affected"] == [0, 1]
    assert origin["co_origins"] == []
    first = {row["rank"]: row["event"] for row in origin["per_rank"]}
    assert first[0]["step"] == 3 and first[0]["kind"] == "collective output"
    assert first[0]["op"] == "_reduce_scatter_base_" and first[0]["micro"] == 1
    # nothing non-finite before step 3 anywhere
    for r in (0, 1):
        steps = open_trace(run_dir).rank(r).steps
        assert steps["step"][steps["nonfinite"]].min() == 3
    code, out = cli(capsys, "nan", str(run_dir))
    assert code == 1
    assert "rank 1" in out and "step 3" in out
    code, out = cli(capsys, "nan", str(run_dir), "--json")
    assert code == 1
    data = json.loads(out)
    assert data["found"] and data["origin"]["rank"] == 1 and data["origin"]["value"] == "NaN"
    code, out = cli(capsys, "inspect", str(run_dir), "--json")
    first = json.loads(out)["findings"][0]  # inspect leads with it, and says what to run
    assert (first["kind"], first["rank"], first["step"]) == ("nonfinite", 1, 3), first
    # recorded without payloads: the replay that verifies step 3 runs every rank again
    assert first["next"].startswith(
        f"fsdp-replay nan {run_dir}; fsdp-replay replay {run_dir} --all-ranks --to-step 3"
    )
    code, out = cli(capsys, "inspect", str(run_dir))
    assert out.startswith(f"trace {run_dir}") and "findings PROBLEM first non-finite value: rank 1" in out, (
        out
    )


@pytest.mark.slow
def test_nan_origin_is_a_poisoned_parameter_shard(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 0's shard of the first layer's weight made NaN before step 2 (issue #11): the first
    non-finite value is rank 0's input to that layer's forward all-gather, not the loss after it."""
    run_dir, _ = record(
        tmp_path,
        2,
        "--nan-at-step",
        "2",
        "--nan-rank",
        "0",
        record_args=NO_PAYLOADS,
        script=(str(NAN_SHARD),),
    )
    trace = open_trace(run_dir)
    origin = nonfinite_origin(trace)
    assert origin is not None
    assert (origin["rank"], origin["step"], origin["micro"]) == (0, 2, 0), origin
    assert origin["kind"] == "collective input" and origin["role"] == "input"
    assert origin["op"] == "_allgather_base_" and origin["tensor_index"] == 0
    # the step's first collective: the first layer's forward all-gather (0.weight + 0.bias shards)
    colls = trace.rank(0).collectives
    first_seq = int(colls["seq"][colls["step"] == 2].min())
    assert origin["seq"] == first_seq
    assert origin["dtype"] == "float32" and origin["shape"] == [8 * 8 + 8]  # rank 0's half of [16, 8] + [16]
    assert origin["co_origins"] == [] and origin["ranks_affected"] == [0, 1]
    first = {row["rank"]: row["event"] for row in origin["per_rank"]}
    # rank 1 received it in the same all-gather's output
    assert first[1]["kind"] == "collective output" and first[1]["seq"] == first_seq
    assert "loss" not in origin["message"]
    assert "after step 1" in origin["cause"]
    code, out = cli(capsys, "nan", str(run_dir))
    assert code == 1
    assert (
        f"rank 0, non-finite input 0 (float32 [72]) of _allgather_base_ (seq {first_seq}, "
        f"process group {origin['pg']}) at step 2 micro-batch 0" in out
    ), out
    assert "non-finite loss" not in out.split("first non-finite event per rank")[0]


def _assert_rank1_skipped_the_loss_allreduce(rep: dict[str, Any], at_step: int) -> None:
    """The example's loss all_reduce (metrics group) comes after the optimizer step: step+1."""
    assert not rep["consistent"]
    mm = rep["first_mismatch"]
    assert mm is not None, rep
    assert mm["kind"] == "missing"
    assert mm["issued"] == [0] and mm["never"] == [1]
    assert 1 in mm["suspects"] and 0 not in mm["suspects"]
    e0 = mm["entries"]["0"]
    assert e0["op"] == "allreduce_" and e0["step"] == at_step and e0["in_flight"]
    ranks = {pr["rank"]: pr for pr in rep["ranks"]}
    assert e0["seq"] == ranks[0]["in_flight"]["seq"]
    # rank 0 did the same all_reduce once per earlier step boundary: steps 1 .. at_step-1
    assert mm["position"] == at_step - 1
    assert mm["moved_on"]["1"]["op"] == "_allgather_base_"
    assert mm["moved_on"]["1"]["pg"] != mm["pg"]
    assert ranks[1]["deviation"] is not None and ranks[1]["deviation"]["expected"]["op"] == "allreduce_"
    assert ranks[0]["deviation"] is None
    assert ranks[0]["steps_done"] == ranks[1]["steps_done"] == at_step
    assert "rank 1 never did" in mm["message"] and f"position {at_step - 1}" in mm["message"]
    # its step unlike the one before, where it departs: what it did instead of the all_reduce
    assert f"; in step {at_step - 1} it was allreduce_" in mm["message"], mm["message"]


@pytest.mark.slow
def test_desync_of_a_hang_killed_by_the_pg_timeout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, proc = record(
        tmp_path,
        2,
        *SMALL,
        "--skip-collective-at-step",
        "2",
        "--skip-rank",
        "1",
        "--pg-timeout",
        "15",
        record_args=NO_PAYLOADS,
        check=False,
    )
    assert proc.returncode != 0
    rep = desync_report(open_trace(run_dir))
    _assert_rank1_skipped_the_loss_allreduce(rep, at_step=3)
    for pr in rep["ranks"]:
        assert pr["end"] == "exit" and pr["in_flight"] is not None
    code, out = cli(capsys, "desync", str(run_dir))
    assert code == 1
    assert "rank 1 never did" in out
    code, out = cli(capsys, "desync", str(run_dir), "--json")
    assert code == 1 and json.loads(out)["first_mismatch"]["never"] == [1]
    code, out = cli(capsys, "inspect", str(run_dir), "--json")
    found = json.loads(out)["findings"]
    desync = next(f for f in found if f["kind"] == "desync")
    assert (desync["rank"], desync["step"], desync["op"]) == (1, 3, "allreduce_"), found
    assert desync["seq"] == rep["first_mismatch"]["entries"]["0"]["seq"]
    assert found[0]["severity"] == "problem" and "ok" not in {f["kind"] for f in found}
    # a hang is not a NaN
    assert nonfinite_origin(open_trace(run_dir)) is None


@pytest.mark.slow
def test_a_stalled_ranks_evaluation_step_is_not_blamed_for_the_hang(tmp_path: Path) -> None:
    """Rank 1 stops after an evaluation (more collectives than a training step, on every rank):
    desync names it, and does not offer that step's difference from the one before as the why."""
    out = tmp_path / "stall"
    workload = REPO / "tests" / "workloads" / "eval_stall.py"
    cmd = [
        *CLI,
        "record",
        "--out",
        str(out),
        *NO_PAYLOADS,
        "--",
        *torchrun_cmd(2, workload, "--stall-s", "20"),
    ]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    mm = desync_report(open_trace(out))["first_mismatch"]
    assert mm is not None and mm["kind"] == "missing" and mm["never"] == [1] and mm["suspects"] == [1]
    assert mm["entries"]["0"]["op"] == "allreduce_" and mm["entries"]["0"]["step"] == 3
    assert mm["message"].endswith("(suspect: rank 1)"), mm["message"]


@pytest.mark.slow
def test_desync_of_a_hang_stopped_by_sigterm(tmp_path: Path) -> None:
    """SIGTERM to `fsdp-replay record` while the job hangs: each rank's end event names the
    collective it was inside (the agent finishes the trace once the blocked wait returns)."""
    out = tmp_path / "term"
    cmd = [
        *CLI,
        "record",
        "--out",
        str(out),
        *NO_PAYLOADS,
        "--",
        *torchrun_cmd(
            2, EXAMPLE, *SMALL, "--skip-collective-at-step", "3", "--skip-rank", "1", "--pg-timeout", "12"
        ),
    ]
    proc = subprocess.Popen(
        cmd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 180
    for line in proc.stdout:
        if line.startswith("step 2 "):
            break
        assert time.monotonic() < deadline, "training did not reach step 2"
    time.sleep(4)  # both ranks reach the hang within a second of that line
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode != 0
    rep = desync_report(open_trace(out))
    ranks = {pr["rank"]: pr for pr in rep["ranks"]}
    assert ranks[0]["end"] == ranks[1]["end"] == "SIGTERM", err[-3000:]
    assert ranks[0]["in_flight"]["op"] == "allreduce_"
    assert ranks[1]["in_flight"]["op"] == "_allgather_base_"
    _assert_rank1_skipped_the_loss_allreduce(rep, at_step=4)


@pytest.mark.slow
def test_two_recordings_of_the_same_run_are_identical(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = open_trace(runs["a"]), open_trace(runs["b"])
    res = diff_traces(a, b)
    assert not res["diverged"] and res["first"] is None
    for pr in res["ranks"]:
        assert pr["identical"] and pr["same_length"]
        assert pr["compared"]["collectives"] == len(a.rank(pr["rank"]).collectives) > 0
        assert pr["compared"]["steps"] == 6
        assert set(pr["drift"]["params_differing"]) == {0} and set(pr["drift"]["loss_abs_diff"]) == {0.0}
        assert "identical over" in pr["message"]
    code, out = cli(capsys, "diff", str(runs["a"]), str(runs["b"]), "--plot", str(tmp_path / "same.png"))
    assert code == 0 and "identical" in out
    assert (tmp_path / "same.png").read_bytes()[:8] == PNG_MAGIC
    for plot in (tmp_path / "same.txt", tmp_path, runs["a"] / "trace.zarr" / "d.png"):
        assert cli(capsys, "diff", str(runs["a"]), str(runs["b"]), "--plot", str(plot))[0] == 2
    # a clean run: no NaN, no desync
    assert nonfinite_origin(a) is None
    rep = desync_report(a)
    assert rep["consistent"] and rep["stuck"] == []
    assert cli(capsys, "nan", str(runs["a"]))[0] == 0
    assert cli(capsys, "desync", str(runs["a"]))[0] == 0


@pytest.mark.slow
def test_wallclock_noise_diverges_at_its_step(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    clean, noisy = open_trace(runs["a"]), open_trace(runs["noisy"])
    res = diff_traces(clean, noisy)
    assert res["diverged"]
    assert (res["first"]["rank"], res["first"]["step"]) == (1, 2), res["first"]
    per = {pr["rank"]: pr for pr in res["ranks"]}
    r1, r0 = per[1], per[0]
    # rank 1 scaled its loss: its first difference is that loss, then its reduce-scatter input
    assert r1["first"]["step"] == 2 and r1["first"]["kind"] == "loss"
    assert r1["first_collective"]["step"] == 2
    assert (
        r1["first_collective"]["op"] == "_reduce_scatter_base_" and r1["first_collective"]["role"] == "input"
    )
    # rank 0 sees it at step 2 too, later: in the reduce-scatter's output
    f0 = r0["first"]
    assert f0["step"] == 2 and f0["kind"] == "collective"
    assert f0["op"] == "_reduce_scatter_base_" and f0["role"] == "output"
    assert f0["seq"] >= r1["first_collective"]["seq"]
    assert (f0["micro"], f0["seq"]) > (r1["first"]["micro"], -1)
    assert f0["fp_a"] != f0["fp_b"]
    # outputs' payloads are stored: the magnitude, checked against the bytes themselves
    m = f0["magnitude"]
    assert m is not None and m["numel"] == int(np.prod(f0["shape"]))
    ra, rb = clean.rank(0), noisy.rank(0)
    rows = []
    for rt in (ra, rb):
        c, t = rt.collectives, rt.tensors
        row = int(np.flatnonzero(c["seq"] == f0["seq"])[0])
        outs = [
            i
            for i in range(int(c["tensor_start"][row]), int(c["tensor_start"][row] + c["tensor_count"][row]))
            if t["role"][i] == 1
        ]
        rows.append(np.frombuffer(rt.payload(int(t["payload"][outs[0]])), "<f4"))
    differ = rows[0] != rows[1]
    assert m["n_differing"] == int(differ.sum()) > 0
    assert m["first_index"] == int(np.argmax(differ))
    assert m["max_abs_diff"] == pytest.approx(float(np.abs(rows[0].astype(np.float64) - rows[1]).max()))
    assert m["a_value"] != m["b_value"]
    # the inputs were not stored: said so, not guessed
    assert (
        r1["first_collective"]["magnitude"] is None
        and "no payload" in r1["first_collective"]["magnitude_note"]
    )
    # drift: nothing before step 2, every step from 2 on
    for pr in (r0, r1):
        d = pr["drift"]
        assert d["step"] == list(range(6))
        assert d["params_differing"][:2] == [0, 0] and all(x > 0 for x in d["params_differing"][2:])
        assert d["loss_abs_diff"][:2] == [0.0, 0.0]
    assert r1["drift"]["loss_abs_diff"][2] > 0
    png = tmp_path / "drift.png"
    plot_drift(res, str(png))
    assert png.read_bytes()[:8] == PNG_MAGIC
    # the CLI: exit 1, the rank and step in the human output; --rank and --json
    code, out = cli(capsys, "diff", str(runs["a"]), str(runs["noisy"]))
    assert code == 1 and "rank 1 diverged first" in out and "step 2" in out
    code, out = cli(capsys, "diff", str(runs["a"]), str(runs["noisy"]), "--rank", "0", "--json")
    data = json.loads(out)
    assert code == 1 and [pr["rank"] for pr in data["ranks"]] == [0]
    assert data["first"]["rank"] == 0 and data["first"]["seq"] == f0["seq"]


def test_a_divergent_batch_is_named_by_its_dataloader_iterator() -> None:
    from fsdp_replay.analysis.diff import describe
    from fsdp_replay.cli.analyze import _event_lines

    ev = {"kind": "batch", "step": 3, "micro": 0, "batch_index": 0, "loader": 1, "tensor_index": 0}
    assert describe(ev) == "batch 0 of DataLoader iterator #1 at step 3 micro-batch 0, tensor 0"
    assert _event_lines(ev) == ["step 3 micro 0: batch 0 of DataLoader iterator #1 differs (tensor 0)"]
    from fsdp_replay.analysis.nonfinite import describe_nonfinite

    assert (
        describe_nonfinite(ev)
        == "non-finite tensor 0 of batch 0 of DataLoader iterator #1 at step 3 micro-batch 0"
    )
    ev = {**ev, "kind": "batch structure", "tensor_index": None}
    assert _event_lines(ev) == ["step 3 micro 0: batch 0 of DataLoader iterator #1 differs (its structure)"]
