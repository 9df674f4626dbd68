"""Replaying one rank alone from its trace: what issue #3 says it must show."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import zarr
from harness import CLI, EXAMPLE, REPO, child_env, record, run, torchrun_cmd

from fsdp_replay.cli.launch import agent_env
from fsdp_replay.replayer.config import ReplayConfig
from fsdp_replay.trace import schema
from fsdp_replay.trace.reader import Trace

pytestmark = pytest.mark.slow
SMALL = ("--layers", "2", "--d-model", "64", "--seq-len", "32")


def replay(
    run_dir: Path,
    rank: int,
    *args: str,
    command: tuple[str, ...] = (),
    check_code: int | None = None,
    env: dict[str, str] | None = None,
) -> tuple[dict, str, int]:
    report = run_dir / f"report-{rank}-{'-'.join(a.strip('-') for a in args) or 'all'}"
    shutil.rmtree(report, ignore_errors=True)
    cmd = [*CLI, "replay", str(run_dir), "--rank", str(rank), "--report", str(report), *args]
    if command:
        cmd += ["--", *command]
    proc = run(cmd, check=False, env=env)
    if check_code is not None:
        assert proc.returncode == check_code, proc.stdout[-3000:] + proc.stderr[-5000:]
    doc = json.loads((report / "report.json").read_text()) if (report / "report.json").is_file() else {}
    return doc, proc.stdout + proc.stderr, proc.returncode


@pytest.mark.parametrize(("nproc", "mode"), [(2, "fsdp2"), (2, "fsdp1"), (3, "fsdp2"), (2, "ddp")])
def test_every_rank_replays_alone_bit_exact_from_start_and_from_a_snapshot(
    tmp_path: Path, nproc: int, mode: str
) -> None:
    args = ("--steps", "5", *SMALL, *((f"--{mode}",) if mode != "fsdp2" else ()))
    rec, _ = record(tmp_path, nproc, *args, record_args=("--snapshot-every", "2"))
    for rank in range(nproc):
        doc, out, _ = replay(rec, rank, check_code=0)
        assert doc["status"] == "bit-exact", out
        assert doc["verified_steps"] == [0, 1, 2, 3, 4]
        assert doc["collectives_verified"] == doc["recorded_collectives"] > 0
        assert "BIT-EXACT over steps 0..4" in out
        doc, out, _ = replay(rec, rank, "--from-step", "3", check_code=0)
        assert doc["restored_snapshot"] == 2, out
        assert doc["verified_steps"] == [2, 3, 4]
        assert (rec / f"report-{rank}-from-step-3" / "replay.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_exception_only_the_replay_meets_is_an_error_not_a_divergence(tmp_path: Path) -> None:
    wrapper = REPO / "tests" / "workloads" / "raise_in_replay.py"
    rec, _ = record(tmp_path, 2, "--steps", "4", *SMALL, script=(str(wrapper), str(EXAMPLE)))
    doc, out, _ = replay(rec, 0, check_code=3)
    assert doc["status"] == "error" and not doc["divergences"], out
    assert "raised RuntimeError: planted: only the replay meets this" in out
    assert "not a finding about the recorded run" in out


def test_object_collectives_and_receive_buffers_replay_bit_exact_and_a_real_difference_is_caught(
    tmp_path: Path,
) -> None:
    workload = str(REPO / "tests" / "workloads" / "object_collectives.py")
    runs = {}
    for name, env in (("a", {}), ("b", {}), ("planted", {"PLANT_OBJECT": "1"})):
        out = tmp_path / name
        run([*CLI, "record", "--out", str(out), "--", *torchrun_cmd(2, workload)], env=child_env(**env))
        runs[name] = out
    for rank in (0, 1):  # pickles with storage addresses, a torch.empty receive buffer: no false divergence
        doc, out, _ = replay(runs["a"], rank, check_code=0)
        assert doc["status"] == "bit-exact", out
    proc = run([*CLI, "diff", str(runs["a"]), str(runs["b"])], check=False)
    assert proc.returncode == 0 and "identical" in proc.stdout, proc.stdout + proc.stderr
    # the ranks sent objects of their own (rank 1 none into the broadcast): no disagreement for that
    proc = run([*CLI, "desync", str(runs["a"])], check=False)
    assert proc.returncode == 0 and "ranks agree on every completed collective" in proc.stdout, proc.stdout
    # the replay sends other objects than recorded: this shell's PLANT_OBJECT="" wins over the recorded 1
    doc, out, _ = replay(runs["planted"], 0, check_code=1, env=child_env(PLANT_OBJECT=""))
    first = doc["first_divergence"]
    assert (first["op"], first["tensor"], first["seq"]) == ("broadcast_", "objects sent", 0), out
    assert "differ from the recorded ones" in json.dumps(first)
    doc, out, _ = replay(runs["planted"], 1, check_code=0)  # rank 1 received the recorded bytes
    assert doc["status"] == "bit-exact", out


def test_rooted_collectives_agree_across_ranks_and_replay_bit_exact(tmp_path: Path) -> None:
    """gather/scatter (and their object forms): the root's side is its own, not a disagreement."""
    workload = str(REPO / "tests" / "workloads" / "rooted_collectives.py")
    out = tmp_path / "rooted"
    run([*CLI, "record", "--out", str(out), "--", *torchrun_cmd(2, workload)], env=child_env())
    proc = run([*CLI, "desync", str(out)], check=False)
    assert proc.returncode == 0 and "ranks agree on every completed collective" in proc.stdout, proc.stdout
    for rank in (0, 1):
        doc, text, _ = replay(out, rank, check_code=0)
        assert doc["status"] == "bit-exact" and doc["collectives_verified"] == doc["recorded_collectives"], (
            text
        )


def test_an_all_to_all_records_its_tensors_and_every_rank_replays_bit_exact(tmp_path: Path) -> None:
    """``alltoall_base_`` names its tensors ``input`` and ``output`` (other c10d ops say
    ``input_tensor``...): both must be in the trace, or a replay cannot fill the output."""
    workload = str(REPO / "tests" / "workloads" / "all_to_all.py")
    rec = tmp_path / "run"
    run([*CLI, "record", "--out", str(rec), "--", *torchrun_cmd(2, workload)], env=child_env())
    trace = Trace.open(rec / schema.TRACE_DIR)
    for r in (0, 1):
        rt = trace.rank(r)
        ops, c, t = rt.names("op"), rt.collectives, rt.tensors
        received = sum(s[r] for s in ([1, 3], [2, 2]))  # the rows the workload sends to rank r
        seen = 0
        for i in range(len(c)):
            if ops[int(c["op"][i])] != "alltoall_base_":
                continue
            seen += 1
            start, count = int(c["tensor_start"][i]), int(c["tensor_count"][i])
            tensors = {int(t["role"][j]): int(t["nbytes"][j]) for j in range(start, start + count)}
            assert tensors == {schema.ROLE_INPUT: 4 * 8 * 4, schema.ROLE_OUTPUT: received * 8 * 4}, tensors
        assert seen == 3
    for rank in (0, 1):
        doc, out, _ = replay(rec, rank, check_code=0)
        assert doc["status"] == "bit-exact", out


def _digests(folder: Path) -> dict[str, str]:
    import hashlib

    return {
        str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.rglob("*")) if f.is_file()
    }


def test_a_replay_leaves_the_recorded_jobs_files_alone_and_names_a_changed_input(tmp_path: Path) -> None:
    workload = str(REPO / "tests" / "workloads" / "checkpointing.py")
    config, ckpts = tmp_path / "config.json", tmp_path / "ckpts"
    config.write_text('{"lr": 0.05}')
    rec = tmp_path / "run"
    command = torchrun_cmd(2, workload, "--config", str(config), "--ckpt-dir", str(ckpts))
    run([*CLI, "record", "--out", str(rec), "--", *command], env=child_env())
    before = _digests(ckpts)
    assert len(before) == 2 * 6  # per rank: step0-3, latest, log
    ledger = Trace.open(rec / schema.TRACE_DIR).rank(0).attrs["files"]
    assert str(config) in {r["path"] for r in ledger["read"]}
    assert {"path": str(ckpts / "rank0" / "latest.pt"), "existed": False} in ledger["written"]
    for rank in (0, 1):
        # latest.pt exists now, but did not when the recorded run began: the replay starts fresh
        doc, out, _ = replay(rec, rank, check_code=0)
        assert doc["status"] == "bit-exact", out
        written = set(doc["files"]["written"])
        assert (
            str(ckpts / f"rank{rank}" / "latest.pt") in written
            and "recorded job's files are untouched" in out
        )
        private = Path(doc["files"]["private_folder"])
        assert (private / str(ckpts / f"rank{rank}" / "log.txt").lstrip("/")).read_text().count("step") == 4
    assert _digests(ckpts) == before  # byte-identical
    config.write_text('{"lr": 0.07}')
    doc, out, _ = replay(rec, 0, check_code=1)
    assert f"likely cause: {config} changed since the recording" in out, out
    assert _digests(ckpts) == before


def test_a_checkpoint_another_rank_saved_is_hidden_and_one_it_overwrote_is_named(tmp_path: Path) -> None:
    """Replaying in the recorded folder right after recording: rank 0's checkpoint is there, and a
    program that resumes when it finds one must start fresh as every recorded rank did."""
    workload = REPO / "tests" / "workloads" / "resume_if_present.py"
    work, ckpt = tmp_path / "work", tmp_path / "work" / "resume.pt"
    work.mkdir()
    rec = tmp_path / "run"
    run([*CLI, "record", "--out", str(rec), "--", *torchrun_cmd(2, workload)], cwd=work)
    saved = ckpt.read_bytes()
    trace = Trace.open(rec / schema.TRACE_DIR)
    assert {"path": str(ckpt), "existed": False} in trace.rank(0).attrs["files"]["written"]
    assert str(ckpt) not in {w["path"] for w in trace.rank(1).attrs["files"]["written"]}
    for rank in (0, 1):
        report = tmp_path / f"rank{rank}"
        cmd = [*CLI, "replay", str(rec), "--rank", str(rank), "--report", str(report)]
        proc = run(cmd, cwd=work, check=False)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        doc = json.loads((report / "report.json").read_text())
        assert doc["status"] == "bit-exact" and doc["verified_steps"] == [0, 1, 2, 3]
        assert not doc["files"].get("late_reads")
    proc = run(
        [*CLI, "replay", str(rec), "--all-ranks", "--report", str(tmp_path / "all")], cwd=work, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    merged = json.loads((tmp_path / "all" / "report.json").read_text())
    assert merged["status"] == "bit-exact" and merged["ranks"] == {"0": "bit-exact", "1": "bit-exact"}
    # the live ranks share one private folder: rank 0's replayed save is there, the recorded one intact
    assert (tmp_path / "all" / "files" / str(ckpt).lstrip("/")).is_file()
    assert ckpt.read_bytes() == saved
    # Recorded again in the same folder: both ranks resume from the earlier run's checkpoint, which
    # rank 0 overwrites; the trace cannot give it back as it was, so the report names it.
    rec2 = tmp_path / "run2"
    run(
        [
            *CLI,
            "record",
            "--out",
            str(rec2),
            "--",
            *torchrun_cmd(2, workload, "--steps", "6", "--save-at", "4"),
        ],
        cwd=work,
    )
    assert {"path": str(ckpt), "existed": True} in Trace.open(rec2 / schema.TRACE_DIR).rank(0).attrs["files"][
        "written"
    ]
    cmd = [*CLI, "replay", str(rec2), "--rank", "1", "--report", str(tmp_path / "rank1-again")]
    proc = run(cmd, cwd=work, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-6000:]
    assert (
        f"likely cause: {ckpt} changed since the recording (its content differs (sha256); rank 0 of the recorded "
        "job wrote it during the run); the recorded run read it" in out
    ), out[-6000:]
    assert "--module-fingerprints" not in out and "None" not in proc.stdout, out[-6000:]


def test_op_fingerprints_name_the_racy_op_and_its_module(tmp_path: Path) -> None:
    racy = str(REPO / "tests" / "workloads" / "racy_train.py")
    runs = {}
    for name, extra in (("plain", ()), ("taped", ("--tape-ops", "fsdpr_test::racy_mix"))):
        out = tmp_path / name
        cmd = [*CLI, "record", "--out", str(out), "--op-fingerprints", "steps:0-2", *extra, "--"]
        run([*cmd, *torchrun_cmd(2, racy, "--ddp")], env=child_env())
        runs[name] = out
    doc, out, _ = replay(runs["plain"], 0, check_code=1)
    op = doc["op_finding"]
    assert (op["kind"], op["op"], op["module"], op["step"]) == (
        "op_result",
        "fsdpr_test::racy_mix",
        "module",
        0,
    ), out
    assert "earliest op that differs: fsdpr_test::racy_mix in module" in out
    doc, out, _ = replay(runs["taped"], 1, check_code=0)  # its recorded results injected: every op matches
    assert doc["op_finding"] is None and doc["ops_checked"] > 100, out
    assert "every op of the --op-fingerprints window matched" in out


def test_planted_nondeterminism_stops_the_replay_at_that_step_rank_and_collective(tmp_path: Path) -> None:
    rec, _ = record(
        tmp_path, 2, "--steps", "4", *SMALL, "--wallclock-noise-at-step", "2", "--noise-rank", "1"
    )
    doc, out, _ = replay(rec, 1, check_code=1)
    first = doc["first_divergence"]
    assert (first["rank"], first["step"], first["kind"]) == (1, 2, "loss"), out
    collective = next(d for d in doc["divergences"] if d["seq"] is not None)
    assert collective["step"] == 2 and collective["kind"] == "collective_input"
    assert collective["op"] == "_reduce_scatter_base_"  # the gradients of the noisy loss
    assert collective["modules"], "the parameters feeding the collective are named"
    assert doc["verified_steps"] == [0, 1]
    assert "DIVERGED" in out and "first collective affected" in out
    # rank 0 had no noise of its own: alone, fed rank 1's recorded data, it replays bit-exact
    doc0, _, _ = replay(rec, 0, check_code=0)
    assert doc0["status"] == "bit-exact"


def test_a_different_script_world_size_or_torch_refuses_to_start(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    shutil.copy(EXAMPLE, script)
    out = tmp_path / "rec"
    from harness import child_env, torchrun_cmd

    run(
        [*CLI, "record", "--out", str(out), "--", *torchrun_cmd(2, script, "--steps", "2", *SMALL)],
        env=child_env(),
    )
    backward = "                loss.backward()\n"
    assert backward in script.read_text()
    script.write_text(
        script.read_text().replace(backward, "                raise RuntimeError('an edit')\n" + backward, 1)
    )
    _, text, code = replay(out, 0)
    assert code == 3 and "is not the script that was recorded" in text and "Traceback" not in text
    # --force runs it: the edit's exception is an error whose likely cause is the edited script
    doc, text, code = replay(out, 0, "--force")
    assert code == 3 and doc["status"] == "error", text
    assert f"Likely cause: {script} changed since the recording" in doc["reason"], doc["reason"]
    assert "traceback passes through it" in doc["reason"] and "replay defect" not in doc["reason"]
    shutil.copy(EXAMPLE, script)  # the recorded script again
    import sys

    doc, text, code = replay(
        out, 0, command=("env", "WORLD_SIZE=3", sys.executable, str(script), "--steps", "2", *SMALL)
    )
    assert code == 3 and doc["status"] == "refused" and "world size 3" in doc["reason"], text
    group = zarr.open_group(str(out / schema.TRACE_DIR / "rank_00000"), mode="r+")
    start = dict(group.attrs["rank_start"])
    start["versions"] = {**start["versions"], "torch": "2.4.0"}
    group.attrs["rank_start"] = start
    _, text, code = replay(out, 0)
    assert code == 3 and "recorded with torch 2.4.0" in text


def test_the_replay_key_names_each_setting_that_differs_and_what_it_means(tmp_path: Path) -> None:
    import sys

    rec, _ = record(tmp_path, 2, "--steps", "2", *SMALL)
    key = Trace.open(rec / schema.TRACE_DIR).rank(0).meta["numerics"]
    assert key["device"]["kind"] == "cpu" and key["flags"]["intra_op_threads"] == 1, key
    report = rec / "report-no-rank"  # no --rank on a 2-rank trace: rank 0, and it says so
    proc = run([*CLI, "replay", str(rec), "--report", str(report)], check=False)
    assert proc.returncode == 0 and "no --rank given: replaying rank 0 of the 2 recorded" in proc.stderr, (
        proc.stderr
    )
    doc = json.loads((report / "report.json").read_text())
    assert doc["rank"] == 0 and doc["numerics"] == {"compared": True, "mismatches": []}, doc

    command = (sys.executable, str(EXAMPLE), "--steps", "2", *SMALL)
    doc, text, _ = replay(rec, 0, command=("env", "OMP_NUM_THREADS=2", *command))
    assert any("intra-op threads: recorded 1, replay 2" in n for n in doc["notes"]), text
    assert [m["key"] for m in doc["numerics"]["mismatches"]] == ["flags.intra_op_threads"], doc["numerics"]
    assert "flags.intra_op_threads: recorded 1, here 2" in text

    if key["device"]["cpu_capability"] == "DEFAULT":
        pytest.skip("this CPU runs ATen's DEFAULT kernels already: no other instruction set to replay with")
    doc, text, code = replay(rec, 0, command=("env", "ATEN_CPU_CAPABILITY=default", *command))
    found = {m["key"]: m for m in doc["numerics"]["mismatches"]}
    assert set(found) == {"device.cpu_capability", "env.ATEN_CPU_CAPABILITY"}, found
    assert (
        found["device.cpu_capability"]["replay"] == "DEFAULT"
        and found["device.cpu_capability"]["kind"] == "device"
    )
    if code == 1:  # another instruction set added the sums in another order: named as the likely cause
        assert (
            "likely cause: device.cpu_capability differs (recorded 'AVX2'" in text
            or "likely cause: device" in text
        )
    else:
        assert code == 0 and doc["status"] == "bit-exact", text


def test_the_program_gets_its_recorded_variables_and_a_redacted_one_it_reads_is_named(tmp_path: Path) -> None:
    script = str(REPO / "tests" / "workloads" / "env_reader.py")
    data = tmp_path / "data"
    data.mkdir()
    env = child_env(FSDPR_TEST_DATA_DIR=str(data), FSDPR_TEST_API_TOKEN="tok-5a1f0c")
    out = tmp_path / "rec"
    run([*CLI, "record", "--out", str(out), "--", *torchrun_cmd(2, script, "--steps", "2")], env=env)
    recorded = Trace.open(out / schema.TRACE_DIR).rank(1).meta["env"]
    assert recorded["FSDPR_TEST_DATA_DIR"] == str(data) and schema.is_redacted(
        recorded["FSDPR_TEST_API_TOKEN"]
    )
    doc, text, _ = replay(out, 1, check_code=0)  # this shell has neither variable
    assert doc["status"] == "bit-exact", text
    assert any("looked up FSDPR_TEST_API_TOKEN, which the recording redacted" in n for n in doc["notes"]), (
        text
    )
    assert not any("FSDPR_TEST_DATA_DIR" in n for n in doc["notes"]), text


def test_a_nan_on_one_rank_is_named_and_replays_bit_for_bit(tmp_path: Path) -> None:
    rec, _ = record(
        tmp_path,
        2,
        "--steps",
        "5",
        *SMALL,
        "--nan-at-step",
        "3",
        "--nan-rank",
        "1",
        record_args=("--snapshot-every", "2"),
    )
    r1 = Trace.open(rec / schema.TRACE_DIR).rank(1)
    steps = r1.steps
    assert steps["nonfinite"].tolist()[:4] == [False, False, False, True]
    doc, out, _ = replay(rec, 1, "--from-step", "3", check_code=0)
    assert doc["restored_snapshot"] == 2 and 3 in doc["verified_steps"], out


def test_replay_needs_the_payloads_of_the_steps_it_verifies(tmp_path: Path) -> None:
    rec, _ = record(tmp_path, 2, "--steps", "4", *SMALL, record_args=("--payloads", "steps:0-1"))
    doc, out, _ = replay(rec, 1, "--to-step", "1", check_code=0)
    assert doc["verified_steps"] == [0, 1]
    # Without --to-step, the replay stops cleanly where the kept payloads end, and says so.
    doc, out, _ = replay(rec, 1, check_code=0)
    assert doc["status"] == "bit-exact" and doc["verified_steps"] == [0, 1], out
    assert "the recording kept payloads for steps:0-1, through step 1 from step 0" in out
    # Steps asked for past them are missing: named, never a verdict over the steps before.
    doc, out, _ = replay(rec, 1, "--from-step", "2", check_code=3)
    first = doc["first_divergence"]
    assert first["kind"] == "payload_missing" and first["step"] == 2, out
    assert "needs the payloads" in out
    doc, out, _ = replay(rec, 1, "--to-step", "3", check_code=3)
    assert doc["first_divergence"]["step"] == 2 and "(--to-step 1)" in out, out
    # A payload range that starts later gets a snapshot of its own: its steps replay from it alone.
    rec, _ = record(
        tmp_path, 2, "--steps", "4", *SMALL, record_args=("--payloads", "steps:2-3"), name="later"
    )
    doc, out, _ = replay(rec, 1, "--from-step", "2", check_code=0)
    assert doc["restored_snapshot"] == 2 and doc["verified_steps"] == [2, 3], out
    assert "the record of rank 1 ends" not in out  # the run's last step is 3


def test_replay_of_a_missing_rank_or_trace_is_a_clear_error(tmp_path: Path) -> None:
    proc = run([*CLI, "replay", str(tmp_path / "nothing"), "--rank", "0"], check=False)
    assert proc.returncode == 3 and "Traceback" not in proc.stderr
    rec, _ = record(tmp_path, 2, "--steps", "1", *SMALL)
    proc = run([*CLI, "replay", str(rec), "--rank", "5"], check=False, cwd=REPO)
    assert proc.returncode == 2 and "--rank 5: the recorded job had 2 ranks" in proc.stderr, proc.stderr
    # Steps the record cannot give are refused before the program starts: no report, no verdict.
    for args, said in (
        (("--from-step", "1"), "--from-step 1: rank 1's record ends with step 0"),
        (("--from-step", "1", "--to-step", "0"), "--to-step 0 is before --from-step 1"),
        (("--device", "tpu"), "--device tpu: use cpu, cuda or cuda:N"),
        (("--device", "cuda:99"), "--device cuda:99: this machine has"),
    ):
        proc = run([*CLI, "replay", str(rec), "--rank", "1", *args], check=False, cwd=REPO)
        assert proc.returncode == 2 and said in proc.stderr, proc.stderr[-2000:]
        assert "BIT-EXACT" not in proc.stdout and not (rec / "replays").exists()
    # A report folder inside the trace or over a recording (where the program's writes would land too)
    for report, said in (
        (rec / schema.TRACE_DIR / "rank_00001", "is inside the trace"),
        (rec, "holds a recording"),
    ):
        proc = run([*CLI, "replay", str(rec), "--rank", "1", "--report", str(report)], check=False, cwd=REPO)
        assert proc.returncode == 2 and said in proc.stderr, proc.stderr[-2000:]
    assert (
        not (rec / "report.json").exists()
        and not (rec / schema.TRACE_DIR / "rank_00001" / "report.json").exists()
    )
    # The agent checks it again, for a replay started without the command: the program never runs.
    report = tmp_path / "direct"
    config = ReplayConfig(trace=str(rec / schema.TRACE_DIR), rank=1, from_step=1, report=str(report))
    env = agent_env(report, config.to_env(), child_env(RANK="1", WORLD_SIZE="2"))
    proc = run(
        [sys.executable, str(EXAMPLE), "--cpu", "--steps", "1", *SMALL], env=env, check=False, cwd=REPO
    )
    assert proc.returncode == 3 and "step 0 loss" not in proc.stdout, (
        proc.stdout[-2000:] + proc.stderr[-2000:]
    )
    doc = json.loads((report / "report.json").read_text())
    assert doc["status"] == "unusable" and "record ends with step 0" in doc["reason"], doc


def test_all_rank_replay_verifies_a_trace_recorded_without_payloads(tmp_path: Path) -> None:
    rec, _ = record(
        tmp_path, 2, "--steps", "4", *SMALL, record_args=("--payloads", "none", "--snapshot-every", "2")
    )
    report = rec / "all"
    proc = run([*CLI, "replay", str(rec), "--all-ranks", "--report", str(report)], check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    merged = json.loads((report / "report.json").read_text())
    assert merged["status"] == "bit-exact" and merged["ranks"] == {"0": "bit-exact", "1": "bit-exact"}
    proc = run(
        [*CLI, "replay", str(rec), "--all-ranks", "--from-step", "2", "--report", str(report / "from2")],
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    r1 = json.loads((report / "from2" / "rank-00001" / "report.json").read_text())
    assert r1["restored_snapshot"] == 2 and r1["verified_steps"] == [2, 3]


def test_all_rank_replay_finds_where_a_live_rerun_diverges(tmp_path: Path) -> None:
    rec, _ = record(
        tmp_path,
        2,
        "--steps",
        "4",
        *SMALL,
        "--wallclock-noise-at-step",
        "1",
        "--noise-rank",
        "0",
        record_args=("--payloads", "none"),
    )
    report = rec / "all"
    proc = run([*CLI, "replay", str(rec), "--all-ranks", "--report", str(report)], check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-4000:]
    merged = json.loads((report / "report.json").read_text())
    first = merged["first_divergence"]
    assert (first["rank"], first["step"], first["kind"]) == (0, 1, "loss")
    r1 = json.loads((report / "rank-00001" / "report.json").read_text())
    # rank 1 computed nothing wrong itself: it first sees rank 0's gradients in the reduce-scatter result
    assert r1["first_divergence"]["kind"] == "collective_output" and r1["first_divergence"]["step"] == 1
