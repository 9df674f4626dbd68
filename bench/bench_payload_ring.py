"""What storing GPU payloads costs the training stream: the payload ring against the plain copy.

    python bench/bench_payload_ring.py --reps 10 --steps 20 --results bench/results/payload_ring_gpu

A training step on the H200 of the size of the GPU reference step (#13): 8 blocks, d=1024, a batch
of 16 x 512 tokens, bf16, forward and backward of each block's MLP (d -> 4d -> d) with autograd.
Before each block's forward, a "collective output" is made the way FSDP's all-gather makes one (the
block's weights copied into a buffer that the next step writes again), and stored as a payload,
one of 16.8 MB per block (134 MB a step), in one of four arms, interleaved (the order rotates
every repetition):

* ``plain``: no payload stored (the step alone);
* ``ring``: ``PayloadRing.stage`` (agent/payload_ring.py): a device-to-device copy on the training
  stream, the copy to pinned host memory on a side stream; a drain thread, standing in for the
  agent's writer, waits for each payload's event, reads its bytes and frees the slot;
* ``ring-sm``: the same, the device-to-device copy made by an elementwise kernel (a bitwise OR
  with 0 over 32-bit words) instead of ``copy_``'s memcpy, which may wait for a copy engine that
  the side stream's host copies hold;
* ``direct``: the copy the agent made before the ring (``tensor_record._copy``): pinned memory
  allocated, the copy to it issued on the training stream; the drain thread waits for its event.

Per run: the median step time (wall, the training stream synchronized at each step end, not the
side stream), payloads staged and dropped (ring full), and the drain's throughput (bytes over the
time from the first payload's copy to the last one's arrival). Reported: each arm's step time
against ``plain`` of the same repetition (median of the paired ratios and its 95% bootstrap
interval), and the host-copy ceiling of this machine (one 1 GiB pinned device-to-host copy).
The drain does not write to a disk: what is measured is the training stream's share of the cost
and the copy path's throughput; what a disk adds is the writer's, off the training thread.
"""

from __future__ import annotations

import argparse
import datetime
import queue
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchlib import REPO, bootstrap_median, machine_info, portable_command, write_results

ARMS = ("plain", "ring", "ring-sm", "direct")


class Drain:
    """The writer's stand-in: waits for each payload's event, touches its bytes, frees its slot."""

    def __init__(self) -> None:
        self.q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.bytes = 0
        self.first_t: float | None = None
        self.last_t = 0.0
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def put(self, item: Any) -> None:
        if self.first_t is None:
            self.first_t = time.perf_counter()
        self.q.put(item)

    def _run(self) -> None:
        import torch

        while True:
            item = self.q.get()
            if item is None:
                return
            data, ready, nbytes = item
            ready.synchronize()
            host = getattr(data, "host", data)
            _ = memoryview(host.reshape(-1).view(torch.uint8).numpy()).nbytes  # the writer reads them here
            if hasattr(data, "release"):
                data.release()
            self.bytes += nbytes
            self.last_t = time.perf_counter()

    def close(self) -> None:
        self.q.put(None)
        self.t.join()


def run_arm(arm: str, steps: int, warmup: int, ring_bytes: int, model: Any) -> dict[str, Any]:
    import torch

    from fsdp_replay.agent.payload_ring import PayloadRing
    from fsdp_replay.agent.tensor_record import _copy

    blocks, x, buffers = model
    ring = (
        PayloadRing(torch.device("cuda"), ring_bytes, sm_copy=arm == "ring-sm")
        if arm.startswith("ring")
        else None
    )
    drain = Drain()
    training = torch.cuda.current_stream()
    times: list[float] = []
    staged = dropped = 0
    for step in range(warmup + steps):
        training.synchronize()
        t0 = time.perf_counter()
        h = x
        for (w1, w2), buf in zip(blocks, buffers, strict=True):
            # the "all-gather": this step's weights into the buffer the next step writes again
            torch.cat([w1.detach().reshape(-1), w2.detach().reshape(-1)], out=buf)
            if arm != "plain":
                nbytes = buf.numel() * buf.element_size()
                if ring is not None:
                    got = ring.stage(buf, nbytes)
                    if got is None:
                        dropped += 1
                    else:
                        drain.put((got[0], got[1], nbytes))
                        staged += 1
                else:
                    copy, ready = _copy(buf)
                    drain.put((copy, ready, nbytes))
                    staged += 1
            h = torch.nn.functional.gelu(h @ w1) @ w2 + h
        h.float().pow(2).mean().backward()
        for w1, w2 in blocks:
            w1.grad = w2.grad = None
        training.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    drain.close()
    wall = (drain.last_t - drain.first_t) if drain.first_t is not None and drain.bytes else 0.0
    return {
        "arm": arm,
        "step_median_s": statistics.median(times),
        "step_times_s": times,
        "staged": staged,
        "dropped": dropped,
        "drained_bytes": drain.bytes,
        "drain_gbps": drain.bytes / wall / 1e9 if wall > 0 else None,
    }


def ceiling_gbps() -> float:
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    best = 0.0
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, (1 << 30) / (time.perf_counter() - t0) / 1e9)
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--steps", type=int, default=20, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--ring-mb", type=int, default=256, help="the ring's size (the agent's default: 256)")
    p.add_argument("--results", default=str(REPO / "bench" / "results" / "payload_ring_gpu"))
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("bench_payload_ring: needs a CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    d, tokens, n_blocks = 1024, 16 * 512, 8
    dev, dt = torch.device("cuda"), torch.bfloat16
    blocks = [
        (
            (torch.randn(d, 4 * d, device=dev, dtype=dt) * 0.02).requires_grad_(),
            (torch.randn(4 * d, d, device=dev, dtype=dt) * 0.02).requires_grad_(),
        )
        for _ in range(n_blocks)
    ]
    x = torch.randn(tokens, d, device=dev, dtype=dt)
    buffers = [torch.empty(8 * d * d, device=dev, dtype=dt) for _ in range(n_blocks)]
    model = (blocks, x, buffers)
    started = time.time()
    ceiling = ceiling_gbps()
    runs: list[dict[str, Any]] = []
    for rep in range(args.reps):
        order = ARMS[rep % len(ARMS) :] + ARMS[: rep % len(ARMS)]
        for arm in order:
            r = run_arm(arm, args.steps, args.warmup, args.ring_mb << 20, model)
            r["rep"] = rep
            runs.append(r)
            print(
                f"rep {rep} {arm:6s} step {r['step_median_s'] * 1e3:7.3f} ms  staged {r['staged']:4d} "
                f"dropped {r['dropped']:4d}  drain {r['drain_gbps'] or 0:6.1f} GB/s",
                flush=True,
            )
    plain = {r["rep"]: r["step_median_s"] for r in runs if r["arm"] == "plain"}
    summary: dict[str, Any] = {}
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        ratios = [r["step_median_s"] / plain[r["rep"]] for r in mine]
        med, lo, hi = bootstrap_median(ratios)
        gbps = [r["drain_gbps"] for r in mine if r["drain_gbps"]]
        summary[arm] = {
            "step_ms_median": statistics.median(r["step_median_s"] for r in mine) * 1e3,
            "ratio_to_plain": [med, lo, hi],
            "staged": sum(r["staged"] for r in mine),
            "dropped": sum(r["dropped"] for r in mine),
            "drain_gbps_median": statistics.median(gbps) if gbps else None,
        }
    payload_mb = buffers[0].numel() * buffers[0].element_size() / 1e6
    doc: dict[str, Any] = {
        "command": portable_command(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "took_s": round(time.time() - started, 1),
        "machine": {**machine_info(), "gpu": torch.cuda.get_device_name()},
        "config": {**vars(args), "payload_mb": payload_mb, "payloads_per_step": n_blocks},
        "ceiling_gbps": ceiling,
        "summary": summary,
        "runs": runs,
    }
    out = Path(args.results)
    lines = [
        "# GPU payloads off the training stream: the payload ring against the plain copy",
        "",
        f"- Produced by: `{doc['command']}` (in the repository root)",
        f"- Date: {doc['date']} (took {doc['took_s']} s); GPU: {doc['machine']['gpu']}; "
        f"torch {doc['machine']['torch']}; commit {doc['machine']['git_commit']}",
        f"- Step: {n_blocks} blocks, d={d}, {tokens} tokens, bf16, MLP forward and backward; "
        f"{n_blocks} payloads of {payload_mb:.1f} MB a step ({n_blocks * payload_mb:.0f} MB); "
        f"ring {args.ring_mb} MiB; {args.reps} repetitions x {args.steps} steps per arm, interleaved",
        f"- Host-copy ceiling on this machine (1 GiB pinned device-to-host copy, best of 5): "
        f"**{ceiling:.1f} GB/s**",
        "",
        "| arm | step ms (median) | step time / plain: median [95% CI] | payloads staged | dropped (ring full) "
        "| drain GB/s (median) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for arm in ARMS:
        s = summary[arm]
        med, lo, hi = s["ratio_to_plain"]
        g = s["drain_gbps_median"]
        lines.append(
            f"| {arm} | {s['step_ms_median']:.3f} | {med:.3f} [{lo:.3f}, {hi:.3f}] | {s['staged']} | "
            f"{s['dropped']} | {'-' if g is None else f'{g:.1f}'} |"
        )
    lines += [
        "",
        "Reading it: `direct` puts each payload's copy to the host on the training stream, so a step "
        "waits for its payloads' bytes at the host-copy speed; `ring` leaves the training stream one "
        "device-to-device copy per payload and moves the rest to a side stream, dropping (and counting) "
        "what does not fit when the host copy cannot keep up. The drain rate is bounded by the ceiling "
        "above; the drain thread here does not write to a disk.",
    ]
    write_results(out, doc, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
