"""On a CUDA device: fingerprints computed on the GPU, and record/replay of an NCCL run.

Run on a GPU machine with `bench/gpu_suite.sh` (which also runs the GPU benchmarks).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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


def _record(tmp: Path, name: str, args: tuple[str, ...] = ARGS) -> Path:
    out = tmp / name
    run(
        [
            *CLI,
            "record",
            "--out",
            str(out),
            "--snapshot-every",
            "2",
            "--",
            *torchrun_cmd(1, EXAMPLE, "--save-params", str(out / "params-{rank}.pt"), *args),
        ],
        env=child_env(),
    )
    return out


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


def test_without_deterministic_algorithms_the_replay_says_what_that_means(tmp_path: Path) -> None:
    rec = _record(tmp_path, "nondet", tuple(a for a in ARGS if a != "--deterministic"))
    report = rec / "replay"
    proc = run([*CLI, "replay", str(rec), "--rank", "0", "--report", str(report)], check=False)
    doc = json.loads((report / "report.json").read_text())
    assert doc["recorded_on_cuda"] is True
    assert proc.returncode in (0, 1)
    if proc.returncode == 1:  # kernels with atomics: the report must say so, not blame the data
        assert "use_deterministic_algorithms" in proc.stdout
    shutil.rmtree(rec, ignore_errors=True)
