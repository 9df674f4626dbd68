"""A stand-in for a recorded training process: writes one rank's spool with the real SpoolWriter.

    spool_trainer.py OUT RANK STEPS [--step-s S] [--no-end]

Each step: two collectives, a step event with cumulative cpu_ns (hooks: 1000*(i+1)^2 ns, writer:
100*(i+1) ns, so the per-step figures are known), an alive mark. Then an end event, unless
--no-end (a rank killed by SIGKILL writes none). Started with FSDP_REPLAY_MODE in its environment,
discovery takes it for a trainer.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import spool_events as ev  # noqa: E402

from fsdp_replay.trace import schema, spool  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("rank", type=int)
    p.add_argument("steps", type=int)
    p.add_argument("--step-s", type=float, default=0.1)
    p.add_argument("--no-end", action="store_true")
    a = p.parse_args()
    t0 = time.monotonic_ns()
    w = spool.SpoolWriter(spool.rank_dir(Path(a.out) / schema.SPOOL_DIR, a.rank), a.rank)
    w.append(schema.KIND_EVENT, ev.rank_start(a.rank, time.time_ns() - (time.monotonic_ns() - t0)))
    seq = 0
    for i in range(a.steps):
        time.sleep(a.step_s)
        for op in ("_allgather_base_", "_reduce_scatter_base_"):
            w.append(schema.KIND_EVENT, ev.coll(seq, op, time.monotonic_ns() - t0, 1000, step=i))
            seq += 1
        w.append(
            schema.KIND_EVENT, ev.step(i, time.monotonic_ns() - t0, (1000 * (i + 1) ** 2, 100 * (i + 1)))
        )
    if not a.no_end:
        hooks, writer = 1000 * a.steps**2, 100 * a.steps
        w.append(
            schema.KIND_EVENT,
            ev.end(time.monotonic_ns() - t0, a.steps, seq, agent_cpu_ns=hooks, writer_cpu_ns=writer),
        )
    w.close()
    print(f"rank {a.rank} pid {os.getpid()} wrote {w.records_written} records", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
