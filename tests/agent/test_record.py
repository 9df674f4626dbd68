"""Recording a real multi-process gloo FSDP run: what issue #2 says it must show."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psutil
import pytest
from harness import (
    CLI,
    EXAMPLE,
    REPO,
    assert_same_params,
    child_env,
    record,
    run,
    small_tmpfs,
    torchrun_cmd,
    train,
    training_ranks,
)

from fsdp_replay.analysis.summary import rank_summary, recording_cost
from fsdp_replay.trace import schema
from fsdp_replay.trace.reader import Trace

WORKLOADS = Path(__file__).parents[1] / "workloads"
SMALL = ("--steps", "6", "--layers", "2", "--d-model", "64", "--seq-len", "32")

pytestmark = pytest.mark.slow
FUNCTIONAL_TO_C10D = {
    "_c10d_functional.all_reduce": "allreduce_",
    "_c10d_functional.all_gather_into_tensor": "_allgather_base_",
    "_c10d_functional.reduce_scatter_tensor": "_reduce_scatter_base_",
    "_c10d_functional.broadcast": "broadcast_",
}


def recorded_ops(trace: Trace, rank: int) -> Counter[str]:
    r = trace.rank(rank)
    names = r.names("op")
    return Counter(names[c] for c in r.collectives["op"].tolist())


@pytest.mark.parametrize(
    ("nproc", "mode"),
    [(2, "fsdp2"), (2, "fsdp1"), (3, "fsdp2")],
)
def test_recorded_run_is_bit_identical(tmp_path: Path, nproc: int, mode: str) -> None:
    args = (*SMALL, "--fsdp1") if mode == "fsdp1" else SMALL
    plain = train(tmp_path, nproc, *args)
    rec, _ = record(tmp_path, nproc, *args, record_args=("--snapshot-every", "3"))
    assert_same_params(plain, rec, nproc)
    trace = Trace.open(rec / schema.TRACE_DIR)
    assert trace.ranks == list(range(nproc))
    assert trace.world_size == nproc
    for r in range(nproc):
        rt = trace.rank(r)
        assert len(rt.steps) == 6
        assert rt.attrs["end"]["reason"] == "exit"
        assert [s["step"] for s in rt.attrs["snapshots"]] == [0, 3, 6]
        assert rt.attrs["agent_errors"] == []
        # two micro-steps per step (the example's default gradient accumulation)
        assert rt.steps["micro_steps"].tolist() == [2] * 6


@pytest.mark.parametrize("mode", ["fsdp2", "fsdp1"])
def test_collectives_match_an_independent_count(tmp_path: Path, mode: str) -> None:
    """The profiler counts what gloo executed; the trace must hold exactly those collectives."""
    args = (*SMALL, "--fsdp1") if mode == "fsdp1" else SMALL
    wrapper = str(WORKLOADS / "profiled.py")
    plain_counts = tmp_path / "plain-counts"
    run(torchrun_cmd(2, wrapper, str(EXAMPLE), *args), env=child_env(COUNT_OUT=str(plain_counts)))
    rec_counts = tmp_path / "rec-counts"
    out = tmp_path / "rec"
    run(
        [
            *CLI,
            "record",
            "--out",
            str(out),
            "--payloads",
            "none",
            "--",
            *torchrun_cmd(2, wrapper, str(EXAMPLE), *args),
        ],
        env=child_env(COUNT_OUT=str(rec_counts)),
    )
    trace = Trace.open(out / schema.TRACE_DIR)
    for r in range(2):
        plain = json.loads((plain_counts / f"counts-{r}.json").read_text())
        rec = json.loads((rec_counts / f"counts-{r}.json").read_text())
        ops = recorded_ops(trace, r)
        # Same backend work with and without the agent, and the trace has one row per op call.
        assert rec["gloo"] == plain["gloo"]
        assert sum(ops.values()) == sum(plain["gloo"].values())
        # c10d ops one for one. A functional collective (clip_grad_norm_ on DTensors) runs its
        # c10d op below autograd: the trace has it once, under its functional name.
        expected = Counter({k.removeprefix("c10d::"): v for k, v in plain["c10d"].items()})
        folded = Counter()
        for name, n in ops.items():
            folded[FUNCTIONAL_TO_C10D.get(name, name)] += n
        assert folded == expected
        assert len(ops) >= 2  # an all-gather and a reduce-scatter flavour at least
        seq = trace.rank(r).collectives["seq"]
        assert seq.tolist() == list(range(len(seq)))


def test_identical_payloads_are_stored_once(tmp_path: Path) -> None:
    rec, _ = record(tmp_path, 2, *SMALL)
    trace = Trace.open(rec / schema.TRACE_DIR)
    digests: dict[int, list[str]] = {}
    for r in range(2):
        rt = trace.rank(r)
        t = rt.tensors
        outs = (t["role"] == 1) & (t["payload"] >= 0)
        assert outs.sum() == (t["role"] == 1).sum(), "policy 'all' stores every output"
        digests[r] = [rt.payload_digest(int(p)) for p in t["payload"][outs]]
        end = rt.attrs["end"]["counters"]
        assert end["agent_cpu_ns"] > 0 and end["writer_cpu_ns"] > 0  # the agent measures its own cost
        # ... and says where it went: every collective's hook, the payloads it stored inside them,
        # the step-0 snapshot; the parts fit in the whole (payloads and snapshots inside hooks)
        parts = {k: end[f"agent_cpu_{k}_ns"] for k in ("collectives", "tape", "payloads", "snapshots", "cxx")}
        assert parts["collectives"] > 0 and parts["payloads"] > 0 and parts["snapshots"] > 0, parts
        assert parts["collectives"] + parts["tape"] + parts["cxx"] <= end["agent_cpu_ns"], (parts, end)
        cost = recording_cost(rt)  # ... per step too, which inspect reports
        assert cost is not None and cost["agent_cpu_ms_per_step"] > 0 and cost["writer_cpu_ms_per_step"] >= 0
        # ... by part: the steps' cumulative columns never go back and stay within the whole, and
        # the statistic is reported for every part
        for k in parts:
            col = rt.steps[f"cpu_{k}_ns"]
            assert (col >= 0).all() and (np.diff(col) >= 0).all() and col[-1] <= end[f"agent_cpu_{k}_ns"], k
        assert (rt.steps["cpu_collectives_ns"] <= rt.steps["agent_cpu_ns"]).all()
        assert set(cost["agent_cpu_parts_ms"]) == set(parts) and cost["agent_cpu_parts_ms"]["collectives"] > 0
        # the install built the native fingerprint core, and the recording used it
        assert rank_summary(rt)["environment"]["fingerprint_algos"]["native_core"] is True
        # FSDP2 re-gathers the same parameters in backward: the agent writes those bytes once.
        assert end["blobs_deduplicated"] > 0
        assert len(set(digests[r])) < len(digests[r])
    # all-gather outputs are identical on both ranks: stored once for the whole trace
    all_digests = set(digests[0]) | set(digests[1])
    blob_arrays = {name for _, g in trace.root["blobs"].groups() for name in g.array_keys()}
    assert all_digests <= blob_arrays
    shared = set(digests[0]) & set(digests[1])
    assert shared, "expected all-gather outputs shared across ranks"
    rt = trace.rank(0)
    payload_rows = len(rt.payloads)
    assert payload_rows == len(set(rt.payload_digest(i) for i in range(payload_rows)))


def test_sigkill_mid_run_leaves_a_readable_trace(tmp_path: Path) -> None:
    out = tmp_path / "killed"
    cmd = [
        *CLI,
        "record",
        "--out",
        str(out),
        "--snapshot-every",
        "2",
        "--",
        *torchrun_cmd(2, EXAMPLE, *SMALL[2:], "--steps", "200", "--sleep-per-step", "0.3"),
    ]
    proc = subprocess.Popen(
        cmd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
    )
    assert proc.stdout is not None
    last = -1
    deadline = time.monotonic() + 240
    for line in proc.stdout:
        if line.startswith("step "):
            last = int(line.split()[1])
            if last >= 5:
                break
        assert time.monotonic() < deadline, "training did not reach step 5"
    victims = training_ranks(psutil.Process(proc.pid))
    assert len(victims) == 2
    for v in victims:
        v.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode != 0
    trace = Trace.open(out / schema.TRACE_DIR)
    for r in range(2):
        rt = trace.rank(r)
        steps = rt.steps["step"].tolist()
        # rank 0 printed `step N` after finishing optimizer step N; rank 1 is at most one behind
        done = last + 1 - r
        assert steps[:done] == list(range(done)), (r, steps, last)
        assert rt.attrs["end"] is None, "a killed rank has no end record"
    insp = run([*CLI, "inspect", str(out), "--json"])
    summary = json.loads(insp.stdout)
    assert all(not r["complete"] for r in summary["per_rank"])
    assert "INCOMPLETE" in err


def test_damaged_spool_and_chunk_give_clear_errors_and_lose_nothing_else(tmp_path: Path) -> None:
    rec, _ = record(tmp_path, 2, *SMALL, record_args=("--no-collect",))
    seg = sorted((rec / "spool" / "rank-00001").glob("seg-*.fsrs"))[-1]
    data = bytearray(seg.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4] = b"\xff\xff\xff\xff"
    seg.write_bytes(bytes(data))
    proc = run([*CLI, "collect", str(rec)], check=False)
    assert proc.returncode == 3
    assert str(seg) in proc.stderr and "checksum mismatch" in proc.stderr
    assert "Traceback" not in proc.stderr
    trace = Trace.open(rec / schema.TRACE_DIR)
    assert len(trace.rank(0).steps) == 6 and trace.rank(0).attrs["damage"] == []
    r1 = trace.rank(1)
    assert r1.attrs["damage"] and len(r1.collectives) > 0
    # Corrupt a Zarr chunk: inspect names the array, no traceback, exit code 3.
    chunk = rec / schema.TRACE_DIR / "rank_00000" / "collectives" / "op" / "c" / "0"
    chunk.write_bytes(b"\x00garbage" + chunk.read_bytes()[8:])
    bad = run([*CLI, "inspect", str(rec)], check=False)
    assert bad.returncode == 3, bad.stderr
    assert "rank_00000/collectives/op" in bad.stderr and "Traceback" not in bad.stderr
    # rank 1 is still fully readable
    ok = run([*CLI, "inspect", str(rec), "--rank", "1", "--json"])
    assert json.loads(ok.stdout)["per_rank"][0]["collectives"] == len(r1.collectives)


def test_internal_error_stops_recording_and_never_reaches_training(tmp_path: Path) -> None:
    plain = train(tmp_path, 2, *SMALL)
    rec, proc = record(tmp_path, 2, *SMALL, FSDP_REPLAY_INJECT_FAULT="coll:5")
    assert_same_params(plain, rec, 2)
    assert proc.stderr.count("internal error in collective") == 2, proc.stderr  # once per rank
    trace = Trace.open(rec / schema.TRACE_DIR)
    for r in range(2):
        rt = trace.rank(r)
        errors = rt.attrs["agent_errors"]
        assert len(errors) == 1 and "fault injected" in errors[0]["message"]
        assert len(rt.collectives) == 4  # the 5th raised inside the agent: recording stopped there
        assert rt.attrs["end"]["counters"]["agent_errors"] >= 1


def test_credentials_appear_nowhere_in_the_trace(tmp_path: Path) -> None:
    secrets = {
        "MY_SERVICE_TOKEN": "tok-4f1c9e2d7a5b",
        "NCCL_IB_PASSWORD": "pw-93c1d0aa",
        "HF_TOKEN": "hf_" + "a1B2c3D4e5F6g7H8i9J0kLmN",
        "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
        "TORCH_HOME": "https://alice:hunter2pw@example.invalid/cache",
    }
    argv_secret = "sk-" + "Zx9Yw8Vu7Ts6Rq5Po4Nm3"
    out = tmp_path / "secret"
    run(
        [
            *CLI,
            "record",
            "--out",
            str(out),
            "--",
            *torchrun_cmd(
                2,
                WORKLOADS / "tiny_train.py",
                "--api-key",
                "argv-key-77aa",
                f"--password={argv_secret}",
                "--steps",
                "2",
            ),
        ],
        env=child_env(**secrets),
    )
    needles = [*secrets.values(), "hunter2pw", argv_secret, "argv-key-77aa"]
    for path in out.rglob("*"):
        if path.is_file():
            blob = path.read_bytes()
            for n in needles:
                assert n.encode() not in blob, f"{n!r} leaked into {path}"
    meta = Trace.open(out / schema.TRACE_DIR).rank(0).meta
    assert schema.is_redacted(meta["env"]["NCCL_IB_PASSWORD"])
    assert schema.is_redacted(meta["env"]["MY_SERVICE_TOKEN"])  # every variable recorded, secrets redacted
    assert any(schema.is_redacted(a) for a in meta["argv"])


def test_sitecustomize_when_disabled_is_cheap_imports_no_torch_and_chains(tmp_path: Path) -> None:
    boot = REPO / "fsdp_replay" / "agent" / "boot"
    user = tmp_path / "user"
    user.mkdir()
    marker = tmp_path / "user-sitecustomize-ran"
    (user / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('yes')\n")
    env = child_env(PYTHONPATH=os.pathsep.join([str(boot), str(user)]))
    probe = "import sys; print('torch' in sys.modules, 'fsdp_replay' in sys.modules)"
    proc = run([sys.executable, "-X", "importtime", "-c", probe], env=env)
    assert proc.stdout.split() == ["False", "False"]
    assert marker.read_text() == "yes"
    # -X importtime reports each module's own import time in microseconds (cumulative column).
    costs = [
        int(line.split("|")[1])
        for line in proc.stderr.splitlines()
        if line.rstrip().endswith(" sitecustomize")
    ]
    assert costs and max(costs) < 50_000, proc.stderr[-2000:]
    # Enabled, it still chains to the user's sitecustomize and still imports no torch by itself.
    marker.unlink()
    env_on = {**env, "FSDP_REPLAY_MODE": "record", "FSDP_REPLAY_OUT": str(tmp_path / "x")}
    proc = run([sys.executable, "-c", probe], env=env_on)
    assert proc.stdout.split()[0] == "False"
    assert marker.read_text() == "yes"
    assert not (tmp_path / "x").exists(), "nothing is written by a process that never used torch"


def test_recorded_payloads_match_their_fingerprints(tmp_path: Path) -> None:
    rec, _ = record(tmp_path, 2, "--steps", "2", "--layers", "1", "--d-model", "32", "--seq-len", "16")
    rt = Trace.open(rec / schema.TRACE_DIR).rank(1)
    t = rt.tensors
    algos = rt.names("algo")
    rows = np.nonzero(t["payload"] >= 0)[0]
    assert len(rows) > 0
    for i in rows.tolist():
        data = rt.payload(int(t["payload"][i]), verify=(algos[int(t["algo"][i])], int(t["fp"][i])))
        assert len(data) == int(t["nbytes"][i])


def test_a_hang_killed_with_sigkill_still_shows_where_each_rank_waited(tmp_path: Path) -> None:
    """The writer thread notes a collective in flight for over 2 s; SIGKILL cannot erase that."""
    out = tmp_path / "hung"
    cmd = [
        *CLI,
        "record",
        "--out",
        str(out),
        "--payloads",
        "none",
        "--",
        *torchrun_cmd(
            2, EXAMPLE, *SMALL[2:], "--steps", "6", "--skip-collective-at-step", "2", "--skip-rank", "1"
        ),
    ]
    proc = subprocess.Popen(
        cmd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("step 1 "):
            break
    time.sleep(8)  # both ranks are now blocked in different collectives
    victims = training_ranks(psutil.Process(proc.pid))
    assert len(victims) == 2
    for v in victims:
        v.send_signal(signal.SIGKILL)
    proc.communicate(timeout=240)
    trace = Trace.open(out / schema.TRACE_DIR)
    for r in range(2):
        rt = trace.rank(r)
        assert rt.attrs["end"] is None
        stuck = rt.attrs["stuck"]
        assert stuck and stuck[-1]["waited_ns"] >= schema.STUCK_AFTER_NS, (r, stuck)
    # rank 0 waits in the loss all-reduce rank 1 skipped; rank 1 has moved on to step 3
    assert trace.rank(0).attrs["stuck"][-1]["op"] == "allreduce_"
    assert trace.rank(1).attrs["stuck"][-1]["step"] == 3
    report = run([*CLI, "desync", str(out), "--json"], check=False)
    assert report.returncode == 1
    doc = json.loads(report.stdout)
    assert all(r["in_flight"] is not None for r in doc["ranks"]), doc["ranks"]


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A 3 MiB tmpfs: a disk that fills up during a recording."""
    with small_tmpfs(tmp_path / "disk", "3m") as mnt:
        yield mnt


def test_a_full_disk_drops_payloads_first_and_keeps_every_event(tmp_path: Path, tiny_disk: Path) -> None:
    plain = train(tmp_path, 2, *SMALL)
    out = tiny_disk / "run"
    run(
        [
            *CLI,
            "record",
            "--out",
            str(out),
            "--no-collect",
            "--",
            *torchrun_cmd(2, EXAMPLE, "--save-params", str(tmp_path / "params-{rank}.pt"), *SMALL),
        ]
    )
    for r in range(2):  # the training itself was not disturbed
        import torch

        a = torch.load(plain / f"params-{r}.pt")
        b = torch.load(tmp_path / f"params-{r}.pt")
        assert all(torch.equal(a[k], b[k]) for k in a)
    trace_dir = tmp_path / "trace.zarr"
    proc = run([*CLI, "collect", str(out), "--trace", str(trace_dir)], check=False)
    assert proc.returncode == 0, proc.stderr
    assert "payloads dropped while recording (disk full" in proc.stderr
    trace = Trace.open(trace_dir)
    for r in range(2):
        rt = trace.rank(r)
        counters = rt.attrs["end"]["counters"]
        assert counters["blobs_dropped"] > 0 and counters["write_errors"] > 0
        assert counters["events_dropped"] == 0
        assert len(rt.steps) == 6  # metadata of every step survived
        assert (rt.tensors["payload"] < 0).any() and (rt.tensors["payload"] >= 0).any()


def test_a_full_writer_holds_the_training_back_and_drops_only_when_asked(tmp_path: Path) -> None:
    # A 1-byte pending bound, set in the environment (record builds the agent's environment from
    # its options: the variable must reach the agent, not be replaced by the option's default):
    # every payload waits for the writer to take the one before it (back-pressure, the default),
    # nothing is dropped, the waits are counted, and the rank replays BIT-EXACT. With
    # --when-full drop the same bound stores no payload at all, and says so.
    out = tmp_path / "wait"
    proc = run(
        [*CLI, "record", "--out", str(out), "--payloads", "all", "--", *torchrun_cmd(1, EXAMPLE, *SMALL)],
        env=child_env(FSDP_REPLAY_MAX_PENDING_BYTES="1"),
    )
    assert "dropped" not in proc.stderr, proc.stderr[-2000:]
    assert "with --payloads all a step stores" in proc.stderr and "its writer took" in proc.stderr, (
        proc.stderr
    )
    rt = Trace.open(out / schema.TRACE_DIR).rank(0)
    counters = rt.attrs["end"]["counters"]
    assert counters["blobs_dropped"] == 0 and counters["blobs"] > 0
    assert counters["payload_waits"] > 0 and counters["payload_wait_ns"] > 0, counters
    assert (rt.tensors["payload"] >= 0).any() and len(rt.steps) == 6
    text = run([*CLI, "inspect", str(out)]).stdout
    assert "recording waited" in text and "for its writer" in text, text
    replayed = run([*CLI, "replay", str(out), "--rank", "0"], check=False)
    assert replayed.returncode == 0 and "BIT-EXACT" in replayed.stdout, replayed.stdout[-2000:]
    out = tmp_path / "drop"
    proc = run(
        [*CLI, "record", "--out", str(out), "--when-full", "drop", "--", *torchrun_cmd(1, EXAMPLE, *SMALL)],
        env=child_env(FSDP_REPLAY_MAX_PENDING_BYTES="1"),
    )
    assert "payloads dropped while recording" in proc.stderr, proc.stderr[-2000:]
    rt = Trace.open(out / schema.TRACE_DIR).rank(0)
    assert rt.attrs["end"]["counters"]["blobs_dropped"] > 0
    assert (rt.tensors["payload"] < 0).all() and len(rt.steps) == 6
