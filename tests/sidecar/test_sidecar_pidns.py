"""The program in a pod's PID namespace: ids from bpf_get_ns_current_pid_tgid (no root needed here;
the daemon's eBPF test loads it for real inside a private namespace)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from sidecar_support import FIXTURE_PROC

from fsdp_replay.sidecar import procfs
from fsdp_replay.sidecar.ebpf import nccl, programs


def test_program_takes_ids_in_the_given_namespace() -> None:
    probes = nccl.by_name("ncclAllReduce", "ncclGroupStart")
    host = programs.build_program(probes)
    assert "bpf_get_ns_current_pid_tgid" not in host and "bpf_get_current_pid_tgid()" in host
    pod = programs.build_program(probes, pid_namespace=(4, 4026532871))
    assert "bpf_get_current_pid_tgid" not in pod
    # At entry (fr_begin, shared) and in every return handler: the in-flight key is the
    # namespace's tid on both sides.
    assert pod.count("bpf_get_ns_current_pid_tgid(4ULL, 4026532871ULL, &ns, sizeof(ns))") == 1 + len(probes)
    assert "r->pid = tgid;" in pod and "r->tid = tid;" in pod
    assert "struct fr_key k = {.tid = tid, .probe_id = 0};" in pod
    assert "if (!fr_pids.lookup(&tgid))" in pod  # the filter holds the namespace's pids
    with pytest.raises(ValueError, match="device, inode"):
        programs.build_program(probes, pid_namespace=(-1, 5))


def test_pid_namespace_of_the_host_and_of_a_new_one(tmp_path: Path) -> None:
    # Here (the host's namespace: kthreadd is pid 2), and on a fixture tree without kernel threads.
    if procfs.status(2).get("Name") == "kthreadd":
        assert procfs.pid_namespace() is None
    fixture = procfs.pid_namespace(str(FIXTURE_PROC))
    assert fixture is not None  # no kernel thread there: our own namespace, as (dev, ino)
    st = os.stat("/proc/self/ns/pid")
    assert fixture == ((os.major(st.st_dev) << 20) | os.minor(st.st_dev), st.st_ino)
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a new PID namespace needs root and unshare")
    code = "from fsdp_replay.sidecar import procfs; print(list(procfs.pid_namespace()))"
    out = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", code],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    dev, ino = json.loads(out)
    assert ino != st.st_ino and dev == fixture[0]  # another namespace, on the same nsfs
