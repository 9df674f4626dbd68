"""The real sidecar daemon as a process: plain-container mode exits 0 by itself once the trainers it
saw have ended (and not while a restarted one is due), native mode runs until SIGTERM.

Trainers are stand-ins that write their spools with the real SpoolWriter (helpers/spool_trainer.py)
and carry FSDP_REPLAY_MODE=record, so discovery takes them for trainers. Other engineers run
recorded trainers on this machine too, so the container-mode test runs the sidecar and its
trainers in a private PID namespace, as in a pod (``unshare --pid --fork --mount-proc``, root).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import spool_events as ev
from daemon_support import (
    POD,
    SPOOL_TRAINER,
    can_isolate,
    free_port,
    get,
    parse,
    sidecar_cmd,
    sidecar_env,
    total,
    wait_healthy,
    wait_metrics,
)

from fsdp_replay.sidecar.config import SidecarConfig
from fsdp_replay.sidecar.main import Sidecar
from fsdp_replay.trace import schema, spool

STEPS = 5
QUIET_S = 2.0


def trainer(out: Path, rank: int, *args: str) -> dict[str, Any]:
    """A stand-in trainer for pod.py: its argv and environment."""
    return {
        "argv": [sys.executable, str(SPOOL_TRAINER), str(out), str(rank), str(STEPS), *args],
        "env": {"FSDP_REPLAY_MODE": "record", "RANK": str(rank)},
    }


@pytest.mark.slow
def test_container_mode_exits_0_after_the_trainers_it_saw_end(tmp_path: Path) -> None:
    why = can_isolate()
    if why is not None:
        pytest.skip(f"a private PID namespace: {why}")
    out, port = tmp_path / "run", free_port()
    spec = {
        "sidecar": sidecar_cmd(
            out,
            port,
            "--mode",
            "container",
            "--no-ebpf",
            "--poll-interval-s",
            "0.2",
            "--exit-quiet-s",
            str(QUIET_S),
        ),
        "port": port,
        # Two ranks (rank 1 dies without its end event), then rank 0 restarted by "torchrun"
        # within the quiet period: the sidecar must wait for it, then exit.
        "groups": [[trainer(out, 0), trainer(out, 1, "--no-end")], [trainer(out, 0)]],
        "gap_s": QUIET_S / 2,
        "timeout_s": 60,
    }
    proc = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, str(POD), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=180,
        env=sidecar_env(),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["trainer_rcs"] == [0, 0, 0]
    assert report["sidecar_rc"] == 0, proc.stderr[-4000:]
    assert report["alive_between_groups"] == [True]  # a restart within the quiet period keeps it
    assert QUIET_S <= report["exit_after_s"] < QUIET_S + 5, report["exit_after_s"]
    assert "the training processes have ended and the spools are quiet: exiting" in proc.stderr
    # The last values served before it exited: everything recorded, counted once.
    m = parse(report["metrics"])
    assert get(m, "fsdp_replay_trainer_processes_seen_total") == 3
    assert get(m, "fsdp_replay_spool_ranks") == 2 and get(m, "fsdp_replay_spool_ranks_ended") == 1
    assert get(m, "fsdp_replay_spool_steps_total", rank="0") == 2 * STEPS
    assert get(m, "fsdp_replay_spool_events_total", rank="0", type="rank_start") == 2
    assert total(m, "fsdp_replay_spool_collectives_total", rank="1") == 2 * STEPS
    assert get(m, "fsdp_replay_spool_damage_total", rank="0") == 0
    # Hooks cpu_ns is 1000 (i+1)^2: increments 3000, 5000, 7000, 9000, and across the restart
    # 1000 - 25000 = -24000: the median of the 9 increments, as summary.recording_cost computes it.
    increments = sorted([3000, 5000, 7000, 9000] * 2 + [-24000])
    assert get(m, "fsdp_replay_agent_hooks_cpu_per_step_seconds", rank="0") == increments[4] / 1e9
    assert get(m, "fsdp_replay_sidecar_ebpf_enabled") == 0


@pytest.mark.slow
def test_native_mode_runs_until_sigterm_and_stops_cleanly(tmp_path: Path) -> None:
    out, port, log = tmp_path / "run", free_port(), tmp_path / "sidecar.log"
    with open(log, "w") as log_file:
        sc = subprocess.Popen(
            sidecar_cmd(out, port, "--no-ebpf", "--poll-interval-s", "0.2", "--exit-quiet-s", "0.5"),
            stderr=log_file,
            text=True,
            env=sidecar_env(),
        )
    try:
        wait_healthy(port, sc)
        t = trainer(out, 4)
        subprocess.run(t["argv"], env={**sidecar_env(), **t["env"]}, check=True, timeout=60)
        m = wait_metrics(
            port, "rank 4's end in /metrics", lambda s: get(s, "fsdp_replay_spool_ranks_ended") == 1
        )
        assert get(m, "fsdp_replay_spool_steps_total", rank="4") == STEPS
        # Hooks increments 3000, 5000, 7000, 9000: median 6000 ns; writer 100 each.
        assert get(m, "fsdp_replay_agent_hooks_cpu_per_step_seconds", rank="4") == 6000 / 1e9
        assert get(m, "fsdp_replay_agent_writer_cpu_per_step_seconds", rank="4") == 100 / 1e9
        time.sleep(1.5)  # past the quiet period: a native sidecar does not exit by itself
        assert sc.poll() is None
        sc.send_signal(signal.SIGTERM)
        sc.wait(timeout=30)
    finally:
        if sc.poll() is None:
            sc.kill()
            sc.wait()
    err = log.read_text()
    assert sc.returncode == 0, err[-3000:]
    assert "signal 15: stopping" in err and "rank 4: 5 steps, 10 collectives" in err
    assert "eBPF disabled by configuration" in err


def test_when_the_trainers_count_as_done(tmp_path: Path) -> None:
    """The container-mode exit rule, on an empty proc root (no process at all) and a real spool."""
    (tmp_path / "proc").mkdir()
    out = tmp_path / "run"
    config = SidecarConfig(out=str(out), proc_root=str(tmp_path / "proc"), ebpf=False, exit_quiet_s=2.0)
    sc = Sidecar(config)
    sc.step(now=0.0)
    assert not sc.trainers_done(now=0.0) and not sc.trainers_done(now=100.0)  # nothing seen yet
    w = spool.SpoolWriter(spool.rank_dir(out / schema.SPOOL_DIR, 0), 0)
    w.append(schema.KIND_EVENT, ev.rank_start(0, 1))
    sc.step(now=1.0)
    assert not sc.trainers_done(now=1.0) and not sc.trainers_done(now=50.0)  # a rank that has not ended
    w.append(schema.KIND_EVENT, ev.end(5, 0, 0))
    sc.step(now=60.0)
    # No trainer was seen (the sidecar started late), but every rank ended: quiet for 2 s, then done.
    assert not sc.trainers_done(now=60.0)
    assert not sc.trainers_done(now=61.9)
    assert sc.trainers_done(now=62.0)
    w.append(schema.KIND_EVENT, ev.rank_start(0, 2))  # a restarted rank writes again: not quiet
    sc.step(now=63.0)
    assert not sc.trainers_done(now=63.0)
    w.append(schema.KIND_EVENT, ev.end(5, 0, 0))
    w.close()
    sc.step(now=64.0)
    assert not sc.trainers_done(now=64.0) and sc.trainers_done(now=66.0)
    sc.shutdown()


@pytest.mark.slow
def test_without_bpf_privileges_it_runs_without_ebpf_and_says_so_once(tmp_path: Path) -> None:
    """eBPF asked for (the default) but not possible: every capability dropped (as root here, with
    setpriv; a non-root user has none anyway). The spools are followed all the same."""
    out, port, log = tmp_path / "run", free_port(), tmp_path / "sidecar.log"
    cmd = sidecar_cmd(out, port, "--poll-interval-s", "0.2")
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("no setpriv (util-linux) to drop root's capabilities")
        cmd = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", *cmd]
    with open(log, "w") as log_file:
        sc = subprocess.Popen(cmd, stderr=log_file, text=True, env=sidecar_env())
    try:
        wait_healthy(port, sc)
        t = trainer(out, 2)
        subprocess.run(t["argv"], env={**sidecar_env(), **t["env"]}, check=True, timeout=60)
        m = wait_metrics(port, "rank 2's end", lambda s: get(s, "fsdp_replay_spool_ranks_ended") == 1)
        assert get(m, "fsdp_replay_sidecar_ebpf_enabled") == 0
        assert get(m, "fsdp_replay_spool_steps_total", rank="2") == STEPS
        assert get(m, "fsdp_replay_ebpf_processes_tracked") == 0
        sc.send_signal(signal.SIGTERM)
        sc.wait(timeout=30)
    finally:
        if sc.poll() is None:
            sc.kill()
            sc.wait()
    text = log.read_text()
    assert sc.returncode == 0, text[-3000:]
    assert text.count("eBPF unavailable, running without it") == 1, text[-3000:]


def test_a_dump_request_that_a_rank_never_answers_is_closed_at_its_deadline(tmp_path: Path) -> None:
    """The hang capture's wait (sidecar/main.py): rank 0 is stuck in a collective, rank 1 answers
    the dump request and rank 0 never does (its writer cannot run); the request stays open until
    --hang-dump-wait-s, then closes with rank 1 answered and rank 0 unanswered, both counted."""
    from fsdp_replay.trace.dump_request import read_request

    (tmp_path / "proc").mkdir()
    out = tmp_path / "run"
    config = SidecarConfig(out=str(out), proc_root=str(tmp_path / "proc"), ebpf=False, hang_dump_wait_s=5.0)
    sc = Sidecar(config)
    writers = [spool.SpoolWriter(spool.rank_dir(out / schema.SPOOL_DIR, r), r) for r in range(2)]
    for r, w in enumerate(writers):
        w.append(schema.KIND_EVENT, ev.rank_start(r, 1))
    writers[0].append(schema.KIND_EVENT, ev.stuck(7, "allreduce_", 10, 3_000_000_000))
    sc.step(now=0.0)
    assert sc._hang_to_capture() and sc._ask_for_state(10.0)
    req = read_request(out)
    assert req is not None and "stuck" in req.reason
    answer = {
        "type": schema.EV_STATE,
        "id": req.id,
        "reason": req.reason,
        "t_ns": 20,
        "t_wall_ns": 20,
        "step": 0,
        "micro": 0,
        "seq": 7,
        "recording": True,
        "inflight": None,
        "threads": [],
        "threads_dropped": 0,
    }
    writers[1].append(schema.KIND_EVENT, answer)
    sc._follow(final=False)
    assert not sc._dump_settled(12.0)  # rank 0 has not answered, and there is time left
    assert sc._dump_settled(15.0)  # the deadline: closed
    hang = sc.state.hang
    assert hang.requests == 1 and hang.answered == {1: 1} and hang.unanswered == {0: 1}
    for w in writers:
        w.close()
    sc.shutdown()
