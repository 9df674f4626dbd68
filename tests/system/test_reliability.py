"""Never lie, never hang, never lose: the core under kills, damage, full disks and concurrent use.

One test (or more) per defect of issue #9, each with real processes: the replay fails closed, an
incomplete record is never called DIVERGED, a killed collect is repaired by the next one, two
collects take turns, a missing chunk is an error, one bad rank spares the others, a full disk keeps
the exit code and says what was dropped, killing ``record`` stops its job, and the user's thread
count wins in a replay.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from harness import CLI, EXAMPLE, REPO, child_env, record, run, small_tmpfs, torchrun_cmd, training_ranks

from fsdp_replay.trace import schema
from fsdp_replay.trace.reader import Trace

pytestmark = pytest.mark.slow
SMALL = ("--layers", "2", "--d-model", "64", "--seq-len", "32")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 2-rank recording (4 steps, snapshots every 2, spool kept) that tests copy and damage."""
    tmp = tmp_path_factory.mktemp("reliability")
    rec, _ = record(tmp, 2, "--steps", "4", *SMALL, record_args=("--snapshot-every", "2", "--keep-spool"))
    return rec


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def replay(run_dir: Path, rank: int, *args: str, timeout: float = 240) -> tuple[int, str, dict]:
    report = run_dir / f"replay-{rank}-{time.monotonic_ns()}"
    proc = run(
        [*CLI, "replay", str(run_dir), "--rank", str(rank), "--report", str(report), *args],
        check=False,
        timeout=timeout,
    )
    path = report / "report.json"
    doc = json.loads(path.read_text()) if path.is_file() else {}
    return proc.returncode, proc.stdout + proc.stderr, doc


def assert_clean_failure(code: int, out: str, *names: str) -> None:
    """Exit 3, the file named, no traceback."""
    assert code == 3, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert any(n in out for n in names), (names, out[-3000:])


# -- 1. a replay that cannot attach never runs the program -----------------------------------
@pytest.mark.parametrize("damage", ["garbage array zarr.json", "doubled array shape", "deleted blobs"])
def test_a_replay_that_cannot_attach_exits_3_and_never_runs_the_program(
    recorded: Path, tmp_path: Path, damage: str
) -> None:
    rec = copy_run(recorded, tmp_path / "run")
    trace = rec / schema.TRACE_DIR
    if damage == "garbage array zarr.json":
        target = trace / "rank_00001" / "losses" / "value" / "zarr.json"
        target.write_text("{not json")
    elif damage == "doubled array shape":
        target = trace / "rank_00001" / "collectives" / "seq" / "zarr.json"
        meta = json.loads(target.read_text())
        meta["shape"] = [meta["shape"][0] * 2]
        target.write_text(json.dumps(meta))
    else:
        target = trace / "blobs"
        shutil.rmtree(target)
    t0 = time.monotonic()
    code, out, doc = replay(rec, 1)
    # A program that ran for real would sit in a rendezvous for its 30-minute timeout, or train.
    assert time.monotonic() - t0 < 120
    assert not re.search(r"^step \d", out, re.M) and "[fsdp-replay] rank 1: step" not in out, out[-2000:]
    named = target.parent if target.name == "zarr.json" and damage == "doubled array shape" else target
    assert_clean_failure(code, out, str(named.relative_to(rec)))
    assert "DIVERGED" not in out
    if doc:
        assert doc["status"] in ("unusable", "refused"), doc


def test_a_bad_replay_setting_in_the_environment_fails_closed(recorded: Path, tmp_path: Path) -> None:
    """The agent's own settings cannot be parsed: the program must still not run for real."""
    env = child_env(
        FSDP_REPLAY_MODE="replay",
        FSDP_REPLAY_TRACE=str(recorded / schema.TRACE_DIR),
        FSDP_REPLAY_REPORT=str(tmp_path / "rep"),
        FSDP_REPLAY_FROM_STEP="not-a-number",
        PYTHONPATH=str(REPO / "fsdp_replay" / "boot" / "site"),
    )
    proc = run([sys.executable, str(EXAMPLE), "--steps", "1", *SMALL], env=env, check=False, timeout=120)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "cannot replay" in proc.stderr and "FSDP_REPLAY_FROM_STEP" in proc.stderr
    assert not re.search(r"^step \d", proc.stdout, re.M)
    assert json.loads((tmp_path / "rep" / "report.json").read_text())["status"] == "unusable"


# -- 2. an incomplete record is never called DIVERGED ----------------------------------------
def test_a_killed_run_replays_bit_exact_up_to_its_last_complete_step(tmp_path: Path) -> None:
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        [
            *CLI,
            "record",
            "--out",
            str(out),
            "--",
            *torchrun_cmd(2, EXAMPLE, "--steps", "100", "--sleep-per-step", "0.2", *SMALL),
        ],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("step ") and int(line.split()[1]) >= 3:
            break
    for p in training_ranks(psutil.Process(proc.pid)):
        p.send_signal(signal.SIGKILL)
    proc.communicate(timeout=240)
    trace = Trace.open(out / schema.TRACE_DIR)
    for rank in range(2):
        comp = trace.rank(rank).completeness
        assert not comp["complete"] and "killed" in " ".join(comp["reasons"])
        last = comp["through_step"]
        code, text, doc = replay(out, rank)
        assert code == 0, text[-3000:]
        assert doc["status"] == "bit-exact" and doc["verified_steps"][-1] == last, doc
        assert f"BIT-EXACT over steps 0..{last}" in text
        assert f"the record of rank {rank} ends before" in text and "killed" in text
        # Asking for a step the record does not hold is refused, not guessed at.
        code, text, doc = replay(out, rank, "--from-step", str(last + 5))
        assert_clean_failure(code, text, "complete only through step")


def test_an_agent_that_stopped_recording_is_not_a_divergence(tmp_path: Path) -> None:
    rec, _ = record(tmp_path, 2, "--steps", "4", *SMALL, FSDP_REPLAY_INJECT_FAULT="step:3")
    trace = Trace.open(rec / schema.TRACE_DIR)
    comp = trace.rank(0).completeness
    assert comp["through_step"] == 1 and "stopped recording at step 2" in comp["reasons"][0], comp
    for rank in range(2):
        code, text, doc = replay(rec, rank)
        assert "DIVERGED" not in text
        assert code == 0 and doc["verified_steps"] == [0, 1], text[-2000:]
        assert "the record of rank" in text and "stopped recording at step 2" in text
    for cmd in ("desync", "nan"):
        proc = run([*CLI, cmd, str(rec)], check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "complete only through step 1" in proc.stdout


def test_a_record_that_ends_between_a_steps_batches_ends_the_replay_there(tmp_path: Path) -> None:
    """The agent stops before the 6th batch (step 2's second micro-batch): the replay goes
    through step 1, verifies what step 2 recorded, and stops where the program asks for the
    batch that was never recorded, instead of failing inside the program's data loop."""
    rec, _ = record(tmp_path, 2, "--steps", "4", *SMALL, FSDP_REPLAY_INJECT_FAULT="batch:6")
    trace = Trace.open(rec / schema.TRACE_DIR)
    assert trace.rank(0).completeness["through_step"] == 1, trace.rank(0).completeness
    assert len(trace.rank(0).batches["index"]) == 5
    code, text, doc = replay(rec, 0)
    assert "DIVERGED" not in text and "Traceback" not in text, text[-3000:]
    assert code == 0 and doc["status"] == "bit-exact" and doc["verified_steps"] == [0, 1], text[-3000:]
    assert "ends before batch 5 (the recording holds 5)" in text, text[-3000:]


def test_a_lost_spool_record_cuts_the_record_instead_of_shifting_it(recorded: Path, tmp_path: Path) -> None:
    """A collective's record is destroyed in the spool: collect says so, the replay stops before
    its step, desync and diff see no disagreement."""
    rec = copy_run(recorded, tmp_path / "run")
    seg = rec / schema.SPOOL_DIR / "rank-00001" / "seg-000000.fsrs"
    data = bytearray(seg.read_bytes())
    colls = _coll_offsets(data)
    data[colls[len(colls) // 2] + 20] ^= 0xFF  # inside a collective's body: its checksum fails
    seg.write_bytes(bytes(data))
    shutil.rmtree(rec / schema.TRACE_DIR)
    proc = run([*CLI, "collect", str(rec)], check=False)
    assert proc.returncode == 3 and "DAMAGED" in proc.stderr, proc.stderr
    assert "record complete through step" in proc.stderr
    comp = Trace.open(rec / schema.TRACE_DIR).rank(1).completeness
    assert not comp["complete"] and comp["through_step"] < 3
    code, text, doc = replay(rec, 1)
    assert code == 0 and doc["verified_steps"][-1] == comp["through_step"], text[-3000:]
    assert "DIVERGED" not in text
    for cmd in (["desync", str(rec)], ["diff", str(recorded), str(rec)]):
        proc = run([*CLI, *cmd], check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "Traceback" not in proc.stderr


def _coll_offsets(data: bytearray) -> list[int]:
    out, pos = [], 0
    while (pos := data.find(b'"type":"coll"', pos + 1)) > 0:
        out.append(pos)
    return out


# -- 4. a killed collect is repaired by the next one -----------------------------------------
def test_a_collect_killed_mid_write_is_repaired_by_the_next(recorded: Path, tmp_path: Path) -> None:
    rec = copy_run(recorded, tmp_path / "run")
    rng = random.Random(9)
    shutil.rmtree(rec / schema.TRACE_DIR)
    for _ in range(6):
        proc = subprocess.Popen(
            [*CLI, "collect", str(rec)], env=child_env(), cwd=REPO, stderr=subprocess.DEVNULL
        )
        time.sleep(rng.uniform(0.3, 2.5))
        proc.kill()
        proc.wait()
    # A blob left half-written and one whose completion mark is missing, as a kill leaves them.
    blobs = sorted(p for p in (rec / schema.TRACE_DIR / "blobs").glob("*/*") if p.is_dir())
    for victim in blobs[:2]:
        for chunk in (victim / "c").glob("*"):
            chunk.unlink()
    meta_path = blobs[2] / "zarr.json"
    meta = json.loads(meta_path.read_text())
    meta["attributes"].pop(schema.BLOB_COMPLETE_ATTR, None)
    meta_path.write_text(json.dumps(meta))
    proc = run([*CLI, "collect", str(rec)])
    assert "rank 1: 4 steps" in proc.stderr
    for rank in range(2):
        code, text, doc = replay(rec, rank)
        assert code == 0 and doc["status"] == "bit-exact", text[-3000:]
    assert run([*CLI, "inspect", str(rec)]).returncode == 0


# -- 5. two collects on one run folder take turns ---------------------------------------------
def test_two_collects_at_once_take_turns(recorded: Path, tmp_path: Path) -> None:
    rec = copy_run(recorded, tmp_path / "run")
    shutil.rmtree(rec / schema.TRACE_DIR)
    procs = [
        subprocess.Popen(
            [*CLI, "collect", str(rec)], env=child_env(), cwd=REPO, stderr=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    errs = [p.communicate(timeout=240)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errs
    assert any("another collect (pid" in e and "waiting" in e for e in errs), errs
    for rank in range(2):
        code, text, _ = replay(rec, rank)
        assert code == 0, text[-3000:]


# -- 6. a deleted chunk is an error, not zeros ------------------------------------------------
def test_a_deleted_chunk_is_an_error_naming_the_array(recorded: Path, tmp_path: Path) -> None:
    rec = copy_run(recorded, tmp_path / "run")
    column = rec / schema.TRACE_DIR / "rank_00000" / "losses" / "value"
    for chunk in (column / "c").glob("*"):
        chunk.unlink()
    proc = run([*CLI, "inspect", str(rec)], check=False)
    assert_clean_failure(proc.returncode, proc.stderr, "rank_00000/losses/value")
    assert "chunks are missing" in proc.stderr
    code, text, _ = replay(rec, 0)
    assert_clean_failure(code, text, "rank_00000/losses/value")


# -- 7. one rank's bad spool spares the others -------------------------------------------------
def test_one_ranks_bad_segment_header_spares_the_other_ranks(recorded: Path, tmp_path: Path) -> None:
    rec = copy_run(recorded, tmp_path / "run")
    shutil.rmtree(rec / schema.TRACE_DIR)
    # rank 1: a damaged segment header (its records carry their own checksums: recoverable)
    seg = rec / schema.SPOOL_DIR / "rank-00001" / "seg-000000.fsrs"
    data = bytearray(seg.read_bytes())
    data[12:20] = b"\xff" * 8  # inside the header's JSON
    seg.write_bytes(bytes(data))
    # rank 0: a segment of a foreign format version (unreadable as a whole)
    header = json.dumps({"format_version": 99, "rank": 0, "segment": 0}).encode()
    bad = rec / schema.SPOOL_DIR / "rank-00000" / "seg-000000.fsrs"
    bad.write_bytes(schema.SEGMENT_MAGIC + len(header).to_bytes(4, "little") + header)
    proc = run([*CLI, "collect", str(rec)], check=False)
    assert proc.returncode == 3, proc.stderr
    assert "rank 0: NOT COLLECTED" in proc.stderr and "version 99" in proc.stderr
    assert "damaged segment header" in proc.stderr
    trace = Trace.open(rec / schema.TRACE_DIR)
    assert trace.ranks == [1]
    assert len(trace.rank(1).steps) == 4  # every record after the damaged header was recovered
    code, text, doc = replay(rec, 1)
    assert code == 0 and doc["status"] == "bit-exact", text[-3000:]


# -- 8. a full disk keeps the exit code and says what was dropped ------------------------------
@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "disk", "3m") as mnt:
        yield mnt


def test_a_full_disk_keeps_the_commands_exit_code_and_names_what_was_dropped(
    tmp_path: Path, tiny_disk: Path
) -> None:
    out = tiny_disk / "run"
    proc = run(
        [*CLI, "record", "--out", str(out), "--", *torchrun_cmd(2, EXAMPLE, "--steps", "6", *SMALL)],
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]  # the command's own exit code
    assert "Traceback" not in proc.stderr
    trace_dir = out / schema.TRACE_DIR
    if "could not write the trace" in proc.stderr:
        # the collector ran out of space: it said where, and how to write the trace elsewhere
        assert "collect" in proc.stderr and "--trace OTHER" in proc.stderr and str(out) in proc.stderr
        assert (out / schema.SPOOL_DIR).is_dir()
        trace_dir = tmp_path / "elsewhere.zarr"
        run([*CLI, "collect", str(out), "--trace", str(trace_dir)])
    rt = Trace.open(trace_dir).rank(1)
    assert rt.attrs["end"]["counters"]["blobs_dropped"] > 0
    # a replay of a step whose payloads were dropped says that, not "record with --payloads all"
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    shutil.copytree(trace_dir, run_dir / schema.TRACE_DIR)
    code, text, _doc = replay(run_dir, 1)
    assert code == 3 and "DIVERGED" not in text, text[-3000:]
    assert "dropped" in text and "--payloads all" not in text, text[-3000:]


# -- 11. killing record stops its job ----------------------------------------------------------
def test_killing_record_stops_the_job_it_started(tmp_path: Path) -> None:
    out = tmp_path / "orphan"
    proc = subprocess.Popen(
        [
            *CLI,
            "record",
            "--out",
            str(out),
            "--",
            *torchrun_cmd(2, EXAMPLE, "--steps", "300", "--sleep-per-step", "0.2", *SMALL),
        ],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        start_new_session=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("step "):
            break
    job = [
        p
        for p in psutil.Process(proc.pid).children(recursive=True)
        if "watchdog" not in " ".join(p.cmdline())
    ]
    assert len(training_ranks(psutil.Process(proc.pid))) == 2
    os.killpg(proc.pid, signal.SIGKILL)  # record and everything in its process group
    _, err = proc.communicate()  # drains and closes both pipes (the watchdog's too)
    _gone, alive = psutil.wait_procs(job, timeout=60)
    assert not alive, [p.cmdline() for p in alive]
    assert f"build the trace with `fsdp-replay collect {out}`" in err, err[-2000:]
    # the spools are kept, and the trace can be built from them
    collected = run([*CLI, "collect", str(out)], check=False)
    assert collected.returncode in (0, 3), collected.stderr
    assert len(Trace.open(out / schema.TRACE_DIR).ranks) == 2


def test_a_replay_keeps_the_users_thread_count_and_says_so(recorded: Path, tmp_path: Path) -> None:
    rec = copy_run(recorded, tmp_path / "run")
    report = tmp_path / "rep"
    proc = run(
        [*CLI, "replay", str(rec), "--rank", "0", "--report", str(report)],
        env=child_env(OMP_NUM_THREADS="2"),
        check=False,
    )
    text = proc.stdout + proc.stderr
    assert "OMP_NUM_THREADS=2 from your environment is used" in text, text[-3000:]
    doc = json.loads((report / "report.json").read_text())
    assert any("intra-op threads: recorded 1, replay 2" in n for n in doc["notes"]), doc["notes"]


@pytest.fixture(scope="module")
def slow_steps(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A recording whose replay takes long enough to be stopped mid-way (read, never changed: the
    replays' reports go elsewhere)."""
    rec, _ = record(
        tmp_path_factory.mktemp("slow-steps"),
        2,
        "--steps",
        "24",
        "--sleep-per-step",
        "0.25",
        *SMALL,
        record_args=("--payloads", "all"),
    )
    return rec


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stopped_replay_says_what_it_verified_without_a_verdict(
    slow_steps: Path, tmp_path: Path, signum: int
) -> None:
    """Ctrl-C (or SIGTERM) during a replay: no DIVERGED, no 'replay defect' error; the shell's
    128 + N exit code, and for Ctrl-C the steps that matched before the stop."""
    rec = slow_steps
    report = tmp_path / "stopped"
    with subprocess.Popen(
        [*CLI, "replay", str(rec), "--rank", "1", "--report", str(report)],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        # as a terminal's Ctrl-C finds it: SIGINT not ignored (a background test runner ignores it)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    ) as proc:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if "rank 1: step 3/" in line:
                break
        proc.send_signal(signum)
        out = "".join(seen) + proc.stdout.read()
        assert proc.wait(timeout=120) == 128 + signum, out[-3000:]
    assert "DIVERGED" not in out and "replay defect" not in out, out[-3000:]
    if signum == signal.SIGINT:  # the program's KeyboardInterrupt: the replay reports
        doc = json.loads((report / "report.json").read_text())
        assert doc["status"] == "interrupted" and doc["first_divergence"] is None, doc
        assert doc["verified_steps"][:4] == [0, 1, 2, 3], doc["verified_steps"]
        assert "INTERRUPTED: stopped by Ctrl-C (SIGINT) at step" in out, out[-3000:]
        assert f"before that, steps 0..{doc['verified_steps'][-1]} matched the record" in out
    else:  # killed: the command line says so
        assert "the replay was stopped by SIGTERM before it could report" in out, out[-3000:]
