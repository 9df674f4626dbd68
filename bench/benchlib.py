"""Helpers shared by the benchmarks: machine facts, the child environment, small statistics.

Each benchmark is still run as a script (``python bench/bench_record.py``); this module sits
beside them and is imported by name.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.metadata
import json
import os
import platform
import random
import re
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "train_fsdp.py"


class BenchError(RuntimeError):
    pass


def portable_command() -> str:
    """This benchmark's command line as a reader can rerun it from the repository root: the
    interpreter as ``python`` and paths inside the repository relative to it (results files
    must not carry the paths of the machine that made them)."""

    def rel(arg: str) -> str:
        for prefix in ("", "--results=", "--workdir="):
            if arg.startswith(prefix) and arg[len(prefix) :].startswith("/"):
                path = Path(arg[len(prefix) :])
                try:
                    return prefix + str(path.resolve().relative_to(REPO))
                except ValueError:
                    return prefix + "<" + path.name + ">" if prefix else "<" + path.name + ">"
        return arg

    return shlex.join(["python", *(rel(a) for a in sys.argv)])


def quantiles(xs: list[float]) -> tuple[float, float, float]:
    """(q1, median, q3); degenerate inputs give the value itself."""
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def bootstrap_median(xs: list[float], reps: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """(median, low, high): the median and its 95% percentile-bootstrap interval."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(reps))
    return statistics.median(xs), meds[int(0.025 * reps)], meds[int(0.975 * reps) - 1]


def write_results(stem: Path, doc: dict[str, Any], lines: list[str]) -> None:
    """``stem``.json (the whole document) and ``stem``.md (``lines``), and the table on stdout."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str))
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def cpu_times() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine since boot, from /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return 0.0, 0.0
    v = [int(x) for x in fields] + [0] * 10
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq, steal = v[:8]
    return (user + nice + system + irq + softirq) / hz, steal / hz


def example_defaults() -> dict[str, Any]:
    """The example's Config defaults, read from its source (no torch import)."""
    try:
        tree = ast.parse(EXAMPLE.read_text())
    except (OSError, SyntaxError):
        return {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "Config":
            out: dict[str, Any] = {}
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value:
                    with contextlib.suppress(ValueError):
                        out[stmt.target.id] = ast.literal_eval(stmt.value)
            return out
    return {}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def version_of(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _git(*args: str, env: dict[str, str] | None = None) -> str | None:
    """A git command's output in the repository, or None where it fails."""
    try:
        out = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=60, check=False, env=env
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit() -> str | None:
    """HEAD, and where the working tree differs from it, the tree id of what ran (tracked and
    untracked files, ignored ones left out), made with a temporary index (the repository's own
    index is untouched; the files' blobs are added to its object store). A copy whose git
    metadata is stale (the GPU machine's) is then still traceable: ``git log --format='%H %T'``
    names the commit whose tree that is."""
    head = _git("rev-parse", "HEAD")
    if head is None:
        return None
    if _git("status", "--porcelain") == "":
        return head
    with tempfile.TemporaryDirectory(prefix="bench-index-") as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": os.path.join(tmp, "index")}
        tree = _git("write-tree", env=env) if _git("add", "-A", env=env) is not None else None
    return f"{head} with uncommitted changes (working tree {tree or 'unknown'})"


def machine_info() -> dict[str, Any]:
    return {
        "nproc": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": version_of("torch"),
        "fsdp_replay": version_of("fsdp-replay"),
        "git_commit": git_commit(),
        "hostname": platform.node(),
    }


def run_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_REPLAY_")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def fmt_bytes(x: float | None) -> str:
    if x is None:
        return "-"
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if x >= k:
            return f"{x / k:.2f} {unit}"
    return f"{x:.0f} B"


def check_trace(
    run_dir: Path, nproc: int, steps: int, payloads: str, snapshot_every: int
) -> tuple[dict[str, Any], list[str]]:
    """Check a recording through ``fsdp-replay inspect --json``. payloads: all, none, steps:A-B or
    window:N (the flight recorder: a run that ends well writes no payload and no snapshot)."""
    out = subprocess.run(
        [sys.executable, "-m", "fsdp_replay", "inspect", str(run_dir), "--json"],
        cwd=REPO,
        env=run_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if out.returncode != 0:
        return {}, [f"inspect exited with {out.returncode}: {out.stderr.strip()[-2000:]}"]
    try:
        summary = json.loads(out.stdout)
    except json.JSONDecodeError as e:
        return {}, [f"inspect printed no JSON: {e}"]
    problems: list[str] = []
    if summary.get("world_size") != nproc or sorted(summary.get("ranks", [])) != list(range(nproc)):
        problems.append(
            f"world_size {summary.get('world_size')}, ranks {summary.get('ranks')} (expected {nproc})"
        )
    if summary.get("missing_ranks"):
        problems.append(f"missing ranks {summary['missing_ranks']}")
    want_snaps = sorted({0, *range(snapshot_every, steps + 1, snapshot_every)}) if snapshot_every else [0]
    if payloads.startswith("window:"):
        want_snaps = []
    for r in summary.get("per_rank", []):
        rk = r.get("rank")
        if r.get("steps") != steps:
            problems.append(f"rank {rk}: {r.get('steps')} steps in the trace, expected {steps}")
        if not r.get("complete"):
            problems.append(f"rank {rk}: incomplete (no clean end record)")
        for key in ("damage", "agent_errors"):
            if r.get(key):
                problems.append(f"rank {rk}: {key} {r[key]}")
        if r.get("payload_missing"):
            problems.append(f"rank {rk}: {r['payload_missing']} payloads missing")
        counters = (r.get("end") or {}).get("counters") or {}
        for key in ("events_dropped", "blobs_dropped", "write_errors", "agent_errors"):
            if counters.get(key):
                problems.append(f"rank {rk}: counter {key} = {counters[key]}")
        cov = r.get("payload_coverage") or {}
        stored, outputs = cov.get("with_payload"), cov.get("outputs")
        if payloads == "all" and stored != outputs:
            problems.append(f"rank {rk}: payloads for {stored} of {outputs} outputs with --payloads all")
        elif payloads == "none" and stored:
            problems.append(f"rank {rk}: {stored} payloads stored with --payloads none")
        elif payloads.startswith("window:") and (stored or (r.get("flight_recorder") or {}).get("dumps")):
            problems.append(f"rank {rk}: {stored} payloads stored by a run that ended well with {payloads}")
        elif payloads.startswith("steps:"):
            # Tensors of 64 KiB or less keep their bytes in every step under a steps policy
            # (agent/tensor_record.py), so more steps than the window may hold payloads: a model
            # whose collectives are all small has them all. The window must be covered.
            window = payloads.split(":", 1)[1]
            if not stored or not step_ranges(window) <= step_ranges(str(cov.get("steps") or "")):
                problems.append(
                    f"rank {rk}: payload coverage {cov} (expected at least steps {window}, with {payloads})"
                )
        snaps = sorted(r.get("snapshots") or [])
        if snaps != want_snaps:
            problems.append(f"rank {rk}: snapshots at steps {snaps}, expected {want_snaps}")
    return summary, problems


def step_ranges(spec: str) -> set[int]:
    """The steps of a ``0-3,10`` spec (as inspect prints payload coverage)."""
    steps: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        if lo.isdigit():
            steps.update(range(int(lo), int(hi if hi.isdigit() else lo) + 1))
    return steps


# -- running the measured commands ----------------------------------------------------------------
STEP_RE = re.compile(r"^step (\d+) loss (\S+) lr (\S+)$")  # rank 0's line per optimizer step


@dataclass
class Proc:
    """One finished command; line timestamps are ns since the command started."""

    cmd: list[str]
    code: int
    wall_s: float
    cpu_s: float
    other_cpu_frac: float
    steal_frac: float
    out: list[tuple[int, str]]
    err: list[tuple[int, str]]
    exit_ns: int


def stop(proc: subprocess.Popen[bytes]) -> None:
    """End a process a benchmark started (fsdp-replay forwards the signal to its command)."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its own session, started by us
        proc.wait()


def execute(cmd: list[str], timeout_s: float, echo: bool) -> Proc:
    """Run cmd, timestamping every stdout and stderr line as it arrives."""
    out: list[tuple[int, str]] = []
    err: list[tuple[int, str]] = []
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy0, steal0 = cpu_times()
    t0 = time.perf_counter_ns()
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    assert proc.stdout is not None and proc.stderr is not None

    def drain(stream: Any, sink: list[tuple[int, str]], mark: str) -> None:
        for raw in iter(stream.readline, b""):
            now = time.perf_counter_ns() - t0
            line = raw.decode(errors="replace").rstrip("\n")
            sink.append((now, line))
            if echo:
                print(f"    {mark} {line}", flush=True)

    readers = [
        threading.Thread(target=drain, args=(proc.stdout, out, "|"), daemon=True),
        threading.Thread(target=drain, args=(proc.stderr, err, "!"), daemon=True),
    ]
    for r in readers:
        r.start()
    timer = threading.Timer(timeout_s, stop, args=(proc,))
    timer.start()
    try:
        code = proc.wait()
    finally:
        timer.cancel()
        if proc.poll() is None:
            stop(proc)
    exit_ns = time.perf_counter_ns() - t0
    for r in readers:
        r.join(10)
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy1, steal1 = cpu_times()
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    wall = exit_ns / 1e9
    capacity = wall * (os.cpu_count() or 1)
    other = max(0.0, (busy1 - busy0) - cpu) / capacity
    steal = (steal1 - steal0) / capacity
    code = 128 - code if code < 0 else code
    return Proc(cmd, code, wall, cpu, other, steal, out, err, exit_ns)


def step_lines(proc: Proc) -> tuple[dict[int, int], list[str], list[str]]:
    """Rank 0's ``step N loss X lr Y`` stdout lines: (step -> arrival ns, losses, problems)."""
    arrivals: dict[int, int] = {}
    losses: list[str] = []
    problems: list[str] = []
    for ns, line in proc.out:
        m = STEP_RE.match(line)
        if m:
            n = int(m.group(1))
            if n in arrivals:
                problems.append(f"step {n} printed twice")
            arrivals.setdefault(n, ns)
            losses.append(m.group(2))
    return arrivals, losses, problems
