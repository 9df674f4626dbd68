"""The sidecar ships the trace to object storage: a real S3-compatible server (moto's) on loopback.

A 2-rank run is recorded with ``--no-collect`` (in a pod, the sidecar collects). The sidecar runs
first while the store is down: the collection fails, is counted, and every spool is kept. With the
store up, a second sidecar collects into ``s3://``, reads the trace back whole and deletes the
spools; ``inspect`` and ``replay --rank 1`` then read the trace from the store (BIT-EXACT). The
sidecar SIGKILLed mid-run and restarted (the new one resumes where the store says the killed one
stopped, without collecting anything anew), and a store on a full disk (a 256 kB tmpfs), lose
nothing and duplicate nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_support import free_port, get, sidecar_cmd, sidecar_env, wait_for, wait_metrics
from harness import CLI, EXAMPLE, child_env, run, small_tmpfs, torchrun_cmd

pytestmark = pytest.mark.slow
BUCKET = "traces"
SMALL = ("--steps", "3", "--layers", "2", "--d-model", "32", "--seq-len", "16")


def _aws(port: int) -> dict[str, str]:
    return {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }


@pytest.fixture
def s3_port(tmp_path: Path) -> Iterator[int]:
    pytest.importorskip("moto.server", reason="moto[server] (the test extras) runs the S3-compatible server")
    pytest.importorskip("s3fs", reason="s3fs (the test extras) is fsspec's s3:// filesystem")
    port = free_port()
    yield port


def _start_s3(port: int, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=out
        )

    def up() -> bool | None:
        import urllib.request

        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2).close()
            return True
        except OSError:
            return None

    wait_for("the S3 server", up, timeout=60)
    import boto3

    boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}", **_keys()).create_bucket(Bucket=BUCKET)
    return proc


def _keys() -> dict[str, str]:
    return {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "region_name": "us-east-1"}


def _sidecar(out: Path, store: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    cmd = sidecar_cmd(
        out,
        free_port(),
        "--mode",
        "container",
        "--no-ebpf",
        "--poll-interval-s",
        "0.2",
        "--exit-quiet-s",
        "1",
    )
    return subprocess.run([*cmd, "--store", store], capture_output=True, text=True, timeout=300, env=env)


def test_the_trace_reaches_s3_after_an_outage_and_replays_from_there(tmp_path: Path, s3_port: int) -> None:
    out = tmp_path / "run"
    command = torchrun_cmd(2, EXAMPLE, "--save-params", str(tmp_path / "params-{rank}.pt"), *SMALL)
    run([*CLI, "record", "--out", str(out), "--no-collect", "--", *command], env=child_env())
    spools = sorted(p.name for p in (out / "spool").glob("rank-*"))
    assert spools == ["rank-00000", "rank-00001"]
    url = f"s3://{BUCKET}/jobs/run1"
    env = {**sidecar_env(), **_aws(s3_port)}

    # nothing listens on the store's port; one attempt per request (botocore's retries of a refused
    # connection took 10 of the sidecar's 13 s, and a refusal is a failure however often it is tried)
    down = _sidecar(out, url, {**env, "AWS_MAX_ATTEMPTS": "1"})
    assert down.returncode == 0, down.stderr[-3000:]
    assert f"collecting the trace into {url} failed (the spools are kept" in down.stderr, down.stderr[-3000:]
    assert sorted(p.name for p in (out / "spool").glob("rank-*")) == spools

    server = _start_s3(s3_port, tmp_path / "s3.log")
    try:
        up = _sidecar(out, url, env)
        assert up.returncode == 0, up.stderr[-3000:]
        assert f"trace collected into {url} (2 ranks" in up.stderr, up.stderr[-3000:]
        for rank in (0, 1):
            assert f"rank {rank}: the store holds it whole; its spool is deleted" in up.stderr
        assert not list((out / "spool").glob("rank-*"))
        cli_env = {**child_env(), **_aws(s3_port)}
        # one inspect both summarizes and verifies (--verify reads every array and blob back)
        summary = json.loads(run([*CLI, "inspect", url, "--json", "--verify"], env=cli_env).stdout)
        assert [r["rank"] for r in summary["per_rank"]] == [0, 1]
        assert all(r["steps"] == 3 for r in summary["per_rank"])
        assert summary["verify"]["problems"] == [] and summary["verify"]["blobs"] > 0, summary["verify"]
        report = tmp_path / "replay-1"
        proc = run([*CLI, "replay", url, "--rank", "1", "--report", str(report)], env=cli_env, check=False)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert json.loads((report / "report.json").read_text())["status"] == "bit-exact"
        assert "rank 1: BIT-EXACT over steps 0..2" in proc.stdout
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert os.path.exists(tmp_path / "params-1.pt")


def test_a_hung_job_is_collected_while_it_hangs_and_desync_reads_the_store(tmp_path: Path) -> None:
    import signal

    import psutil

    out, store = tmp_path / "run", tmp_path / "store" / "trace.zarr"
    hang = ("--steps", "6", "--skip-collective-at-step", "2", "--skip-rank", "1", "--pg-timeout", "600")
    job = subprocess.Popen(
        [
            *CLI,
            "record",
            "--out",
            str(out),
            "--no-collect",
            "--payloads",
            "none",
            "--",
            *torchrun_cmd(2, EXAMPLE, *SMALL[2:], *hang),
        ],
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    log, port = tmp_path / "sidecar.log", free_port()
    with open(log, "w") as err:
        cmd = sidecar_cmd(out, port, "--no-ebpf", "--poll-interval-s", "0.3", "--store", str(store))
        sidecar = subprocess.Popen(cmd, stderr=err, text=True, env=sidecar_env())
    try:

        def captured() -> bool | None:
            # rank 0 waits in the all-reduce rank 1 skipped, then rank 1 in step 3's first collective:
            # the collection after both are stuck (and both wrote their state) holds where each waits
            text = log.read_text()
            at = text.find("ranks [0, 1] are stuck in a collective: collecting the trace once every rank")
            done = text.find("ranks [0, 1] wrote their state", at)
            return (at >= 0 and done >= 0 and f"trace collected into {store}" in text[done:]) or None

        wait_for("the sidecar's collection at the hang", captured, timeout=180, every=0.5)
        assert job.poll() is None  # the job still hangs: nothing was killed
        report = run([*CLI, "desync", str(store), "--json"], check=False)
        assert report.returncode == 1, report.stdout + report.stderr
        doc = json.loads(report.stdout)
        waits = {r["rank"]: r["in_flight"] for r in doc["ranks"]}
        assert waits[0] is not None and waits[0]["op"] == "allreduce_", doc["ranks"]
        # both ranks' answers to the sidecar's last dump request: each waits in a collective
        states = {r["rank"]: r["state"] for r in doc["ranks"]}
        assert states[0]["id"] == states[1]["id"] >= 1, states
        assert all(
            st["inflight"] is not None and st["reason"].startswith("sidecar:") for st in states.values()
        )
        samples = wait_metrics(
            port,
            "the hang capture's metrics",
            lambda m: get(m, "fsdp_replay_hang_dump_requests_total") is not None,
        )
        assert get(samples, "fsdp_replay_hang_dump_requests_total") == states[0]["id"]  # one request a hang
        assert get(samples, "fsdp_replay_hang_dumps_answered_total", rank="1") >= 1
        assert get(samples, "fsdp_replay_hang_dumps_unanswered_total", rank="1") == 0
        assert list((out / "spool").glob("rank-*"))  # the job runs on: its spools are kept
    finally:
        sidecar.send_signal(signal.SIGTERM)
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(job.pid).children(recursive=True):
                p.kill()
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=60)
        sidecar.wait(timeout=120)


def test_the_sidecar_killed_mid_run_and_restarted_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    out, store = tmp_path / "run", tmp_path / "store" / "trace.zarr"
    steps = ("--steps", "10", "--sleep-per-step", "0.5")
    job = subprocess.Popen(
        [
            *CLI,
            "record",
            "--out",
            str(out),
            "--no-collect",
            "--",
            *torchrun_cmd(
                2, EXAMPLE, "--save-params", str(tmp_path / "params-{rank}.pt"), *SMALL[2:], *steps
            ),
        ],
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )

    def start(log: Path) -> subprocess.Popen[str]:
        args = ("--no-ebpf", "--mode", "container", "--poll-interval-s", "0.2", "--exit-quiet-s", "2")
        cmd = sidecar_cmd(out, free_port(), *args, "--collect-interval-s", "1", "--store", str(store))
        with open(log, "w") as err:
            return subprocess.Popen(cmd, stderr=err, text=True, env=sidecar_env())

    first, second = tmp_path / "sidecar-1.log", tmp_path / "sidecar-2.log"
    try:
        sidecar = start(first)
        wait_for(
            "a collection while the job runs",
            lambda: "trace collected into" in first.read_text() or None,
            180,
        )
        sidecar.kill()  # no chance to finish anything it was writing
        sidecar.wait(timeout=60)
        assert job.poll() is None, "the job ended before the sidecar was killed: nothing was mid-run"
        sidecar = start(second)
        assert job.wait(timeout=300) == 0
        assert sidecar.wait(timeout=180) == 0, second.read_text()[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, 9)
    text = second.read_text()
    assert f"trace collected into {store} (2 ranks" in text, text[-3000:]
    assert "collected anew" not in text, text[-3000:]  # it went on from where the killed one stopped
    assert not list((out / "spool").glob("rank-*")), text[-3000:]  # deleted once the store held them whole
    summary = json.loads(run([*CLI, "inspect", str(store), "--json", "--verify"]).stdout)
    for r in summary["per_rank"]:  # every step and collective the agents counted, once
        assert r["steps"] == 10 and r["complete"], r
        assert r["collectives"] == r["end"]["colls"], (r["collectives"], r["end"])
    assert summary["verify"]["problems"] == [] and summary["verify"]["blobs"] > 0, summary["verify"]
    report = tmp_path / "replay-1"
    proc = run([*CLI, "replay", str(store), "--rank", "1", "--report", str(report)], check=False)
    assert proc.returncode == 0 and "rank 1: BIT-EXACT over steps 0..9" in proc.stdout, proc.stdout[-2000:]


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "small", "256k") as mnt:
        yield mnt


def test_a_full_store_disk_keeps_every_spool_counts_the_failure_and_a_later_store_gets_it_all(
    tmp_path: Path, full_disk: Path
) -> None:
    import signal

    out = tmp_path / "run"
    job = subprocess.Popen(
        [
            *CLI,
            "record",
            "--out",
            str(out),
            "--no-collect",
            "--",
            *torchrun_cmd(2, EXAMPLE, *SMALL[2:], "--steps", "8", "--sleep-per-step", "0.5"),
        ],
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    port = free_port()
    log = tmp_path / "sidecar-full.log"
    with open(log, "w") as err:
        args = ("--no-ebpf", "--poll-interval-s", "0.2", "--collect-interval-s", "1")
        cmd = sidecar_cmd(out, port, *args, "--store", str(full_disk / "trace.zarr"))
        sidecar = subprocess.Popen(cmd, stderr=err, text=True, env=sidecar_env())
    try:
        failures = "fsdp_replay_store_collection_failures_total"
        got = wait_metrics(port, "a failed collection", lambda s: s.get((failures, frozenset()), 0) >= 1, 180)
        assert got.get(("fsdp_replay_store_collections_total", frozenset()), 0) == 0
        assert job.wait(timeout=300) == 0
    finally:
        sidecar.send_signal(signal.SIGTERM)
        sidecar.wait(timeout=120)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, 9)
    text = log.read_text()
    assert "failed (the spools are kept" in text and "No space left on device" in text, text[-3000:]
    assert sorted(p.name for p in (out / "spool").glob("rank-*")) == ["rank-00000", "rank-00001"]

    store = tmp_path / "store" / "trace.zarr"  # room again: the next collection gets all of it
    done = _sidecar(out, str(store), sidecar_env())
    assert done.returncode == 0 and f"trace collected into {store} (2 ranks" in done.stderr, done.stderr[
        -3000:
    ]
    summary = json.loads(run([*CLI, "inspect", str(store), "--json"]).stdout)
    for r in summary["per_rank"]:
        assert r["steps"] == 8 and r["complete"] and r["collectives"] == r["end"]["colls"], r
    assert not list((out / "spool").glob("rank-*"))
