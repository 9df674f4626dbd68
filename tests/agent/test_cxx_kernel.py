"""The C++ kernel for the hot CPU collectives (``fsdp_replay/agent/cxx/_kernel.cpp``; ``record`` uses
it for runs that store no payloads): it writes the same events as the Python kernels, leaves the program's
results alone, hands what it does not take to the Python kernels, and stops recording cleanly on
its own errors."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import CLI, assert_same_params, record, run

from fsdp_replay.agent.cxx import kernel
from fsdp_replay.trace.reader import RankTrace, Trace

pytestmark = pytest.mark.cxx
SMALL = ("--steps", "4", "--layers", "2", "--d-model", "64", "--seq-len", "32")


@pytest.fixture(scope="module")
def built() -> Path:
    return kernel.build()  # a failure here is a failure: the capability check passed


def collectives(rt: RankTrace) -> list[tuple[Any, ...]]:
    """Every collective with its tensors, strings decoded; times left out (they differ by run)."""
    c, t = rt.collectives, rt.tensors

    def name(kind: str, v: Any) -> Any:
        names = rt.names(kind)
        return names[int(v)] if names and int(v) >= 0 else int(v)

    rows = []
    for i in range(len(c)):
        start, count = int(c["tensor_start"][i]), int(c["tensor_count"][i])
        tensors = tuple(
            (
                name("role", t["role"][j]),
                name("dtype", t["dtype"][j]),
                name("algo", t["algo"][j]),
                int(t["fp"][j]),
                int(t["nbytes"][j]),
                bool(t["nonfinite"][j]),
                rt.shape(int(t["shape_start"][j]), int(t["ndim"][j])),
            )
            for j in range(start, start + count)
        )
        rows.append(
            (
                int(c["seq"][i]),
                name("op", c["op"][i]),
                name("reduce_op", c["reduce_op"][i]),
                int(c["pg"][i]),
                int(c["step"][i]),
                int(c["micro"][i]),
                tensors,
            )
        )
    return rows


def used_kernel(rt: RankTrace) -> bool:
    return bool(rt.meta.get("fingerprint_algos", {}).get("cxx_kernel"))


@pytest.mark.slow
def test_it_records_what_the_python_kernels_record(tmp_path: Path, built: Path) -> None:
    py, _ = record(tmp_path, 2, *SMALL, record_args=("--payloads", "none", "--no-cxx-kernel"), name="py")
    cxx, _ = record(tmp_path, 2, *SMALL, record_args=("--payloads", "none"), name="cxx")  # its default
    a, b = Trace.open(py / "trace.zarr"), Trace.open(cxx / "trace.zarr")
    for r in (0, 1):
        assert not used_kernel(a.rank(r)) and used_kernel(b.rank(r))
        want, got = collectives(a.rank(r)), collectives(b.rank(r))
        assert len(got) == len(want) > 40
        assert got == want
        ops = {row[1] for row in got}
        assert {"_allgather_base_", "_reduce_scatter_base_"} <= ops
        # the step events count them too, and the agent's CPU includes the kernel's
        assert b.rank(r).steps["colls"].tolist() == a.rank(r).steps["colls"].tolist()
        assert (b.rank(r).steps["agent_cpu_ns"] > 0).all()
    assert_same_params(py, cxx, 2)
    # a policy that stores payloads is recorded by the Python kernels
    full, _ = record(
        tmp_path, 2, "--steps", "2", record_args=("--payloads", "all", "--cxx-kernel"), name="full"
    )
    assert not used_kernel(Trace.open(full / "trace.zarr").rank(0))


@pytest.mark.slow
def test_an_internal_error_in_it_stops_recording_and_spares_the_program(tmp_path: Path, built: Path) -> None:
    plain, _ = record(tmp_path, 2, *SMALL, record_args=("--payloads", "none", "--no-cxx-kernel"), name="py")
    out, proc = record(
        tmp_path,
        2,
        *SMALL,
        record_args=("--payloads", "none", "--cxx-kernel"),
        name="fault",
        FSDP_REPLAY_INJECT_FAULT="kernel:8",
    )
    assert_same_params(plain, out, 2)
    assert proc.stderr.count("internal error in C++ kernel") == 2, proc.stderr[-3000:]  # once per rank
    summary = json.loads(run([*CLI, "inspect", str(out), "--json"]).stdout)
    for rank in summary["per_rank"]:
        assert [e["where"] for e in rank["agent_errors"]] == ["C++ kernel"], rank["agent_errors"]
    rt = Trace.open(out / "trace.zarr").rank(0)
    seqs = [row[0] for row in collectives(rt)]
    assert seqs[:7] == list(range(7))  # what came before the error is kept


def test_what_it_does_not_take_goes_to_the_python_kernels(built: Path) -> None:
    """One gloo rank, in this process: a contiguous all-reduce is the C++ kernel's, a strided one
    reaches the Python kernels (registered at Autograd, as the agent does)."""
    import torch.distributed as dist

    from fsdp_replay.agent.collectives import CollectiveCall, CollectiveInterceptor

    seen: list[str] = []

    class Handler:
        def active(self) -> bool:
            return True

        def run(self, call: CollectiveCall, real: Any) -> Any:
            seen.append(call.op)
            return real()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(29500 + os.getpid() % 1000)
    dist.init_process_group("gloo", rank=0, world_size=1)
    interceptor = CollectiveInterceptor(Handler(), lambda where, e: None)
    interceptor.install()
    k = kernel.Kernel(built)
    try:
        k.state.t0, k.state.seq, k.state.failed = 0, 100, 0
        k.install()
        x = torch.randn(64)
        dist.all_reduce(x)
        assert seen == [] and k.state.seq == 101
        strided = torch.randn(64, 2)[:, 0]
        dist.all_reduce(strided)
        assert seen == ["allreduce_"] and k.state.seq == 101
        records = k.drain()
        assert [r.seq for r in records] == [100]
        assert records[0].t[0].fp == records[0].t[1].fp  # one rank: the sum is the input
        k.state.enabled = 0  # disabled (a payload step, a failed recorder): all to Python
        dist.all_reduce(x)
        assert seen == ["allreduce_", "allreduce_"]
    finally:
        k.uninstall()
        interceptor.uninstall()
        dist.destroy_process_group()
    dist_calls_after = len(seen)
    assert dist_calls_after == 2
