"""Samples of py-spy raw profiles (``--native --threads --idle --format raw``, gzipped) inside the
agent's frames, several profiles side by side: for the rank's MainThread and the autograd
engine's thread, each fsdp_replay function's inclusive samples, leaving out the program's own
backward that runs inside our ``Hooks._backward`` wrapper. Session 16's first GPU call compared
metadata-only, window:4 and --cupti always with it (``bench/results/gpu-session16/``).

    python bench/experiments/profile_agent_frames.py meta.txt.gz window4.txt.gz cupti.txt.gz
"""

from __future__ import annotations

import argparse
import collections
import gzip
import re

SKIP_THREADS = ("writer", "Feeder", "pin_memory")  # the writer, DataLoader's threads


def key(frame: str) -> str:
    m = re.match(r"(.*) \((.*?):(\d+)\)$", frame)
    return f"{m.group(1)} ({m.group(2).split('/')[-1]})" if m else frame


def agent_samples(path: str) -> tuple[collections.Counter[tuple[str, str]], collections.Counter[str]]:
    """(thread, function) -> inclusive samples in agent frames; thread -> all samples."""
    inclusive: collections.Counter[tuple[str, str]] = collections.Counter()
    totals: collections.Counter[str] = collections.Counter()
    with gzip.open(path, "rt") as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            frames = stack.split(";")
            thread = re.sub(r"\(\d+\)", "", next(x for x in frames if x.startswith("thread ")))
            if any(s in thread for s in SKIP_THREADS):
                continue
            frames = [x for x in frames if not x.startswith(("process ", "thread "))]
            totals[thread] += int(n)
            ours = [i for i, x in enumerate(frames) if "fsdp_replay" in x]
            backward = [
                i for i, x in enumerate(frames) if x.startswith("backward (") and "autograd/__init__" in x
            ]
            if backward:  # only our frames below the program's backward (the tape's hooks)
                ours = [i for i in ours if i > backward[-1]]
            for k in {(thread[:20], key(frames[i])) for i in ours}:
                inclusive[k] += int(n)
    return inclusive, totals


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("profiles", nargs="+")
    p.add_argument("--top", type=int, default=45)
    args = p.parse_args()
    results = {path: agent_samples(path) for path in args.profiles}
    for path, (_, totals) in results.items():
        print(f"{path}: samples per thread {dict(totals)}")
    keys = set().union(*(inc for inc, _ in results.values()))
    rows = sorted(keys, key=lambda k: -max(inc[k] for inc, _ in results.values()))
    print(f"{'':70s}", *(f"{path.split('/')[-1][:10]:>10s}" for path in results))
    for k in rows[: args.top]:
        print(f"{(k[0] + ' ' + k[1])[:70]:70s}", *(f"{inc[k]:>10d}" for inc, _ in results.values()))


if __name__ == "__main__":
    main()
