"""Replay speed and time to the first divergence: ``fsdp-replay replay`` and ``fsdp-replay diff``.

Two measurements of the issue, run side by side in one invocation:

1. **Replay step time vs. recorded step time.** ``examples/train_fsdp.py`` (default model, CPU,
   gloo, ``OMP_NUM_THREADS=1``) is recorded with ``fsdp-replay record --payloads all
   --snapshot-every 10`` on 2 ranks; then rank 0 and rank 1 are each replayed alone
   (``fsdp-replay replay DIR --rank R``). The recorded step time comes from the timestamps of
   rank 0's ``step N loss X lr Y`` stdout lines during the recording; the replay step time from
   the timestamps of the replay's ``[fsdp-replay] rank R: step N/M verified`` stderr lines; both
   are the median of the gaps between consecutive lines after ``--warmup-steps`` steps, exactly as
   ``bench_record.py`` measures. The recorded run has two ranks sharing the machine's cores while
   a replay is one process: that is what a user gets (one rank of an N-rank job replayed on one
   device), but it is not apples to apples, so a 1-rank recording (``--nproc_per_node 1``) and
   its replay are measured as well. Every repetition records and replays afresh, in the order
   record (2 ranks), replay rank 0, replay rank 1, record (1 rank), replay (the two groups swap
   places every repetition), so machine noise and drift hit the recorded and the replayed runs
   alike; the ratios are paired within a repetition.

2. **Time to the first divergence in a 1,000-step trace.** A tiny model (so 1,000 steps take
   well under a minute) is recorded twice with ``--payloads none``: clean, and with
   ``--wallclock-noise-at-step 900 --noise-rank 1`` (rank 1's loss at step 900 depends on the
   wall clock). ``fsdp-replay diff CLEAN NOISY --json`` must find rank 1, step 900; its whole
   process is timed (wall clock, Python start-up included). A third recording of the noisy run
   with ``--payloads steps:890-910`` and a snapshot every 100 steps (tensors of 64 KiB or less keep
   their bytes in every step: all of this tiny model's), and
   ``fsdp-replay replay --rank 1 --from-step 900`` is timed as well: its first two steps compute,
   steps 2-899 run without kernels (the fast-forward, ``replayer/fastforward.py``), then the
   snapshot of step 900 is restored; the time is split with the report's ``fast_forward`` object.

3. **Time to reach step S, for S = 10, 100, 1,000.** The tiny model is recorded once (2 ranks,
   1,010 steps, a snapshot every 10 steps, ``--payloads steps:S-(S+1),...``), then
   ``fsdp-replay replay --rank 1 --from-step S --to-step S+1`` runs for each S, interleaved over
   repetitions (the order rotated every repetition), with the default fast-forward and, as the
   baseline, with ``--fast-forward-warmup S`` (every step before S computes: the old way) for
   S = 10 and 100. Every replay must be BIT-EXACT over S..S+1. Reported per S: the report's
   ``fast_forward.seconds`` and its split, the cost of a skipped step, and the ratio to one
   recorded step.

Every run is checked before it counts (exit codes, every step line, ``inspect --json`` of every
trace, ``report.json`` of every replay: bit-exact over every step where expected; the diverging
diff and replay must name rank 1, step 900). Any failure stops the benchmark with exit code 1
and keeps the folders of the runs.

Results: ``bench/results/replay.{md,json}`` (``--quick``: ``replay.quick.*``, so a smoke run
never overwrites a real measurement). See ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchlib import (
    EXAMPLE,
    REPO,
    BenchError,
    Proc,
    check_trace,
    example_defaults,
    execute,
    fmt_bytes,
    machine_info,
    portable_command,
    quantiles,
    step_lines,
)

RESULTS_DIR = REPO / "bench" / "results"

TARGET_RATIO = 1.0
TARGET_RATIO_TEXT = "single-rank replay step time / recorded step time <= 1.0"
TARGET_DIVERGENCE_S = 10.0
TARGET_DIVERGENCE_TEXT = "time to the first divergence in a 1,000-step trace < 10 s"
TARGET_REACH_STEPS = 2.0  # recorded steps
TARGET_REACH_TEXT = (
    "time to reach step S < 2x one recorded step (the issue's 'under 2x the time of one recorded step plus "
    "the snapshot load'; `fast_forward.seconds` ends before the snapshot load, so the load is left out on "
    "both sides)"
)
TARGET_FLAT_TEXT = (
    "time to reach step S flat in S: reaching the largest S costs less than 2 recorded steps more than "
    "reaching the smallest"
)
NOISY_FRACTION = 0.05  # other processes using more than this share of the CPUs make a run noisy
TINY_MODEL = ("--layers", "1", "--d-model", "32", "--seq-len", "16", "--batch-size", "2")
TINY_ARGS = (*TINY_MODEL, "--workers", "0", "--grad-accum", "1", "--cpu")
NOISE_RANK = 1

# One line per verified step; before the restored snapshot, "fast-forward, computed" for the
# warm-up steps and "fast-forward, skipped" every 100th skipped step and for the last one
# ("fast-forward" alone: a live replay of all ranks, which computes every step).
FF_COMPUTED, FF_SKIPPED, FF_LIVE = "fast-forward, computed", "fast-forward, skipped", "fast-forward"
PROGRESS_RE = re.compile(
    r"^\[fsdp-replay\] rank (\d+): step (\d+)/(\d+) "
    r"(verified|fast-forward, computed|fast-forward, skipped|fast-forward) \((\d+) collectives verified\)$"
)
REACHED_RE = re.compile(
    r"^\[fsdp-replay\] rank (\d+): reached step (\d+) in ([0-9.]+) s \((\d+) steps computed, (\d+) run "
    r"without kernels\); restored its snapshot$"
)
SKIPPED_LINE_EVERY = 100  # the agent prints a skipped step's line every 100th step
FF_WARMUP_DEFAULT = 2  # replay --fast-forward-warmup's default: steps that compute before the skipping
FF_TIME_KEYS = (
    "ff_seconds",
    "ff_setup_s",
    "ff_computed_s",
    "ff_skipped_s",
    "ff_skipped_ms_per_step",
    "ff_computed_ms_per_step",
    "restored_at_s",
    "outside_ff_s",
    "after_restore_s",
)
FF_CHECK_TEXT = (
    "its report.json `fast_forward` says to_step = the restored step, computed_steps = the warm-up, "
    "skipped_steps = the rest (no step computed for new inputs, no root call computed), the model skipped "
    "in every skipped step (root_calls_skipped) and ops run as placeholders; its `reached step S ...` line "
    "says the same and the report's seconds; and its progress lines are `fast-forward, computed` for the "
    "warm-up steps (the last one's line may be held back by the every-100th rule), `fast-forward, skipped` "
    "exactly for every 100th skipped step and the last one, `verified` from S on"
)
COLLECT_RE = re.compile(r"trace written to (.+) in ([0-9.]+)s")


# -- helpers (as in bench_record.py; each benchmark is one self-contained script) ------------------


def spread(xs: list[float]) -> dict[str, Any]:
    """median, min, max and interquartile range of xs (an empty list gives NaNs)."""
    if not xs:
        nan = float("nan")
        return {"n": 0, "median": nan, "min": nan, "max": nan, "iqr": [nan, nan], "values": []}
    q1, q2, q3 = quantiles(xs)
    return {"n": len(xs), "median": q2, "min": min(xs), "max": max(xs), "iqr": [q1, q3], "values": xs}


def tree_bytes(path: Path) -> int:
    size = 0
    if not path.exists():
        return 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            size += os.lstat(os.path.join(root, f)).st_size
    return size


def fmt_ms(x: float) -> str:
    return "-" if x != x else f"{x * 1e3:.1f}"  # NaN: not measured


def fmt_s(x: float, digits: int = 1) -> str:
    return "-" if x != x else f"{x:.{digits}f}"


def portable_paths(x: Any, work: Path) -> Any:
    """The results without this machine's paths: the interpreter as ``python``, the runs' folder
    as ``WORKDIR``, the repository as the current directory (the commands run there)."""
    if isinstance(x, dict):
        return {k: portable_paths(v, work) for k, v in x.items()}
    if isinstance(x, list):
        return [portable_paths(v, work) for v in x]
    if isinstance(x, str):
        return x.replace(sys.executable, "python").replace(str(work), "WORKDIR").replace(f"{REPO}/", "")
    return x


# -- running one command ---------------------------------------------------------------------------
def progress_lines(proc: Proc, rank: int) -> tuple[dict[int, int], dict[int, str], list[str]]:
    """The replay's ``[fsdp-replay] rank R: step N/M STATE`` stderr lines:
    (step -> arrival ns, step -> state, problems)."""
    arrivals: dict[int, int] = {}
    states: dict[int, str] = {}
    problems: list[str] = []
    for ns, line in proc.err:
        m = PROGRESS_RE.match(line)
        if not m:
            continue
        if int(m.group(1)) != rank:
            problems.append(f"progress line of rank {m.group(1)} in the replay of rank {rank}")
        n = int(m.group(2))
        if n in arrivals:
            problems.append(f"progress line of step {n} printed twice")
        arrivals.setdefault(n, ns)
        states.setdefault(n, m.group(4))
    return arrivals, states, problems


def gaps(arrivals: dict[int, int], first: int, last: int) -> list[float]:
    """Seconds between the lines of steps n-1 and n, for n in first..last."""
    return [
        (arrivals[n] - arrivals[n - 1]) / 1e9
        for n in range(max(first, 1), last + 1)
        if n in arrivals and n - 1 in arrivals
    ]


def missing_steps(arrivals: dict[int, int], steps: int) -> list[int]:
    return [n for n in range(steps) if n not in arrivals]


def short(xs: list[int]) -> str:
    return f"{xs[:10]}{' ...' if len(xs) > 10 else ''}"


def tail(proc: Proc, n: int = 40) -> str:
    return "\n".join(line for _ns, line in proc.err[-n:])


# -- runs ------------------------------------------------------------------------------------------
@dataclass
class Run:
    name: str  # record-2r, replay-2r-r0, replay-2r-r1, record-1r, replay-1r-r0, ...
    kind: str  # record | replay | diff
    rep: int
    rank: int | None
    exit_code: int
    wall_s: float
    cpu_s: float
    other_cpu_frac: float
    steal_frac: float
    step_times_s: list[float] = field(default_factory=list)
    step_median_s: float = float("nan")
    step_mean_s: float = float("nan")
    first_line_s: float = float("nan")  # command start -> first step line (start-up)
    after_last_line_s: float = float("nan")  # last step line -> exit (teardown, collector, report)
    losses: list[str] = field(default_factory=list)  # printed by rank 0 (recordings, replays of rank 0)
    collector_s: float | None = None  # record: "trace written to ... in X s"
    trace_bytes: int | None = None
    report: dict[str, Any] | None = None  # replay: the interesting part of report.json
    extra: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def base_run(name: str, kind: str, rep: int, rank: int | None, proc: Proc) -> Run:
    return Run(
        name=name,
        kind=kind,
        rep=rep,
        rank=rank,
        exit_code=proc.code,
        wall_s=proc.wall_s,
        cpu_s=proc.cpu_s,
        other_cpu_frac=proc.other_cpu_frac,
        steal_frac=proc.steal_frac,
    )


def set_step_times(run: Run, arrivals: dict[int, int], steps: int, warmup: int, exit_ns: int) -> None:
    times = gaps(arrivals, warmup, steps - 1)
    run.step_times_s = times
    if times:
        run.step_median_s = statistics.median(times)
        run.step_mean_s = statistics.fmean(times)
    else:
        run.problems.append("no step time measured")
    if arrivals:
        run.first_line_s = min(arrivals.values()) / 1e9
        run.after_last_line_s = (exit_ns - max(arrivals.values())) / 1e9


def train_command(nproc: int, train_args: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        str(EXAMPLE.relative_to(REPO)),
        *train_args,
    ]


def record(
    name: str,
    rep: int,
    run_dir: Path,
    nproc: int,
    train_args: list[str],
    steps: int,
    warmup: int,
    payloads: str,
    snapshot_every: int,
    timeout_s: float,
    echo: bool,
) -> Run:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    rec_args = ["--payloads", payloads]
    if snapshot_every:
        rec_args += ["--snapshot-every", str(snapshot_every)]
    cmd = [
        sys.executable,
        "-m",
        "fsdp_replay",
        "record",
        "--out",
        str(run_dir),
        *rec_args,
        "--",
        *train_command(nproc, train_args),
    ]
    proc = execute(cmd, timeout_s, echo)
    run = base_run(name, "record", rep, None, proc)
    arrivals, run.losses, run.problems = step_lines(proc)
    if proc.code != 0:
        run.problems.append(f"exit code {proc.code}")
    missing = missing_steps(arrivals, steps)
    if missing:
        run.problems.append(f"rank 0 printed no line for steps {short(missing)}")
    set_step_times(run, arrivals, steps, warmup, proc.exit_ns)
    for _ns, line in proc.err:
        m = COLLECT_RE.search(line)
        if m:
            run.collector_s = float(m.group(2))
    if run.collector_s is None:
        run.problems.append("record printed no 'trace written to ... in X s' line")
    run.trace_bytes = tree_bytes(run_dir / "trace.zarr")
    if not run.problems:
        summary, trace_problems = check_trace(run_dir, nproc, steps, payloads, snapshot_every)
        run.problems += trace_problems
        run.extra["payload_coverage"] = {
            r.get("rank"): r.get("payload_coverage") for r in summary.get("per_rank", [])
        }
    run.extra["command"] = shlex.join(cmd)
    if run.problems:
        run.problems.append(f"command: {shlex.join(cmd)}\nstderr tail:\n{tail(proc)}")
    return run


REPORT_KEYS = (
    "status",
    "reason",
    "rank",
    "from_step",
    "to_step",
    "restored_snapshot",
    "fast_forward",
    "collectives_verified",
    "recorded_steps",
    "recorded_collectives",
    "replayed_collectives",
    "first_divergence",
    "data_differences",
    "notes",
    "seconds",
)


def reached_line(proc: Proc, rank: int) -> dict[str, Any] | None:
    """The replay's ``reached step S in X s (W steps computed, K run without kernels)`` line."""
    for ns, line in proc.err:
        m = REACHED_RE.match(line)
        if m and int(m.group(1)) == rank:
            return {
                "ns": ns,
                "step": int(m.group(2)),
                "seconds": float(m.group(3)),
                "computed": int(m.group(4)),
                "skipped": int(m.group(5)),
            }
    return None


def replay(
    name: str,
    rep: int,
    run_dir: Path,
    rank: int,
    steps: int,
    warmup: int,
    timeout_s: float,
    echo: bool,
    from_step: int | None = None,
    to_step: int | None = None,
    ff_warmup: int | None = None,
) -> tuple[Run, Proc]:
    """Replay one rank; check only that it produced a report (the caller checks the outcome).
    ff_warmup: ``--fast-forward-warmup`` (None: the replay's default)."""
    report_dir = run_dir / "replays" / f"{name}-rank{rank}"
    if report_dir.exists():
        shutil.rmtree(report_dir)
    cmd = [sys.executable, "-m", "fsdp_replay", "replay", str(run_dir), "--rank", str(rank)]
    if from_step is not None:
        cmd += ["--from-step", str(from_step)]
    if to_step is not None:
        cmd += ["--to-step", str(to_step)]
    if ff_warmup is not None:
        cmd += ["--fast-forward-warmup", str(ff_warmup)]
    cmd += ["--report", str(report_dir)]
    proc = execute(cmd, timeout_s, echo)
    run = base_run(name, "replay", rep, rank, proc)
    arrivals, states, run.problems = progress_lines(proc, rank)
    _out_arrivals, run.losses, out_problems = step_lines(proc)
    run.problems += out_problems
    first = from_step or 0
    # step times over the verified steps only (a --from-step replay fast-forwards the ones before)
    verified = {n: t for n, t in arrivals.items() if states.get(n) == "verified"}
    set_step_times(run, verified, steps, first + warmup, proc.exit_ns)
    run.problems = [p for p in run.problems if p != "no step time measured"]  # judged by the caller
    if arrivals:  # start-up: to the first progress line, verified or fast-forward
        run.first_line_s = min(arrivals.values()) / 1e9
        run.after_last_line_s = (proc.exit_ns - max(arrivals.values())) / 1e9
    run.extra["command"] = shlex.join(cmd)
    run.extra["progress_states"] = {
        s: sum(1 for v in states.values() if v == s) for s in ("verified", FF_COMPUTED, FF_SKIPPED, FF_LIVE)
    }
    run.extra["progress_steps"] = sorted(arrivals)
    run.extra["arrivals_ns"] = arrivals
    run.extra["states"] = states
    run.extra["reached"] = reached_line(proc, rank)
    path = report_dir / "report.json"
    try:
        report = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        run.problems.append(f"no readable {path}: {e}")
        report = {}
    run.report = {k: report.get(k) for k in REPORT_KEYS}
    run.report["verified_steps"] = report.get("verified_steps")
    return run, proc


def fail_if(run: Run, proc: Proc | None = None) -> None:
    if run.problems:
        if proc is not None:
            run.problems.append(f"command: {shlex.join(proc.cmd)}\nstderr tail:\n{tail(proc)}")
        raise BenchError(f"run {run.name} (rep {run.rep}) is broken:\n  - " + "\n  - ".join(run.problems))


def check_bit_exact(run: Run, proc: Proc, steps: int, first: int = 0) -> None:
    """A replay must verify every step first..steps-1 and say bit-exact, exit 0 (the steps before
    ``first`` are the fast-forward's: check_fast_forward)."""
    rep = run.report or {}
    if proc.code != 0:
        run.problems.append(f"exit code {proc.code} (0 = bit-exact expected)")
    if rep.get("status") != "bit-exact":
        run.problems.append(f"report status {rep.get('status')!r} (bit-exact expected): {rep.get('reason')}")
    if rep.get("verified_steps") != list(range(first, steps)):
        run.problems.append(
            f"report verified_steps {short(rep.get('verified_steps') or [])}, expected {first}..{steps - 1}"
        )
    states = run.extra["states"]
    missing = [n for n in missing_steps(run.extra["arrivals_ns"], steps) if n >= first]
    if missing:
        run.problems.append(f"no progress line for steps {short(missing)}")
    not_verified = sorted(n for n, s in states.items() if s != "verified" and n >= first)
    if not_verified:
        run.problems.append(f"steps {short(not_verified)} not 'verified' in the progress lines")
    if first == 0 and not run.step_times_s:
        run.problems.append("no step time measured")


def expected_ff_lines(restore: int, warmup: int) -> tuple[set[int], set[int], set[int]]:
    """Steps before the restored snapshot with a progress line: (computed, of which optional, skipped).

    The warm-up steps print "computed", the skipped ones "skipped" every 100th step and for the
    last one. The last warm-up step's line is optional: the agent prints it after the skipping has
    begun, so the every-100th rule holds it back (it is in the report's counts all the same)."""
    w = min(warmup, restore)
    computed = set(range(w))
    optional = {w - 1} if 0 < w < restore and w % SKIPPED_LINE_EVERY else set()
    skipped = {s for s in range(w, restore) if (s + 1) % SKIPPED_LINE_EVERY == 0 or s == restore - 1}
    return computed, optional, skipped


def check_fast_forward(run: Run, restore: int, warmup: int) -> None:
    """A replay that restored the snapshot of step ``restore`` > 0 after ``warmup`` computed steps:
    the report's ``fast_forward`` object, the ``reached step`` line and the progress lines must
    all say that exactly steps 0..warmup-1 computed and warmup..restore-1 ran without kernels."""
    rep = run.report or {}
    ff = rep.get("fast_forward") or {}
    w = min(warmup, restore)
    if rep.get("restored_snapshot") != restore:
        run.problems.append(f"restored snapshot {rep.get('restored_snapshot')}, expected {restore}")
    if not ff:
        run.problems.append("report.json has no fast_forward object")
        return
    # this workload's batches all have one shape (drop_last): no call meets new inputs
    want = {
        "to_step": restore,
        "computed_steps": w,
        "skipped_steps": restore - w,
        "steps_computed_for_new_inputs": 0,
        "root_calls_computed": 0,
    }
    for key, value in want.items():
        if ff.get(key) != value:
            run.problems.append(f"report fast_forward.{key} = {ff.get(key)!r}, expected {value}")
    timed = ["seconds", "setup_seconds", "computed_seconds"] + (["skipped_seconds"] if restore > w else [])
    for key in timed:
        if not isinstance(ff.get(key), int | float) or ff[key] < 0:
            run.problems.append(f"report fast_forward.{key} = {ff.get(key)!r}, expected seconds")
    if restore > w:
        if (ff.get("root_calls_skipped") or 0) < restore - w:
            run.problems.append(
                f"report fast_forward.root_calls_skipped = {ff.get('root_calls_skipped')!r} for "
                f"{restore - w} skipped steps (the model must be skipped in each)"
            )
        if not ff.get("ops_as_placeholders"):
            run.problems.append("report fast_forward.ops_as_placeholders is 0 with steps skipped")
    elif ff.get("skipped_seconds") is not None or ff.get("root_calls_skipped"):
        run.problems.append(
            f"nothing to skip (warm-up {warmup}), yet fast_forward.skipped_seconds = "
            f"{ff.get('skipped_seconds')!r}, root_calls_skipped = {ff.get('root_calls_skipped')!r}"
        )
    reached = run.extra.get("reached")
    if reached is None:
        run.problems.append("no '[fsdp-replay] rank R: reached step S in X s ...' line")
    else:
        got = (reached["step"], reached["computed"], reached["skipped"])
        if got != (restore, w, restore - w):
            run.problems.append(
                f"reached line says step {got[0]}, {got[1]} computed, {got[2]} skipped; expected "
                f"{restore}, {w}, {restore - w}"
            )
        if isinstance(ff.get("seconds"), int | float) and abs(reached["seconds"] - ff["seconds"]) > 0.006:
            run.problems.append(f"reached line says {reached['seconds']} s, the report {ff['seconds']} s")
    states: dict[int, str] = run.extra["states"]
    computed, optional, skipped = expected_ff_lines(restore, w)
    got_computed = {n for n, v in states.items() if v == FF_COMPUTED}
    got_skipped = {n for n, v in states.items() if v == FF_SKIPPED}
    if not computed - optional <= got_computed <= computed:
        run.problems.append(
            f"'{FF_COMPUTED}' lines for steps {short(sorted(got_computed))}, expected {short(sorted(computed))}"
        )
    if got_skipped != skipped:
        run.problems.append(
            f"'{FF_SKIPPED}' lines for steps {short(sorted(got_skipped))}, expected {short(sorted(skipped))}"
        )
    wrong = sorted(n for n, v in states.items() if (n < restore) == (v == "verified") or v == FF_LIVE)
    if wrong:
        run.problems.append(
            f"steps {short(wrong)} have progress lines of the wrong kind: {[states[n] for n in wrong[:5]]}"
        )
    run.extra["last_warmup_line_printed"] = bool(optional & got_computed) if optional else None


def fast_forward_times(run: Run, proc: Proc) -> None:
    """Where a --from-step replay's time went: the report's fast_forward split, and on the
    command's clock the ``reached step`` line (printed once the snapshot is restored)."""
    ff = (run.report or {}).get("fast_forward") or {}
    reached = run.extra["reached"]

    def num(key: str) -> float:
        v = ff.get(key)
        return float(v) if isinstance(v, int | float) else float("nan")

    skipped = ff.get("skipped_steps") or 0
    restored_at = reached["ns"] / 1e9
    run.extra.update(
        ff_seconds=num("seconds"),
        ff_setup_s=num("setup_seconds"),
        ff_computed_s=num("computed_seconds"),
        ff_skipped_s=num("skipped_seconds") if skipped else 0.0,
        ff_skipped_ms_per_step=num("skipped_seconds") / skipped * 1e3 if skipped else float("nan"),
        ff_computed_ms_per_step=num("computed_seconds") / ff["computed_steps"] * 1e3
        if ff.get("computed_steps")
        else float("nan"),
        restored_at_s=restored_at,  # command start -> snapshot restored
        # CLI start-up and checks, the program's interpreter before the agent, the snapshot load
        outside_ff_s=restored_at - num("setup_seconds") - num("seconds"),
        after_restore_s=proc.exit_ns / 1e9 - restored_at,
        ff_counts={
            k: ff.get(k)
            for k in (
                "computed_steps",
                "skipped_steps",
                "steps_computed_for_new_inputs",
                "root_calls_skipped",
                "root_calls_computed",
                "ops_as_placeholders",
                "small_ops_computed",
                "values_served",
            )
        },
    )


def check_losses(run: Run, recorded: Run) -> None:
    """The replay of rank 0 prints the same losses as the recording (its all-reduce comes from the trace)."""
    if run.losses != recorded.losses:
        i = next(
            (i for i, (a, b) in enumerate(zip(run.losses, recorded.losses, strict=False)) if a != b),
            min(len(run.losses), len(recorded.losses)),
        )
        run.problems.append(
            f"printed losses differ from the recording's from line {i} "
            f"({len(run.losses)} vs {len(recorded.losses)} lines)"
        )


def cleanup(run_dir: Path, keep: bool) -> None:
    if not keep:
        shutil.rmtree(run_dir, ignore_errors=True)


def rest(cooldown: float) -> None:
    os.sync()  # the next run must not pay for this run's write-back
    time.sleep(cooldown)


# -- part 1: replay speed --------------------------------------------------------------------------
def part_speed(args: argparse.Namespace, work: Path, log: Any) -> tuple[list[Run], list[str]]:
    steps, warmup, reps = args.steps, args.warmup_steps, args.reps
    train_args = ["--cpu", "--steps", str(steps), *shlex.split(args.train_args)]
    runs: list[Run] = []
    checks: list[str] = []
    reference: dict[int, list[str]] = {}  # nproc -> losses of the first recording

    def group(nproc: int, rep: int) -> None:
        tag = f"{nproc}r"
        run_dir = work / f"speed-{tag}-rep{rep}"
        rec = record(
            f"record-{tag}",
            rep,
            run_dir,
            nproc,
            train_args,
            steps,
            warmup,
            "all",
            args.snapshot_every,
            args.timeout,
            args.verbose,
        )
        if nproc in reference and rec.losses != reference[nproc]:
            rec.problems.append(
                "printed losses differ from the first recording's (the run is not deterministic)"
            )
        fail_if(rec)
        reference.setdefault(nproc, rec.losses)
        runs.append(rec)
        log(rec)
        rest(args.cooldown)
        for rank in range(nproc):
            rp, proc = replay(
                f"replay-{tag}-r{rank}", rep, run_dir, rank, steps, warmup, args.timeout, args.verbose
            )
            check_bit_exact(rp, proc, steps)
            if rank == 0:
                check_losses(rp, rec)
            fail_if(rp, proc)
            runs.append(rp)
            log(rp)
            rest(args.cooldown)
        cleanup(run_dir, args.keep)

    for rep in range(reps):
        order = [2, 1] if rep % 2 == 0 else [1, 2]
        for nproc in order:
            group(nproc, rep)
    checks += [
        f"{2 * reps} recordings ({reps} x 2 ranks, {reps} x 1 rank, --payloads all --snapshot-every "
        f"{args.snapshot_every}): exit 0, rank 0 printed every step, `inspect --json` shows every rank complete "
        "with all steps, no damage/agent errors/drops, payloads for every collective output, the expected snapshots",
        "printed losses identical in every repetition (per world size)",
        f"{3 * reps} whole replays (rank 0 and rank 1 of each 2-rank trace, rank 0 of each 1-rank trace): exit 0, "
        f"report.json status bit-exact with verified_steps = 0..{steps - 1}, a `verified` progress line for "
        "every step",
        "the replays of rank 0 printed the same `step N loss X lr Y` lines as the recording",
    ]
    return runs, checks


def summarize_speed(runs: list[Run]) -> dict[str, Any]:
    by = {(r.name, r.rep): r for r in runs}
    names = ["record-2r", "replay-2r-r0", "replay-2r-r1", "record-1r", "replay-1r-r0"]
    reference = {"replay-2r-r0": "record-2r", "replay-2r-r1": "record-2r", "replay-1r-r0": "record-1r"}
    out: dict[str, Any] = {}
    for name in names:
        rs = [r for r in runs if r.name == name]
        if not rs:
            continue
        s: dict[str, Any] = {
            "runs": len(rs),
            "step_median_s": spread([r.step_median_s for r in rs]),
            "step_mean_s": spread([r.step_mean_s for r in rs]),
            "wall_s": spread([r.wall_s for r in rs]),
            "first_line_s": spread([r.first_line_s for r in rs]),
            "after_last_line_s": spread([r.after_last_line_s for r in rs]),
            "cpu_s": spread([r.cpu_s for r in rs]),
        }
        if name in reference:
            ref = reference[name]
            pairs = [(r, by[(ref, r.rep)]) for r in rs if (ref, r.rep) in by]
            s["versus"] = ref
            s["ratio_paired"] = spread([r.step_median_s / b.step_median_s for r, b in pairs])
            s["ratio_mean_paired"] = spread([r.step_mean_s / b.step_mean_s for r, b in pairs])
            s["ratio_wall_paired"] = spread([r.wall_s / b.wall_s for r, b in pairs])
            s["report_seconds"] = spread([float((r.report or {}).get("seconds") or "nan") for r in rs])
        else:
            s["collector_s"] = spread([r.collector_s or 0.0 for r in rs])
            s["trace_bytes"] = spread([float(r.trace_bytes or 0) for r in rs])
        out[name] = s
    return out


# -- part 2: time to the first divergence ----------------------------------------------------------
def part_divergence(
    args: argparse.Namespace, work: Path, log: Any
) -> tuple[dict[str, Any], list[Run], list[str]]:
    n, k = args.long_steps, args.noise_step
    lo, hi = max(0, k - 10), min(n - 1, k + 10)
    window = f"steps:{lo}-{hi}"
    snap_every = args.long_snapshot_every
    base = [*TINY_ARGS, "--steps", str(n)]
    noise = ["--wallclock-noise-at-step", str(k), "--noise-rank", str(NOISE_RANK)]
    runs: list[Run] = []
    checks: list[str] = []
    dirs = {x: work / f"long-{x}" for x in ("clean", "noisy", "noisy-window")}
    warm = args.warmup_steps

    clean = record(
        "record-long-clean", 0, dirs["clean"], 2, base, n, warm, "none", 0, args.timeout, args.verbose
    )
    fail_if(clean)
    runs.append(clean)
    log(clean)
    rest(args.cooldown)
    noisy = record(
        "record-long-noisy",
        0,
        dirs["noisy"],
        2,
        [*base, *noise],
        n,
        warm,
        "none",
        0,
        args.timeout,
        args.verbose,
    )
    if noisy.losses[:k] != clean.losses[:k]:
        noisy.problems.append(f"printed losses differ from the clean run's before step {k}")
    fail_if(noisy)
    runs.append(noisy)
    log(noisy)
    printed_diff = next(
        (i for i, (a, b) in enumerate(zip(noisy.losses, clean.losses, strict=False)) if a != b), None
    )
    rest(args.cooldown)

    # diff: the whole CLI process, timed by wall clock
    diff_runs: list[dict[str, Any]] = []
    diff_cmd = [sys.executable, "-m", "fsdp_replay", "diff", str(dirs["clean"]), str(dirs["noisy"]), "--json"]
    for i in range(args.diff_reps):
        proc = execute(diff_cmd, args.timeout, False)
        problems: list[str] = []
        res: dict[str, Any] = {}
        try:
            res = json.loads("\n".join(line for _ns, line in proc.out))
        except json.JSONDecodeError as e:
            problems.append(f"diff printed no JSON: {e}")
        first = res.get("first") or {}
        per_rank = {pr.get("rank"): pr for pr in res.get("ranks", [])}
        r1_first = (per_rank.get(NOISE_RANK) or {}).get("first") or {}
        if proc.code != 1:
            problems.append(f"diff exit code {proc.code} (1 = divergence found expected)")
        if not res.get("diverged"):
            problems.append("diff found no divergence")
        if first.get("rank") != NOISE_RANK or first.get("step") != k:
            problems.append(f"diff's first divergence is rank {first.get('rank')} step {first.get('step')}")
        if r1_first.get("step") != k:
            problems.append(f"diff's first divergence on rank {NOISE_RANK} is at step {r1_first.get('step')}")
        entry = {
            "i": i,
            "wall_s": proc.wall_s,
            "cpu_s": proc.cpu_s,
            "exit_code": proc.code,
            "other_cpu_frac": proc.other_cpu_frac,
            "steal_frac": proc.steal_frac,
            "message": res.get("message"),
            "first": {kk: first.get(kk) for kk in ("rank", "kind", "step", "micro", "seq", "op")},
            "ranks_diverged_at": {
                str(r): ((pr.get("first") or {}).get("step")) for r, pr in per_rank.items()
            },
        }
        diff_runs.append(entry)
        print(
            f"  diff #{i}: {proc.wall_s:.2f} s wall, exit {proc.code}: {res.get('message')}",
            flush=True,
        )
        if problems:
            raise BenchError(
                "diff is broken:\n  - "
                + "\n  - ".join(problems)
                + f"\ncommand: {shlex.join(diff_cmd)}\nstderr tail:\n{tail(proc)}"
            )
        time.sleep(args.cooldown)

    win = record(
        "record-long-window",
        0,
        dirs["noisy-window"],
        2,
        [*base, *noise],
        n,
        warm,
        window,
        snap_every,
        args.timeout,
        args.verbose,
    )
    fail_if(win)
    runs.append(win)
    log(win)
    rest(args.cooldown)
    restore = max(s for s in range(0, k + 1, snap_every)) if snap_every else 0

    replays: list[Run] = []
    for rep in range(args.long_reps):
        rp, proc = replay(
            "replay-long-from", rep, dirs["noisy-window"], NOISE_RANK, n, warm, args.timeout, args.verbose, k
        )
        report = rp.report or {}
        fd = report.get("first_divergence") or {}
        if proc.code != 1:
            rp.problems.append(f"exit code {proc.code} (1 = diverged expected)")
        if report.get("status") != "diverged":
            rp.problems.append(
                f"report status {report.get('status')!r} (diverged expected): {report.get('reason')}"
            )
        if fd.get("rank") != NOISE_RANK or fd.get("step") != k:
            rp.problems.append(f"first divergence at rank {fd.get('rank')} step {fd.get('step')}")
        check_fast_forward(rp, restore, FF_WARMUP_DEFAULT)
        fail_if(rp, proc)
        fast_forward_times(rp, proc)
        replays.append(rp)
        runs.append(rp)
        log(rp)
        rest(args.cooldown)

    for d in dirs.values():
        cleanup(d, args.keep)

    checks += [
        f"3 recordings of {n} steps (tiny model): exit 0, rank 0 printed every step, `inspect --json` complete "
        f"with all steps and no damage/errors/drops; no payloads with --payloads none, payloads for at least "
        f"{window} with --payloads {window} (and snapshots every {snap_every} steps) in the third",
        f"the noisy run printed the same losses as the clean one before step {k}",
        f"every `diff` exited 1 and named rank {NOISE_RANK} step {k} as the first divergence",
        f"every `replay --rank {NOISE_RANK} --from-step {k}` exited 1 with status diverged, first divergence at "
        f"rank {NOISE_RANK} step {k}, restored the snapshot of step {restore}; {FF_CHECK_TEXT}",
    ]
    summary = {
        "steps": n,
        "noise_step": k,
        "noise_rank": NOISE_RANK,
        "payload_window": window,
        "snapshot_every": snap_every,
        "restored_snapshot": restore,
        "fast_forward_warmup": FF_WARMUP_DEFAULT,
        "first_printed_loss_difference_step": printed_diff,
        "recorded_step_median_s": {r.name: r.step_median_s for r in (clean, noisy, win)},
        "recording_wall_s": {r.name: r.wall_s for r in (clean, noisy, win)},
        "trace_bytes": {r.name: r.trace_bytes for r in (clean, noisy, win)},
        "window_payload_coverage": win.extra.get("payload_coverage"),
        "diff_command": shlex.join(diff_cmd),
        "diff": diff_runs,
        "diff_wall_s": spread([d["wall_s"] for d in diff_runs]),
        "diff_cpu_s": spread([d["cpu_s"] for d in diff_runs]),
        "replay_command": replays[0].extra["command"] if replays else None,
        "replay_wall_s": spread([r.wall_s for r in replays]),
        "replay_report_seconds": spread([float((r.report or {}).get("seconds") or "nan") for r in replays]),
        **{f"replay_{key}": spread([r.extra[key] for r in replays]) for key in FF_TIME_KEYS},
        "replay_fast_forward_counts": replays[0].extra["ff_counts"] if replays else None,
        "replay_first_divergence": (replays[0].report or {}).get("first_divergence") if replays else None,
    }
    return summary, runs, checks


# -- part 3: time to reach step S -------------------------------------------------------------------
def reach_configs(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(mode, S) of every replay of a repetition: the fast-forward at every S, then the baseline."""
    return [("fast-forward", s) for s in args.reach_at] + [("computed", s) for s in args.reach_baseline_at]


def part_reach(args: argparse.Namespace, work: Path, log: Any) -> tuple[dict[str, Any], list[Run], list[str]]:
    n, every = args.reach_steps, args.reach_snapshot_every
    targets = args.reach_at
    payloads = "steps:" + ",".join(f"{s}-{s + 1}" for s in targets)
    run_dir = work / "reach"
    runs: list[Run] = []
    rec = record(
        "record-reach",
        0,
        run_dir,
        2,
        [*TINY_ARGS, "--steps", str(n)],
        n,
        args.warmup_steps,
        payloads,
        every,
        args.timeout,
        args.verbose,
    )
    fail_if(rec)
    runs.append(rec)
    log(rec)
    rest(args.cooldown)

    configs = reach_configs(args)
    replays: list[Run] = []
    for rep in range(args.reach_reps):
        shift = rep % len(configs)
        for mode, target in configs[shift:] + configs[:shift]:
            warm = target if mode == "computed" else None
            rp, proc = replay(
                f"reach-{'ff' if warm is None else 'computed'}-S{target}",
                rep,
                run_dir,
                NOISE_RANK,
                target + 2,
                args.warmup_steps,
                args.timeout,
                args.verbose,
                from_step=target,
                to_step=target + 1,
                ff_warmup=warm,
            )
            check_bit_exact(rp, proc, target + 2, first=target)
            check_fast_forward(rp, target, FF_WARMUP_DEFAULT if warm is None else warm)
            fail_if(rp, proc)
            fast_forward_times(rp, proc)
            rp.extra.update(mode=mode, target=target)
            replays.append(rp)
            runs.append(rp)
            log(rp)
            rest(args.cooldown)
    cleanup(run_dir, args.keep)

    step_s = rec.step_median_s
    by_config: dict[str, Any] = {}
    for mode, target in configs:
        rs = [r for r in replays if r.extra["mode"] == mode and r.extra["target"] == target]
        by_config[f"{mode} S={target}"] = {
            "mode": mode,
            "target": target,
            "runs": len(rs),
            "command": rs[0].extra["command"],
            "counts": rs[0].extra["ff_counts"],
            "wall_s": spread([r.wall_s for r in rs]),
            "report_seconds": spread([float((r.report or {}).get("seconds") or "nan") for r in rs]),
            **{key: spread([r.extra[key] for r in rs]) for key in FF_TIME_KEYS},
            "ratio_to_recorded_step": spread([r.extra["ff_seconds"] / step_s for r in rs]),
        }
    # The growth in S: a least-squares line through every fast-forward run's seconds against its
    # skipped steps, and per repetition the slope between the smallest and the largest S.
    ff_runs = [r for r in replays if r.extra["mode"] == "fast-forward"]
    xs = [float(r.extra["ff_counts"]["skipped_steps"]) for r in ff_runs]
    ys = [r.extra["ff_seconds"] for r in ff_runs]
    lo, hi = min(targets), max(targets)
    per_rep: list[float] = []
    increases: list[float] = []
    for rep in range(args.reach_reps if hi > lo else 0):
        a = next(r for r in ff_runs if r.rep == rep and r.extra["target"] == lo).extra["ff_seconds"]
        b = next(r for r in ff_runs if r.rep == rep and r.extra["target"] == hi).extra["ff_seconds"]
        increases.append(b - a)
        per_rep.append((b - a) / (hi - lo))
    slope_s = statistics.linear_regression(xs, ys).slope if len(set(xs)) > 1 else float("nan")
    increase = spread(increases)
    summary = {
        "steps": n,
        "targets": targets,
        "baseline_targets": args.reach_baseline_at,
        "snapshot_every": every,
        "payloads": payloads,
        "reps": args.reach_reps,
        "rank": NOISE_RANK,
        "fast_forward_warmup": FF_WARMUP_DEFAULT,
        "record_command": rec.extra["command"],
        "recorded_step_median_s": step_s,
        "recorded_step_mean_s": rec.step_mean_s,
        "recorded_step_iqr_s": list(quantiles(rec.step_times_s))[::2],
        "recording_wall_s": rec.wall_s,
        "trace_bytes": rec.trace_bytes,
        "payload_coverage": rec.extra.get("payload_coverage"),
        "by_config": by_config,
        "slope_s_per_skipped_step_fit": slope_s,
        "slope_s_per_skipped_step_per_rep": spread(per_rep),
        "slope_fraction_of_recorded_step": slope_s / step_s,
        "increase_s": {"from": lo, "to": hi, **increase},
    }
    checks = [
        f"1 recording of {n} steps (tiny model, 2 ranks, --payloads {payloads} --snapshot-every {every}): exit 0, "
        "rank 0 printed every step, `inspect --json` complete with all steps, no damage/errors/drops, payloads "
        "for at least those steps, snapshots every "
        f"{every} steps",
        f"{len(replays)} replays `replay --rank {NOISE_RANK} --from-step S --to-step S+1` "
        f"({args.reach_reps} x S = {', '.join(map(str, targets))} with the default fast-forward, and S = "
        f"{', '.join(map(str, args.reach_baseline_at)) or 'none'} with --fast-forward-warmup S): every one exited "
        "0 with status bit-exact, verified_steps = [S, S+1] and a `verified` progress line for both; "
        + FF_CHECK_TEXT.replace("the warm-up", "the warm-up (2, or S with --fast-forward-warmup S)", 1),
    ]
    return summary, runs, checks


# -- verdicts --------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run (~2 min): 12 steps, 1 repetition, a 200-step long trace; checks that everything works",
    )
    p.add_argument("--steps", type=int, default=None, help="steps per speed run (default 30; --quick 12)")
    p.add_argument(
        "--reps", type=int, default=None, help="repetitions of the speed runs (default 5; --quick 1)"
    )
    p.add_argument("--warmup-steps", type=int, default=3, help="first steps not measured (default 3)")
    p.add_argument(
        "--snapshot-every", type=int, default=10, help="snapshots in the speed recordings (default 10)"
    )
    p.add_argument(
        "--train-args",
        default="",
        help="extra flags for the speed runs of examples/train_fsdp.py, written with '=': "
        "--train-args='--d-model 256' (default: the example's defaults)",
    )
    p.add_argument(
        "--long-steps", type=int, default=None, help="steps of the long traces (default 1000; --quick 200)"
    )
    p.add_argument(
        "--noise-step",
        type=int,
        default=None,
        help="step of the wall-clock noise (default 90%% of --long-steps)",
    )
    p.add_argument(
        "--long-snapshot-every",
        type=int,
        default=None,
        help="snapshots in the payload-window recording (default --long-steps / 10)",
    )
    p.add_argument("--diff-reps", type=int, default=None, help="diff runs (default 5; --quick 3)")
    p.add_argument(
        "--long-reps", type=int, default=None, help="replay --from-step runs (default 3; --quick 1)"
    )
    p.add_argument(
        "--reach-at",
        default=None,
        help="part 3: the steps S replayed from, comma-separated (default 10,100,1000; --quick 10,100)",
    )
    p.add_argument(
        "--reach-baseline-at",
        default=None,
        help="part 3: the S also replayed with --fast-forward-warmup S, computing every step before S "
        "(default 10,100; --quick 10; '' for none)",
    )
    p.add_argument(
        "--reach-steps", type=int, default=None, help="part 3: steps of its recording (default max S + 10)"
    )
    p.add_argument(
        "--reach-snapshot-every",
        type=int,
        default=10,
        help="part 3: snapshots in its recording (default 10; every S must be a multiple)",
    )
    p.add_argument(
        "--reach-reps",
        type=int,
        default=None,
        help="part 3: repetitions of its replays (default 5; --quick 1)",
    )
    p.add_argument(
        "--parts",
        default="speed,divergence,reach",
        help="comma-separated subset of: speed, divergence, reach (default all three)",
    )
    p.add_argument("--workdir", default=None, help="where runs are recorded (default: a temporary folder)")
    p.add_argument(
        "--keep", action="store_true", help="keep every run's folder (default: delete after measuring)"
    )
    p.add_argument(
        "--cooldown", type=float, default=1.0, help="seconds of rest after each run (after a sync)"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a run is stopped as hung")
    p.add_argument("--results", default=None, help="output path stem (default bench/results/replay[.quick])")
    p.add_argument("-v", "--verbose", action="store_true", help="echo the runs' output")
    args = p.parse_args(argv)
    args.steps = args.steps or (12 if args.quick else 30)
    args.reps = args.reps or (1 if args.quick else 5)
    args.long_steps = args.long_steps or (200 if args.quick else 1000)
    args.noise_step = args.noise_step if args.noise_step is not None else round(0.9 * args.long_steps)
    args.long_snapshot_every = args.long_snapshot_every or max(1, args.long_steps // 10)
    args.diff_reps = args.diff_reps or (3 if args.quick else 5)
    args.long_reps = args.long_reps or (1 if args.quick else 3)

    def steps_list(text: str) -> list[int]:
        try:
            return sorted({int(x) for x in text.split(",") if x.strip()})
        except ValueError:
            p.error(f"expected comma-separated step numbers, not {text!r}")

    reach_at = args.reach_at if args.reach_at is not None else ("10,100" if args.quick else "10,100,1000")
    baseline = args.reach_baseline_at
    baseline = baseline if baseline is not None else ("10" if args.quick else "10,100")
    args.reach_at, args.reach_baseline_at = steps_list(reach_at), steps_list(baseline)
    args.reach_steps = args.reach_steps or max(args.reach_at, default=0) + 10
    args.reach_reps = args.reach_reps or (1 if args.quick else 5)
    every = args.reach_snapshot_every
    for s in {*args.reach_at, *args.reach_baseline_at}:
        if s <= 0 or every <= 0 or s % every or s + 2 > args.reach_steps:
            p.error(
                f"step {s}: every S of --reach-at and --reach-baseline-at must be a positive multiple of "
                f"--reach-snapshot-every ({every}) with S + 2 <= --reach-steps ({args.reach_steps})"
            )
    if not args.reach_at:
        p.error("--reach-at names no step")
    return args


def main(argv: list[str] | None = None) -> int:
    from replay_report import flat_verdict, ratio_verdict, reach_verdict, render_markdown, time_verdict

    args = parse_args(argv)
    parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    if not parts or parts - {"speed", "divergence", "reach"}:
        print(f"bench: --parts takes speed, divergence and/or reach, not {args.parts!r}", file=sys.stderr)
        return 2
    if args.steps < args.warmup_steps + 2:
        print(f"bench: --steps must be at least {args.warmup_steps + 2}", file=sys.stderr)
        return 2
    if not 0 < args.noise_step < args.long_steps:
        print("bench: --noise-step must be inside the long run", file=sys.stderr)
        return 2
    if args.long_snapshot_every > args.noise_step:
        print(
            "bench: --long-snapshot-every must leave a snapshot after step 0 by --noise-step", file=sys.stderr
        )
        return 2
    stem = Path(args.results) if args.results else RESULTS_DIR / ("replay.quick" if args.quick else "replay")
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-replay-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    load_before = os.getloadavg()
    if load_before[0] > 0.5:
        print(
            f"bench: WARNING: load average {load_before[0]:.2f} before starting: the machine is not quiet",
            file=sys.stderr,
        )
    plan = []
    if "speed" in parts:
        plan.append(
            f"speed: {args.reps} repetition(s) x (record 2 ranks + 2 replays, record 1 rank + 1 replay), "
            f"{args.steps} steps"
        )
    if "divergence" in parts:
        plan.append(
            f"divergence: 3 recordings of {args.long_steps} steps, {args.diff_reps} diff(s), "
            f"{args.long_reps} replay(s) from step {args.noise_step}"
        )
    if "reach" in parts:
        plan.append(
            f"reach: 1 recording of {args.reach_steps} steps, {args.reach_reps} repetition(s) x "
            f"{len(reach_configs(args))} replays (from S = {args.reach_at}, computed from S = "
            f"{args.reach_baseline_at})"
        )
    print(f"bench: {'; '.join(plan)}; runs in {work}", flush=True)
    all_runs: list[Run] = []

    def log(r: Run) -> None:
        all_runs.append(r)
        rep = r.report or {}
        what = rep.get("status") or (f"collector {r.collector_s}s, trace {fmt_bytes(r.trace_bytes)}")
        ff = rep.get("fast_forward") or {}
        if ff:
            what += (
                f"; reached step {ff.get('to_step')} in {ff.get('seconds')} s (set-up {ff.get('setup_seconds')} s, "
                f"{ff.get('computed_steps')} computed in {ff.get('computed_seconds')} s, {ff.get('skipped_steps')} "
                f"skipped in {ff.get('skipped_seconds')} s)"
            )
        print(
            f"  [{time.time() - started:6.0f}s] rep {r.rep} {r.name:20s}: median step {fmt_ms(r.step_median_s)} ms, "
            f"mean {fmt_ms(r.step_mean_s)} ms, wall {r.wall_s:.1f}s, start-up {fmt_s(r.first_line_s)}s; {what}; "
            f"other CPU {r.other_cpu_frac:.0%}",
            flush=True,
        )

    checks: list[str] = []
    speed_runs: list[Run] = []
    divergence: dict[str, Any] = {}
    reach: dict[str, Any] = {}
    try:
        if "speed" in parts:
            speed_runs, c = part_speed(args, work, log)
            checks += c
        if "divergence" in parts:
            divergence, _runs, c = part_divergence(args, work, log)
            checks += c
        if "reach" in parts:
            reach, _runs, c = part_reach(args, work, log)
            checks += c
    except BenchError as e:
        print(f"bench: {e}", file=sys.stderr)
        print(f"bench: the runs' folders are kept under {work}", file=sys.stderr)
        return 1
    if not args.keep and not args.workdir:
        shutil.rmtree(work, ignore_errors=True)

    speed_summary = summarize_speed(speed_runs) if speed_runs else {}
    verdicts: list[dict[str, Any]] = []
    if speed_summary:
        for rank in (0, 1):
            verdicts.append(
                ratio_verdict(
                    f"rank {rank} of the 2-rank job replayed alone",
                    TARGET_RATIO_TEXT,
                    speed_summary.get(f"replay-2r-r{rank}"),
                    args.quick,
                )
            )
        verdicts.append(
            ratio_verdict(
                "1-rank job replayed (apples to apples: one process each)",
                TARGET_RATIO_TEXT + " (same target, like for like)",
                speed_summary.get("replay-1r-r0"),
                args.quick,
            )
        )
    if divergence:
        verdicts.append(
            time_verdict("`fsdp-replay diff`", divergence["diff_wall_s"], args.long_steps, args.quick)
        )
        verdicts.append(
            time_verdict(
                f"`fsdp-replay replay --from-step {args.noise_step}` (fast-forward included)",
                divergence["replay_wall_s"],
                args.long_steps,
                args.quick,
            )
        )
    if reach:
        for x in reach["by_config"].values():
            if x["mode"] == "fast-forward":
                verdicts.append(reach_verdict(x, reach["recorded_step_median_s"], args.quick))
        if len(reach["targets"]) > 1:
            verdicts.append(flat_verdict(reach, args.quick))
    defaults = example_defaults()
    model_keys = ("d_model", "layers", "heads", "seq_len", "batch_size", "grad_accum", "vocab", "workers")
    workload_model = ", ".join(f"{k}={defaults[k]}" for k in model_keys if k in defaults)
    runs_doc = []
    for r in all_runs:
        d = asdict(r)
        d["extra"] = {
            k: v for k, v in d["extra"].items() if k not in ("arrivals_ns", "states", "progress_steps")
        }
        runs_doc.append(d)
    doc: dict[str, Any] = {
        "benchmark": "replay",
        "command_line": portable_command(),
        "cwd": "the repository root",
        "date": datetime.datetime.now(datetime.timezone.utc).astimezone().isoformat(timespec="seconds"),
        "elapsed_s": time.time() - started,
        "machine": machine_info(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "parameters": {
            "quick": args.quick,
            "parts": sorted(parts),
            "steps": args.steps,
            "warmup_steps": args.warmup_steps,
            "reps": args.reps,
            "snapshot_every": args.snapshot_every,
            "speed_train_args": ["--cpu", "--steps", str(args.steps), *shlex.split(args.train_args)],
            "workload_model": workload_model + (f"; plus {args.train_args}" if args.train_args else ""),
            "example_defaults": defaults,
            "long_steps": args.long_steps,
            "noise_step": args.noise_step,
            "long_snapshot_every": args.long_snapshot_every,
            "long_train_args": [*TINY_ARGS, "--steps", str(args.long_steps)],
            "diff_reps": args.diff_reps,
            "long_reps": args.long_reps,
            "reach_at": args.reach_at,
            "reach_baseline_at": args.reach_baseline_at,
            "reach_steps": args.reach_steps,
            "reach_snapshot_every": args.reach_snapshot_every,
            "reach_reps": args.reach_reps,
            "reach_train_args": [*TINY_ARGS, "--steps", str(args.reach_steps)],
            "env": {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
            "timing_source": "recording: wall time between rank 0's consecutive 'step N' stdout lines; replay: "
            "between the replay's consecutive '[fsdp-replay] rank R: step N/M verified' stderr lines; both read "
            "as they arrive",
        },
        "verdicts": verdicts,
        "speed": {"summary": speed_summary},
        "divergence": divergence,
        "reach": reach,
        "checks": checks,
        "runs": runs_doc,
    }
    stem.parent.mkdir(parents=True, exist_ok=True)
    md_path, json_path = stem.with_name(stem.name + ".md"), stem.with_name(stem.name + ".json")
    doc = portable_paths(doc, work)
    json_path.write_text(json.dumps(doc, indent=2) + "\n")
    md = render_markdown(doc)
    md_path.write_text(md)
    print()
    print(md)
    print(f"bench: wrote {md_path} and {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
