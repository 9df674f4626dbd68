"""A workload we did not write: Hugging Face GPT-2 (tiny random config, no downloads) under FSDP2.

The model, its dropout, its loss and its LR schedule are transformers' code; tests/workloads/hf_train.py
only adds the usual loop (per-block ``fully_shard``, AdamW, dict batches from a DistributedSampler,
gradient accumulation without sync on the first micro-batch, gradient clipping). Recording must not
change the run, and each rank must replay alone bit for bit, from the start and from a snapshot.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
from harness import CLI, assert_same_params, child_env, run, torchrun_cmd

from fsdp_replay.trace import schema
from fsdp_replay.trace.reader import Trace

pytest.importorskip("transformers", reason="the Hugging Face workload needs transformers (the test extras)")

pytestmark = pytest.mark.slow
WORKLOAD = Path(__file__).parents[1] / "workloads" / "hf_train.py"
STEPS, ACCUM, BLOCKS = 4, 2, 2  # hf_train.py defaults: 4 optimizer steps of 2 micro-batches, 2 GPT-2 blocks
FSDP_GROUPS = BLOCKS + 1  # one fully_shard per block, plus the root (embeddings, tied lm_head, final norm)


def hf_env() -> dict[str, str]:
    return child_env(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")


def train_cmd(out: Path) -> list[str]:
    return torchrun_cmd(2, WORKLOAD, "--steps", str(STEPS), "--save-params", str(out / "params-{rank}.pt"))


def replay(rec: Path, rank: int, *args: str) -> tuple[dict, str, int]:
    report = rec / f"report-{rank}-{'-'.join(a.strip('-') for a in args) or 'all'}"
    shutil.rmtree(report, ignore_errors=True)
    proc = run(
        [*CLI, "replay", str(rec), "--rank", str(rank), "--report", str(report), *args],
        env=hf_env(),
        check=False,
    )
    doc = json.loads((report / "report.json").read_text()) if (report / "report.json").is_file() else {}
    return doc, proc.stdout[-3000:] + proc.stderr[-6000:], proc.returncode


def test_hf_gpt2_under_fsdp2_records_unchanged_and_every_rank_replays_bit_exact(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    run(train_cmd(plain), env=hf_env())
    rec = tmp_path / "rec"
    run([*CLI, "record", "--out", str(rec), "--snapshot-every", "2", "--", *train_cmd(rec)], env=hf_env())
    assert_same_params(plain, rec, 2)  # recording changed nothing, bit for bit

    # The trace looks like FSDP2 over transformers' model: gathers and reduce-scatters on one gloo group,
    # a reduce-scatter per FSDP group only on the micro-batch that syncs, dict batches, 2 micro-steps.
    insp = json.loads(run([*CLI, "inspect", str(rec), "--json"]).stdout)
    assert insp["world_size"] == 2 and insp["missing_ranks"] == []
    for per_rank in insp["per_rank"]:
        assert (
            per_rank["complete"] and per_rank["steps"] == STEPS and per_rank["micro_steps"] == STEPS * ACCUM
        )
        ops = Counter({e["op"]: e["count"] for e in per_rank["by_op"]})
        assert ops["_reduce_scatter_base_"] == STEPS * FSDP_GROUPS, ops
        assert ops["_allgather_base_"] > ops["_reduce_scatter_base_"], ops  # forward and backward gathers
        assert any("all_reduce" in op for op in ops), ops  # clip_grad_norm_ over the DTensor gradients
        assert per_rank["batches"] == STEPS * ACCUM and not per_rank["agent_errors"]
    assert (
        insp["collectives_by_op"]["_allgather_base_"] > 0
        and insp["collectives_by_op"]["_reduce_scatter_base_"] > 0
    )
    r1 = Trace.open(rec / schema.TRACE_DIR).rank(1)
    assert r1.attrs["structures"] == [
        {"d": [[{"v": "input_ids"}, {"T": 0}], [{"v": "attention_mask"}, {"T": 1}]]}
    ]
    assert r1.steps["micro_steps"].tolist() == [ACCUM] * STEPS

    for rank in range(2):
        doc, out, code = replay(rec, rank)
        assert code == 0, out
        assert doc["status"] == "bit-exact", out
        assert doc["verified_steps"] == list(range(STEPS))
        assert doc["collectives_verified"] == doc["recorded_collectives"] > 0
        assert doc["first_divergence"] is None
        assert f"BIT-EXACT over steps 0..{STEPS - 1}" in out

    doc, out, code = replay(rec, 1, "--from-step", "3")
    assert code == 0, out
    assert doc["status"] == "bit-exact", out
    assert doc["restored_snapshot"] == 2, out
    assert doc["verified_steps"] == [2, 3]
    assert doc["first_divergence"] is None
