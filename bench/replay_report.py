"""The Markdown report of bench_replay.py: verdicts against the targets, and the tables."""

from __future__ import annotations

import statistics
from typing import Any

from bench_replay import (
    NOISY_FRACTION,
    TARGET_DIVERGENCE_S,
    TARGET_DIVERGENCE_TEXT,
    TARGET_FLAT_TEXT,
    TARGET_RATIO,
    TARGET_REACH_STEPS,
    TARGET_REACH_TEXT,
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


def side_of(s: dict[str, Any], limit: float) -> str:
    """Whether every run is on one side of a limit."""
    if s["n"] < 3:
        return f"not assessable from {s['n']} run(s)"
    if s["max"] < limit or s["min"] >= limit:
        return "clear: every run is on one side of the target"
    return "within noise: the runs straddle the target"


def reach_verdict(x: dict[str, Any], step_s: float, quick: bool) -> dict[str, Any]:
    """Time to reach step S (the report's fast_forward.seconds) against 2 recorded steps."""
    r, t = x["ratio_to_recorded_step"], x["ff_seconds"]
    skipped = (x["counts"] or {}).get("skipped_steps")
    return {
        "target": TARGET_REACH_TEXT,
        "what": f"reaching step {x['target']}",
        "max_recorded_steps": TARGET_REACH_STEPS,
        "measured": r["median"],
        "statistic": f"median over {r['n']} run(s) of report.json fast_forward.seconds / the recorded median step",
        "result": ("PASS" if r["median"] < TARGET_REACH_STEPS else "FAIL")
        + (" (quick smoke run: not a measurement)" if quick else ""),
        "confidence": side_of(r, TARGET_REACH_STEPS),
        "detail": f"reaching step {x['target']} ({x['counts'].get('computed_steps')} steps computed, {skipped} "
        f"skipped): {t['median']:.2f} s ({t['min']:.2f}-{t['max']:.2f}) = {r['median']:.1f}x "
        f"({r['min']:.1f}-{r['max']:.1f}) one recorded step of {fmt_ms(step_s)} ms vs < {TARGET_REACH_STEPS:.0f}x; "
        + side_of(r, TARGET_REACH_STEPS),
    }


def flat_verdict(reach: dict[str, Any], quick: bool) -> dict[str, Any]:
    """Flat in S: the growth from the smallest to the largest S, against 2 recorded steps."""
    step_s, inc = reach["recorded_step_median_s"], reach["increase_s"]
    per_rep = reach["slope_s_per_skipped_step_per_rep"]
    slope = reach["slope_s_per_skipped_step_fit"]
    limit = TARGET_REACH_STEPS * step_s
    return {
        "target": TARGET_FLAT_TEXT,
        "what": f"S = {inc['from']} -> {inc['to']}",
        "max_s": limit,
        "measured": inc["median"],
        "statistic": "median over repetitions of (fast_forward.seconds at the largest S - at the smallest S)",
        "result": ("PASS" if inc["median"] < limit else "FAIL")
        + (" (quick smoke run: not a measurement)" if quick else ""),
        "confidence": side_of(inc, limit),
        "detail": f"reaching step {inc['to']} takes {inc['median']:.2f} s ({inc['min']:.2f}-{inc['max']:.2f}) more "
        f"than step {inc['from']} = {inc['median'] / step_s:.1f} recorded steps, vs < {TARGET_REACH_STEPS:.0f} "
        f"({limit * 1e3:.0f} ms); slope {slope * 1e3:.2f} ms per skipped step (least squares over all runs; per "
        f"repetition {per_rep['median'] * 1e3:.2f}, {per_rep['min'] * 1e3:.2f}-{per_rep['max'] * 1e3:.2f}) = "
        f"{reach['slope_fraction_of_recorded_step']:.1%} of a recorded step; {side_of(inc, limit)}",
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
        "# Replay speed, time to the first divergence, time to reach step S: `fsdp-replay replay` / `diff` on "
        "`examples/train_fsdp.py`",
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
        if "detail" in v:
            detail = v["detail"]
        elif "max_ratio" in v:
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
    if doc.get("reach"):
        lines += reach_section(doc)
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
        "The 1-rank recording vs. its replay is closer to apples to apples (one training process each), though the "
        "replay serves the recorded batches from the trace and starts no DataLoader worker, while the recording "
        "runs the example's workers.",
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
        + f". Payload coverage of the third ({fmt_coverage(dv.get('window_payload_coverage'))}): tensors of "
        "64 KiB or less keep their bytes in every step under a steps policy, and this tiny model's are all "
        "that small.",
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
        *fast_forward_table(dv, "replay_", dv["restored_snapshot"], dv["fast_forward_warmup"]),
        f"| snapshot restored -> exit: step {k} up to the divergence, report.json, report.txt, replay.png | "
        f"{fmt_spread_s(dv['replay_after_restore_s'], 2)} |",
        f"| whole command (wall) | {fmt_spread_s(dv['replay_wall_s'], 2)} |",
        f"| report.json `seconds` (agent start -> report) | {fmt_spread_s(dv['replay_report_seconds'], 2)} |",
        "",
        f"Time to reach step {dv['restored_snapshot']} (`fast_forward.seconds`: the warm-up and the skipped "
        f"steps): {fmt_spread_s(dv['replay_ff_seconds'], 2)} s, "
        f"{dv['replay_ff_seconds']['median'] / dv['recorded_step_median_s']['record-long-window']:.1f} recorded "
        f"steps of {fmt_ms(dv['recorded_step_median_s']['record-long-window'])} ms (the payload-window "
        f"recording's). Counts from the first run's report: {fmt_counts(dv['replay_fast_forward_counts'])}. "
        f"The first {dv['fast_forward_warmup']} steps compute (frameworks finish their set-up there); the rest "
        "run the program's loop with its model skipped and every other op a placeholder, then the snapshot is "
        "restored. `diff` reads the two traces and never runs the program.",
        "",
    ]


def fmt_coverage(c: dict[str, Any] | None) -> str:
    """inspect's payload coverage of each rank: rank R: stored/outputs outputs, steps A-B."""
    return (
        "; ".join(
            f"rank {rank}: {x.get('with_payload')} of {x.get('outputs')} outputs, steps {x.get('steps')}"
            for rank, x in (c or {}).items()
            if x
        )
        or "-"
    )


def fmt_counts(c: dict[str, Any] | None) -> str:
    return ", ".join(f"{k} {v}" for k, v in (c or {}).items()) or "-"


def fast_forward_table(x: dict[str, Any], prefix: str, restore: int, warmup: int) -> list[str]:
    """Rows from the command's start to the snapshot's restore, split with report.json's fast_forward."""

    def v(key: str) -> str:
        return fmt_spread_s(x[prefix + key], 2)

    w = min(warmup, restore)
    skipped = (
        f"| &nbsp;&nbsp;steps {w}..{restore - 1} run without kernels ({fmt_spread_ms_x(x[prefix + 'ff_skipped_ms_per_step'])} "
        f"ms per step) | {v('ff_skipped_s')} |"
        if restore > w
        else "| &nbsp;&nbsp;no step skipped | - |"
    )
    return [
        "| part | s |",
        "|---|---:|",
        f"| command start -> snapshot of step {restore} restored (its `reached step` line) | {v('restored_at_s')} |",
        "| &nbsp;&nbsp;set-up in the replayed program (report.json `fast_forward.setup_seconds`: agent start -> "
        f"the program's first batch or model call: model construction, ...) | {v('ff_setup_s')} |",
        f"| &nbsp;&nbsp;steps 0..{w - 1} computed ({fmt_spread_ms_x(x[prefix + 'ff_computed_ms_per_step'])} ms per step) "
        f"| {v('ff_computed_s')} |",
        skipped,
        "| &nbsp;&nbsp;the rest: CLI start-up and checks, the replayed interpreter before the agent, the snapshot "
        f"load (the reached line's time minus the three above) | {v('outside_ff_s')} |",
    ]


def fmt_spread_ms_x(s: dict[str, Any]) -> str:
    """A spread already in ms."""
    return f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})"


def reach_section(doc: dict[str, Any]) -> list[str]:
    p, r = doc["parameters"], doc["reach"]
    step_s = r["recorded_step_median_s"]
    q1, q3 = r["recorded_step_iqr_s"]
    lines = [
        "## 3. Time to reach step S",
        "",
        f"Workload: `examples/train_fsdp.py {' '.join(p['reach_train_args'])}` on 2 ranks, recorded once with "
        f"`--payloads {r['payloads']} --snapshot-every {r['snapshot_every']}` (payloads stored: "
        f"{fmt_coverage(r.get('payload_coverage'))}, as tensors of 64 KiB or less keep their bytes in every step; "
        f"trace {fmt_bytes(r['trace_bytes'])}, "
        f"recorded step {fmt_ms(step_s)} ms median, [{fmt_ms(q1)}, {fmt_ms(q3)}] interquartile, over its steps "
        f"after the first {p['warmup_steps']}). Then `fsdp-replay replay DIR --rank {r['rank']} --from-step S "
        f"--to-step S+1` for S = {', '.join(map(str, r['targets']))} with the default fast-forward "
        f"(`--fast-forward-warmup {r['fast_forward_warmup']}`), and with `--fast-forward-warmup S` (every step "
        f"before S computes: the old way, the baseline) for S = {', '.join(map(str, r['baseline_targets'])) or 'none'}"
        + (
            f" (not for S = {max(r['targets'])}: that would compute {max(r['targets'])} steps, "
            "about as long as recording them)"
            if r["baseline_targets"] and max(r["targets"]) > max(r["baseline_targets"])
            else ""
        )
        + f"; {r['reps']} repetition(s), the replays of a repetition in a rotated order. Every replay was "
        "BIT-EXACT over steps S..S+1.",
        "",
        "Time to reach S = report.json `fast_forward.seconds` (the program's first batch or model call -> step S "
        "reached, before the snapshot load): the warm-up steps that compute plus the skipped ones. Median over "
        "runs (min-max).",
        "",
        "| S | mode | reach S, s | x recorded step | set-up s | computed s | skipped s | ms per skipped step "
        "| start -> restored s | wall s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for x in r["by_config"].values():
        c = x["counts"] or {}
        mode = (
            f"fast-forward ({c.get('computed_steps')} computed, {c.get('skipped_steps')} skipped)"
            if x["mode"] == "fast-forward"
            else f"computed (`--fast-forward-warmup {x['target']}`)"
        )
        per_skip = x["ff_skipped_ms_per_step"]
        lines.append(
            f"| {x['target']} | {mode} | {fmt_spread_s(x['ff_seconds'], 2)} "
            f"| {x['ratio_to_recorded_step']['median']:.1f} ({x['ratio_to_recorded_step']['min']:.1f}-"
            f"{x['ratio_to_recorded_step']['max']:.1f}) | {fmt_spread_s(x['ff_setup_s'], 2)} "
            f"| {fmt_spread_s(x['ff_computed_s'], 2)} "
            f"| {fmt_spread_s(x['ff_skipped_s'], 2) if x['mode'] == 'fast-forward' else '-'} "
            f"| {fmt_spread_ms_x(per_skip) if per_skip['median'] == per_skip['median'] else '-'} "
            f"| {fmt_spread_s(x['restored_at_s'], 2)} | {fmt_spread_s(x['wall_s'], 2)} |"
        )
    inc, per_rep = r["increase_s"], r["slope_s_per_skipped_step_per_rep"]
    slope = r["slope_s_per_skipped_step_fit"]
    lines += [
        "",
        "Set-up = `fast_forward.setup_seconds` (agent start -> the program's first batch or model call: model "
        "construction, optimizer, ...); computed = the warm-up steps; skipped = the steps run without kernels; "
        "start -> restored = the command's start to its `reached step S` line, printed once the snapshot is "
        "restored (so it also holds the CLI's start-up and checks, the replayed interpreter before the agent, "
        "and the snapshot load); wall = the whole command (then steps S and S+1 verified, the report, "
        "report.txt and replay.png).",
        "",
    ]
    if inc["n"]:
        lines += [
            f"**Growth in S**: reaching step {inc['to']} takes {fmt_spread_s(inc, 2)} s more than step "
            f"{inc['from']} (per repetition, median (min-max)): a slope of {slope * 1e3:.2f} ms per skipped step "
            f"(least squares over every fast-forward run; per repetition {fmt_spread_ms(per_rep)} ms), "
            f"{r['slope_fraction_of_recorded_step']:.1%} of a recorded step. The design still runs the program's "
            "loop once per skipped step (its Python, the placeholders' dispatch, the optimizer's bookkeeping), "
            "so the time is linear in S at that slope, not flat; what it no longer pays is the model's kernels.",
            "",
        ]
    per_s = [
        (x["target"], x["ff_skipped_ms_per_step"]["median"])
        for x in r["by_config"].values()
        if x["mode"] == "fast-forward"
        and x["ff_skipped_ms_per_step"]["median"] == x["ff_skipped_ms_per_step"]["median"]
    ]
    if len(per_s) > 1:
        (t0, ms0), (t1, ms1), (t2, ms2) = per_s[0], per_s[-2], per_s[-1]
        if ms2 > 1.5 * ms1:
            shape = f"it grows with S (x{ms2 / ms1:.2f} from S = {t1} to {t2}): reaching S grows faster than linearly"
        else:
            shape = f"no growth from S = {t1} to {t2} (x{ms2 / ms1:.2f}): reaching S grows linearly in S, not faster"
            if len(per_s) > 2 and ms0 > 1.5 * ms2:
                shape += f" (the first skipped steps cost more: {ms0:.1f} ms each at S = {t0})"
        lines += [
            "Cost of a skipped step by S (median ms): "
            + ", ".join(f"S = {t}: {ms:.2f}" for t, ms in per_s)
            + f"; {shape}.",
            "",
        ]
    warm = [x for x in r["by_config"].values() if x["mode"] == "fast-forward"]
    if warm:
        computed_s = statistics.median(x["ff_computed_s"]["median"] for x in warm)
        lines += [
            f"The {r['fast_forward_warmup']} warm-up steps alone take {computed_s:.2f} s (median over S) = "
            f"{computed_s / step_s:.1f} recorded steps: the first steps of a fresh process (lazy initialization, "
            "first calls of every op) cost more than a step of the running job"
            + (
                f", so no S can reach {TARGET_REACH_STEPS:.0f} recorded steps with them."
                if computed_s / step_s >= TARGET_REACH_STEPS
                else "."
            ),
            "",
        ]
    computed = {x["target"]: x for x in r["by_config"].values() if x["mode"] == "computed"}
    ff = {x["target"]: x for x in r["by_config"].values() if x["mode"] == "fast-forward"}
    rows = [
        f"S = {t}: {c['ff_seconds']['median']:.2f} s computing every step "
        f"({c['ff_computed_ms_per_step']['median']:.1f} ms per step) against {ff[t]['ff_seconds']['median']:.2f} s "
        f"(x{c['ff_seconds']['median'] / ff[t]['ff_seconds']['median']:.1f})"
        for t, c in computed.items()
        if t in ff
    ]
    if rows:
        lines += ["Against the baseline (`--fast-forward-warmup S`): " + "; ".join(rows) + ".", ""]
    return lines


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
