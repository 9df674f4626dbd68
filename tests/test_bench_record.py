"""``bench/bench_record.py`` stopped by a time limit (as the GPU machine's calls stop it) keeps the
repetitions it finished: its results are written after each whole one, marked PARTIAL until the
last. A real run of the benchmark on the CPU example (two ranks over gloo), stopped with SIGTERM
once its first repetition is written."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness import REPO, child_env

pytestmark = pytest.mark.slow


def test_a_stopped_benchmark_keeps_its_whole_repetitions(tmp_path: Path) -> None:
    stem = tmp_path / "overhead"
    json_path, md_path = stem.with_name("overhead.json"), stem.with_name("overhead.md")
    cmd = [
        sys.executable,
        "bench/bench_record.py",
        "--configs",
        "meta",
        "--reps",
        "3",
        "--steps",
        "6",
        "--cooldown",
        "0",
        "--workdir",
        str(tmp_path / "work"),
        "--results",
        str(stem),
    ]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 240
        while not md_path.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)  # (the Markdown is written after the JSON, each by a rename)
        assert md_path.exists(), f"no results after the first repetition; exit {proc.poll()}"
        proc.send_signal(signal.SIGTERM)  # in the second repetition: what a call's time limit does
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, out[-2000:]
    doc = json.loads(json_path.read_text())
    assert doc["parameters"]["reps"] == 3 and doc["parameters"]["reps_done"] == 1
    assert sorted(r["config"] for r in doc["runs"]) == ["baseline", "meta"]
    assert all(r["step_median_s"] > 0 and not r["problems"] for r in doc["runs"])
    assert "**PARTIAL**: 1 of 3 repetitions" in md_path.read_text()
