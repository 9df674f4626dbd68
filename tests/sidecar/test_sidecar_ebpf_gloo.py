"""Real uprobes on gloo's collectives inside torch's libtorch_cpu.so, during a real FSDP2 run.

The same machinery as for NCCL, on another library: discovery finds the two ranks (torchrun puts
LOCAL_RANK in their environment), the probe adds them to the kernel pid filter and attaches per
process (scope "process": breakpoints in the ranks' memory only, set before torch is even loaded;
gloo's collectives run in ProcessGroupGloo's worker threads), and the calls are counted per pid. The expected counts follow from the FSDP2 structure of examples/train_fsdp.py
(``fully_shard`` per block, then the root; gradient accumulation with sync on the last micro-batch):
per step and rank, with L blocks and A micro-batches,

- all-gathers: A * (2L + 1): forward gathers L blocks + the root, backward re-gathers the L
  blocks (resharded after forward; the root is not);
- reduce-scatters: L + 1, once per step (gradient sync on the last micro-batch only);
- all-reduces: (L + 1) + 2: gloo has no reduce-scatter primitive, so ProcessGroupGloo reduces
  each reduce-scatter with gloo::allreduce; plus the gradient-norm clip and the loss average;
- broadcasts: 0 (FSDP2 does not sync module states unless asked).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from sidecar_support import REPO, child_env

from fsdp_replay.sidecar.discovery import Discovery
from fsdp_replay.sidecar.ebpf.probe import Event, Probe
from fsdp_replay.sidecar.ebpf.signatures import Signature

pytestmark = [pytest.mark.ebpf, pytest.mark.slow, pytest.mark.usefixtures("bcc_works")]

# Mangled names read from libtorch_cpu.so's .dynsym (torch 2.13): `nm -D --defined-only ... | grep _ZN4gloo`.
GLOO = {
    "gloo::allgather": "_ZN4gloo9allgatherERNS_16AllgatherOptionsE",
    "gloo::allreduce": "_ZN4gloo9allreduceERKNS_16AllreduceOptionsE",
    "gloo::broadcast": "_ZN4gloo9broadcastERNS_16BroadcastOptionsE",
    "gloo::reduce": "_ZN4gloo6reduceERNS_13ReduceOptionsE",
    # No gloo::reduce_scatter is exported; the c10d entry point is.
    "ProcessGroupGloo::_reduce_scatter_base": (
        "_ZN4c10d16ProcessGroupGloo20_reduce_scatter_baseERN2at6TensorES3_RKNS_20ReduceScatterOptionsE"
    ),
}
STEPS, LAYERS, ACCUM = 3, 2, 2
RUN_TIMEOUT_S = 300


def test_gloo_collectives_of_both_ranks(libtorch_cpu: Path) -> None:
    sigs = [Signature(name, symbols=(sym,), returns="void") for name, sym in GLOO.items()]
    calls: Counter[tuple[int, str]] = Counter()

    def count(e: Event) -> None:
        calls[(e.pid, e.function)] += 1

    with Probe(sigs, count, scope="process") as probe:
        discovery = Discovery(library_pattern=None, env_markers=("LOCAL_RANK",))
        discovery.poll()  # processes already running are not part of the run
        cmd = [
            str(Path(sys.executable).parent / "torchrun"),
            "--standalone",
            "--nproc_per_node=2",
            str(REPO / "examples" / "train_fsdp.py"),
            *("--steps", str(STEPS), "--layers", str(LAYERS), "--grad-accum", str(ACCUM)),
            *(
                "--d-model",
                "32",
                "--heads",
                "2",
                "--seq-len",
                "16",
                "--batch-size",
                "2",
                "--dataset-size",
                "64",
            ),
        ]
        run = subprocess.Popen(
            cmd, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        ranks: dict[int, int] = {}
        others: set[int] = set()
        deadline = time.monotonic() + RUN_TIMEOUT_S
        try:
            while run.poll() is None and time.monotonic() < deadline:
                update = discovery.poll()
                for proc in update.started:
                    # Only this run's processes: the machine may be running other torchruns.
                    if proc.ppid == run.pid:
                        ranks[proc.pid] = proc.rank if proc.rank is not None else -1
                    elif proc.ppid in ranks:
                        others.add(proc.pid)  # DataLoader workers inherit LOCAL_RANK; no collectives
                    else:
                        continue
                    # Attached before the process maps the library: the kernel sets the
                    # breakpoints when it does.
                    (att,) = probe.track(proc.pid, libraries=[str(libtorch_cpu)])
                    assert att.missing == (), f"symbols not in this torch: {att.missing}"
                probe.poll(20)
        finally:
            if run.poll() is None:
                run.kill()
            output = run.communicate(timeout=30)[0]
        probe.drain()
        stats = probe.stats()
    assert run.returncode == 0, output[-4000:]
    assert sorted(ranks.values()) == [0, 1], f"ranks found: {ranks}"
    assert {pid for pid, _ in calls} == set(ranks), "calls from a process that is not a rank"
    assert not {pid for pid, _ in calls} & others
    expected = {
        "gloo::allgather": STEPS * ACCUM * (2 * LAYERS + 1),
        "ProcessGroupGloo::_reduce_scatter_base": STEPS * (LAYERS + 1),
        "gloo::allreduce": STEPS * (LAYERS + 1 + 2),
        "gloo::broadcast": 0,
        "gloo::reduce": 0,
    }
    for pid in ranks:
        got = {name: calls[(pid, name)] for name in GLOO}
        assert got == expected, f"rank {ranks[pid]} (pid {pid})"
    assert stats.lost == 0 and stats.delivered == sum(calls.values())
