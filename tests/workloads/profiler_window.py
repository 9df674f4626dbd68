"""A small CUDA training loop that opens a torch.profiler window (CUDA activities) for a few steps.

For the CUPTI capture's coexistence test (``tests/system/test_cupti_gpu.py``): recorded with
``--cupti always``, the profiler must get its kernels while our capture stands aside, and our
capture must come back after the window. The profiler starts before iteration --profile-from and
stops after the optimizer step of iteration --profile-to; what it saw goes to $PROFILE_OUT (JSON:
its kernel and copy events, and the kernel names it saw most).
"""

from __future__ import annotations

import argparse
import collections
import json
import os

import torch
from kineto_events import activity  # this folder: the script's own
from torch import nn
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--profile-from", type=int, default=4)
    p.add_argument("--profile-to", type=int, default=5)
    args = p.parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randn(64, 256, device=device)
    prof = None
    for step in range(args.steps):
        if step == args.profile_from:
            prof = profile(activities=[ProfilerActivity.CUDA])
            prof.start()
        x = data.roll(step, 0).cpu().to(device, non_blocking=True)  # a copy each way, every step
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step == args.profile_to and prof is not None:
            prof.stop()
            events = list(prof.profiler.kineto_results.events())
            kinds = collections.Counter(activity(e) for e in events)
            names = collections.Counter(e.name() for e in events if activity(e) == "kernel")
            with open(os.environ["PROFILE_OUT"], "w") as f:
                json.dump({"activity_types": dict(kinds), "top_kernels": names.most_common(8)}, f)
        print(f"step {step} loss {loss.item():.6f}", flush=True)


if __name__ == "__main__":
    main()
