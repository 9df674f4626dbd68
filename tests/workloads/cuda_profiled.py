"""Run a training script under torch.profiler with CUDA activities only.

An independent count for the CUPTI capture's GPU test (``tests/system/test_cupti_gpu.py``), and the
comparison configuration of ``bench/bench_record.py`` (``torch-profiler``). With $COUNT_OUT set,
rank 0 writes ``kernels-0.json`` there: the kernels (by name, in launch order) and the copies
Kineto saw in each step. Steps are told apart as fsdp-replay's trace numbers them (step k: from
the end of optimizer step k-1 to the end of optimizer step k): a global optimizer post-step hook
launches a marker kernel (``torch.cuda._sleep``'s ``spin_kernel``), and each kernel belongs to the
step of the first marker launched after it (by CUPTI correlation id: launch order). The markers
are left out of the counts. Without $COUNT_OUT nothing is launched or written: the bench measures
the profiler alone.
"""

from __future__ import annotations

import bisect
import collections
import json
import os
import runpy
import sys
from typing import Any

import torch
from kineto_events import activity  # this folder: the script's own
from torch.optim import optimizer as optim_module
from torch.profiler import ProfilerActivity, profile

MARKER = "spin_kernel"
KERNEL_TYPES = ("kernel",)
COPY_TYPES = ("gpu_memcpy", "gpu_memset")


def by_step(events: list[Any]) -> dict[str, Any]:
    kernels = sorted((e.correlation_id(), e.name()) for e in events if activity(e) in KERNEL_TYPES)
    copies = sorted(e.correlation_id() for e in events if activity(e) in COPY_TYPES)
    markers = [corr for corr, name in kernels if MARKER in name]
    steps: dict[int, list[str]] = collections.defaultdict(list)
    for corr, name in kernels:
        if MARKER not in name:
            steps[bisect.bisect_left(markers, corr)].append(name)
    copies_by_step = collections.Counter(bisect.bisect_left(markers, corr) for corr in copies)
    return {
        "markers": len(markers),
        "kernels": {str(k): v for k, v in sorted(steps.items())},
        "copies": {str(k): v for k, v in sorted(copies_by_step.items())},
        "activity_types": dict(collections.Counter(activity(e) for e in events)),
    }


def main() -> None:
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    out = os.environ.get("COUNT_OUT")
    if out:
        optim_module.register_optimizer_step_post_hook(lambda _opt, _a, _k: torch.cuda._sleep(1))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runpy.run_path(script, run_name="__main__")
    if out and os.environ.get("RANK", "0") == "0":
        os.makedirs(out, exist_ok=True)
        doc = by_step(list(prof.profiler.kineto_results.events()))
        with open(os.path.join(out, "kernels-0.json"), "w") as f:
            json.dump(doc, f)


if __name__ == "__main__":
    main()
