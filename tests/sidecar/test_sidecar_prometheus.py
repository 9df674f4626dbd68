"""End to end with real components: a recorded 2-rank FSDP run, the real sidecar following its
spools as they are written, and a real Prometheus server (Debian's) scraping the sidecar every
second. What Prometheus stored must be what ``fsdp-replay inspect --json`` reports for the trace:
the agent's CPU per step to the last bit (seconds there, milliseconds here), the steps and the
collectives of each rank.

eBPF is off here (``--no-ebpf``): the CPU run makes no NCCL call, and a probe on this shared
machine would put breakpoints in other people's processes that map the same libnccl.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from daemon_support import free_port, scrape, sidecar_cmd, sidecar_env, wait_for, wait_healthy
from harness import CLI, record, run

INSTALL = "scripts/install-prometheus.sh (as root) installs Debian's prometheus"
TRAIN_ARGS = (
    "--steps",
    "8",
    "--layers",
    "2",
    "--d-model",
    "64",
    "--seq-len",
    "32",
    "--sleep-per-step",
    "0.3",
)


def prometheus_config(path: Path, target_port: int) -> None:
    path.write_text(
        "global:\n"
        "  scrape_interval: 1s\n"
        "  scrape_timeout: 1s\n"
        "  evaluation_interval: 1s\n"
        "scrape_configs:\n"
        "  - job_name: fsdp-replay-sidecar\n"
        "    static_configs:\n"
        f"      - targets: ['127.0.0.1:{target_port}']\n"
    )


def query(port: int, promql: str) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=10) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def by_rank(port: int, promql: str) -> dict[int, str]:
    """rank -> the value Prometheus returns, as the text it sent (its float formatting)."""
    return {int(row["metric"]["rank"]): row["value"][1] for row in query(port, promql)}


@pytest.mark.slow
def test_prometheus_stores_the_recording_cost_that_inspect_reports(tmp_path: Path) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip(f"no prometheus binary: {INSTALL}")
    sidecar_port, prom_port = free_port(), free_port()
    config = tmp_path / "prometheus.yml"
    prometheus_config(config, sidecar_port)
    out = tmp_path / "rec"  # what record() below writes: the sidecar starts before it exists
    procs: list[subprocess.Popen[str]] = []
    try:
        with open(tmp_path / "prometheus.log", "w") as log:
            procs.append(
                subprocess.Popen(
                    [
                        binary,
                        f"--config.file={config}",
                        f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                        f"--web.listen-address=127.0.0.1:{prom_port}",
                    ],
                    stdout=log,
                    stderr=log,
                    text=True,
                )
            )
        with open(tmp_path / "sidecar.log", "w") as log:
            procs.append(
                subprocess.Popen(
                    sidecar_cmd(out, sidecar_port, "--no-ebpf", "--poll-interval-s", "0.5"),
                    stderr=log,
                    text=True,
                    env=sidecar_env(),
                )
            )
        wait_healthy(sidecar_port, procs[1])

        def ready() -> bool | None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{prom_port}/-/ready", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return None

        wait_for("Prometheus ready", ready, timeout=60)
        wait_for("the first scrape", lambda: query(prom_port, "up") or None, timeout=30)

        record(tmp_path, 2, *TRAIN_ARGS, record_args=["--keep-spool"])
        summary = json.loads(run([*CLI, "inspect", str(out), "--json"]).stdout)
        expected = {r["rank"]: r for r in summary["per_rank"]}
        assert sorted(expected) == [0, 1]
        for r in expected.values():
            assert r["recording_cost"] is not None and r["steps"] == 8

        def stored() -> dict[str, dict[int, str]] | None:
            got = {
                "hooks": by_rank(prom_port, "fsdp_replay_agent_hooks_cpu_per_step_seconds"),
                "writer": by_rank(prom_port, "fsdp_replay_agent_writer_cpu_per_step_seconds"),
                "steps": by_rank(prom_port, "fsdp_replay_spool_steps_total"),
                "colls": by_rank(prom_port, "sum by (rank) (fsdp_replay_spool_collectives_total)"),
            }
            ended = query(prom_port, "fsdp_replay_spool_ranks_ended")
            done = ended and ended[0]["value"][1] == "2" and all(len(got[k]) == 2 for k in ("hooks", "steps"))
            return got if done else None

        got = wait_for("both ranks' final values in Prometheus", stored, timeout=60, every=0.5)
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    assert procs[1].returncode == 0, (tmp_path / "sidecar.log").read_text()[-3000:]

    for rank, want in expected.items():
        cost = want["recording_cost"]
        # Prometheus's value (seconds, as Go formats float64) against inspect's (ms): equal but for
        # the float formatting and the unit conversion.
        hooks_s, writer_s = float(got["hooks"][rank]), float(got["writer"][rank])
        assert math.isclose(hooks_s * 1e3, cost["agent_cpu_ms_per_step"], rel_tol=1e-12, abs_tol=0), (
            rank,
            hooks_s,
        )
        assert math.isclose(writer_s * 1e3, cost["writer_cpu_ms_per_step"], rel_tol=1e-12, abs_tol=0)
        assert hooks_s > 0
        assert float(got["steps"][rank]) == want["steps"] == 8
        assert float(got["colls"][rank]) == want["collectives"] > 0
    text = (tmp_path / "sidecar.log").read_text()
    assert "following the spool of rank 0" in text and "following the spool of rank 1" in text
    assert scrape(sidecar_port) is None  # stopped
