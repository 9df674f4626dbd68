"""The nondeterministic-kernel tape (#12): record what a racy op computed, inject it in the replay.

On the CPU the mechanism is exercised with a planted racy op (``tests/workloads/racy_train.py``:
a kernel that sums in a random order drawn from the OS, as atomics do on a GPU); the GPU tests
(tests/system/test_gpu.py) exercise the real CUDA ops of the table.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from harness import CLI, REPO, run, torchrun_cmd

from fsdp_replay.agent.tape import (
    NONDETERMINISTIC_CUDA_OPS,
    OpTape,
    agent_work,
    overloads,
    start_tape,
    tape_ops,
)

RACY = REPO / "tests" / "workloads" / "racy_train.py"
OP = "fsdpr_test::racy_mix"


def test_every_op_of_the_table_exists_in_this_torch_with_its_overloads() -> None:
    missing = [op.name for op in NONDETERMINISTIC_CUDA_OPS if not overloads(op)]
    assert not missing, f"the tape names ops this torch ({torch.__version__}) does not have: {missing}"
    names = [op.name for op in NONDETERMINISTIC_CUDA_OPS]
    assert len(names) == len(set(names))
    assert all(op.source and op.keys == ("CUDA",) for op in NONDETERMINISTIC_CUDA_OPS)
    # forward and backward ops are taped by their own names
    for must in ("aten::index_add_", "aten::scatter_add_", "aten::_flash_attention_backward", "aten::cumsum"):
        assert must in names


def test_the_users_ops_are_taped_on_cpu_and_cuda() -> None:
    user = tape_ops("my_ext::racy, other::op")[-2:]
    assert [(o.name, o.keys) for o in user] == [
        ("my_ext::racy", ("CPU", "CUDA")),
        ("other::op", ("CPU", "CUDA")),
    ]


class _Counting:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def active(self) -> bool:
        return True

    def taped(self, name: str, call: object) -> object:
        self.calls.append(name)
        return call()  # type: ignore[operator]


def test_the_wrapper_sees_the_op_runs_it_unchanged_and_steps_aside_for_agent_work() -> None:
    lib = torch.library.Library("fsdpr_tape_unit", "DEF")
    lib.define("double(Tensor x) -> Tensor")
    lib.impl("double", lambda x: x * 2, "CPU")
    handler = _Counting()
    tape = OpTape(handler, tape_ops("fsdpr_tape_unit::double")[-1:], lambda w, e: pytest.fail(f"{w}: {e}"))
    assert [i.name for i in tape.install()] == ["fsdpr_tape_unit::double"]
    try:
        x = torch.arange(4.0)
        assert torch.equal(torch.ops.fsdpr_tape_unit.double(x), x * 2)
        assert handler.calls == ["fsdpr_tape_unit::double"]
        with agent_work():  # the agent's own calls are not the program's
            torch.ops.fsdpr_tape_unit.double(x)
        torch.use_deterministic_algorithms(True)
        try:  # deterministic mode picks deterministic kernels: nothing taped
            torch.ops.fsdpr_tape_unit.double(x)
        finally:
            torch.use_deterministic_algorithms(False)
        assert len(handler.calls) == 1
    finally:
        tape.uninstall()
    torch.ops.fsdpr_tape_unit.double(torch.arange(2.0))
    assert len(handler.calls) == 1  # uninstalled: the original kernel again


def test_calls_made_while_a_cuda_graph_is_captured_are_counted_not_taped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The graph runs their kernels later, at each launch: neither side can read what they compute.
    On the CPU the capture is stood in for; the gpu test below captures a real graph."""
    import fsdp_replay.agent.tape as tape_mod

    lib = torch.library.Library("fsdpr_tape_graph", "DEF")
    lib.define("double(Tensor x) -> Tensor")
    lib.impl("double", lambda x: x * 2, "CPU")
    handler = _Counting()
    tape = OpTape(handler, tape_ops("fsdpr_tape_graph::double")[-1:], lambda w, e: pytest.fail(f"{w}: {e}"))
    tape.install()
    try:
        x = torch.arange(3.0)
        monkeypatch.setattr(tape_mod, "capturing", lambda: True)
        assert torch.equal(torch.ops.fsdpr_tape_graph.double(x), x * 2)  # run, unchanged
        assert handler.calls == [] and tape.captured == 1
        monkeypatch.setattr(tape_mod, "capturing", lambda: False)
        torch.ops.fsdpr_tape_graph.double(x)
        assert handler.calls == ["fsdpr_tape_graph::double"] and tape.captured == 1
    finally:
        tape.uninstall()
    assert not tape_mod.capturing()  # no capture here (nor CUDA at all)


@pytest.mark.gpu
def test_an_index_add_captured_in_a_cuda_graph_is_counted_and_the_graph_still_runs() -> None:
    handler = _Counting()
    tape = OpTape(handler, NONDETERMINISTIC_CUDA_OPS, lambda w, e: pytest.fail(f"{w}: {e}"))
    tape.install()
    try:
        dest = torch.zeros(64, 8, device="cuda")
        index = torch.randint(0, 64, (4096,), device="cuda")
        src = torch.ones(4096, 8, device="cuda")
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up outside the capture, as torch.cuda.graph asks
            dest.index_add_(0, index, src)
        torch.cuda.current_stream().wait_stream(stream)
        assert handler.calls and tape.captured == 0
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            dest.index_add_(0, index, src)
        assert tape.captured >= 1 and len(handler.calls) == 1
        dest.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert float(dest.sum()) == 4096 * 8  # the captured kernel ran, untouched by the tape
    finally:
        tape.uninstall()


def test_a_user_op_defined_after_the_tape_is_installed_later() -> None:
    handler = _Counting()
    tape = OpTape(handler, tape_ops("fsdpr_tape_late::op")[-1:], lambda w, e: pytest.fail(f"{w}: {e}"))
    tape.install()
    assert [o.name for o in tape.pending] == ["fsdpr_tape_late::op"]
    lib = torch.library.Library("fsdpr_tape_late", "DEF")
    lib.define("op(Tensor x) -> Tensor")
    lib.impl("op", lambda x: x + 1, "CPU")
    tape.install_missing()
    try:
        assert not tape.pending
        torch.ops.fsdpr_tape_late.op(torch.zeros(1))
        assert handler.calls == ["fsdpr_tape_late::op"]
    finally:
        tape.uninstall()


def test_a_torch_that_refuses_the_kernels_gets_no_tape_and_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    lib = torch.library.Library("fsdpr_tape_refused", "DEF")
    lib.define("op(Tensor x) -> Tensor")
    lib.impl("op", lambda x: x + 1, "CPU")

    def refuse(*_: object) -> object:
        raise RuntimeError("no get_kernel in this torch")

    monkeypatch.setattr(torch.library, "get_kernel", refuse)
    handler = _Counting()
    tape, why = start_tape(handler, "fsdpr_tape_refused::op", lambda w, e: pytest.fail(f"{w}: {e}"))
    assert tape is None and "could not be installed" in why and "no get_kernel" in why
    torch.ops.fsdpr_tape_refused.op(torch.zeros(1))
    assert handler.calls == []  # nothing was left wrapped


def _record(tmp: Path, name: str, *args: str) -> Path:
    out = tmp / name
    run([*CLI, "record", "--out", str(out), *args, "--", *torchrun_cmd(2, RACY, "--steps", "3")])
    return out


def _replay(run_dir: Path, rank: int) -> tuple[int, str, dict]:
    report = run_dir / f"replay-{rank}"
    proc = run([*CLI, "replay", str(run_dir), "--rank", str(rank), "--report", str(report)], check=False)
    return proc.returncode, proc.stdout + proc.stderr, json.loads((report / "report.json").read_text())


@pytest.mark.slow
def test_a_racy_op_diverges_without_the_tape_and_replays_bit_exact_with_it(tmp_path: Path) -> None:
    plain = _record(tmp_path, "untaped")
    code, text, doc = _replay(plain, 0)
    assert code == 1 and doc["status"] == "diverged", text[-3000:]  # the op really races
    taped = _record(tmp_path, "taped", "--tape-ops", OP)
    summary = json.loads(run([*CLI, "inspect", str(taped), "--json"]).stdout)
    for r in summary["per_rank"]:
        assert r["tape"] == {"calls": 3, "by_op": {OP: 3}, "outputs": 3, "with_payload": 3}, r["tape"]
    assert "nondeterministic-kernel tape" in run([*CLI, "inspect", str(taped)]).stdout
    for rank in range(2):
        code, text, doc = _replay(taped, rank)
        assert code == 0 and doc["status"] == "bit-exact", text[-3000:]
        assert doc["verified_steps"] == [0, 1, 2]
        n = doc["injected"][OP]
        assert 1 <= n <= doc["tape_calls"] == 3, doc
        assert re.search(
            rf"BIT-EXACT over steps 0\.\.2 .*with {n} results of nondeterministic kernels injected \({OP}: {n}\)",
            text,
        )


@pytest.mark.slow
def test_without_the_tapes_payloads_the_divergence_is_attributed_to_the_kernel(tmp_path: Path) -> None:
    run_dir = _record(tmp_path, "fingerprints", "--tape-ops", OP, "--tape-payloads", "none")
    code, text, doc = _replay(run_dir, 1)
    assert code == 1, text[-3000:]
    first = doc["first_divergence"]
    assert first["kind"] == "nondeterministic_kernel" and first["op"] == OP, first
    assert f"at a known nondeterministic kernel ({OP}, step 0, call #0)" in first["detail"]
    assert "a known nondeterministic kernel computed another result" in text
