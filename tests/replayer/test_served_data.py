"""A replay without the training data (#16): the recorded batches are served from the trace, with
the dataset's folder removed before the replay.

- The example reading token shards from a folder (its constructor lists and sizes them): with the
  folder gone, each rank replays BIT-EXACT, from the start and from a snapshot; the report says
  which paths were shown as recorded; ``--data live`` (run the program's own pipeline) cannot.
- A dataset that augments with the process's RNG in the main process: the batch row keeps the RNG
  state after the fetch, and the served replay is BIT-EXACT.
- A Hugging Face GPT-2 over FSDP2 reading its token shards from a folder, removed: BIT-EXACT.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from harness import CLI, EXAMPLE, REPO, child_env, record, run, torchrun_cmd

from fsdp_replay.trace.reader import Trace

pytestmark = pytest.mark.slow
TINY = ("--cpu", "--layers", "1", "--d-model", "32", "--seq-len", "16")
WORKLOADS = REPO / "tests" / "workloads"


def _replay(rec: Path, rank: int, *args: str, env: dict[str, str] | None = None) -> tuple[dict, str, int]:
    report = rec / f"report-{rank}-{'-'.join(a.strip('-') for a in args) or 'all'}"
    shutil.rmtree(report, ignore_errors=True)
    proc = run(
        [*CLI, "replay", str(rec), "--rank", str(rank), "--report", str(report), *args], check=False, env=env
    )
    doc = json.loads((report / "report.json").read_text()) if (report / "report.json").is_file() else {}
    return doc, proc.stdout + proc.stderr[-5000:], proc.returncode


def test_the_example_replays_with_its_data_folder_removed(tmp_path: Path) -> None:
    data = tmp_path / "data"
    run(
        [
            sys.executable,
            str(EXAMPLE),
            "--prepare-data",
            str(data),
            "--seq-len",
            "16",
            "--dataset-size",
            "256",
        ]
    )
    assert sorted(p.name for p in data.iterdir()) == ["shard-0000.bin", "shard-0001.bin"]
    rec, _ = record(
        tmp_path, 2, "--steps", "6", *TINY, "--data-dir", str(data), record_args=("--snapshot-every", "3")
    )
    shutil.rmtree(data)

    for rank in (0, 1):
        doc, out, code = _replay(rec, rank)
        assert code == 0 and doc["status"] == "bit-exact", out
        assert doc["verified_steps"] == list(range(6))
        assert any("the recorded run saw are not here" in n and str(data) in n for n in doc["notes"]), doc[
            "notes"
        ]
    doc, out, code = _replay(rec, 1, "--from-step", "4")
    assert code == 0 and doc["restored_snapshot"] == 3, out

    doc, out, code = _replay(rec, 1, "--data", "live")  # the program's own DataLoader needs the data
    assert code == 3 and doc["status"] == "error", out
    assert "recorded run read this file" in out or "No such file" in out


def test_a_record_cut_after_an_epoch_ends_the_replay_at_the_next_iterator(tmp_path: Path) -> None:
    """The agent stops after the 4th batch, the last of the first epoch (2 steps of 2 micro-batches
    a rank): the replay verifies steps 0..1 and ends where the program starts its next epoch,
    instead of running the program's own data pipeline over a folder that is not here."""
    data = tmp_path / "data"
    run(
        [sys.executable, str(EXAMPLE), "--prepare-data", str(data), "--seq-len", "16", "--dataset-size", "64"]
    )
    rec, _ = record(
        tmp_path, 2, "--steps", "4", *TINY, "--data-dir", str(data), FSDP_REPLAY_INJECT_FAULT="batch:5"
    )
    assert len(Trace.open(str(rec / "trace.zarr")).rank(0).table("batches")["rng"]) == 4
    shutil.rmtree(data)
    doc, out, code = _replay(rec, 0)
    assert code == 0 and doc["status"] == "bit-exact" and doc["verified_steps"] == [0, 1], out
    assert "ends at DataLoader iterator #1, after its last batch (4 recorded)" in out, out
    assert not any("own data pipeline" in n for n in doc["notes"]), doc["notes"]


def test_a_dataset_that_draws_the_process_rng_replays_served(tmp_path: Path) -> None:
    wl = WORKLOADS / "augment_train.py"
    out = tmp_path / "rec"
    run([*CLI, "record", "--out", str(out), "--", *torchrun_cmd(2, wl, "--steps", "4")])
    rows = Trace.open(str(out / "trace.zarr")).rank(1).table("batches")["rng"]
    assert len(rows) == 4 and (rows >= 0).all()  # every fetch drew: each kept the state after it
    for rank in (0, 1):
        doc, text, code = _replay(out, rank)
        assert code == 0 and doc["status"] == "bit-exact", text


def test_a_hugging_face_model_replays_with_its_data_folder_removed(tmp_path: Path) -> None:
    pytest.importorskip(
        "transformers", reason="the Hugging Face workload needs transformers (the test extras)"
    )
    env = child_env(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    wl = WORKLOADS / "hf_train.py"
    data = tmp_path / "tokens"
    subprocess.run([sys.executable, str(wl), "--prepare-data", str(data)], check=True, env=env, timeout=300)
    out = tmp_path / "rec"
    run(
        [
            *CLI,
            "record",
            "--out",
            str(out),
            "--snapshot-every",
            "2",
            "--",
            *torchrun_cmd(2, wl, "--data-dir", str(data)),
        ],
        env=env,
    )
    shutil.rmtree(data)
    for rank, args in ((1, ()), (0, ("--from-step", "3"))):
        doc, text, code = _replay(out, rank, *args, env=env)
        assert code == 0 and doc["status"] == "bit-exact", text
