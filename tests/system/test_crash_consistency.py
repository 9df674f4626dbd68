"""Crash consistency: SIGKILLs at random moments of a 2-rank recording.

What a trace promises after a kill at any moment (docs/exit-codes.md): every trace that holds data
collects and inspects; a replay of any rank runs up to that rank's last complete step and is
BIT-EXACT there; nothing says DIVERGED; nothing prints a traceback; and ``desync`` of a healthy job
that was killed finds no disagreement.
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from harness import CLI, EXAMPLE, REPO, child_env, run, torchrun_cmd, training_ranks

from fsdp_replay.trace import schema
from fsdp_replay.trace.reader import Trace

pytestmark = pytest.mark.slow
KILLS = 20
SMALL = ("--layers", "2", "--d-model", "64", "--seq-len", "32")


def _record_and_kill(
    out: Path, delay_s: float, victims: str, during_startup: bool
) -> subprocess.CompletedProcess[str]:
    """Record the example, SIGKILL ``victims`` ("both" ranks, "one" rank) ``delay_s`` after the
    ranks appear (``during_startup``) or after the first step (killing during steps, snapshots
    and the writer's flushes)."""
    proc = subprocess.Popen(
        [
            *CLI,
            "record",
            "--out",
            str(out),
            "--snapshot-every",
            "2",
            "--",
            *torchrun_cmd(2, EXAMPLE, "--steps", "40", "--sleep-per-step", "0.05", *SMALL),
        ],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    record = psutil.Process(proc.pid)
    deadline = time.monotonic() + 120
    ranks: list[psutil.Process] = []
    while len(ranks) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
        ranks = training_ranks(record)
    head = []
    if not during_startup:
        assert proc.stdout is not None
        for line in proc.stdout:
            head.append(line)
            if line.startswith("step "):
                break
    time.sleep(delay_s)
    for p in ranks if victims == "both" else ranks[:1]:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, "".join(head) + stdout, stderr)


def test_random_sigkills_leave_traces_that_never_lie(tmp_path: Path) -> None:
    rng = random.Random(20261201)
    outcomes: list[str] = []
    for i in range(KILLS):
        out = tmp_path / f"kill-{i:02d}"
        delay = rng.uniform(0.0, 4.0)
        victims = "both" if i % 3 else "one"
        during_startup = i % 5 == 4
        rec = _record_and_kill(out, delay, victims, during_startup)
        assert "Traceback (most recent call last)" not in rec.stderr.split("fsdp-replay: recording into")[0]
        if not (out / schema.TRACE_DIR).exists():
            # killed before any rank wrote a record: the spool must be empty too
            spool = out / schema.SPOOL_DIR
            assert not spool.exists() or not any(spool.rglob("*.fsrs")), rec.stderr[-2000:]
            outcomes.append(f"{i}: no data (killed after {delay:.2f}s)")
            continue
        insp = run([*CLI, "inspect", str(out), "--json"], check=False)
        assert insp.returncode == 0, insp.stderr[-3000:]
        summary = json.loads(insp.stdout)
        trace = Trace.open(out / schema.TRACE_DIR)
        desync = run([*CLI, "desync", str(out)], check=False)
        assert desync.returncode == 0, desync.stdout[-3000:] + desync.stderr[-2000:]
        assert "suspect" not in desync.stdout and "Traceback" not in desync.stderr
        rank = i % 2
        if rank not in trace.ranks:
            outcomes.append(f"{i}: rank {rank} wrote nothing")
            continue
        through = trace.rank(rank).completeness["through_step"]
        report = out / f"replay-{rank}"
        rep = run([*CLI, "replay", str(out), "--rank", str(rank), "--report", str(report)], check=False)
        text = rep.stdout + rep.stderr
        assert "DIVERGED" not in text and "Traceback" not in text, text[-4000:]
        if through < 0:  # not even step 0 is complete: its recorded collectives, or refused
            assert rep.returncode in (0, 3), text[-3000:]
            if rep.returncode == 0:
                doc = json.loads((report / "report.json").read_text())
                assert doc["status"] == "bit-exact" and doc["verified_steps"] == [], doc
                assert "no step of the record is complete" in text
            outcomes.append(f"{i}: rank {rank} incomplete before step 0: exit {rep.returncode}")
            continue
        assert rep.returncode == 0, text[-4000:]
        doc = json.loads((report / "report.json").read_text())
        assert doc["status"] == "bit-exact" and doc["verified_steps"] == list(range(through + 1)), doc
        when = "of start-up" if during_startup else "after step 0"
        outcomes.append(
            f"{i}: killed {victims} {delay:.2f}s {when}, rank {rank} bit-exact through step {through} "
            f"(ranks present {summary['ranks']})"
        )
    print("\n".join(outcomes))
    assert sum("bit-exact" in o for o in outcomes) >= KILLS // 2, outcomes
