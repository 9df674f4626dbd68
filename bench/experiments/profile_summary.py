"""Summarize py-spy's raw (collapsed) stacks of a recorded run (``profile_tape.sh``): samples per
thread of the rank process, and inside one function (default the tape's ``TapeRecorder.taped``)
the cumulative samples of each function below it, leaving out one-time work (imports, Triton's
compilation).

    python bench/experiments/profile_summary.py prof-tape.txt [--within TapeRecorder.taped] [--top 20]
"""

from __future__ import annotations

import argparse
import collections
import re

ONE_TIME = ("compile", "importlib", "triton_key", "_find_and_load")


def key(frame: str) -> str:
    m = re.match(r"(.*) \((.*?):(\d+)\)$", frame)
    return f"{m.group(1)} ({m.group(2).split('/')[-1]})" if m else frame


def load(path: str) -> list[tuple[str, list[str], int]]:
    """(thread, frames outermost first, samples) of the rank process (the example's)."""
    rows = []
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            frames = stack.split(";")
            procs = [x for x in frames if x.startswith("process ")]
            if procs and "train_fsdp.py" not in procs[-1]:  # (`--pid` of the rank: no process frames)
                continue
            thread = next((x for x in frames if x.startswith("thread ")), "thread ?")
            rows.append((thread, [x for x in frames if not x.startswith(("process ", "thread "))], int(n)))
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("raw")
    p.add_argument("--within", default="TapeRecorder.taped")
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args()
    rows = load(args.raw)
    threads: collections.Counter[str] = collections.Counter()
    for thread, _, n in rows:
        threads[thread] += n
    print(f"## {args.raw}\n\nsamples per thread of the rank process:")
    for thread, n in threads.most_common(6):
        print(f"- {n} {thread}")
    cum: collections.Counter[str] = collections.Counter()
    leaves: collections.Counter[str] = collections.Counter()  # where the samples were taken (self)
    total = 0
    for _, frames, n in rows:
        keys = [key(f) for f in frames]
        if any(any(w in k for w in ONE_TIME) for k in keys):
            continue
        inside = [i for i, k in enumerate(keys) if args.within in k]
        if not inside:
            continue
        total += n
        for k in set(keys[inside[-1] :]):
            cum[k] += n
        leaves[keys[-1]] += n
    print(f"\nsteady-state samples inside {args.within}: {total} (one-time work left out)")
    for k, n in cum.most_common(args.top):
        print(f"- {n} {k}")
    print(
        "\nof them, by the innermost frame (self samples; `--within Engine::thread_main`: the autograd thread)"
    )
    for k, n in leaves.most_common(args.top):
        print(f"- {n} {k}")


if __name__ == "__main__":
    main()
