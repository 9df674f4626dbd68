"""A job that reads a config, writes checkpoints and a log, reads its own checkpoint back, and
resumes from ``latest.pt`` when it finds one: what a replay must neither overwrite nor be fooled
by (``replayer/overlay.py``).

``checkpointing.py --config CONFIG.json --ckpt-dir DIR [--steps N]``, under torchrun (gloo).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    with open(args.config) as f:
        lr = float(json.load(f)["lr"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    ckpt = os.path.join(args.ckpt_dir, f"rank{rank}")
    os.makedirs(ckpt, exist_ok=True)
    latest = os.path.join(ckpt, "latest.pt")
    start = 0
    if os.path.exists(latest):  # a replay must not see what the recorded run wrote after it began
        state = torch.load(latest)
        model.load_state_dict(state["model"])
        start = state["step"] + 1
    for step in range(start, args.steps):
        loss = model(torch.randn(4, 16)).pow(2).mean()
        loss.backward()
        for param in model.parameters():
            dist.all_reduce(param.grad)
        opt.step()
        opt.zero_grad()
        torch.save({"model": model.state_dict(), "step": step}, os.path.join(ckpt, f"step{step}.pt"))
        tmp = latest + ".tmp"
        torch.save({"model": model.state_dict(), "step": step}, tmp)
        os.replace(tmp, latest)
        with open(os.path.join(ckpt, "log.txt"), "a") as log:
            log.write(f"step {step} loss {loss.item():.8f}\n")
        if step == 1:  # its own output, read back
            back = torch.load(os.path.join(ckpt, "step0.pt"))
            assert back["step"] == 0
        print(f"step {step} loss {loss.item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
