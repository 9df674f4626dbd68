"""The daemon's eBPF half, for real (root, bcc, the wheel's libnccl): processes it discovers while it
runs are probed, their NCCL calls counted exactly in /metrics, and detached when they exit.

As in a pod with shareProcessNamespace, the sidecar runs in a private PID namespace (it is its
pid 1, ``unshare --pid --fork --mount-proc``) and the trainers are started into it afterwards
(``nsenter --pid``): discovery and the kernel pid filter then see the namespace's pids, not the
host's, which is what ``bpf_get_ns_current_pid_tgid`` in the program is for; and nothing else
running on the machine (other engineers' recorded trainers) is in the pod. The trainers are the C
load loop (helpers/nccl_loop.c) on the real libnccl.so.2, with FSDP_REPLAY_MODE=record
(discovery's marker) and a RANK of their own. Scope "process" puts the breakpoints in the
tracked processes only, so "detached" is visible: the probe points drop back to zero.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from daemon_support import (
    Samples,
    free_port,
    get,
    sidecar_cmd,
    sidecar_env,
    total,
    wait_healthy,
    wait_metrics,
)

from fsdp_replay.sidecar.ebpf import nccl

pytestmark = [pytest.mark.ebpf, pytest.mark.usefixtures("bcc_works")]


class Loop:
    """nccl_loop LIBNCCL N wait, in the pod's PID namespace (that of ``pod_pid``): maps libnccl,
    prints "ready", runs N ncclAllReduce calls once it reads a line."""

    def __init__(self, pod_pid: int, exe: Path, libnccl: Path, calls: int, rank: int) -> None:
        env = {**sidecar_env(), "FSDP_REPLAY_MODE": "record", "RANK": str(rank)}
        self.proc = subprocess.Popen(
            ["nsenter", "--target", str(pod_pid), "--pid", "--", str(exe), str(libnccl), str(calls), "wait"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "ready"

    def go(self) -> str:
        out, err = self.proc.communicate("\n", timeout=120)
        assert self.proc.returncode == 0, err
        return out

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


def _child(pid: int) -> int:
    """The one child of ``pid`` (unshare's: the sidecar, pid 1 of the new namespace)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


@pytest.mark.slow
def test_daemon_probes_processes_it_discovers_and_detaches_them(
    tmp_path: Path, libnccl: Path, nccl_loop: Path
) -> None:
    for tool in ("unshare", "nsenter"):
        if shutil.which(tool) is None:
            pytest.skip(f"no {tool} (util-linux) to make the pod's PID namespace")
    out, port, log = tmp_path / "run", free_port(), tmp_path / "sidecar.log"
    cmd = sidecar_cmd(out, port, "--probe-scope", "process", "--poll-interval-s", "0.2")
    with open(log, "w") as log_file:
        pod = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", *cmd],
            stderr=log_file,
            text=True,
            env=sidecar_env(),
        )
    try:
        wait_healthy(port, pod)
        sidecar = _child(pod.pid)
        wait_metrics(port, "eBPF loaded", lambda s: get(s, "fsdp_replay_sidecar_ebpf_enabled") == 1)
        hits_before = 0.0
        for rank, calls in ((7, 3000), (8, 2000)):  # the second process starts after the first is gone
            r = str(rank)

            def discovered(s: Samples, r: str = r) -> bool:
                return get(s, "fsdp_replay_trainer_processes", rank=r) == 1

            def detached(s: Samples, r: str = r) -> bool:
                return (
                    get(s, "fsdp_replay_trainer_processes", rank=r) == 0
                    and get(s, "fsdp_replay_ebpf_probe_points") == 0
                    and get(s, "fsdp_replay_ebpf_processes_tracked") == 0
                )

            loop = Loop(sidecar, nccl_loop, libnccl, calls, rank)
            try:
                # Discovered, tracked and attached in the same poll that reports its usage.
                m = wait_metrics(port, f"rank {r} discovered", discovered)
                assert get(m, "fsdp_replay_ebpf_probe_points") == 2 * len(nccl.API)  # uprobe + uretprobe
                assert get(m, "fsdp_replay_ebpf_processes_tracked") == 1
                assert "ret=4" in loop.go()  # NCCL refused the zeroed communicator after its checks
            finally:
                loop.kill()

            def counted(s: Samples, r: str = r, n: int = calls, before: float = hits_before) -> bool:
                got = total(s, "fsdp_replay_nccl_calls_total", rank=r, op="ncclAllReduce")
                # The probe's own counters are copied at each poll: wait for them too.
                hits = get(s, "fsdp_replay_ebpf_probe_hits_total", function="ncclAllReduce") or 0
                return got >= n and hits - before >= n

            m = wait_metrics(port, f"rank {r}'s {calls} calls", counted)
            assert total(m, "fsdp_replay_nccl_calls_total", rank=r, op="ncclAllReduce") == calls
            # count = the call's index, float32 (4 bytes): bytes = 4 * (0 + 1 + ... + calls - 1).
            assert (
                total(m, "fsdp_replay_nccl_bytes_total", rank=r, op="ncclAllReduce")
                == 4 * calls * (calls - 1) // 2
            )
            assert total(m, "fsdp_replay_nccl_failed_calls_total", rank=r, op="ncclAllReduce") == calls
            assert total(m, "fsdp_replay_nccl_host_latency_seconds_total", rank=r) > 0
            hits = get(m, "fsdp_replay_ebpf_probe_hits_total", function="ncclAllReduce") or 0
            assert hits - hits_before == calls  # nothing else in the pod calls NCCL
            hits_before = hits
            assert total(m, "fsdp_replay_ebpf_lost_events_total") == 0

            # Gone: untracked, its probe points detached, its calls counted once and kept.
            m = wait_metrics(port, f"rank {r} detached", detached)
            assert total(m, "fsdp_replay_nccl_calls_total", rank=r, op="ncclAllReduce") == calls
            assert get(m, "fsdp_replay_trainer_cpu_seconds_total", rank=r) is not None
        os.kill(sidecar, signal.SIGTERM)  # what the kubelet does
        pod.wait(timeout=60)
    finally:
        if pod.poll() is None:
            pod.kill()  # --kill-child: the sidecar goes with it
            pod.wait()
    text = log.read_text()
    assert pod.returncode == 0, text[-3000:]
    assert "eBPF uprobes loaded" in text and "probing" in text
