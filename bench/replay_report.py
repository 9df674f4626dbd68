"""The Markdown report of bench_replay.py: verdicts against the targets, and the tables."""

from __future__ import annotations

from typing import Any

from bench_replay import (
    NOISY_FRACTION,
    TARGET_DIVERGENCE_S,
    TARGET_DIVERGENCE_TEXT,
    TARGET_RATIO,
    fmt_ms,
    fmt_s,
)
from benchlib import (
    fmt_bytes,
)


def ratio_verdict(name: str, target: str, s: dict[str, Any] | None, quick: bool) -> dict[str, Any]:
    if s is None:
        return {"target": target, "result": "NOT MEASURED"}
    r = s["ratio_paired"]
    q1, q3 = r["iqr"]
    if r["n"] < 3:
        confidence = f"not assessable from {r['n']} repetition(s)"
    elif q3 <= TARGET_RATIO or q1 > TARGET_RATIO:
        confidence = "clear: the interquartile range of the paired ratios is on one side of the target"
    else:
        confidence = "within noise: the interquartile range of the paired ratios straddles the target"
    return {
        "target": target,
        "what": name,
        "max_ratio": TARGET_RATIO,
        "measured": r["median"],
        "statistic": "median over repetitions of (replay's median step / the same repetition's recorded median step)",
        "result": ("PASS" if r["median"] <= TARGET_RATIO else "FAIL")
        + (" (quick smoke run: not a measurement)" if quick else ""),
        "confidence": confidence,
    }


def time_verdict(what: str, s: dict[str, Any], steps: int, quick: bool) -> dict[str, Any]:
    caveat = []
    if steps != 1000:
        caveat.append(f"a {steps}-step trace, not the target's 1,000")
    if quick:
        caveat.append("quick smoke run: not a measurement")
    return {
        "target": TARGET_DIVERGENCE_TEXT,
        "what": what,
        "max_s": TARGET_DIVERGENCE_S,
        "measured": s["median"],
        "worst": s["max"],
        "statistic": f"median wall time of the whole command over {s['n']} run(s)",
        "result": ("PASS" if s["median"] < TARGET_DIVERGENCE_S else "FAIL")
        + (f" ({'; '.join(caveat)})" if caveat else ""),
        "confidence": "clear"
        if s["max"] < TARGET_DIVERGENCE_S or s["min"] >= TARGET_DIVERGENCE_S
        else "within noise",
    }


# -- report ----------------------------------------------------------------------------------------
def fmt_spread_ms(s: dict[str, Any]) -> str:
    return f"{fmt_ms(s['median'])} ({fmt_ms(s['min'])}-{fmt_ms(s['max'])})"


def fmt_spread_s(s: dict[str, Any], digits: int = 1) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def fmt_ratio(s: dict[str, Any]) -> str:
    q1, q3 = s["iqr"]
    return f"{s['median']:.3f} [{q1:.3f}, {q3:.3f}] ({s['min']:.3f}-{s['max']:.3f})"


def render_markdown(doc: dict[str, Any]) -> str:
    m, p = doc["machine"], doc["parameters"]
    lines = [
        "# Replay speed and time to the first divergence: `fsdp-replay replay` / `diff` on `examples/train_fsdp.py`",
        "",
        f"- Produced by: `{doc['command_line']}` (in {doc['cwd']})",
        f"- Date: {doc['date']} (took {doc['elapsed_s'] / 60:.1f} min)",
        f"- Machine: {m['nproc']} CPUs ({m['cpus_usable']} usable), {m['cpu_model']}; {m['platform']}; "
        f"Python {m['python']}, torch {m['torch']}, fsdp-replay {m['fsdp_replay']}, commit {m['git_commit']}",
        f"- Load average before / after: {doc['loadavg_before']} / {doc['loadavg_after']}",
        "- OMP_NUM_THREADS=1, PYTHONUNBUFFERED=1 for every command"
        + (" (QUICK smoke run: too few steps and repetitions to be trustworthy)" if p["quick"] else ""),
        "",
        "## Targets",
        "",
    ]
    for v in doc["verdicts"]:
        if "max_ratio" in v:
            detail = f"{v['what']}: {v['measured']:.3f} vs <= {v['max_ratio']}; {v['confidence']}"
        elif "max_s" in v:
            detail = f"{v['what']}: {v['measured']:.2f} s (worst {v['worst']:.2f} s) vs < {v['max_s']:.0f} s"
        else:
            detail = ""
        lines.append(f"- {v['target']} -> **{v['result']}** ({detail})")
    lines.append("")
    if doc["speed"]["summary"]:
        lines += speed_section(doc)
    if doc["divergence"]:
        lines += divergence_section(doc)
    lines += ["## Checks (all passed; any failure stops the benchmark)", ""]
    lines += [f"- {c}" for c in doc["checks"]]
    lines += runs_section(doc)
    return "\n".join(lines)


def speed_section(doc: dict[str, Any]) -> list[str]:
    m, p, s = doc["machine"], doc["parameters"], doc["speed"]["summary"]
    lines = [
        "",
        "## 1. Replay step time vs. recorded step time",
        "",
        f"Workload: `examples/train_fsdp.py {' '.join(p['speed_train_args'])}` (model: the example's defaults, "
        f"{p['workload_model']}), recorded with `fsdp-replay record --payloads all --snapshot-every "
        f"{p['snapshot_every']}` under `torchrun --standalone --nproc_per_node 2` and, for the apples-to-apples "
        "number, `--nproc_per_node 1`; every rank of every trace replayed alone with "
        "`fsdp-replay replay DIR --rank R`. "
        f"{p['steps']} steps per run, the first {p['warmup_steps']} not measured; {p['reps']} repetition(s), each "
        "recording afresh: record 2 ranks, replay rank 0, replay rank 1, record 1 rank, replay it (the two groups "
        "swap places every repetition).",
        "",
        "**Read this first**: the 2-rank recording runs two ranks (and their DataLoader workers) on the "
        f"machine's {m['cpus_usable']} cores at once, while a replay is one process with the machine to itself. "
        "That is what a user gets (one rank of an N-rank job replayed alone on one device) and it is what the "
        "target is judged on, but part of the speed-up is the freed cores, not the missing communication. "
        "The 1-rank recording vs. its replay is apples to apples (one process each, same data loading).",
        "",
        "Step time = wall time between consecutive step lines: rank 0's `step N loss X lr Y` on stdout for a "
        "recording, `[fsdp-replay] rank R: step N/M verified` on stderr for a replay; per run the median over "
        "the measured steps, here the median over runs (min-max over runs). Paired ratio = median over "
        "repetitions of (replay / the recording of the same repetition), [interquartile range] (min-max).",
        "",
        "| run | step ms | paired ratio to recorded | ratio of means | start-up s | wall s | report `seconds` | after last step s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, x in s.items():
        ratio = fmt_ratio(x["ratio_paired"]) if "ratio_paired" in x else "-"
        ratio_mean = f"{x['ratio_mean_paired']['median']:.3f}" if "ratio_mean_paired" in x else "-"
        seconds = fmt_spread_s(x["report_seconds"]) if "report_seconds" in x else "-"
        lines.append(
            f"| {name} | {fmt_spread_ms(x['step_median_s'])} | {ratio} | {ratio_mean} "
            f"| {fmt_spread_s(x['first_line_s'])} | {fmt_spread_s(x['wall_s'])} | {seconds} "
            f"| {fmt_spread_s(x['after_last_line_s'])} |"
        )
    lines += [
        "",
        "Start-up = command start -> the line of step 0 (interpreter, torch import, process group or fake "
        "process group, opening the trace, first step). After last step = last step line -> exit (for a "
        "recording: teardown and the collector building the trace; for a replay: the end-of-run checks, "
        "report.json, report.txt and the replay.png plot). Report `seconds` = the replay's own "
        "`seconds` in report.json (the replayed process's time from agent start to the report). The mean "
        "includes the periodic costs (a snapshot every "
        f"{p['snapshot_every']} steps while recording, DataLoader re-forks at epoch boundaries) that the "
        "median leaves out.",
        "",
    ]
    return lines


def divergence_section(doc: dict[str, Any]) -> list[str]:
    p, dv = doc["parameters"], doc["divergence"]
    n, k = dv["steps"], dv["noise_step"]
    return [
        "## 2. Time to the first divergence in a 1,000-step trace"
        + (f" (here {n} steps: quick run)" if n != 1000 else ""),
        "",
        f"Workload: `examples/train_fsdp.py {' '.join(p['long_train_args'])}` on 2 ranks, recorded three times: "
        f"clean and noisy (`--wallclock-noise-at-step {k} --noise-rank {dv['noise_rank']}`) with "
        f"`--payloads none`, and noisy again with `--payloads {dv['payload_window']} --snapshot-every "
        f"{dv['snapshot_every']}`. Recorded step time (rank 0, median): "
        + ", ".join(f"{name} {fmt_ms(t)} ms" for name, t in dv["recorded_step_median_s"].items())
        + "; trace sizes: "
        + ", ".join(f"{name} {fmt_bytes(b)}" for name, b in dv["trace_bytes"].items())
        + ".",
        "",
        "| command | wall s, median (min-max) | runs | found |",
        "|---|---:|---:|---|",
        f"| `fsdp-replay diff CLEAN NOISY --json` | {fmt_spread_s(dv['diff_wall_s'], 2)} | {dv['diff_wall_s']['n']} "
        f"| {dv['diff'][0]['message'] if dv['diff'] else '-'} |",
        f"| `fsdp-replay replay NOISY-WINDOW --rank {dv['noise_rank']} --from-step {k}` "
        f"| {fmt_spread_s(dv['replay_wall_s'], 2)} | {dv['replay_wall_s']['n']} "
        f"| {describe_divergence(dv['replay_first_divergence'])} |",
        "",
        "`diff` is timed as a whole process (Python start-up, imports, opening both traces, the comparison, "
        "the JSON), with the traces in the page cache (they were just written). CPU time of one diff: "
        f"{fmt_spread_s(dv['diff_cpu_s'], 2)} s.",
        "",
        f"Where the `replay --from-step {k}` time goes (median over runs, min-max):",
        "",
        "| part | s |",
        "|---|---:|",
        f"| start-up to the end of step 0 (interpreter, torch, trace, program set-up, step 0) | "
        f"{fmt_spread_s(dv['replay_startup_to_step0_s'], 2)} |",
        f"| fast-forward: steps 1..{dv['restored_snapshot'] - 1} run unverified before the snapshot of step "
        f"{dv['restored_snapshot']} is restored ({fmt_spread_ms(dv['replay_fast_forward_step_median_s'])} ms per step) "
        f"| {fmt_spread_s(dv['replay_fast_forward_s'], 2)} |",
        "| restore, step up to the divergence, report, replay.png, exit | "
        f"{fmt_spread_s(dv['replay_after_fast_forward_s'], 2)} |",
        f"| whole command (wall) | {fmt_spread_s(dv['replay_wall_s'], 2)} |",
        f"| report.json `seconds` | {fmt_spread_s(dv['replay_report_seconds'], 2)} |",
        "",
        f"A replay from step S restores the latest snapshot at or before S only when the program reaches it: "
        f"the {dv['restored_snapshot']} earlier steps still run (forward, backward, optimizer; collectives "
        "answered with the recorded payloads where stored, zeros elsewhere, nothing verified), so its cost "
        "grows with S like the training itself, at the fast-forward step time above; the snapshot only "
        "makes the verified part start at S. `diff` reads the two traces and never runs the program.",
        "",
    ]


def runs_section(doc: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    worst = max([r["other_cpu_frac"] + r["steal_frac"] for r in doc["runs"]], default=0.0)
    lines.append("")
    if worst > NOISY_FRACTION:
        lines += [
            f"**Warning**: during some runs, other processes (or the hypervisor) used up to {worst:.0%} of "
            "the machine's CPU: these numbers are noisier than they should be (see the per-run table).",
            "",
        ]
    lines += [
        "## Per run (in the order they ran)",
        "",
        "| rep | run | rank | step ms median | step ms mean | start-up s | wall s | CPU s | other CPU | steal | outcome |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in doc["runs"]:
        rep = r.get("report") or {}
        outcome = rep.get("status") or (
            f"collector {r['collector_s']} s" if r.get("collector_s") is not None else ""
        )
        lines.append(
            f"| {r['rep']} | {r['name']} | {'-' if r['rank'] is None else r['rank']} | {fmt_ms(r['step_median_s'])} "
            f"| {fmt_ms(r['step_mean_s'])} | {fmt_s(r['first_line_s'])} | {r['wall_s']:.1f} | {r['cpu_s']:.1f} "
            f"| {r['other_cpu_frac']:.1%} | {r['steal_frac']:.1%} | {outcome} |"
        )
    lines.append("")
    return lines


def describe_divergence(fd: dict[str, Any] | None) -> str:
    if not fd:
        return "-"
    return f"rank {fd.get('rank')}: {fd.get('what', fd.get('kind'))} at step {fd.get('step')} micro-step {fd.get('micro')}"


# -- main ------------------------------------------------------------------------------------------
