"""What a rank's CUPTI capture holds (``kernels``, ``copies``, the ``cupti`` attribute), for
``inspect``: counts by step, the busiest kernels, what was dropped and why, when it stood aside."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from fsdp_replay.trace import schema
from fsdp_replay.trace.reader import RankTrace

# The agent's counters (end.counters) that say what the capture received, wrote and dropped.
DROP_COUNTERS = {
    "cupti_dropped_buffer": "no CUPTI buffer space",
    "cupti_dropped_subscriber": "another profiler owned CUPTI",
    "cupti_dropped_error": "an error of the capture",
    "cupti_dropped_incomplete": "not run when flushed",
}

# ``off`` reasons inspect does not repeat (agent/gpu_activity.py says them).
QUIET_OFF = ("no CUDA device in use", "--cupti off")


def cupti_summary(r: RankTrace) -> dict[str, Any] | None:
    """The capture's summary, or None for a trace from before it (format < 4)."""
    if not r.has_table("kernels"):
        return None
    k, c = r.table("kernels"), r.table("copies")
    names = r.names("kernel")
    attr = r.attrs.get(schema.CUPTI_ATTR) or {}
    states = list(attr.get("states") or [])
    counters = ((r.attrs.get("end") or {}).get("counters")) or {}
    steps = np.unique(k["step"]).tolist() if len(k) else []
    busiest = (
        Counter(names[n] if 0 <= n < len(names) else "?" for n in k["name"].tolist()) if len(k) else Counter()
    )
    kinds = Counter(
        schema.COPY_KINDS[x] if 0 <= x < len(schema.COPY_KINDS) else "?" for x in c["kind"].tolist()
    )
    last = states[-1] if states else None
    return {
        "kernels": len(k),
        "copies": len(c),
        "copy_kinds": dict(kinds),
        "copy_bytes": int(c["bytes"].sum()) if len(c) else 0,
        "steps": [int(s) for s in steps],
        "kernels_per_step": {
            int(s): int(n) for s, n in zip(*np.unique(k["step"], return_counts=True), strict=True)
        }
        if len(k)
        else {},
        "distinct_kernels": len(names),
        "top_kernels": busiest.most_common(5),
        "state": None if last is None else {"state": last.get("state"), "reason": last.get("reason")},
        "pauses": [s for s in states if s.get("state") in ("paused", "lost", "error")],
        "off": next((s["reason"] for s in states if s.get("state") == "off"), None),
        "agent_records": int(counters.get("cupti_agent_records", 0)),
        "detaches": int(counters.get("cupti_detaches", 0)),  # (absent before session 16: 0)
        "dropped": {key: int(counters[key]) for key in DROP_COUNTERS if counters.get(key)},
        "clock": attr.get("clock") or [],
    }


def cupti_lines(rank: int, s: dict[str, Any]) -> list[str]:
    """``cupti_summary`` in words, for ``inspect``'s text output."""
    if s["off"] is not None and not s["kernels"]:
        # a CPU rank, or a capture turned off on purpose: nothing to say
        quiet = s["off"].startswith(QUIET_OFF)
        return [] if quiet else [f"rank {rank}: CUDA kernels not captured: {s['off']}"]
    if not s["kernels"] and not s["copies"] and not s["pauses"]:
        return []
    steps = s["steps"]
    if not steps:
        span = "no step"
    elif len(steps) == 1:
        span = f"step {steps[0]}"
    elif len(steps) == steps[-1] - steps[0] + 1:
        span = f"steps {steps[0]}..{steps[-1]}"
    else:  # windows: say which steps, not a range that suggests every step in it
        span = f"{len(steps)} steps ({', '.join(map(str, steps[:8]))}{', ...' if len(steps) > 8 else ''})"
    detached = s.get("detaches", 0)
    lines = [
        f"rank {rank}: CUDA kernels captured (CUPTI): {s['kernels']} kernels ({s['distinct_kernels']} distinct) "
        f"and {s['copies']} copies over {span}; {s['agent_records']} of the agent's own left out"
        + (
            f"; CUPTI let go between windows {detached} time{'s' if detached != 1 else ''}"
            if detached
            else ""
        )
    ]
    if s["dropped"]:
        why = ", ".join(f"{n} ({DROP_COUNTERS[key]})" for key, n in s["dropped"].items())
        lines.append(f"  records dropped: {why}")
    for p in s["pauses"]:
        lines.append(f"  step {p.get('step')}: {p.get('state')}: {p.get('reason')}")
    return lines
