"""On a CUDA device: fingerprints computed on the GPU, and record/replay of an NCCL run.

Run on a GPU machine with `bench/gpu_suite.sh` (which also runs the GPU benchmarks).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from harness import CLI, EXAMPLE, assert_same_params, child_env, run, torchrun_cmd

from fsdp_replay.trace import schema
from fsdp_replay.trace.reader import Trace

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
ARGS = ("--steps", "6", "--layers", "2", "--d-model", "128", "--seq-len", "64", "--deterministic")


def test_lin64_on_the_gpu_matches_the_numpy_reference() -> None:
    import torch

    from fsdp_replay.agent.fingerprint import fingerprint
    from fsdp_replay.trace.fingerprint import lin64

    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8):
        for n in (0, 1, 3, 1023, 1024, 1025, 1_000_003):
            t = (torch.randn(n, device="cuda") * 100).to(dtype)
            fp, nonfinite, algo = fingerprint(t, schema.FP_LIN64)
            assert algo == schema.FP_LIN64
            host = t.cpu().contiguous().view(torch.uint8).numpy()
            assert fp.value() == lin64(host), (dtype, n)
            assert nonfinite.value() is False
    t = torch.ones(10, device="cuda")
    t[3] = float("nan")
    assert fingerprint(t, schema.FP_LIN64)[1].value() is True
    assert fingerprint(t)[2] == schema.FP_LIN64  # 40 bytes: not whole sk64 rows


def _record(
    tmp: Path,
    name: str,
    args: tuple[str, ...] = ARGS,
    options: tuple[str, ...] = (),
    nproc: int = 1,
    env: dict[str, str] | None = None,
) -> Path:
    out = tmp / name
    run(
        [
            *CLI,
            "record",
            "--out",
            str(out),
            "--snapshot-every",
            "2",
            *("--payloads", "all"),  # (record's default on a GPU is the flight recorder)
            *options,
            "--",
            *torchrun_cmd(nproc, EXAMPLE, "--save-params", str(out / "params-{rank}.pt"), *args),
        ],
        env={**child_env(), **(env or {})},
    )
    return out


def _replay(rec: Path, rank: int, *args: str) -> tuple[int, str, dict]:
    report = rec / f"replay-{rank}{'-'.join(args)}"
    proc = run([*CLI, "replay", str(rec), "--rank", str(rank), "--report", str(report), *args], check=False)
    doc = json.loads((report / "report.json").read_text())
    verdict = "\n".join(line for line in proc.stdout.splitlines() if line.startswith(("rank ", "  ")))
    print(f"replay {rec.name} rank {rank} {' '.join(args)}:\n{verdict}")
    return proc.returncode, proc.stdout + proc.stderr[-3000:], doc


def test_a_recorded_gpu_run_is_bit_identical_and_replays_bit_exact(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    run(torchrun_cmd(1, EXAMPLE, "--save-params", str(plain / "params-{rank}.pt"), *ARGS), env=child_env())
    rec = _record(tmp_path, "rec")
    assert_same_params(plain, rec, 1)
    rt = Trace.open(rec / schema.TRACE_DIR).rank(0)
    assert (
        "cuda" in rt.names("device") and rt.names("algo") == [schema.FP_LIN64]
    ) or schema.FP_LIN64 in rt.names("algo")
    for args in ((), ("--from-step", "3")):
        report = rec / f"replay{'-'.join(args)}"
        proc = run([*CLI, "replay", str(rec), "--rank", "0", "--report", str(report), *args], check=False)
        doc = json.loads((report / "report.json").read_text())
        assert proc.returncode == 0 and doc["status"] == "bit-exact", proc.stdout + proc.stderr[-3000:]


# Default kernels (no deterministic mode), bf16 autocast, attention wide enough for the fused
# SDPA kernels: the configuration users run, whose backward kernels race.
DEFAULT_KERNELS = (
    *("--steps", "6", "--d-model", "1024", "--layers", "8", "--heads", "16", "--seq-len", "512"),
    *("--batch-size", "16", "--vocab", "8192", "--workers", "2"),
)
SNAPSHOTS = ("--snapshot-every", "3")


def test_the_table_installs_on_cuda_and_tapes_index_add() -> None:
    import torch

    from fsdp_replay.agent.tape import NONDETERMINISTIC_CUDA_OPS, start_tape

    class Seen:
        calls: list[str] = []

        def active(self) -> bool:
            return True

        def taped(self, name: str, call: object) -> object:
            self.calls.append(name)
            return call()  # type: ignore[operator]

    seen = Seen()
    tape, why = start_tape(seen, "", lambda w, e: pytest.fail(f"{w}: {e}"))
    assert tape is not None, why
    try:
        assert len({i.name.split(".")[0] for i in tape.installed}) >= len(NONDETERMINISTIC_CUDA_OPS) - 3
        dest = torch.zeros(64, 8, device="cuda")
        dest.index_add_(0, torch.randint(0, 64, (4096,), device="cuda"), torch.randn(4096, 8, device="cuda"))
        assert seen.calls and seen.calls[0].startswith("aten::index_add"), seen.calls
    finally:
        tape.uninstall()


def test_default_kernels_replay_bit_exact_with_the_recorded_results_injected(tmp_path: Path) -> None:
    # The taped results are about 0.8 GB a step here (the attention backward's dq, dk, dv): more
    # than the writer's default in-memory bound lets wait, and more than the default payload ring
    # holds (it drops what does not fit, counted), so this run raises both.
    env = {"FSDP_REPLAY_MAX_PENDING_BYTES": str(24 << 30), "FSDP_REPLAY_PAYLOAD_RING_BYTES": str(8 << 30)}
    rec = _record(tmp_path, "tape", DEFAULT_KERNELS, SNAPSHOTS, env=env)
    summary = json.loads(run([*CLI, "inspect", str(rec), "--json"]).stdout)
    tape = summary["per_rank"][0]["tape"]
    print("taped ops:", json.dumps(tape), "payload bytes:", summary["per_rank"][0]["payload_bytes"])
    assert tape["calls"] > 0 and tape["with_payload"] == tape["outputs"], tape  # nothing dropped
    for args in ((), ("--from-step", "4")):
        code, text, doc = _replay(rec, 0, *args)
        assert code == 0 and doc["status"] == "bit-exact", text
        injected = sum(doc["injected"].values())
        assert doc["tape_calls"] > 0 and injected > 0, doc
        if not args:  # the whole run: every taped output either matched or was injected
            assert doc["tape_matched"] + injected == tape["outputs"], doc
            # most compute the same bits again (the embedding backward always): the replay's
            # fingerprints (torch ops) equal the recording's (one Triton launch per call)
            assert doc["tape_matched"] > 0, doc


def test_without_the_tape_default_kernels_diverge_and_the_report_says_why(tmp_path: Path) -> None:
    rec = _record(tmp_path, "notape", DEFAULT_KERNELS, (*SNAPSHOTS, "--no-tape"))
    code, text, doc = _replay(rec, 0)
    assert doc["recorded_on_cuda"] is True and doc["tape_calls"] == 0
    if code == 1:  # kernels with atomics: the report must say so, not blame the data
        assert "use_deterministic_algorithms" in text and "--no-tape" in text, text
    else:
        assert code == 0, text


def test_without_stored_results_a_differing_kernel_is_named(tmp_path: Path) -> None:
    rec = _record(tmp_path, "fponly", DEFAULT_KERNELS, (*SNAPSHOTS, "--tape-payloads", "none"))
    summary = json.loads(run([*CLI, "inspect", str(rec), "--json"]).stdout)
    r0 = summary["per_rank"][0]
    if r0["environment"]["fingerprint_algos"].get("cxx_tape"):  # no stored results: C++ records the calls
        counters = r0["end"]["counters"]
        print(
            "C++ tape:", counters["tape_cxx_calls"], "calls,", counters["tape_cxx_deferred"], "left to Python"
        )
        assert counters["tape_cxx_calls"] > 0 and counters["tape_cxx_deferred"] == 0, counters
    code, text, doc = _replay(rec, 0)
    assert code in (0, 1), text
    if code == 1:  # a taped kernel computed other bits: named there, not several ops later
        first = doc["first_divergence"]
        assert first["kind"] == "nondeterministic_kernel", first
        assert "a known nondeterministic kernel computed another result" in text
    assert not doc["injected"]


def test_two_ranks_on_one_gpu_over_gloo_replay_bit_exact_with_default_kernels(tmp_path: Path) -> None:
    rec = _record(tmp_path, "two", (*DEFAULT_KERNELS, "--layers", "4", "--one-gpu"), SNAPSHOTS, nproc=2)
    summary = json.loads(run([*CLI, "inspect", str(rec), "--json"]).stdout)
    ops = {row["op"] for row in summary["per_rank"][0]["by_op"]}
    assert {"_allgather_base_", "_reduce_scatter_base_"} & ops or "allgather_into_tensor_coalesced_" in ops, (
        ops
    )
    for rank in (0, 1):
        code, text, doc = _replay(rec, rank)
        assert code == 0 and doc["status"] == "bit-exact", text
    shutil.rmtree(rec, ignore_errors=True)


WORKLOADS = Path(__file__).parents[1] / "workloads"


def _record_script(
    tmp: Path, name: str, script: str, args: tuple[str, ...], options: tuple[str, ...]
) -> Path:
    out = tmp / name
    cmd = [*CLI, "record", "--out", str(out), "--payloads", "all", *options, "--"]
    run([*cmd, *torchrun_cmd(1, str(WORKLOADS / script), *args)], env=child_env())
    return out


def test_a_transformers_llama_with_default_kernels_replays_bit_exact_and_its_key_matches(
    tmp_path: Path,
) -> None:
    pytest.importorskip("transformers", reason="the Llama workload needs transformers")
    rec = _record_script(
        tmp_path,
        "llama",
        "llama_train.py",
        ("--steps", "5", "--save-params", str(tmp_path / "llama" / "params-{rank}.pt")),
        ("--snapshot-every", "2", "--max-pending-bytes", str(24 << 30)),
    )
    key = Trace.open(rec / schema.TRACE_DIR).rank(0).meta["numerics"]
    print("replay key:", json.dumps(key))
    assert key["device"]["kind"] == "cuda" and key["device"]["sm_count"] > 0 and key["libraries"]["cublas"], (
        key
    )
    summary = json.loads(run([*CLI, "inspect", str(rec), "--json"]).stdout)
    tape = summary["per_rank"][0]["tape"]
    print("llama taped ops:", json.dumps(tape))
    assert tape["with_payload"] == tape["outputs"], tape
    for args in ((), ("--from-step", "3")):
        code, text, doc = _replay(rec, 0, *args)
        assert code == 0 and doc["status"] == "bit-exact", text
        assert doc["numerics"] == {"compared": True, "mismatches": []}, doc["numerics"]
        assert doc["tape_matched"] + sum(doc["injected"].values()) <= tape["outputs"], doc


def test_a_racy_index_add_in_the_model_is_named_by_op_fingerprints(tmp_path: Path) -> None:
    # Not taped (--no-tape): the atomics of index_add over duplicate indices give other sums in the
    # replay, and the op check names that op (the tape would have injected its recorded result).
    rec = _record_script(
        tmp_path,
        "racy",
        "compiled_train.py",
        ("--device", "cuda", "--no-compile"),
        ("--no-tape", "--op-fingerprints", "steps:0-2"),
    )
    code, text, doc = _replay(rec, 0)
    assert code == 1 and doc["status"] == "diverged", text
    op = doc["op_finding"]
    assert op is not None and op["kind"] == "op_result" and op["op"].startswith("aten::index_add"), (op, text)
    assert op["module"] == "module" and op["step"] == 0, op
    assert "earliest op that differs: aten::index_add" in text


def test_compiled_code_on_the_gpu_is_named_with_its_generated_kernels(tmp_path: Path) -> None:
    rec = _record_script(tmp_path, "compiled", "compiled_train.py", ("--device", "cuda"), ())
    summary = json.loads(run([*CLI, "inspect", str(rec), "--json"]).stdout)
    c = summary["per_rank"][0]["compiled"]
    print("compiled on cuda:", json.dumps(c))
    assert c and "cuda" in c["devices"] and c["steps"] == [0, 1, 2], c
    assert any(k.startswith("triton_") and "index_add" in k for k in c["nondeterministic"]), c
    code, text, doc = _replay(rec, 0)
    assert code in (0, 1) and doc["compiled"]["graphs"] == c["graphs"], text
    assert "generated kernels that do the work of nondeterministic ops: triton_" in text, text


def test_replay_from_a_late_snapshot_skips_the_model_on_the_gpu(tmp_path: Path) -> None:
    """#16 on CUDA: default kernels, bf16; a replay from step 20 computes steps 0-1, runs 2-19
    without kernels (a witness below the fast-forward's dispatch mode counts what computed) and is
    BIT-EXACT with the taped results of steps 20-21 injected. Both reach times are printed: the
    fast-forward, and every step computed (--fast-forward-warmup 20) as before."""
    args = (
        *("--steps", "22", "--d-model", "512", "--layers", "4", "--heads", "8", "--seq-len", "256"),
        *("--batch-size", "8", "--vocab", "8192", "--workers", "2"),
    )
    out = tmp_path / "late"
    wrapper = WORKLOADS / "count_kernels.py"
    run(
        [
            *CLI,
            "record",
            "--out",
            str(out),
            "--snapshot-every",
            "10",
            "--payloads",
            "steps:20-21",
            "--max-pending-bytes",
            str(24 << 30),
            "--",
            *torchrun_cmd(1, str(wrapper), str(EXAMPLE), *args),
        ],
        env=child_env(),
    )
    counters = Trace.open(out / schema.TRACE_DIR).rank(0).attrs["end"]["counters"]
    # the snapshots of steps 10 and 20 were copied off the training stream (step 0's on it)
    assert (counters["snapshots_sync_copied"], counters["snapshots_torn"]) == (1, 0), counters
    assert counters["snapshot_pinned_bytes"] > 0, counters
    times = {}
    for warm in ("2", "20"):
        counts = tmp_path / f"counts-{warm}.jsonl"
        report = out / f"replay-warm{warm}"
        proc = run(
            [
                *CLI,
                "replay",
                str(out),
                "--rank",
                "0",
                "--from-step",
                "20",
                "--to-step",
                "21",
                "--report",
                str(report),
                "--fast-forward-warmup",
                warm,
            ],
            env=child_env(COUNT_KERNELS_OUT=str(counts)),
            check=False,
        )
        doc = json.loads((report / "report.json").read_text())
        text = proc.stdout + proc.stderr[-3000:]
        assert proc.returncode == 0 and doc["status"] == "bit-exact", text
        ff = doc["fast_forward"]
        times[warm] = ff
        print(f"fast-forward warm-up {warm}:", json.dumps(ff))
        # in the temp folder the file is the replay's own; elsewhere its private copy (files/...)
        written = counts if counts.is_file() else next(report.joinpath("files").rglob(counts.name), None)
        rows = [json.loads(line) for line in written.read_text().splitlines()] if written else []
        if warm == "2":
            assert ff["computed_steps"] == 2 and ff["skipped_steps"] == 18, ff
            # (step 19's row also holds the restore's copies: the snapshot is loaded in its hook)
            assert rows and all(r["big"] == 0 for r in rows if 2 <= r["step"] < 19), rows
    print(
        "reach step 20: skipped", times["2"]["seconds"], "s; every step computed", times["20"]["seconds"], "s"
    )


def test_a_nan_on_the_gpu_dumps_the_window_through_the_payload_ring_and_it_replays_bit_exact(
    tmp_path: Path,
) -> None:
    # #13's flight recorder with device payloads (collective outputs, the tape's results):
    # copied through their GPU's payload ring into pinned memory of their own, written at the NaN;
    # two ranks on the one GPU over gloo, so that the collectives' outputs are CUDA tensors too
    out = tmp_path / "flight"
    args = ("--steps", "12", "--layers", "2", "--d-model", "128", "--seq-len", "64")
    proc = run(
        [
            *CLI,
            "record",
            "--out",
            str(out),
            *("--payloads", "window:4", "--snapshot-every", "2", "--"),
            *torchrun_cmd(
                2, EXAMPLE, *args, "--one-gpu", "--nan-at-step", "9", "--nan-rank", "1", "--stop-on-nan"
            ),
        ],
        env=child_env(),
        check=False,
    )
    assert proc.returncode != 0 and "FloatingPointError" in proc.stderr, proc.stderr[-3000:]
    rt = Trace.open(out / schema.TRACE_DIR).rank(1)
    dumps = rt.attrs["flight_dumps"]
    print("flight dumps:", json.dumps(dumps))
    assert dumps[0]["reason"] == "nonfinite" and (dumps[0]["first_step"], dumps[0]["last_step"]) == (4, 9), (
        dumps
    )
    assert dumps[0]["blobs"] > 0 and all(d["dropped"] == 0 for d in dumps), dumps
    counters = rt.attrs["end"]["counters"]
    assert counters["flight_ring_landed"] > 0 and counters["flight_ring_full_drops"] == 0, counters
    # the tape's CUDA calls were recorded by its C++ hook, which kept their outputs (session 15):
    # every taped output of the dumped steps has its bytes, none of the healthy steps before
    if counters.get("tape_cxx_calls", 0):
        assert counters["tape_cxx_kept"] > 0 and counters["tape_cxx_keep_dropped"] == 0, counters
    tape, tt = rt.table("tape"), rt.table("tape_tensors")
    tape_steps = tape["step"][tt["call"]] if len(tt) else np.zeros(0, dtype=np.int64)
    dumped = (tape_steps >= 4) & (tape_steps <= 9)
    print(
        "taped outputs in steps 4..9:",
        int(dumped.sum()),
        "with bytes:",
        int((tt["payload"][dumped] >= 0).sum()),
    )
    assert dumped.any() and (tt["payload"][dumped] >= 0).all()
    assert not (tt["payload"][tape_steps < 4] >= 0).any()
    outs = rt.tensors["role"] == schema.ROLE_OUTPUT
    steps = rt.collectives["step"][rt.tensors["coll"]]
    assert set(steps[outs & (rt.tensors["payload"] >= 0)].tolist()) >= set(range(4, 10))
    assert not set(steps[outs & (rt.tensors["payload"] >= 0)].tolist()) & set(range(4))
    code, text, doc = _replay(out, 1, "--from-step", "4", "--to-step", "9")
    assert code == 0 and doc["status"] == "bit-exact", text
    assert doc["verified_steps"] == list(range(4, 10)), text
    assert counters["snapshots_torn"] == 0 and counters["snapshots_sync_copied"] == 1, counters


def test_snapshots_are_copied_off_the_training_stream_and_a_torn_one_is_left_out(tmp_path: Path) -> None:
    """A snapshot after step 1 is copied into pinned memory on a side stream while the next step
    runs, and settled at the next optimizer.step(). A program that clamps its parameters in place
    right after optimizer.step() from step 5 on changes the state the step-8 snapshot was copying:
    that snapshot is left out (counted, said), the later ones are copied on the program's stream,
    and replays from the step-4 snapshot (copied off the stream) and across the missing one are
    BIT-EXACT."""
    out = tmp_path / "torn"
    args = ("--steps", "12", "--layers", "2", "--d-model", "128", "--seq-len", "64", "--clamp-from-step", "5")
    proc = run(
        [
            *CLI,
            "record",
            "--out",
            str(out),
            "--payloads",
            "all",
            "--snapshot-every",
            "4",
            "--",
            *torchrun_cmd(1, EXAMPLE, *args),
        ],
        env=child_env(),
    )
    assert "changed its parameters or optimizer state in place" in proc.stderr, proc.stderr[-3000:]
    rt = Trace.open(out / schema.TRACE_DIR).rank(0)
    counters = rt.attrs["end"]["counters"]
    assert (counters["snapshots_torn"], counters["snapshots_sync_copied"]) == (1, 2), counters
    assert [sn["step"] for sn in rt.attrs["snapshots"]] == [0, 4, 12]
    for first in ("4", "9"):  # 9: from the step-4 snapshot, the step-8 one being left out
        code, text, doc = _replay(out, 0, "--from-step", first)
        assert code == 0 and doc["status"] == "bit-exact", text
