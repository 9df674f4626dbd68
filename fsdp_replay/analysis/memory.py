"""The CUDA caching allocator in a trace: memory per step, the largest allocations, and what an
out-of-memory error's snapshot says (``inspect``'s memory section and its ``oom`` finding).

Reads the ``memory_steps`` and ``allocs`` tables and the ``ooms`` rank attribute (format 4,
``agent/allocations.py``). An OOM's snapshot is torch's ``torch.cuda.memory._snapshot()``, stored
as JSON: ``{"segments": [{"address", "total_size", "allocated_size", "requested_size", "stream",
"segment_type", "blocks": [{"address", "size", "requested_size", "state", "frames"}]}],
"device_traces": [[{"action", "addr", "size", "stream", "time_us", "frames"}]]}``.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from fsdp_replay.errors import FsdpReplayError
from fsdp_replay.trace.reader import RankTrace
from fsdp_replay.trace.schema import ALLOC_ACTION_CODES

LARGEST = 5  # allocations listed, per rank and per snapshot
GIB = float(1 << 30)


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if abs(n) >= (1 << 30) else f"{n / (1 << 20):.1f} MiB"


def memory_summary(r: RankTrace) -> dict[str, Any] | None:
    """Per step the allocator's counters, the largest allocations of the history steps, and each
    OOM with its snapshot's summary; None for a rank that recorded no CUDA memory."""
    ooms = [oom_record(r, oom) for oom in r.attrs.get("ooms") or []]
    if not r.has_table("memory_steps") and not ooms:
        return None
    m = r.table("memory_steps")
    if not len(m) and not ooms:
        return None
    steps = []
    if len(m):
        cols = {
            c: m[c].tolist()
            for c in ("step", "allocated_end", "reserved_end", "allocated_peak", "reserved_peak")
        }
        cols["history"] = m["history"].tolist()
        cols["alloc_retries"] = m["alloc_retries"].tolist()
        for i in range(len(m)):
            steps.append({k: int(v[i]) for k, v in cols.items()})
    return {
        "steps": steps,
        "peak_allocated": max((s["allocated_peak"] for s in steps), default=None),
        "peak_reserved": max((s["reserved_peak"] for s in steps), default=None),
        "history_steps": [s["step"] for s in steps if s["history"] >= 0],
        "largest": largest_allocations(r),
        "ooms": ooms,
    }


def largest_allocations(r: RankTrace, n: int = LARGEST) -> list[dict[str, Any]]:
    """The ``n`` largest allocations of the rank's history steps: bytes, step, micro, stream, site."""
    if not r.has_table("allocs"):
        return []
    a = r.table("allocs")
    if not len(a):
        return []
    rows = np.flatnonzero(a["action"] == ALLOC_ACTION_CODES["alloc"])
    if not len(rows):
        return []
    sizes = a["bytes"][rows]
    top = rows[np.argsort(-sizes, kind="stable")[:n]]
    sites = r.names("alloc_site")
    out = []
    for i in top.tolist():
        site = int(a["site"][i])
        out.append(
            {
                "bytes": int(a["bytes"][i]),
                "step": int(a["step"][i]),
                "micro": int(a["micro"][i]),
                "stream": int(a["stream"][i]),
                "addr": int(a["addr"][i]),
                "site": sites[site] if 0 <= site < len(sites) else None,
            }
        )
    return out


def oom_record(r: RankTrace, oom: dict[str, Any]) -> dict[str, Any]:
    """One ``ooms`` entry with its snapshot summarized (``snapshot`` None when it was not stored
    or cannot be read: ``snapshot_error`` says why)."""
    out = {
        k: oom.get(k) for k in ("step", "micro", "t_ns", "device", "requested", "device_total", "device_free")
    }
    out["stats"] = oom.get("stats") or {}
    out["snapshot"] = None
    row = int(oom.get("payload", -1))
    if row < 0:
        out["snapshot_error"] = "no snapshot stored (only the first OOMs of a process keep one)"
        return out
    try:
        out["snapshot"] = summarize_snapshot(json.loads(r.payload(row)), int(oom.get("requested") or -1))
    except (FsdpReplayError, ValueError, TypeError, KeyError) as e:
        out["snapshot_error"] = f"the snapshot cannot be read: {e}"
    return out


def summarize_snapshot(snapshot: dict[str, Any], requested: int = -1) -> dict[str, Any]:
    """What an allocator snapshot says: reserved against allocated (fragmentation), the largest
    allocations and free blocks, and the actions before it (when the history was on)."""
    segments = snapshot.get("segments") or []
    reserved = allocated = pending = 0
    blocks: list[dict[str, Any]] = []
    free_blocks: list[int] = []
    for seg in segments:
        reserved += int(seg.get("total_size", 0))
        for b in seg.get("blocks") or []:
            size, state = int(b.get("size", 0)), str(b.get("state", ""))
            if state == "active_allocated":
                allocated += size
                blocks.append(
                    {
                        "bytes": size,
                        "requested": int(b.get("requested_size", size)),
                        "addr": int(b.get("address", -1)),
                        "stream": int(seg.get("stream", 0)),
                        "site": _site(b.get("frames")),
                    }
                )
            elif state == "inactive":
                free_blocks.append(size)
            else:  # freed by the program, waiting for another stream's work (active_pending_free)
                pending += size
    blocks.sort(key=lambda b: -b["bytes"])
    cached_free = sum(free_blocks)
    largest_free = max(free_blocks, default=0)
    traces = snapshot.get("device_traces") or []
    actions = sum(len(t) for t in traces)
    out = {
        "segments": len(segments),
        "reserved": reserved,
        "allocated": allocated,
        "pending_free": pending,
        "cached_free": cached_free,
        "largest_free_block": largest_free,
        "free_blocks": len(free_blocks),
        "fragmentation": (reserved - allocated) / reserved if reserved else 0.0,
        "allocations": len(blocks),
        "largest": blocks[:LARGEST],
        "history_actions": actions,
        "last_allocs": _last_allocs(traces),
    }
    out["cause"] = _cause(out, requested)
    return out


# path parts of frames that are the libraries' own, not the program's (a block's site skips them)
_LIBRARY_PARTS = ("/torch/", "/fsdp_replay/")


def _site(frames: Any) -> str | None:
    """``file:line function`` of the innermost frame outside torch and fsdp_replay (torch lists
    the innermost first), else the innermost; None without frames."""
    if not frames:
        return None
    own = [f for f in frames if not any(part in str(f.get("filename", "")) for part in _LIBRARY_PARTS)]
    f = (own or frames)[0]
    return f"{f.get('filename')}:{f.get('line')} {f.get('name')}"


def _last_allocs(traces: list[list[dict[str, Any]]], n: int = LARGEST) -> list[dict[str, Any]]:
    """The last allocations before the snapshot, newest last (empty without history)."""
    allocs = [e for t in traces for e in t if e.get("action") == "alloc"]
    allocs.sort(key=lambda e: int(e.get("time_us") or 0))
    return [{"bytes": int(e.get("size", 0)), "site": _site(e.get("frames"))} for e in allocs[-n:]]


def _cause(s: dict[str, Any], requested: int) -> str:
    """Why the allocation failed, as far as the snapshot tells."""
    if requested < 0:
        return "the request's size is not known (the OOM was seen only as the program's exception)"
    if s["cached_free"] >= requested > s["largest_free_block"]:
        return (
            f"fragmentation: the allocator held {gib(s['cached_free'])} free in {s['free_blocks']} cached blocks, "
            f"but none of {gib(requested)} (the largest: {gib(s['largest_free_block'])}); "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets segments grow instead"
        )
    return (
        f"the program needed more than the device has: {gib(s['allocated'])} allocated by tensors, "
        f"{gib(s['reserved'])} reserved, and {gib(requested)} more asked for"
    )


def oom_message(rank: int, oom: dict[str, Any]) -> str:
    """The ``oom`` finding's text."""
    micro = int(oom.get("micro", -1))
    where = f"step {oom['step']}" + (f" micro-step {micro}" if micro >= 0 else "")
    text = f"rank {rank} ran out of CUDA memory (device {oom.get('device')}) at {where}"
    req, total, free = (int(oom.get(k, -1)) for k in ("requested", "device_total", "device_free"))
    if req >= 0:
        text += f": asked for {gib(req)} with {gib(free)} free of {gib(total)}"
    s = oom.get("snapshot")
    if s is None:
        return text + f"; {oom.get('snapshot_error') or 'no snapshot'}"
    text += (
        f"; {gib(s['allocated'])} allocated in {s['allocations']} blocks, {gib(s['reserved'])} reserved in "
        f"{s['segments']} segments ({s['fragmentation']:.0%} of it not allocated); {s['cause']}"
    )
    if s["largest"]:
        big = ", ".join(gib(b["bytes"]) + (f" at {b['site']}" if b["site"] else "") for b in s["largest"][:3])
        text += f"; largest allocations: {big}"
    return text
