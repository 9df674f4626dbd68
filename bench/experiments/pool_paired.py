"""Pools the paired ratios of two or more `bench_record.py` result files (runs of the same
configurations, e.g. two GPU calls on the same machine kind): per repetition, one config's median
step over the reference's, then the median and quartiles of all of them; and each config's agent
CPU a step (ms) per run, with its median.

    python bench/experiments/pool_paired.py window4 meta-python a.json b.json
"""

from __future__ import annotations

import argparse
import json
import statistics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("reference")
    ap.add_argument("results", nargs="+")
    a = ap.parse_args()
    ratios: list[float] = []
    cpu: dict[str, list[float]] = {a.config: [], a.reference: []}
    for path in a.results:
        with open(path) as f:
            runs = json.load(f)["runs"]
        by = {(r["rep"], r["config"]): r for r in runs}
        for r in runs:
            if r["config"] in cpu and r.get("agent_cpu_ms_per_step") is not None:
                cpu[r["config"]].append(r["agent_cpu_ms_per_step"])
        for rep in sorted({rep for rep, _ in by}):
            run, ref = by.get((rep, a.config)), by.get((rep, a.reference))
            if run is not None and ref is not None:
                ratios.append(run["step_median_s"] / ref["step_median_s"])
    if len(ratios) < 2:
        raise SystemExit(f"{len(ratios)} paired repetitions of {a.config} and {a.reference}: too few to pool")
    q1, _, q3 = statistics.quantiles(ratios, n=4)
    print(f"{a.config} over {a.reference}, {len(ratios)} repetitions from {len(a.results)} files:")
    print("  per repetition: " + ", ".join(f"{x:.3f}" for x in sorted(ratios)))
    print(f"  median {statistics.median(ratios):.3f} [quartiles {q1:.3f}, {q3:.3f}]")
    for name, values in cpu.items():
        shown = ", ".join(f"{x:.1f}" for x in values)
        print(f"  agent CPU ms a step, {name}: {shown}; median {statistics.median(values):.1f}")


if __name__ == "__main__":
    main()
