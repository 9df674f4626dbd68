"""Process discovery and /proc parsing, on the fixture tree under fixtures/proc (no root)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from sidecar_support import FIXTURE_PROC

from fsdp_replay.sidecar import procfs
from fsdp_replay.sidecar.discovery import REASON_ENV, REASON_LIBRARY, Discovery

NCCL = "/usr/local/lib/python3.12/dist-packages/nvidia/nccl/lib/libnccl.so.2"


@pytest.fixture
def proc_root(tmp_path: Path) -> Path:
    """A copy of the fixture tree that the test may change between polls; 4400 starts hidden."""
    root = tmp_path / "proc"
    shutil.copytree(FIXTURE_PROC, root)
    (root / "4400").rename(tmp_path / "4400")
    return root


def test_poll_reports_started_and_exited(proc_root: Path) -> None:
    d = Discovery(str(proc_root))
    first = d.poll()
    assert sorted(p.pid for p in first.started) == [4242, 4243]
    assert first.exited == () and first.changed == ()
    by_pid = {p.pid: p for p in first.started}
    worker = by_pid[4242]
    assert worker.reasons == (REASON_ENV, REASON_LIBRARY)
    assert worker.markers == {"FSDP_REPLAY_MODE": "record"}
    assert worker.rank == 0 and worker.ppid == 4200 and worker.name == "python3.12"
    assert worker.cmdline == ("/usr/bin/python3.12", "-u", "train.py", "--steps", "3")
    assert [m.path for m in worker.libraries] == [NCCL]  # three mappings, one file
    assert worker.libraries[0].inode == 1311003 and worker.start_ticks is None
    # FSDP_REPLAY_MODE=off does not enable the agent; mapping NCCL still makes it a training process.
    assert by_pid[4243].reasons == (REASON_LIBRARY,) and by_pid[4243].markers == {}
    # bash (4300) and torchrun with FSDP_REPLAY_MODE="" (4200) are not training processes.
    assert set(d.processes) == {4242, 4243}

    assert not d.poll()  # nothing changed

    # torchrun restarts: 4243 exits, 4400 starts (agent on, NCCL not loaded yet).
    shutil.rmtree(proc_root / "4243")
    (proc_root.parent / "4400").rename(proc_root / "4400")
    second = d.poll()
    assert [p.pid for p in second.started] == [4400]
    assert second.started[0].reasons == (REASON_ENV,) and second.started[0].libraries == ()
    assert [p.pid for p in second.exited] == [4243]
    assert set(d.processes) == {4242, 4400}

    # 4400 loads NCCL: reported as changed, so the probe can attach the new library.
    maps = (proc_root / "4242" / "maps").read_text()
    (proc_root / "4400" / "maps").write_text(maps)
    third = d.poll()
    assert third.started == () and third.exited == ()
    assert [p.pid for p in third.changed] == [4400]
    assert [m.path for m in third.changed[0].libraries] == [NCCL]


def test_reused_pid_is_a_new_process(proc_root: Path) -> None:
    (proc_root / "4242" / "stat").write_text(_stat(4242, start=1000))
    d = Discovery(str(proc_root))
    assert {p.pid for p in d.poll().started} == {4242, 4243}
    (proc_root / "4242" / "stat").write_text(_stat(4242, start=2000))
    update = d.poll()
    assert [(p.pid, p.start_ticks) for p in update.exited] == [(4242, 1000)]
    assert [(p.pid, p.start_ticks) for p in update.started] == [(4242, 2000)]


def test_markers_and_library_pattern_are_parameters(proc_root: Path) -> None:
    by_rank_env = Discovery(str(proc_root), library_pattern=None, env_markers=("LOCAL_RANK",))
    assert {p.pid for p in by_rank_env.poll().started} == {4242, 4243}
    libc_users = Discovery(str(proc_root), library_pattern="libc.so", env_markers=())
    assert {p.pid for p in libc_users.poll().started} == {4200, 4242, 4243, 4300}
    excluded = Discovery(str(proc_root), exclude_pids=[4242])
    assert {p.pid for p in excluded.poll().started} == {4243}


def test_process_vanishing_mid_scan_is_skipped(proc_root: Path) -> None:
    (proc_root / "4243" / "maps").unlink()  # as if it exited between listdir and open
    assert {p.pid for p in Discovery(str(proc_root)).poll().started} == {4242}


def test_live_proc_finds_a_child_by_environment() -> None:
    """On the real /proc: our own process is excluded by default, a child with the marker is found."""
    import subprocess
    import sys

    env = {**os.environ, "FSDP_REPLAY_MODE": "record", "FSDP_REPLAY_OUT": "/nonexistent"}
    env["PYTHONPATH"] = ""  # no sitecustomize: the agent must not actually start
    child = subprocess.Popen(
        [sys.executable, "-S", "-c", "import sys; sys.stdin.readline()"], stdin=subprocess.PIPE, env=env
    )
    try:
        d = Discovery()
        found = {p.pid: p for p in d.poll().started}
        assert child.pid in found and os.getpid() not in found
        assert found[child.pid].markers == {"FSDP_REPLAY_MODE": "record"}
    finally:
        child.communicate(b"\n", timeout=10)
    assert child.pid in {p.pid for p in d.poll().exited}


def test_procfs_parsing(tmp_path: Path) -> None:
    pid_dir = tmp_path / "77"
    pid_dir.mkdir()
    (pid_dir / "maps").write_text(
        "7f0000000000-7f0000200000 r-xp 00000000 fd:01 99  /opt/my libs/libnccl.so.2.28.9 (deleted)\n"
        "7f0000200000-7f0000400000 r--p 00000000 00:00 0 \n"
        "7f0000400000-7f0000600000 r-xp 00000000 fd:01 98  /usr/lib/libnccl-net.so\n"
    )
    (pid_dir / "stat").write_text(_stat(77, start=4321, comm="a) (b"))
    (pid_dir / "environ").write_bytes(b"A=1\0B==x\0BROKEN\0\0")
    maps = procfs.maps(77, str(tmp_path))
    assert [(m.path, m.deleted, m.inode) for m in maps] == [
        ("/opt/my libs/libnccl.so.2.28.9", True, 99),
        ("/usr/lib/libnccl-net.so", False, 98),
    ]
    assert [m.path for m in procfs.mapped_files(77, "libnccl.so", str(tmp_path))] == [
        "/opt/my libs/libnccl.so.2.28.9"
    ]
    assert procfs.host_path(77, maps[0], "/proc") == "/proc/77/map_files/7f0000000000-7f0000200000"
    assert procfs.host_path(77, maps[1], "/proc") == "/proc/77/root/usr/lib/libnccl-net.so"
    assert procfs.start_ticks(77, str(tmp_path)) == 4321
    assert procfs.environ(77, str(tmp_path)) == {"A": "1", "B": "=x"}
    assert procfs.pids(str(tmp_path)) == [77]
    assert procfs.pids(str(tmp_path / "absent")) == []


def _stat(pid: int, *, start: int, comm: str = "python3") -> str:
    # fields 3.. of /proc/<pid>/stat; starttime is field 22
    rest = ["S", "1", str(pid), str(pid), "0", "-1", "4194304"] + ["0"] * 12 + [str(start)] + ["0"] * 10
    return f"{pid} ({comm}) {' '.join(rest)}\n"
