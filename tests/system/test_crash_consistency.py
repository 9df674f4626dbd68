"""Crash consistency: SIGKILLs of a 2-rank recording, at chosen moments and at random ones.

What a trace promises after a kill at any moment (docs/exit-codes.md): every trace that holds data
collects and inspects; a replay of any rank runs up to that rank's last complete step and is
BIT-EXACT there; nothing says DIVERGED; nothing prints a traceback; and ``desync`` of a healthy job
that was killed finds no disagreement.

``test_a_kill_in_each_phase_leaves_a_trace_that_never_lies`` kills at one point of each phase that
matters, chosen, not drawn: during start-up (from outside), in the middle of a rank's first spool
record, of a collective's record during a step, of the step-end record while the step end waits
for it (``sync_steps``), of a snapshot's bytes, at a moment of the run chosen from outside, and
``record`` itself while it collects. A kill inside the agent's writes comes from the rank itself
(``tests/workloads/kill_at.py`` tears the chosen spool record and SIGKILLs its process), so each
case lands where it says; the last complete step it must leave is known, and checked. Every kill
also checks the promise of the step-end wait: a rank's record is complete at least through the
last step the run printed before the kill.

``test_random_sigkills_leave_traces_that_never_lie`` is the long version, SIGKILLs from outside at
random moments: ``FSDP_REPLAY_TEST_RANDOM_KILLS=N`` runs N of them (20 took 8.5 minutes on CI's 2
cores, too long for every run); it is skipped without it.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest
from harness import CLI, EXAMPLE, REPO, child_env, run, torchrun_cmd, training_ranks

from fsdp_replay.trace import schema
from fsdp_replay.trace.reader import Trace

pytestmark = pytest.mark.slow
RANDOM_KILLS = int(os.environ.get("FSDP_REPLAY_TEST_RANDOM_KILLS", "0"))
SMALL = ("--layers", "2", "--d-model", "64", "--seq-len", "32")
KILL_AT = REPO / "tests" / "workloads" / "kill_at.py"


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


def _record_killing_itself(
    out: Path, crash_at: dict[str, Any], *, kill_collect: bool = False
) -> subprocess.CompletedProcess[str]:
    """Record the example under ``kill_at.py``: rank ``crash_at['rank']`` kills itself at the
    chosen spool record (torchrun then stops the other). ``kill_collect``: SIGKILL ``record``
    once its collection has begun writing the trace, and collect again (a second process)."""
    cmd = torchrun_cmd(2, KILL_AT, str(EXAMPLE), "--steps", "8", *SMALL)
    env = child_env(CRASH_AT=json.dumps(crash_at), CRASH_MARK=str(out / "crash"))
    args = [*CLI, "record", "--out", str(out), "--snapshot-every", "2", "--", *cmd]
    if not kill_collect:
        rec = run(args, env=env, check=False)
    else:
        proc = subprocess.Popen(
            args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
        )
        deadline = time.monotonic() + 240
        while not (out / schema.TRACE_DIR).exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert proc.poll() is None, "record ended before its collection could be killed"
        proc.kill()
        stdout, stderr = proc.communicate(timeout=60)
        rec = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        again = run([*CLI, "collect", str(out)], check=False)
        assert again.returncode == 0, again.stderr[-3000:]
        assert "Traceback" not in again.stderr, again.stderr[-3000:]
    victim = crash_at["rank"]  # the chosen point was reached: the victim says where it was
    assert (out / f"crash.rank{victim}").exists(), f"never reached: {crash_at}\n{rec.stderr[-3000:]}"
    return rec


def _check(out: Path, rec: subprocess.CompletedProcess[str], rank: int) -> tuple[str, int | None]:
    """What every killed recording must give (the module docstring). Returns what happened to
    ``rank`` (whose replay is checked) and its last complete step (None: it recorded nothing).

    The example's rank 0 prints ``step N`` after an all-reduce that follows every rank's optimizer
    step N, whose end waited until the step's records were written (``sync_steps``): each rank's
    record is complete at least through the last step printed before the kill."""
    assert "Traceback (most recent call last)" not in rec.stderr.split("fsdp-replay: recording into")[0]
    printed = max(
        (int(line.split()[1]) for line in rec.stdout.splitlines() if line.startswith("step ")), default=-1
    )
    if not (out / schema.TRACE_DIR).exists():
        # killed before any rank wrote a record: the spool must be empty too
        spool = out / schema.SPOOL_DIR
        assert not spool.exists() or not any(spool.rglob("*.fsrs")), rec.stderr[-2000:]
        assert printed < 0, f"step {printed} was printed, and there is no trace"
        return "no data", None
    insp = run([*CLI, "inspect", str(out), "--json"], check=False)
    assert insp.returncode == 0, insp.stderr[-3000:]
    summary = json.loads(insp.stdout)
    trace = Trace.open(out / schema.TRACE_DIR)
    desync = run([*CLI, "desync", str(out)], check=False)
    assert desync.returncode == 0, desync.stdout[-3000:] + desync.stderr[-2000:]
    assert "suspect" not in desync.stdout and "Traceback" not in desync.stderr
    if rank not in trace.ranks:
        assert printed < 0, f"step {printed} was printed, and rank {rank} is not in the trace"
        return f"rank {rank} wrote nothing", None
    through = int(trace.rank(rank).completeness["through_step"])
    assert through >= printed, (
        f"step {printed} was printed before the kill; rank {rank} is complete through {through}"
    )
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
        return f"rank {rank} incomplete before step 0: exit {rep.returncode}", through
    assert rep.returncode == 0, text[-4000:]
    doc = json.loads((report / "report.json").read_text())
    assert doc["status"] == "bit-exact" and doc["verified_steps"] == list(range(through + 1)), doc
    return f"rank {rank} bit-exact through step {through} (ranks present {summary['ranks']})", through


@dataclass(frozen=True)
class Kill:
    name: str
    rank: int  # the rank killed (from outside: both are), whose replay is checked
    crash_at: dict[str, Any] | None = None  # kill_at.py's $CRASH_AT, less the rank; None: from outside
    through: int | None = None  # the last complete step a kill from inside must leave that rank
    delay_s: float = 0.0  # from outside: after the ranks appear (start-up) or after the first step
    during_startup: bool = False
    kill_collect: bool = False  # then SIGKILL record while it collects (``_record_killing_itself``)


# A torn record takes its step away (the record is complete through the step before), and every
# earlier step is whole. With --snapshot-every 2 the snapshots of steps 0, 2, 4 are the rank's first
# three: step 0's at its first optimizer step, 2's and 4's at the ends of steps 1 and 3.
KILLS = [
    Kill("start-up, from outside", 0, during_startup=True),
    Kill("rank 0's first record torn", 0, {"record": "rank_start", "keep": 0.5}, through=-1),
    Kill("a collective of step 3 torn", 1, {"record": "coll", "step": 3, "nth": 5, "keep": 0.5}, through=2),
    Kill("step 3's end torn, in the step-end sync", 0, {"record": "step", "step": 3, "keep": 0.5}, through=2),
    Kill("step 4's snapshot torn", 1, {"record": "snapshot_blob", "nth": 3, "keep": 0.5}, through=3),
    Kill(
        "after step 2's end, then record killed while it collects",
        1,
        {"record": "step", "step": 2, "keep": 1.0},
        through=2,
        kill_collect=True,
    ),
    Kill("mid-run, from outside", 1, delay_s=1.0),
]


@pytest.mark.parametrize("kill", KILLS, ids=[k.name for k in KILLS])
def test_a_kill_in_each_phase_leaves_a_trace_that_never_lies(tmp_path: Path, kill: Kill) -> None:
    out = tmp_path / "run"
    if kill.crash_at is None:
        rec = _record_and_kill(out, kill.delay_s, "both", kill.during_startup)
    else:
        rec = _record_killing_itself(
            out, {**kill.crash_at, "rank": kill.rank}, kill_collect=kill.kill_collect
        )
    outcome, through = _check(out, rec, kill.rank)
    print(f"{kill.name}: {outcome}")
    if kill.crash_at is not None:
        assert through == kill.through, outcome
    elif not kill.during_startup:  # from outside, mid-run: the ranks had completed a step
        assert through is not None and through >= 0, outcome


@pytest.mark.skipif(not RANDOM_KILLS, reason="the long version: set FSDP_REPLAY_TEST_RANDOM_KILLS=N")
def test_random_sigkills_leave_traces_that_never_lie(tmp_path: Path) -> None:
    rng = random.Random(20261201)
    outcomes: list[str] = []
    for i in range(RANDOM_KILLS):
        out = tmp_path / f"kill-{i:02d}"
        delay = rng.uniform(0.0, 4.0)
        victims = "both" if i % 3 else "one"
        during_startup = i % 5 == 4
        rec = _record_and_kill(out, delay, victims, during_startup)
        outcome, _ = _check(out, rec, i % 2)
        when = "of start-up" if during_startup else "after step 0"
        outcomes.append(f"{i}: killed {victims} {delay:.2f}s {when}: {outcome}")
    print("\n".join(outcomes))
    assert sum("bit-exact" in o for o in outcomes) >= RANDOM_KILLS // 2, outcomes
