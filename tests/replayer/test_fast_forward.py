"""Reaching step S without computing the steps before it (``replayer/fastforward.py``), and the
recorded batches served without the dataset (``replayer/serve.py``): issue #16."""

from __future__ import annotations

import collections
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fsdp_replay.agent.batches import encode_structure
from fsdp_replay.replayer.fastforward import SMALL, FastForwardError, Placeholders, RootSkip, is_placeholder
from fsdp_replay.replayer.serve import Unservable, decode_structure

BIG = SMALL * 4


class Witness(TorchDispatchMode):
    """Below the fast-forward's mode: sees only the ops that reach a kernel; keeps those that
    compute on a tensor of more than SMALL elements."""

    def __init__(self) -> None:
        super().__init__()
        self.big: list[str] = []
        self.all: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.all.append(str(func))
        tensors = [a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, torch.Tensor)]
        if not func.is_view and any(t.numel() > SMALL for t in tensors):
            self.big.append(str(func))
        return func(*args, **(kwargs or {}))


def _failures() -> tuple[list[tuple[str, BaseException]], Any]:
    seen: list[tuple[str, BaseException]] = []
    return seen, lambda where, exc: seen.append((where, exc))


def test_big_ops_are_placeholders_and_never_reach_a_kernel() -> None:
    x = torch.randn(BIG)
    w = torch.randn(64, BIG // 64)
    witness = Witness()
    with witness, Placeholders(lambda *_: None) as mode:
        y = torch.nn.functional.gelu(x * 2 + 1)
        z = w @ w.t()  # (64, 64): small output of big inputs
        x.add_(5)  # in place: changes nothing
        f = torch.ones(BIG)  # a big factory
        s = torch.ones(3) * 2  # small and real: computed
    assert is_placeholder(y) and y.shape == x.shape and y.dtype == x.dtype
    assert not is_placeholder(z) and torch.equal(z, torch.zeros(64, 64))  # a small result stands for zeros
    assert is_placeholder(f) and f.shape == (BIG,)
    assert torch.equal(s, torch.full((3,), 2.0))
    assert mode.placeholder_ops >= 6 and mode.small_ops >= 1
    assert witness.big == [] and "aten.mul.Tensor" in witness.all, witness.all  # the small product computed


def test_a_copy_to_another_device_or_dtype_is_a_placeholder_there() -> None:
    x = torch.randn(BIG)
    with Placeholders(lambda *_: None):
        y = x.to("meta" if not torch.cuda.is_available() else "cuda", non_blocking=True)
        z = x.to(torch.bfloat16)
        w = x.to(device="cpu", dtype=torch.float64, copy=True)
    assert is_placeholder(y) and y.shape == x.shape
    assert is_placeholder(z) and z.dtype == torch.bfloat16
    assert is_placeholder(w) and w.dtype == torch.float64 and w.device.type == "cpu"


def test_reads_of_placeholder_values_give_zero_and_small_bookkeeping_computes() -> None:
    logits = torch.randn(16, BIG // 16, requires_grad=True)
    with Placeholders(lambda *_: None):
        loss = torch.nn.functional.cross_entropy(logits, torch.zeros(16, dtype=torch.long))
        acc = torch.zeros(())
        acc += loss.detach()
        step = torch.tensor(3.0)
        step += 1
        finite = bool(torch.isfinite(loss))
        value = loss.item()
        loss.backward()
    assert value == 0.0 and finite  # zeros: finite, no NaN, nothing to skip a step for
    assert step.item() == 4.0  # an optimizer's step counter still counts
    assert logits.grad is not None and is_placeholder(logits.grad)


def test_an_op_without_a_shape_function_stops_with_a_clear_error() -> None:
    seen, fail = _failures()
    x = torch.randn(BIG)
    with pytest.raises(FastForwardError, match="nonzero"), Placeholders(fail):
        torch.nonzero(x > 0)  # its output size depends on the values
    assert seen and seen[0][0] == "fast-forward"


def test_root_calls_with_known_inputs_are_answered_without_running_the_model() -> None:
    calls = collections.Counter[str]()

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 4)

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            calls["forward"] += 1
            return {"out": self.lin(x), "n": x.shape[0]}  # type: ignore[dict-item]

    news: list[int] = []
    roots = RootSkip(lambda *_: None, lambda: None, lambda: news.append(1))
    model = Model()
    roots.install()
    try:
        first = model(torch.randn(2, 8))  # learnt while steps compute
        roots.skipping = True
        second = model(torch.randn(2, 8))
        assert calls["forward"] == 1 and roots.skipped == 1
        assert second["n"] == 2 and second["out"].shape == first["out"].shape
        assert second["out"].requires_grad and second["out"].grad_fn is None  # a leaf: backward still runs
        second["out"].sum().backward()
        model(torch.randn(3, 8))  # inputs of a new shape: computed, and the rest of the step too
        assert calls["forward"] == 2 and news == [1]
    finally:
        roots.uninstall()
    assert torch.nn.Module.__call__ is not None and model(torch.randn(2, 8))["n"] == 2
    assert calls["forward"] == 3  # uninstalled: calls run as usual


def test_batch_structures_round_trip_with_their_types() -> None:
    Pair = collections.namedtuple("Pair", ["a", "b"])

    class Encoding(dict):  # a dict subclass, like transformers' BatchEncoding
        pass

    batch = {
        "ids": torch.arange(4),
        "pair": Pair(torch.ones(2), [torch.zeros(1), 3, "x"]),
        "nested": (torch.eye(2), None),
    }
    leaves: list[torch.Tensor] = []
    encoded = encode_structure(batch, leaves)
    back = decode_structure(json.loads(json.dumps(encoded)), leaves)
    assert back.keys() == batch.keys() and torch.equal(back["ids"], batch["ids"])
    assert type(back["pair"]).__name__ == "Pair" and back["pair"].b[1:] == [3, "x"]
    assert back["nested"][1] is None and torch.equal(back["nested"][0], torch.eye(2))
    typed = encode_structure(Encoding(x=torch.ones(1)), leaves := [])
    assert typed["c"].endswith("Encoding")  # a class defined in a function: not importable here
    with pytest.raises(Unservable):
        decode_structure(typed, leaves)
    from collections import OrderedDict

    from torch.utils.data._utils.collate import default_collate  # an importable dict subclass

    ordered = encode_structure(default_collate([OrderedDict(a=torch.ones(1))]), leaves := [])
    assert type(decode_structure(ordered, leaves)) is OrderedDict
    with pytest.raises(Unservable):
        decode_structure({"o": "<object at 0x1>"}, [])


# ---------------------------------------------------------------------------------------------
# A 1,000-step trace, replayed from step 900


@pytest.fixture(scope="module")
def long_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from harness import EXAMPLE, REPO, record

    tmp = tmp_path_factory.mktemp("ff")
    wrapper = REPO / "tests" / "workloads" / "count_kernels.py"
    rec, _ = record(
        tmp,
        2,
        "--cpu",
        "--steps",
        "1000",
        "--layers",
        "1",
        "--d-model",
        "32",
        "--heads",
        "2",
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--grad-accum",
        "1",
        "--workers",
        "0",
        record_args=("--snapshot-every", "100", "--payloads", "steps:900-905"),
        script=(str(wrapper), str(EXAMPLE)),
    )
    return rec


def _replay_counted(rec: Path, rank: int, *args: str) -> tuple[dict[str, Any], dict[int, int], str]:
    from harness import CLI, child_env, run

    report = rec / f"ff-{rank}-{'-'.join(args)}"
    shutil.rmtree(report, ignore_errors=True)
    counts = report.parent / f"{report.name}-counts.jsonl"
    counts.unlink(missing_ok=True)
    proc = run(
        [*CLI, "replay", str(rec), "--rank", str(rank), "--report", str(report), *args],
        env=child_env(COUNT_KERNELS_OUT=str(counts)),
        check=False,
    )
    out = proc.stdout + proc.stderr[-5000:]
    doc = json.loads((report / "report.json").read_text())
    # in the temp folder the file is the replay's own; elsewhere its private copy (files/...)
    written = counts if counts.is_file() else next(report.joinpath("files").rglob(counts.name), None)
    assert written is not None, out
    rows = [json.loads(line) for line in written.read_text().splitlines()]
    big = {r["step"]: r["big"] for r in rows}
    return doc, big, out


@pytest.mark.slow
def test_from_step_900_of_1000_computes_no_step_before_it_after_the_warm_up(long_run: Path) -> None:
    doc, big, out = _replay_counted(long_run, 0, "--from-step", "900", "--to-step", "905")
    assert doc["status"] == "bit-exact", out
    assert doc["verified_steps"] == list(range(900, 906))
    ff = doc["fast_forward"]
    assert ff["computed_steps"] == 2 and ff["skipped_steps"] == 898, ff
    assert ff["root_calls_skipped"] == 898 and ff["steps_computed_for_new_inputs"] == 0  # one call a step
    assert "reached step 900 in" in out and "898 steps run without kernels" in out
    assert big[0] > 0 and big[1] > 0  # the warm-up computes: the witness sees the model's kernels
    assert all(big.get(s, 0) == 0 for s in range(2, 900)), {
        s: n for s, n in big.items() if 2 <= s < 900 and n
    }
    assert all(big[s] > 0 for s in range(900, 905))  # (the replay ends inside step 905's hook)


@pytest.mark.slow
def test_no_warm_up_computes_only_the_first_step_and_stays_bit_exact(long_run: Path) -> None:
    doc, big, out = _replay_counted(
        long_run, 1, "--from-step", "900", "--to-step", "902", "--fast-forward-warmup", "0"
    )
    assert doc["status"] == "bit-exact", out
    ff = doc["fast_forward"]
    # the model's first call has no known outputs: that step computes (frameworks set up there)
    assert ff["computed_steps"] == 0 and ff["steps_computed_for_new_inputs"] == 1, ff
    assert ff["skipped_steps"] == 899
    assert all(big.get(s, 0) == 0 for s in range(1, 899))


@pytest.mark.slow
def test_ddp_reaches_a_late_snapshot_with_its_buckets_rebuilt_as_recorded(tmp_path: Path) -> None:
    """DDP exchanges parameter shapes when it is built and its rebuilt buckets after the first
    backward: small payloads, kept whatever the payload window (``SMALL_PAYLOAD_BYTES``), so the
    warm-up steps rebuild the buckets the recorded run used and step 20 replays BIT-EXACT."""
    from harness import record

    rec, _ = record(
        tmp_path,
        2,
        "--cpu",
        "--ddp",
        "--steps",
        "22",
        "--layers",
        "1",
        "--d-model",
        "32",
        "--seq-len",
        "16",
        record_args=("--snapshot-every", "10", "--payloads", "steps:20-21"),
    )
    from harness import CLI, run

    for rank in (0, 1):
        report = rec / f"from20-{rank}"
        proc = run(
            [*CLI, "replay", str(rec), "--rank", str(rank), "--from-step", "20", "--report", str(report)],
            check=False,
        )
        doc = json.loads((report / "report.json").read_text())
        out = proc.stdout + proc.stderr[-4000:]
        assert proc.returncode == 0 and doc["status"] == "bit-exact" and doc["verified_steps"] == [20, 21], (
            out
        )
        assert doc["fast_forward"]["skipped_steps"] == 18, doc["fast_forward"]
