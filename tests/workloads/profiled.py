"""Run a training script under torch.profiler and count the collectives its backend executed.

An independent count for tests: the profiler's ``gloo:*`` events come from the backend itself,
not from fsdp-replay's dispatcher hook. Writes {"gloo": {...}, "c10d": {...}} to
$COUNT_OUT/counts-<rank>.json.
"""

from __future__ import annotations

import collections
import json
import os
import runpy
import sys

from torch.profiler import ProfilerActivity, profile


def main() -> None:
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runpy.run_path(script, run_name="__main__")
    gloo = collections.Counter(e.name for e in prof.events() if e.name.startswith("gloo:"))
    c10d = collections.Counter(e.name for e in prof.events() if e.name.startswith("c10d::"))
    out = os.environ["COUNT_OUT"]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"counts-{os.environ.get('RANK', '0')}.json"), "w") as f:
        json.dump({"gloo": gloo, "c10d": c10d}, f)


if __name__ == "__main__":
    main()
