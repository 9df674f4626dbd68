"""Recording overhead of ``fsdp-replay record`` on the reference workload, as a ratio to the unrecorded run.

Runs ``examples/train_fsdp.py`` (2 CPU ranks, gloo, ``torchrun --standalone --nproc_per_node 2``)
in four configurations, interleaved round-robin over several repetitions (the order rotates every
repetition, so each configuration takes each position equally often and machine noise or drift
hits all of them alike):

* ``baseline``:  unrecorded;
* ``meta``:      ``fsdp-replay record --payloads none`` (collective metadata + fingerprints);
* ``payloads``:  ``--payloads all`` (+ collective outputs and batches of every step);
* ``snapshots``: ``--payloads all --snapshot-every 10`` (+ a state snapshot every 10 steps).

Step time is measured from inside the training run, without changing the script: rank 0 prints
one line per optimizer step (``step N loss X lr Y``), flushed (``PYTHONUNBUFFERED=1``); this
script reads that output as it arrives and takes the wall time between consecutive step lines.
Process start-up, the first ``--warmup-steps`` steps (more for a configuration with a longer
warm-up of its own: the flight recorder's ``window4`` fills its window, and pins its memory on a
GPU, in its first 10 steps), the process teardown and the collector (spool -> Zarr, after the
run) are therefore excluded. Each run's statistic is its median step
time (robust to one-off stalls); the mean over the same steps is reported too, because the
periodic costs (a snapshot every 10 steps, the DataLoader re-forking its workers every epoch)
are in the mean but mostly not in the median.

Every recorded run is checked before it counts: exit code 0, every step line present, and
``fsdp-replay inspect --json`` must show both ranks complete with all steps, no damage, no agent
errors, no dropped payloads, and the expected payload coverage and snapshots. The printed losses
of every run must equal those of the first baseline run (recording must not change results).
Any failure stops the benchmark with a non-zero exit code and keeps that run's folder.

Results: ``bench/results/record_overhead.{md,json}`` (``--quick``: ``record_overhead.quick.*``,
so a smoke run never overwrites a real measurement). See ``bench/README.md``.
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
    example_defaults,
    execute,
    fmt_bytes,
    machine_info,
    portable_command,
    quantiles,
    step_lines,
)
from benchlib import (
    check_trace as shared_check_trace,
)

RESULTS_DIR = REPO / "bench" / "results"

TARGET_CONFIG = "meta"
# Configurations that measure CUDA capture: on the CPU they would measure nothing.
CUDA_ONLY = frozenset(
    {
        "meta-cupti",
        "meta-cupti-python",
        "torch-profiler",
        "meta-torchfp",
        "meta-nocupti",
        "meta-attached",
        "window4-nocupti",
        "window4-attached",
        "meta-python-attached",
        "window4-smcopy",
    }
)
TARGET_RATIO = 1.03
TARGET_TEXT = "metadata + fingerprints within 3% of the unrecorded step time"
NOISY_FRACTION = 0.05  # other processes using more than this share of the CPUs make a run noisy

COLLECT_RE = re.compile(r"trace written to (.+) in ([0-9.]+)s")


@dataclass(frozen=True)
class Config:
    name: str
    record_args: tuple[str, ...] | None  # None: unrecorded
    description: str
    train_extra: tuple[str, ...] = ()  # more arguments for the example (another unrecorded program)
    wrapper: str = ""  # a script the example runs under (REPO-relative), e.g. a profiler's
    # what it is also compared with, run for run (its own cost): the first of these in the run
    reference: str | tuple[str, ...] = "baseline"
    env: tuple[str, ...] = ()  # NAME=VALUE settings of the recorded run
    warmup: int = 0  # steps of its own warm-up, skipped whatever --warmup-steps says

    @property
    def recorded(self) -> bool:
        return self.record_args is not None

    @property
    def payloads(self) -> bool:
        args = self.record_args or ()
        return "--payloads" in args and args[args.index("--payloads") + 1] == "all"

    @property
    def snapshot_every(self) -> int:
        args = self.record_args or ()
        if "--snapshot-every" in args:
            return int(args[args.index("--snapshot-every") + 1])
        return 0


WINDOW_WARMUP = 4 + 4 + 2
"""A window:4 run's warm-up: N + interval + 2 steps (the window, the snapshot interval, the GPU's
late non-finite check) fill the window before the first payloads are let go of; on a GPU those
steps also pin its memory (docs/configuration.md), at about 0.4 s a GB on the H200."""

CONFIGS: tuple[Config, ...] = (
    Config("baseline", None, "unrecorded"),
    Config(
        "deterministic",
        None,
        "unrecorded, torch.use_deterministic_algorithms(True): what bit-exactness costs without the tape",
        ("--deterministic",),
    ),
    Config(
        "meta",
        ("--payloads", "none"),
        "metadata + fingerprints only (the hot CPU collectives by the C++ kernel)",
    ),
    Config(
        "meta-nosync",
        ("--payloads", "none", "--no-sync-steps"),
        "metadata + fingerprints, without waiting for each step's records (weaker crash guarantee)",
    ),
    Config(
        "meta-nocupti",
        ("--payloads", "none", "--cupti", "off"),
        "metadata + fingerprints, without CUPTI (--cupti off; the default captures step 1): what the "
        "default capture window leaves in the steps after it",
        reference="meta",
    ),
    Config(
        "meta-attached",
        ("--payloads", "none"),
        "metadata + fingerprints, CUPTI kept attached after its default window (FSDP_REPLAY_CUPTI_DETACH=0; "
        "the default lets it go): what its interception of every CUDA call after the window costs",
        env=("FSDP_REPLAY_CUPTI_DETACH=0",),
        reference="meta",
    ),
    Config(
        "meta-python",
        ("--payloads", "none", "--no-cxx-kernel"),
        "metadata + fingerprints, every collective recorded by the Python kernels (no C++ kernel)",
    ),
    Config(
        "meta-python-attached",
        ("--payloads", "none", "--no-cxx-kernel"),
        "as meta-python, CUPTI kept attached after its default window (FSDP_REPLAY_CUPTI_DETACH=0): the "
        "metadata-only reference of window4-attached",
        env=("FSDP_REPLAY_CUPTI_DETACH=0",),
        reference="meta-python",
    ),
    Config(
        "window4",
        ("--payloads", "window:4"),
        "the flight recorder: every step's payloads held in memory (the last 4 steps and a snapshot), "
        "none written by a run that ends well (the Python kernels: the C++ kernel keeps no payloads)",
        reference="meta-python",  # its own cost: over metadata-only with the same kernels
        warmup=WINDOW_WARMUP,
    ),
    Config(
        "window4-notapebytes",
        ("--payloads", "window:4", "--tape-payloads", "none"),
        "the flight recorder without the taped results' bytes (--tape-payloads none: their fingerprints "
        "only): what keeping about 1 GB of them a step costs, against window4",
        reference="meta-python",
        warmup=WINDOW_WARMUP,
    ),
    Config(
        "window4-nocupti",
        ("--payloads", "window:4", "--cupti", "off"),
        "the flight recorder without CUPTI (--cupti off): session 16's profile found libcupti in more "
        "of the program's CUDA calls of a window4 run than of a metadata-only one, long after step 1's window",
        reference="meta-python",
        warmup=WINDOW_WARMUP,
    ),
    Config(
        "window4-attached",
        ("--payloads", "window:4"),
        "the flight recorder as window4, CUPTI kept attached after its default window "
        "(FSDP_REPLAY_CUPTI_DETACH=0): its interception of every CUDA call goes on after the window",
        reference=("meta-python-attached", "meta-python"),
        env=("FSDP_REPLAY_CUPTI_DETACH=0",),
        warmup=WINDOW_WARMUP,
    ),
    Config(
        "window4-smcopy",
        ("--payloads", "window:4"),
        "the flight recorder as window4, its device-to-device copies on the program's stream made by a "
        "kernel on the SMs (FSDP_REPLAY_SM_COPY=1) rather than a memcpy that may queue on a copy engine "
        "behind the side stream's host copies (about 1 GB a step)",
        reference="meta-python",
        env=("FSDP_REPLAY_SM_COPY=1",),
        warmup=WINDOW_WARMUP,
    ),
    Config(
        "window4-ring2g",
        ("--payloads", "window:4"),
        "the flight recorder as window4, with a 2 GiB payload ring (FSDP_REPLAY_PAYLOAD_RING_BYTES): the "
        "reference step's payloads in flight (about 1 GB a step) overflow the default 256 MiB ring",
        reference="meta-python",
        env=("FSDP_REPLAY_PAYLOAD_RING_BYTES=2147483648",),
        warmup=WINDOW_WARMUP,
    ),
    Config(
        "meta-notape",
        ("--payloads", "none", "--no-tape"),
        "metadata + fingerprints, nondeterministic kernels not taped (--no-tape)",
    ),
    Config(
        "meta-torchfp",
        ("--payloads", "none"),
        "metadata + fingerprints, the taped kernels' fingerprints by torch ops instead of the one "
        "Triton launch (FSDP_REPLAY_TRITON=0)",
        env=("FSDP_REPLAY_TRITON=0",),
        reference="meta",
    ),
    Config(
        "tape-payloads",
        ("--payloads", "none", "--tape-payloads", "all"),
        "metadata + fingerprints + the taped kernels' results every step (what a GPU replay injects)",
    ),
    Config(
        "meta-cupti",
        ("--payloads", "none", "--cupti", "always"),
        "metadata + fingerprints + CUPTI's kernels and copies in every step (--cupti always)",
        reference="meta",
    ),
    Config(
        "meta-cupti-python",
        ("--payloads", "none", "--cupti", "always"),
        "as meta-cupti, CUPTI's records read by cupti-python's per-record callback instead of the native "
        "reader (FSDP_REPLAY_CUPTI_NATIVE=0)",
        env=("FSDP_REPLAY_CUPTI_NATIVE=0",),
        reference="meta",
    ),
    Config(
        "torch-profiler",
        None,
        "unrecorded, under torch.profiler with CUDA activities only, every step (for comparison)",
        wrapper="tests/workloads/cuda_profiled.py",
    ),
    Config("payloads", ("--payloads", "all"), "+ payloads every step"),
    Config(
        "snapshots",
        ("--payloads", "all", "--snapshot-every", "10"),
        "+ payloads every step + snapshots every 10 steps",
    ),
)


@dataclass
class RunResult:
    config: str
    rep: int
    position: int  # place of this run within its repetition (0 = first)
    exit_code: int
    wall_s: float  # the whole command: start-up, training, teardown, collector
    step_times_s: list[float]  # one per measured step (after the warm-up)
    step_median_s: float
    step_mean_s: float
    losses: list[str]  # as printed by rank 0
    after_last_step_s: float  # last step line -> command exit (teardown + collector)
    collector_s: float | None = None  # "trace written to ... in X s"
    trace_bytes: int | None = None
    spool_bytes: int | None = None
    trace_disk_bytes: int | None = None  # allocated blocks (st_blocks * 512)
    spool_disk_bytes: int | None = None
    trace_steps: list[int] | None = None  # inspect: per_rank[*].steps
    # the agent's own account of its cost (step events' cpu_ns), ms per step in the steady state
    agent_cpu_ms_per_step: float | None = None  # on the program's threads (our hooks)
    writer_cpu_ms_per_step: float | None = None  # the agent's writer thread
    # the hooks' CPU by part past the warm-up (median increments of the step events' counters
    # agent_cpu_<part>_ns, mean over ranks): where agent_cpu_ms_per_step goes
    agent_cpu_parts_ms: dict[str, float] = field(default_factory=dict)
    cpu_s: float = 0.0  # user + system CPU of all the command's processes (incl. start-up, collector)
    other_cpu_frac: float = 0.0  # CPU used by everything else on the machine during the run / (wall x CPUs)
    steal_frac: float = 0.0  # CPU stolen by the hypervisor during the run / (wall x CPUs)
    problems: list[str] = field(default_factory=list)


# -- helpers -------------------------------------------------------------------------------------


def tree_bytes(path: Path) -> tuple[int, int]:
    """(apparent bytes, allocated bytes) of every file under path."""
    size = disk = 0
    if not path.exists():
        return 0, 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            st = os.lstat(os.path.join(root, f))
            size += st.st_size
            disk += st.st_blocks * 512
    return size, disk


# -- one run -------------------------------------------------------------------------------------
NPROC = 2  # set from --nproc in main()
WORKLOAD = EXAMPLE  # set from --workload in main()


def build_command(cfg: Config, run_dir: Path, train_args: list[str]) -> list[str]:
    # The running interpreter, so the same script works in .venv here and on a GPU machine.
    train = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(NPROC),
        *([cfg.wrapper] if cfg.wrapper else []),
        str(WORKLOAD.relative_to(REPO)) if WORKLOAD.is_relative_to(REPO) else str(WORKLOAD),
        *train_args,
        *cfg.train_extra,
    ]
    if cfg.record_args is None:
        return train
    return [
        *(["env", *cfg.env] if cfg.env else []),
        sys.executable,
        "-m",
        "fsdp_replay",
        "record",
        "--out",
        str(run_dir),
        *cfg.record_args,
        "--",
        *train,
    ]


def check_trace(run_dir: Path, cfg: Config, steps: int) -> tuple[dict[str, Any], list[str]]:
    """Check the run's trace (benchlib.check_trace); return (inspect's summary, problems)."""
    window = next((a for a in cfg.record_args or () if a.startswith("window:")), None)
    policy = "all" if cfg.payloads else window or "none"
    return shared_check_trace(run_dir, NPROC, steps, policy, cfg.snapshot_every)


def agent_cpu_ms_per_step(run_dir: Path, warmup: int) -> tuple[float, float, dict[str, float]] | None:
    """The agent's own account of its CPU cost in the steady state: (hooks, writer thread) ms per
    step and the hooks' by part (empty for agents that do not count them), the trace's
    ``recording_cost`` per rank after the warm-up steps, mean over ranks."""
    from fsdp_replay.analysis.summary import recording_cost
    from fsdp_replay.trace.reader import Trace

    trace = Trace.open(str(run_dir / "trace.zarr"))
    costs = [recording_cost(trace.rank(rank), warmup) for rank in trace.ranks]
    if not costs or any(c is None for c in costs):
        return None
    parts = [c.get("agent_cpu_parts_ms") or {} for c in costs if c]
    return (
        statistics.fmean(c["agent_cpu_ms_per_step"] for c in costs if c),
        statistics.fmean(c["writer_cpu_ms_per_step"] for c in costs if c),
        {
            "total": statistics.fmean(c["agent_cpu_ms_per_step"] for c in costs if c),
            **{k: statistics.fmean(p[k] for p in parts) for k in parts[0] if all(k in p for p in parts)},
        }
        if parts and parts[0]
        else {},
    )


def cpu_parts() -> tuple[str, ...]:
    from fsdp_replay.trace import schema

    return tuple(schema.AGENT_CPU_PARTS)


def own_warmup(cfg: Config, warmup: int, steps: int) -> int:
    """The steps a run of ``cfg`` leaves out: ``--warmup-steps``, or its own warm-up where that is
    longer and the run has at least two steps past it."""
    return cfg.warmup if warmup < cfg.warmup <= steps - 2 else warmup


def own_warmups(summary: dict[str, Any], p: dict[str, Any]) -> str:
    """The configurations of a run that skipped their own, longer warm-up, as the report says it."""
    own = [
        f"; {c.name}: the first {n} (its own warm-up)"
        for c in CONFIGS
        if c.name in summary and (n := own_warmup(c, p["warmup_steps"], p["steps"])) != p["warmup_steps"]
    ]
    return "".join(own)


def run_one(
    cfg: Config,
    rep: int,
    position: int,
    work: Path,
    steps: int,
    warmup: int,
    train_args: list[str],
    timeout_s: float,
    echo: bool,
) -> tuple[RunResult, Path]:
    warmup = own_warmup(cfg, warmup, steps)
    run_dir = work / f"{cfg.name}-rep{rep}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    cmd = build_command(cfg, run_dir, train_args)
    proc = execute(cmd, timeout_s, echo)
    code, wall, cpu, other, steal = proc.code, proc.wall_s, proc.cpu_s, proc.other_cpu_frac, proc.steal_frac
    err = [line for _, line in proc.err]
    arrivals, losses, problems = step_lines(proc)
    if code != 0:
        problems.append(f"exit code {code}")
    # the example numbers its step lines from 0, like the trace
    missing = [n for n in range(steps) if n not in arrivals]
    if missing:
        problems.append(
            f"rank 0 printed no line for steps {missing[:10]}{' ...' if len(missing) > 10 else ''}"
        )
    times = [
        (arrivals[n] - arrivals[n - 1]) / 1e9
        for n in range(warmup, steps)
        if n in arrivals and n - 1 in arrivals
    ]
    if not times:
        problems.append("no step time measured")
    last = arrivals.get(steps - 1)
    res = RunResult(
        config=cfg.name,
        rep=rep,
        position=position,
        exit_code=code,
        wall_s=wall,
        step_times_s=times,
        step_median_s=statistics.median(times) if times else float("nan"),
        step_mean_s=statistics.fmean(times) if times else float("nan"),
        losses=losses,
        after_last_step_s=(proc.exit_ns - last) / 1e9 if last is not None else float("nan"),
        cpu_s=cpu,
        other_cpu_frac=other,
        steal_frac=steal,
    )
    if cfg.recorded:
        for line in err:
            m = COLLECT_RE.search(line)
            if m:
                res.collector_s = float(m.group(2))
        if res.collector_s is None:
            problems.append("record printed no 'trace written to ... in X s' line")
        res.trace_bytes, res.trace_disk_bytes = tree_bytes(run_dir / "trace.zarr")
        res.spool_bytes, res.spool_disk_bytes = tree_bytes(run_dir / "spool")
        if not problems:
            trace_summary, trace_problems = check_trace(run_dir, cfg, steps)
            res.trace_steps = [int(r.get("steps", -1)) for r in trace_summary.get("per_rank", [])]
            problems += cupti_problems(trace_summary, cfg, steps)
            agent = agent_cpu_ms_per_step(run_dir, warmup)
            if agent is not None:
                res.agent_cpu_ms_per_step, res.writer_cpu_ms_per_step, res.agent_cpu_parts_ms = agent
            problems += trace_problems
    if problems:
        tail = "\n".join(err[-40:])
        problems.append(f"command: {shlex.join(cmd)}\nstderr tail:\n{tail}")
    res.problems = problems
    return res, run_dir


def cupti_problems(summary: dict[str, Any], cfg: Config, steps: int) -> list[str]:
    """With --cupti always: every step from 1 captured, nothing dropped, no pause or error."""
    args = cfg.record_args or ()
    if "--cupti" not in args or args[args.index("--cupti") + 1] != "always":
        return []
    problems = []
    for r in summary.get("per_rank", []):
        c = r.get("cupti") or {}
        if c.get("steps") != list(range(1, steps + 1)) or c.get("dropped") or c.get("pauses"):
            problems.append(
                f"rank {r.get('rank')}: CUPTI captured steps {c.get('steps')}, dropped {c.get('dropped')}, "
                f"pauses {c.get('pauses')} (state {c.get('state')})"
            )
    return problems


# -- summary -------------------------------------------------------------------------------------
def summarize(results: list[RunResult], names: list[str]) -> dict[str, Any]:
    by_cfg = {n: [r for r in results if r.config == n] for n in names}
    base_by_rep = {r.rep: r for r in by_cfg["baseline"]}
    base_median = statistics.median(r.step_median_s for r in by_cfg["baseline"])
    base_mean = statistics.median(r.step_mean_s for r in by_cfg["baseline"])
    out: dict[str, Any] = {}
    for n, runs in by_cfg.items():
        medians = [r.step_median_s for r in runs]
        means = [r.step_mean_s for r in runs]
        pooled = [t for r in runs for t in r.step_times_s]
        pq1, pq2, pq3 = quantiles(pooled)
        mq1, mq2, mq3 = quantiles(medians)
        paired = [r.step_median_s / base_by_rep[r.rep].step_median_s for r in runs]
        paired_mean = [r.step_mean_s / base_by_rep[r.rep].step_mean_s for r in runs]
        rq1, rq2, rq3 = quantiles(paired)
        s: dict[str, Any] = {
            "runs": len(runs),
            "step_median_s": mq2,  # median over runs of each run's median step time
            "step_median_min_s": min(medians),
            "step_median_max_s": max(medians),
            "step_median_iqr_s": [mq1, mq3],
            "pooled_steps": len(pooled),
            "pooled_step_quartiles_s": [pq1, pq2, pq3],
            "step_mean_s": statistics.median(means),  # median over runs of each run's mean step time
            "ratio": mq2 / base_median,  # ratio of the medians
            "ratio_paired_median": rq2,  # median over repetitions of (run / baseline of that repetition)
            "ratio_paired_iqr": [rq1, rq3],
            "ratio_paired_min": min(paired),
            "ratio_paired_max": max(paired),
            "ratio_mean": statistics.median(means) / base_mean,
            "ratio_mean_paired_median": statistics.median(paired_mean),
        }
        if n != "baseline":
            steps = len(runs[0].losses) or 1
            s["trace_bytes_per_step"] = statistics.median((r.trace_bytes or 0) / steps for r in runs)
            s["spool_bytes_per_step"] = statistics.median((r.spool_bytes or 0) / steps for r in runs)
            s["trace_disk_bytes_per_step"] = statistics.median(
                (r.trace_disk_bytes or 0) / steps for r in runs
            )
            s["spool_disk_bytes_per_step"] = statistics.median(
                (r.spool_disk_bytes or 0) / steps for r in runs
            )
            for key in ("agent_cpu_ms_per_step", "writer_cpu_ms_per_step"):
                vals = [getattr(r, key) for r in runs if getattr(r, key) is not None]
                if vals:
                    s[key] = statistics.median(vals)
                    s[key.replace("_ms_per_step", "_fraction")] = s[key] / 1e3 / base_median
            parts = [r.agent_cpu_parts_ms for r in runs if r.agent_cpu_parts_ms]
            if parts:
                s["agent_cpu_parts_ms"] = {
                    k: statistics.median(p.get(k, 0.0) for p in parts) for k in parts[0]
                }
            s["collector_s"] = statistics.median(r.collector_s or 0.0 for r in runs)
            s["collector_max_s"] = max(r.collector_s or 0.0 for r in runs)
        s["wall_s"] = statistics.median(r.wall_s for r in runs)
        s["cpu_s"] = statistics.median(r.cpu_s for r in runs)
        s["other_cpu_frac_max"] = max(r.other_cpu_frac + r.steal_frac for r in runs)
        s["after_last_step_s"] = statistics.median(r.after_last_step_s for r in runs)
        ref = reference_of(n, by_cfg)
        if ref != "baseline":
            ref_by_rep = {r.rep: r for r in by_cfg[ref]}
            own = [r.step_median_s / ref_by_rep[r.rep].step_median_s for r in runs if r.rep in ref_by_rep]
            oq1, oq2, oq3 = quantiles(own)
            s["reference"] = ref
            s["ratio_vs_reference_paired"] = oq2
            s["ratio_vs_reference_iqr"] = [oq1, oq3]
        out[n] = s
    return out


def reference_of(name: str, by_cfg: dict[str, list[Any]]) -> str:
    """The configuration ``name``'s own cost is measured against: the first of its references
    that ran (baseline when none did)."""
    refs = next((c.reference for c in CONFIGS if c.name == name), "baseline")
    for ref in (refs,) if isinstance(refs, str) else refs:
        if by_cfg.get(ref):
            return ref
    return "baseline"


def verdict(summary: dict[str, Any], quick: bool) -> dict[str, Any]:
    s = summary.get(TARGET_CONFIG)
    if s is None:
        return {"target": TARGET_TEXT, "result": "NOT MEASURED"}
    ratio = s["ratio_paired_median"]
    q1, q3 = s["ratio_paired_iqr"]
    ok = ratio <= TARGET_RATIO
    if s["runs"] < 3:
        confidence = f"not assessable from {s['runs']} repetition(s)"
    elif q3 <= TARGET_RATIO or q1 > TARGET_RATIO:
        confidence = "clear: the interquartile range of the paired ratios is on one side of the target"
    else:
        confidence = "within noise: the interquartile range of the paired ratios straddles the target"
    return {
        "target": TARGET_TEXT,
        "config": TARGET_CONFIG,
        "max_ratio": TARGET_RATIO,
        "measured_ratio": ratio,
        "statistic": "median over repetitions of (meta run median step / baseline run median step, same repetition)",
        "result": ("PASS" if ok else "FAIL") + (" (quick smoke run: not a measurement)" if quick else ""),
        "confidence": confidence,
    }


def fmt_ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def agent_cpu_cell(x: dict[str, Any]) -> str:
    if "agent_cpu_ms_per_step" not in x:
        return "-"
    hooks, writer = x["agent_cpu_ms_per_step"], x.get("writer_cpu_ms_per_step", 0.0)
    frac = x["agent_cpu_fraction"] + x.get("writer_cpu_fraction", 0.0)
    return f"{hooks:.1f} + {writer:.1f} ({frac:.1%} of a baseline step)"


def render_markdown(doc: dict[str, Any]) -> str:
    s, v, m, p = doc["summary"], doc["verdict"], doc["machine"], doc["parameters"]
    lines = [
        f"# Recording overhead: `fsdp-replay record` on `{p.get('workload', 'examples/train_fsdp.py')}`",
        "",
        f"- Produced by: `{doc['command_line']}` (in {doc['cwd']})",
        f"- Date: {doc['date']} (took {doc['elapsed_s'] / 60:.1f} min)",
        f"- Machine: {m['nproc']} CPUs ({m['cpus_usable']} usable), {m['cpu_model']}; {m['platform']}; "
        f"Python {m['python']}, torch {m['torch']}, fsdp-replay {m['fsdp_replay']}, commit {m['git_commit']}",
        f"- Load average before / after: {doc['loadavg_before']} / {doc['loadavg_after']}",
        f"- Workload: `torchrun --standalone --nproc_per_node {NPROC} {p.get('workload', 'examples/train_fsdp.py')} "
        f"{' '.join(p['train_args'])}` ({NPROC} ranks, OMP_NUM_THREADS=1)"
        + (f"; model: the example's defaults ({p['workload_model']})" if p["workload_model"] else ""),
        f"- {p['steps']} steps per run, the first {p['warmup_steps']} skipped{own_warmups(s, p)}; "
        f"{p['reps']} repetitions, configurations interleaved round-robin, order rotated every repetition"
        + (" (QUICK smoke run: too few steps and repetitions to be trustworthy)" if p["quick"] else "")
        + (
            f" (**PARTIAL**: {p['reps_done']} of {p['reps']} repetitions were done when these results "
            "were last written; the run did not finish)"
            if p.get("reps_done", p["reps"]) < p["reps"]
            else ""
        ),
        "",
        f"**Target**: {v['target']} -> **{v['result']}** "
        + (
            f"(paired ratio {v['measured_ratio']:.3f} vs <= {v['max_ratio']}; {v['confidence']})"
            if "measured_ratio" in v
            else ""
        ),
        "",
        "Step time = wall time between consecutive `step N` lines of rank 0, per run the median over "
        "the measured steps; the table shows the median over runs and its min-max over runs. "
        "Ratio = that median / baseline's; paired = median over repetitions of (run / baseline "
        "run of the same repetition), with its interquartile range. Mean-based ratio includes periodic "
        "costs (snapshots, DataLoader re-forks at epoch boundaries) that the median leaves out.",
        "",
        "| config | what | step ms (median) | min-max over runs | ratio | paired ratio [IQR] | ratio of means "
        "| trace B/step | spool B/step | collector s | CPU s/run | agent CPU ms/step (hooks + writer) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    descr = {c.name: c.description for c in CONFIGS}
    for name, x in s.items():
        q1, q3 = x["ratio_paired_iqr"]
        collector = f"{x['collector_s']:.1f}" if "collector_s" in x else "-"
        lines.append(
            f"| {name} | {descr.get(name, '')} | {fmt_ms(x['step_median_s'])} "
            f"| {fmt_ms(x['step_median_min_s'])}-{fmt_ms(x['step_median_max_s'])} "
            f"| {x['ratio']:.3f} | {x['ratio_paired_median']:.3f} [{q1:.3f}, {q3:.3f}] | {x['ratio_mean']:.3f} "
            f"| {fmt_bytes(x.get('trace_bytes_per_step'))} | {fmt_bytes(x.get('spool_bytes_per_step'))} "
            f"| {collector} | {x['cpu_s']:.1f} | {agent_cpu_cell(x)} |"
        )
    for name, x in s.items():
        if "reference" in x:
            q1, q3 = x["ratio_vs_reference_iqr"]
            lines += [
                "",
                f"{name} over {x['reference']} (its own cost, paired by repetition): "
                f"{x['ratio_vs_reference_paired']:.3f} [{q1:.3f}, {q3:.3f}]",
            ]
    parted = {n: x["agent_cpu_parts_ms"] for n, x in s.items() if x.get("agent_cpu_parts_ms")}
    if parted:
        lines += [
            "",
            "Agent CPU on the program's threads by part, ms a step past the warm-up (the trace's "
            "`recording_cost`: per rank the median increment of `steps.cpu_<part>_ns`, so snapshot "
            "steps are left out, mean over ranks; median over runs): the "
            "collectives' and the tape's hooks each whole; payloads (keeping bytes: stored or held) "
            "and snapshots inside any hook; cxx: the C++ kernel and tape hook.",
            "",
            "| config | total | " + " | ".join(cpu_parts()) + " |",
            "|---|---:|" + "---:|" * len(cpu_parts()),
        ]
        for name, parts in parted.items():
            cells = " | ".join(f"{parts.get(k, 0.0):.1f}" for k in cpu_parts())
            lines.append(f"| {name} | {parts.get('total', 0.0):.1f} | {cells} |")
    lines += [
        "",
        "Bytes per step = size of the run's `trace.zarr` (and of its `spool/`, which `record` "
        "removes once the trace holds every record: 0 unless kept) "
        f"divided by the {p['steps']} steps; it includes the fixed part (step-0 collectives, the step-0 "
        "snapshot, metadata), so it overstates the marginal cost of short runs. Collector = "
        "`record`'s own `trace written to ... in X s` (after training; not in the step time). "
        "Agent CPU = the agent's own account of its cost, from the cumulative `cpu_ns` of each step "
        "event (thread CPU time in its hooks, less the program's own collectives and waits they run; "
        "and its writer thread's CPU time): per rank the median over the measured steps, then the "
        "mean over ranks. The wall-clock ratio also sees what that CPU time displaces on a busy "
        "machine, and not what overlaps with idle time.",
        "",
        "Checks on every recorded run: exit code 0, all step lines printed, `fsdp-replay inspect --json` "
        "shows both ranks complete with all steps, no damage/agent errors/drops, expected payload "
        "coverage and snapshots; printed losses identical to the first baseline run: "
        + (
            "not compared (default CUDA kernels: not run-to-run reproducible, recorded or not)."
            if doc["losses_identical"] is None
            else f"{'yes' if doc['losses_identical'] else 'NO'}."
        ),
        "",
        "CPU s/run = user + system CPU time of all the run's processes (ranks, DataLoader workers, "
        "torchrun, record and its collector), start-up included: less sensitive to other load than "
        "wall time, but not a step-time measure.",
        "",
    ]
    worst = max(r["other_cpu_frac"] + r["steal_frac"] for r in doc["runs"])
    if worst > NOISY_FRACTION:
        lines += [
            f"**Warning**: during some runs, other processes (or the hypervisor) used up to {worst:.0%} of "
            "the machine's CPU: these numbers are noisier than they should be (see the per-run table).",
            "",
        ]
    lines += [
        "Per run (in the order they ran):",
        "",
        "| rep | pos | config | step ms median | step ms mean | wall s | CPU s | other CPU | steal |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["runs"]:
        lines.append(
            f"| {r['rep']} | {r['position']} | {r['config']} | {fmt_ms(r['step_median_s'])} "
            f"| {fmt_ms(r['step_mean_s'])} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['other_cpu_frac']:.1%} "
            f"| {r['steal_frac']:.1%} |"
        )
    lines.append("")
    return "\n".join(lines)


# -- main ----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="smoke run: 12 steps, 1 repetition (~1-2 min; noisy)")
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: force CPU/gloo (default); cuda: let the example use the GPU(s) with NCCL",
    )
    p.add_argument("--steps", type=int, default=None, help="steps per run (default 40; --quick 12)")
    p.add_argument(
        "--reps", type=int, default=None, help="repetitions of every configuration (default 10; --quick 1)"
    )
    p.add_argument("--warmup-steps", type=int, default=3, help="first steps not measured (default 3)")
    p.add_argument(
        "--configs",
        default=None,
        help="comma-separated subset of: "
        + ", ".join(c.name for c in CONFIGS)
        + " (baseline is always run; default: all, but "
        + ", ".join(sorted(CUDA_ONLY))
        + " only with --device cuda)",
    )
    p.add_argument(
        "--train-args",
        default="",
        help="extra flags for examples/train_fsdp.py, written with '=': --train-args='--d-model 256' (default: the example's defaults)",
    )
    p.add_argument(
        "--workload",
        default=str(EXAMPLE.relative_to(REPO)),
        help="the training script every configuration runs (default: the example); it must print rank 0's "
        "'step N loss X lr Y' line after each step, as examples/train_fsdp.py and tests/workloads/gpt2_job.py do",
    )
    p.add_argument("--workdir", default=None, help="where runs are recorded (default: a temporary folder)")
    p.add_argument(
        "--keep", action="store_true", help="keep every run's folder (default: delete after measuring)"
    )
    p.add_argument(
        "--cooldown", type=float, default=1.0, help="seconds of rest after each run (after a sync)"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a run is stopped as hung")
    p.add_argument(
        "--results", default=None, help="output path stem (default bench/results/record_overhead[.quick])"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="echo the runs' output")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    steps = args.steps or (12 if args.quick else 40)
    reps = args.reps or (1 if args.quick else 10)
    warmup = args.warmup_steps
    if steps < warmup + 2:
        print(f"bench: --steps must be at least {warmup + 2}", file=sys.stderr)
        return 2
    default = [c.name for c in CONFIGS if args.device == "cuda" or c.name not in CUDA_ONLY]
    chosen = args.configs.split(",") if args.configs is not None else default
    wanted = {x.strip() for x in chosen if x.strip()} | {"baseline"}
    unknown = wanted - {c.name for c in CONFIGS}
    if unknown:
        print(f"bench: unknown configurations {sorted(unknown)}", file=sys.stderr)
        return 2
    if args.device == "cpu" and wanted & CUDA_ONLY:
        print(f"bench: {sorted(wanted & CUDA_ONLY)} measure CUDA capture: use --device cuda", file=sys.stderr)
        return 2
    configs = [c for c in CONFIGS if c.name in wanted]
    global NPROC, WORKLOAD
    WORKLOAD = (REPO / args.workload).resolve()
    if not WORKLOAD.is_file():
        print(f"bench: no workload {args.workload}", file=sys.stderr)
        return 2
    NPROC = args.nproc
    device_args = ["--cpu"] if args.device == "cpu" else []
    train_args = [*device_args, "--steps", str(steps), *shlex.split(args.train_args)]
    stem = (
        Path(args.results)
        if args.results
        else RESULTS_DIR / ("record_overhead.quick" if args.quick else "record_overhead")
    )

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-record-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    load_before = os.getloadavg()
    if load_before[0] > 0.5:
        print(
            f"bench: WARNING: load average {load_before[0]:.2f} before starting: the machine is not quiet",
            file=sys.stderr,
        )
    print(
        f"bench: {len(configs)} configurations x {reps} repetitions, {steps} steps each "
        f"(first {warmup} not measured); runs in {work}",
        flush=True,
    )
    results: list[RunResult] = []
    baseline_losses: list[str] | None = None
    losses_identical: bool | None = True
    # Default CUDA kernels (no --deterministic) are not run-to-run reproducible, recorded or not:
    # there the losses cannot show that recording changed nothing, and are not compared.
    compare_losses = args.device == "cpu" or "--deterministic" in train_args
    if not compare_losses:
        losses_identical = None
    total = len(configs) * reps
    done = 0

    def save(reps_done: int) -> tuple[Path, Path, str]:
        return write_results(
            args, stem, configs, results, reps_done, reps, steps, warmup, train_args, started, load_before,
            losses_identical,
        )  # fmt: skip

    for rep in range(reps):
        k = rep % len(configs)
        order = configs[k:] + configs[:k]  # rotate: every configuration takes every position
        for pos, cfg in enumerate(order):
            res, run_dir = run_one(cfg, rep, pos, work, steps, warmup, train_args, args.timeout, args.verbose)
            done += 1
            if cfg.name == "baseline" and baseline_losses is None and not res.problems:
                baseline_losses = res.losses
            if (
                compare_losses
                and not cfg.train_extra
                and baseline_losses is not None
                and res.losses
                and res.losses != baseline_losses
            ):
                losses_identical = False
                diff = next(
                    i for i, (a, b) in enumerate(zip(res.losses, baseline_losses, strict=False)) if a != b
                )
                res.problems.append(
                    f"printed losses differ from the baseline's from step {diff}: "
                    f"{res.losses[diff]} vs {baseline_losses[diff]}"
                )
            extra = ""
            if cfg.recorded:
                extra = (
                    f", trace {fmt_bytes(res.trace_bytes)}, spool {fmt_bytes(res.spool_bytes)}, "
                    f"collector {res.collector_s}s"
                )
            eta = (time.time() - started) / done * (total - done)
            print(
                f"  [{done}/{total}] rep {rep} {cfg.name:9s}: median step {fmt_ms(res.step_median_s)} ms, "
                f"mean {fmt_ms(res.step_mean_s)} ms, wall {res.wall_s:.1f}s, CPU {res.cpu_s:.1f}s{extra}; "
                f"other CPU {res.other_cpu_frac:.0%}; ETA {eta / 60:.1f} min",
                flush=True,
            )
            if res.problems:
                print(
                    f"bench: run {cfg.name} rep {rep} is broken; its folder is kept: {run_dir}",
                    file=sys.stderr,
                )
                for prob in res.problems:
                    print(f"  - {prob}", file=sys.stderr)
                return 1
            results.append(res)
            if not args.keep:
                shutil.rmtree(run_dir, ignore_errors=True)
            os.sync()  # the next run must not pay for this run's write-back
            time.sleep(args.cooldown)
        if rep + 1 < reps:  # a run stopped by a time limit keeps its whole repetitions
            save(rep + 1)
    if not args.keep and not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    md_path, json_path, md = save(reps)
    print()
    print(md)
    print(f"bench: wrote {md_path} and {json_path}")
    return 0


def write_results(
    args: argparse.Namespace,
    stem: Path,
    configs: list[Config],
    results: list[RunResult],
    reps_done: int,
    reps: int,
    steps: int,
    warmup: int,
    train_args: list[str],
    started: float,
    load_before: tuple[float, float, float],
    losses_identical: bool | None,
) -> tuple[Path, Path, str]:
    """The results of the repetitions done so far, as JSON and Markdown next to ``stem``; a
    partial write (``reps_done < reps``) says so, and the next one replaces it."""
    names = [c.name for c in configs]
    summary = summarize(results, names)
    example = EXAMPLE.resolve() == WORKLOAD
    defaults = example_defaults() if example else {}
    model_keys = ("d_model", "layers", "heads", "seq_len", "batch_size", "grad_accum", "vocab", "workers")
    workload_model = ", ".join(f"{k}={defaults[k]}" for k in model_keys if k in defaults)
    doc: dict[str, Any] = {
        "benchmark": "record_overhead",
        "command_line": portable_command(),
        "cwd": "the repository root",
        "date": datetime.datetime.now(datetime.timezone.utc).astimezone().isoformat(timespec="seconds"),
        "elapsed_s": time.time() - started,
        "machine": machine_info(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "parameters": {
            "quick": args.quick,
            "steps": steps,
            "warmup_steps": warmup,
            "reps": reps,
            "reps_done": reps_done,
            "configs": {c.name: list(c.record_args) if c.record_args is not None else None for c in configs},
            "workload": str(WORKLOAD.relative_to(REPO)) if WORKLOAD.is_relative_to(REPO) else str(WORKLOAD),
            "train_args": train_args,
            "workload_model": workload_model + (f"; plus {args.train_args}" if args.train_args else ""),
            "example_defaults": defaults,
            "env": {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
            "timing_source": "wall time between consecutive 'step N' lines of rank 0, read as they arrive",
        },
        "verdict": verdict(summary, args.quick),
        "summary": summary,
        "losses_identical": losses_identical,
        "runs": [asdict(r) for r in results],
    }
    stem.parent.mkdir(parents=True, exist_ok=True)
    md_path, json_path = stem.with_name(stem.name + ".md"), stem.with_name(stem.name + ".json")
    md = render_markdown(doc)
    for path, text in ((json_path, json.dumps(doc, indent=2) + "\n"), (md_path, md)):
        partial = path.with_name(path.name + ".writing")
        partial.write_text(text)
        partial.replace(path)  # whole or not at all, should the run be stopped now
    return md_path, json_path, md


if __name__ == "__main__":
    sys.exit(main())
