"""A hung job asked for its state: one rank stalls outside any collective, the other waits in one.

A real 2-rank gloo recording of the example: rank 1 sleeps at step 1 (``--stall-at-step``)
before the loss all-reduce that rank 0 already waits in. ``fsdp-replay dump`` on the running job
gets both ranks' answers; ``collect`` (the job still hung) puts them in the trace, where
``desync`` and ``inspect`` name the line rank 1 is at. The job is killed at the end: it hangs by
design.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from harness import CLI, EXAMPLE, REPO, child_env, run, torchrun_cmd

from fsdp_replay.trace import schema, spool

pytestmark = pytest.mark.slow
SMALL = ("--layers", "2", "--d-model", "32", "--seq-len", "16", "--workers", "0")
STALL = (
    "--steps",
    "4",
    "--stall-at-step",
    "1",
    "--stall-rank",
    "1",
    "--stall-s",
    "600",
    "--pg-timeout",
    "600",
)


def _stall_line() -> int:
    return next(
        i
        for i, line in enumerate(EXAMPLE.read_text().splitlines(), 1)
        if "# the stall (--stall-at-step)" in line
    )


def _stuck(out: Path, rank: int) -> bool:
    folder = spool.rank_dir(out / schema.SPOOL_DIR, rank)
    if not folder.is_dir():
        return False
    records = spool.read_rank(folder, spool.SegmentReport())
    return any(r.kind == schema.KIND_EVENT and r.obj.get("type") == schema.EV_STUCK for r in records)


def test_dump_on_a_hung_job_shows_the_stalled_rank_line_and_the_waiting_rank_collective(
    tmp_path: Path,
) -> None:
    out = tmp_path / "run"
    cmd = [*CLI, "record", "--out", str(out), "--no-collect", "--payloads", "none", "--"]
    cmd += torchrun_cmd(2, EXAMPLE, *SMALL, *STALL)
    with open(tmp_path / "job.log", "w") as log:
        job = subprocess.Popen(cmd, env=child_env(), stdout=log, stderr=log, start_new_session=True, cwd=REPO)
    try:
        deadline = time.monotonic() + 240
        while not _stuck(out, 0):
            assert job.poll() is None, (tmp_path / "job.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "rank 0 never waited in the all-reduce"
            time.sleep(0.5)
        line = _stall_line()
        dump = run([*CLI, "dump", str(out), "--wait", "60"], check=False)
        assert dump.returncode == 0, dump.stdout + dump.stderr
        assert (
            # the agent counts steps at the optimizer: the loss all-reduce after step 1's is step 2's
            "rank 1 is not in a collective (step 2, next collective #" in dump.stdout
            and f"its main thread is at examples/train_fsdp.py:{line} in train (time.sleep(cfg.stall_s)"
            in dump.stdout
        ), dump.stdout
        assert "rank 0 waits in collective #" in dump.stdout and "allreduce_ (step 2" in dump.stdout, (
            dump.stdout
        )
        assert "answered: [0, 1]" in dump.stdout

        run([*CLI, "collect", str(out)])  # the job still hangs
        assert job.poll() is None
        report = run([*CLI, "desync", str(out), "--json"], check=False)
        doc = json.loads(report.stdout)
        states = {pr["rank"]: pr["state"] for pr in doc["ranks"]}
        assert states[0]["inflight"]["op"] == "allreduce_" and states[0]["inflight"]["waited_ns"] > 2e9
        assert states[1]["inflight"] is None and states[1]["id"] == 1
        frame = states[1]["main"]["frame"]
        assert (frame["file"], frame["line"], frame["function"]) == ("examples/train_fsdp.py", line, "train")
        assert any(
            s.startswith("rank 1 is not in a collective") and f"train_fsdp.py:{line}" in s
            for s in doc["states"]
        )
        text = run([*CLI, "desync", str(out)], check=False).stdout
        assert "what each rank was doing when asked" in text and f"train_fsdp.py:{line}" in text

        summary = json.loads(run([*CLI, "inspect", str(out), "--json"]).stdout)
        found = [f for f in summary["findings"] if f["kind"] == "state"]
        assert [(f["rank"], f["severity"]) for f in sorted(found, key=lambda f: f["rank"])] == [
            (0, "info"),
            (1, "problem"),
        ]
        assert "the ranks in a collective wait for it" in next(f for f in found if f["rank"] == 1)["message"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=60)
