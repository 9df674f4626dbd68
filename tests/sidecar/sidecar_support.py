"""Helpers of the sidecar tests: where the real targets are, and the helper programs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).parent
REPO = HERE.parents[1]
FIXTURE_PROC = HERE / "fixtures" / "proc"
NCCL_CALLS = HERE / "helpers" / "nccl_calls.py"
NCCL_LOOP_C = HERE / "helpers" / "nccl_loop.c"
LIBNCCL_REL = Path("nvidia") / "nccl" / "lib" / "libnccl.so.2"
INSTALL_HINT = "scripts/install-ebpf.sh .venv (as root) installs it"


def site_dirs() -> list[Path]:
    paths = sysconfig.get_paths()
    return [Path(p) for p in dict.fromkeys((paths["purelib"], paths["platlib"]))]


LIBNCCL_ENV = "FSDP_REPLAY_TEST_LIBNCCL"
"""Set to another libnccl.so.2 (e.g. an unpacked older wheel) to run the tests against it."""


def find_libnccl() -> Path | None:
    """The real libnccl.so.2 of the nvidia-nccl-cu13 wheel in this interpreter's site-packages
    (or the one named by FSDP_REPLAY_TEST_LIBNCCL)."""
    if os.environ.get(LIBNCCL_ENV):
        return Path(os.environ[LIBNCCL_ENV]).resolve()
    for site in site_dirs():
        if (site / LIBNCCL_REL).is_file():
            return (site / LIBNCCL_REL).resolve()
    return None


def find_libtorch_cpu() -> Path | None:
    """torch's libtorch_cpu.so (gloo lives inside it), found without importing torch."""
    for site in site_dirs():
        lib = site / "torch" / "lib" / "libtorch_cpu.so"
        if lib.is_file():
            return lib.resolve()
    return None


def build_nccl_loop(out_dir: Path) -> Path:
    """Compile the C load generator; raises when gcc is missing or fails."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise FileNotFoundError("gcc")
    exe = out_dir / "nccl_loop"
    subprocess.run(
        [gcc, "-O2", "-Wall", "-o", str(exe), str(NCCL_LOOP_C), "-ldl"], check=True, capture_output=True
    )
    return exe


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_REPLAY_", "NCCL_"))}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


class Waiting:
    """A helper process that has printed "ready" and waits for a line on stdin to start."""

    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        assert self.proc.stdout is not None and self.proc.stdin is not None
        line = self.proc.stdout.readline().strip()
        if line != "ready":
            self.proc.kill()
            _, err = self.proc.communicate(timeout=10)
            raise AssertionError(f"{cmd[0]} did not start: {line!r}\n{err}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float = 120.0) -> str:
        """Its output (stdout), once it has exited 0."""
        out, err = self.proc.communicate(timeout=timeout)
        if self.proc.returncode != 0:
            raise AssertionError(f"helper exited {self.proc.returncode}\n{out}\n{err}")
        return out

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate(timeout=10)


def nccl_calls_cmd(libnccl: Path, *args: str) -> list[str]:
    return [sys.executable, str(NCCL_CALLS), str(libnccl), *args]


def parse_loop_output(line: str) -> dict[str, float]:
    """``calls=N ns=T rate=R ns_per_call=X ret=4`` -> numbers."""
    return {k: float(v) for k, v in (item.split("=", 1) for item in line.split())}
