"""A trace as a timeline: the Trace Event Format's JSON, which ui.perfetto.dev and
chrome://tracing open (``fsdp-replay export --perfetto``).

One process per rank (``pid`` = rank), its tracks as threads:

- ``steps``: one complete (``X``) slice per optimizer step, from the previous step's end (step 0:
  from the rank's first timed record) to its end;
- ``micro-steps``: each ``backward()`` from the previous one's end (or the step's start) to its
  own, then ``optimizer`` to the step's end (format 4: ``micro_steps``);
- ``collectives pg N``: each collective from its issue to the completion the agent saw, named by
  its op, with its sequence number, process group, bytes and fingerprints in ``args``; collectives
  in flight together go to extra lanes (``pg N #2``), since slices on one thread must nest;
- ``cuda stream S``: the kernels and copies CUPTI saw (format 4 ``kernels``/``copies``), their
  device times mapped to the host clock;
- counters (``C``): the caching allocator's requested and reserved bytes after each action of the
  ``--alloc-history`` steps, and torch's counters at each step's end;
- instants (``i``): out-of-memory errors and collectives written down as stuck.

Times are ``ts``/``dur`` in microseconds from the earliest event of the export, on each rank's
wall clock (``rank_start.t0_wall_ns`` + ``t_ns``), so ranks line up as well as their clocks do.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import numpy as np

from fsdp_replay.trace import schema
from fsdp_replay.trace.reader import RankTrace, Trace

# thread ids within a rank's process: fixed tracks first, then lanes
TID_STEPS = 1
TID_MICRO = 2
TID_COLL_BASE = 100  # + LANES * (pg id + 1) + lane
LANES = 100  # per process group (more collectives in flight at once share the last lane)
TID_STREAM_BASE = 1_000_000  # + the stream's index in the rank
COUNTER_ALLOCATOR = "cuda allocator (history)"
COUNTER_STEP_END = "cuda memory (step ends)"


class Timeline:
    """Trace events with absolute times (ns), shifted to microseconds from the earliest at the end."""

    def __init__(self) -> None:
        self.meta: list[dict[str, Any]] = []
        self.events: list[tuple[int, dict[str, Any]]] = []  # (absolute start ns, event)

    def name_process(self, pid: int, name: str, sort: int) -> None:
        self.meta.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}})
        self.meta.append(
            {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": sort}}
        )

    def name_thread(self, pid: int, tid: int, name: str) -> None:
        self.meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
        self.meta.append(
            {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}}
        )

    def slice(
        self, pid: int, tid: int, name: str, start_ns: int, end_ns: int, cat: str, args: dict[str, Any]
    ) -> None:
        ev = {
            "ph": "X",
            "name": name,
            "cat": cat,
            "pid": pid,
            "tid": tid,
            "dur": max(end_ns - start_ns, 0) / 1000,
        }
        ev["args"] = args
        self.events.append((start_ns, ev))

    def counter(self, pid: int, name: str, t_ns: int, values: dict[str, int]) -> None:
        self.events.append((t_ns, {"ph": "C", "name": name, "pid": pid, "tid": 0, "args": values}))

    def instant(self, pid: int, tid: int, name: str, t_ns: int, cat: str, args: dict[str, Any]) -> None:
        ev = {"ph": "i", "name": name, "cat": cat, "pid": pid, "tid": tid, "s": "p", "args": args}
        self.events.append((t_ns, ev))

    def document(self, other: dict[str, Any]) -> dict[str, Any]:
        self.events.sort(key=lambda e: e[0])
        base = self.events[0][0] if self.events else 0
        out = list(self.meta)
        for t_ns, ev in self.events:
            ev["ts"] = (t_ns - base) / 1000
            out.append(ev)
        return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {**other, "origin_ns": base}}


def export(trace: Trace, ranks: list[int] | None = None) -> dict[str, Any]:
    """The trace (or ``ranks`` of it) as a trace-event document (a JSON object)."""
    chosen = trace.ranks if ranks is None else [r for r in ranks if r in trace.ranks]
    tl = Timeline()
    notes: list[str] = []
    for rank in chosen:
        r = trace.rank(rank)
        notes += RankTimeline(tl, r).build()
    other = {
        "trace": trace.url,
        "format_version": trace.meta.get("format_version"),
        "ranks": chosen,
        "clock": "each rank's wall clock (rank_start.t0_wall_ns + t_ns)",
        "notes": notes,
    }
    return tl.document(other)


class RankTimeline:
    """One rank's tracks."""

    def __init__(self, tl: Timeline, r: RankTrace) -> None:
        self.tl = tl
        self.r = r
        self.pid = r.rank
        # every t_ns of this rank on the shared clock; traces before format 3 have no t0_wall_ns
        self.t0 = int(r.meta.get("t0_wall_ns") or 0)
        self.notes: list[str] = []
        self.named: set[int] = set()  # threads named so far

    def build(self) -> list[str]:
        r, tl = self.r, self.tl
        host = r.meta.get("host")
        tl.name_process(self.pid, f"rank {r.rank}" + (f" ({host})" if host else ""), r.rank)
        attempts = int(r.attrs.get("attempts") or 1)
        if attempts > 1:  # the trace keeps the first attempt's clock only
            self.notes.append(
                f"rank {r.rank} started {attempts} times: each later attempt's times count from its own "
                "process start, and are drawn from the first attempt's"
            )
        starts = self._steps()
        self._micro_steps(starts)
        self._collectives()
        self._stuck()
        self._device_activity()
        self._allocator()
        self._ooms()
        return self.notes

    # -- steps and micro-steps -----------------------------------------------------------------
    def _first_time(self) -> int | None:
        """The earliest timed record of the rank (its step 0 starts there)."""
        times = []
        c = self.r.collectives
        if len(c):
            times.append(int(c["t_ns"].min()))
        for table, col in (("micro_steps", "t_ns"), ("allocs", "t_ns")):
            if self.r.has_table(table) and len(self.r.table(table)):
                t = self.r.table(table)[col]
                t = t[t >= 0]
                if len(t):
                    times.append(int(t.min()))
        return min(times) if times else None

    def _steps(self) -> dict[int, int]:
        """The ``steps`` track; returns each step's start (t_ns)."""
        s = self.r.steps
        starts: dict[int, int] = {}
        if not len(s):
            return starts
        self.tl.name_thread(self.pid, TID_STEPS, "steps")
        ends = s["t_ns"].tolist()
        first = self._first_time()
        losses = self.r.table("losses")["value"]
        for i, step in enumerate(s["step"].tolist()):
            start = ends[i - 1] if i else min(first if first is not None else 0, ends[0])
            starts[step] = start
            lo, n = int(s["loss_start"][i]), int(s["loss_count"][i])
            args = {
                "step": step,
                "micro_steps": int(s["micro_steps"][i]),
                "collectives": int(s["colls"][i]),
                "loss": [_json_float(x) for x in losses[lo : lo + n].tolist()],
                "nonfinite": bool(s["nonfinite"][i]),
            }
            self.tl.slice(
                self.pid, TID_STEPS, f"step {step}", self.t0 + start, self.t0 + ends[i], "step", args
            )
        return starts

    def _micro_steps(self, starts: dict[int, int]) -> None:
        if not self.r.has_table("micro_steps"):
            self.notes.append(f"rank {self.r.rank}: no micro-step times (a trace before format 4)")
            return
        m = self.r.table("micro_steps")
        if not len(m):
            return
        self.tl.name_thread(self.pid, TID_MICRO, "micro-steps")
        s = self.r.steps
        step_end = dict(zip(s["step"].tolist(), s["t_ns"].tolist(), strict=True))
        by_step: dict[int, list[tuple[int, int]]] = defaultdict(list)
        for step, micro, t in zip(m["step"].tolist(), m["micro"].tolist(), m["t_ns"].tolist(), strict=True):
            by_step[step].append((micro, t))
        for step, ends in by_step.items():
            prev = starts.get(step, ends[0][1])
            for micro, t in ends:
                args = {"step": step, "micro": micro}
                self.tl.slice(
                    self.pid, TID_MICRO, f"micro {micro}", self.t0 + prev, self.t0 + t, "micro", args
                )
                prev = t
            if step in step_end:
                args = {"step": step, "micro": len(ends)}
                self.tl.slice(
                    self.pid, TID_MICRO, "optimizer", self.t0 + prev, self.t0 + step_end[step], "micro", args
                )

    # -- collectives ---------------------------------------------------------------------------
    def _collectives(self) -> None:
        r = self.r
        c, t = r.collectives, r.tensors
        if not len(c):
            return
        ops, reduce_ops, algos = r.names("op"), r.names("reduce_op"), r.names("algo")
        pg_names = {int(g["pg"]): str(g.get("name", "")) for g in r.attrs.get("process_groups", [])}
        role, nbytes, fp, algo = t["role"], t["nbytes"], t["fp"], t["algo"]
        lanes: dict[int, list[int]] = defaultdict(list)  # pg -> each lane's end (t_ns)
        order = np.argsort(c["t_ns"], kind="stable")
        cols = {k: c[k] for k in ("seq", "step", "micro", "op", "pg", "reduce_op", "root", "t_ns", "dur_ns")}
        first, count = c["tensor_start"], c["tensor_count"]
        for i in order.tolist():
            pg, start = int(cols["pg"][i]), int(cols["t_ns"][i])
            end = start + max(int(cols["dur_ns"][i]), 0)
            lane = min(_lane(lanes[pg], start, end), LANES - 1)
            tid = TID_COLL_BASE + LANES * (pg + 1) + lane
            if tid not in self.named:
                self.named.add(tid)
                name = pg_names.get(pg)
                label = f"collectives pg {pg}" + (f" ({name})" if name and name != str(pg) else "")
                self.tl.name_thread(self.pid, tid, label + (f" #{lane + 1}" if lane else ""))
            rows = range(int(first[i]), int(first[i]) + int(count[i]))
            outs = [j for j in rows if role[j] == schema.ROLE_OUTPUT]
            ins = [j for j in rows if role[j] == schema.ROLE_INPUT]
            op = ops[int(cols["op"][i])]
            ro, root = int(cols["reduce_op"][i]), int(cols["root"][i])
            args = {
                "seq": int(cols["seq"][i]),
                "pg": pg,
                "pg_name": pg_names.get(pg),
                "op": op,
                "step": int(cols["step"][i]),
                "micro": int(cols["micro"][i]),
                "bytes": int(sum(int(nbytes[j]) for j in (outs or ins))),
                "reduce_op": reduce_ops[ro] if ro >= 0 else None,
                "root": root if root >= 0 else None,
                "fingerprints": {
                    "in": [f"{algos[int(algo[j])]}:{int(fp[j]):016x}" for j in ins],
                    "out": [f"{algos[int(algo[j])]}:{int(fp[j]):016x}" for j in outs],
                },
            }
            self.tl.slice(self.pid, tid, op, self.t0 + start, self.t0 + end, "collective", args)

    def _stuck(self) -> None:
        for s in self.r.attrs.get("stuck") or []:
            args = {k: s.get(k) for k in ("seq", "step", "op", "pg", "waited_ns")}
            self.tl.instant(
                self.pid, TID_STEPS, f"stuck in {s.get('op')}", self.t0 + int(s["t_ns"]), "stuck", args
            )

    # -- the device ----------------------------------------------------------------------------
    def _device_activity(self) -> None:
        """Kernels and copies (CUPTI, format 4), on their streams' tracks."""
        r = self.r
        has = [name for name in ("kernels", "copies") if r.has_table(name) and len(r.table(name))]
        if not has:
            return
        clock = DeviceClock.of(r)
        if clock is None:
            self.notes.append(
                f"rank {r.rank}: kernels and copies left out: the trace has no device-to-host clock pair"
            )
            return
        streams: dict[tuple[int, int], int] = {}

        def tid_of(device: int, stream: int) -> int:
            key = (device, stream)
            if key not in streams:
                streams[key] = TID_STREAM_BASE + len(streams)
                self.tl.name_thread(self.pid, streams[key], f"cuda stream {stream} (device {device})")
            return streams[key]

        for table in has:
            attempt, last_corr = 0, None
            for row in _device_rows(r, table):
                if last_corr is None or row["corr"] < last_corr:  # a process attempt's first row
                    attempt = clock.attempt_at(row["start_ns"])
                last_corr = row["corr"]
                start = clock.to_host(row.pop("start_ns"), attempt)
                end = clock.to_host(row.pop("end_ns"), attempt)
                name = row.pop("label")
                tid = tid_of(row["device"], row["stream"])
                cat = "kernel" if table == "kernels" else "copy"
                self.tl.slice(self.pid, tid, name, self.t0 + start, self.t0 + end, cat, row)

    # -- the caching allocator -----------------------------------------------------------------
    def _allocator(self) -> None:
        r = self.r
        if r.has_table("memory_steps") and len(r.table("memory_steps")):
            m, s = r.table("memory_steps"), r.steps
            step_end = dict(zip(s["step"].tolist(), s["t_ns"].tolist(), strict=True))
            for i, step in enumerate(m["step"].tolist()):
                if step not in step_end:
                    continue
                values = {
                    "allocated": int(m["allocated_end"][i]),
                    "reserved": int(m["reserved_end"][i]),
                    "peak allocated": int(m["allocated_peak"][i]),
                }
                self.tl.counter(self.pid, COUNTER_STEP_END, self.t0 + step_end[step], values)
        if not r.has_table("allocs") or not len(r.table("allocs")):
            return
        for t_ns, requested, reserved in allocator_series(r):
            self.tl.counter(
                self.pid, COUNTER_ALLOCATOR, self.t0 + t_ns, {"requested": requested, "reserved": reserved}
            )

    def _ooms(self) -> None:
        for oom in self.r.attrs.get("ooms") or []:
            args = {
                k: oom.get(k) for k in ("step", "micro", "device", "requested", "device_total", "device_free")
            }
            self.tl.instant(self.pid, TID_STEPS, "out of memory", self.t0 + int(oom["t_ns"]), "oom", args)


def _lane(ends: list[int], start: int, end: int) -> int:
    """The first lane free at ``start`` (slices on one lane never overlap), taken until ``end``."""
    for i, busy_until in enumerate(ends):
        if busy_until <= start:
            ends[i] = end
            return i
    ends.append(end)
    return len(ends) - 1


def allocator_series(r: RankTrace) -> Iterator[tuple[int, int, int]]:
    """``(t_ns, requested, reserved)`` after each timed action of the history steps: torch's
    requested bytes (live tensors' sizes as asked) and reserved bytes (segments), from each step's
    base (``memory_steps.requested_base``/``reserved_base``; the previous step's end where a step
    has none, such as the teardown after the last step; 0 before any) plus its actions."""
    a = r.table("allocs")
    base: dict[int, tuple[int, int]] = {}
    if r.has_table("memory_steps"):
        m = r.table("memory_steps")
        for step, req, res in zip(
            m["step"].tolist(), m["requested_base"].tolist(), m["reserved_base"].tolist(), strict=True
        ):
            base[step] = (max(req, 0), max(res, 0))
    codes = schema.ALLOC_ACTION_CODES
    d_req = {codes["alloc"]: 1, codes["free_completed"]: -1}
    d_res = {
        codes["segment_alloc"]: 1,
        codes["segment_map"]: 1,
        codes["segment_free"]: -1,
        codes["segment_unmap"]: -1,
    }
    current_step = None
    requested = reserved = 0
    for step, t_ns, action, nbytes in zip(
        a["step"].tolist(), a["t_ns"].tolist(), a["action"].tolist(), a["bytes"].tolist(), strict=True
    ):
        if step != current_step:
            # a step without its own base (the teardown after the last step) goes on from the last
            requested, reserved = base.get(step, (requested, reserved))
            current_step = step
        requested += d_req.get(action, 0) * nbytes
        reserved += d_res.get(action, 0) * nbytes
        if t_ns >= 0:
            yield t_ns, requested, reserved


class DeviceClock:
    """CUPTI ns -> a rank's t_ns (docs/trace-format.md, "On the rank's timeline"): by the first
    clock pair of the row's process attempt (``cupti.clock``: ``[cupti_ns, t_ns, attempt]``, read
    when the capture armed). An attempt's rows follow the earlier attempts' and their ``corr``
    starts again low; which attempt they are is the attempt of the last pair read before the
    first of them (CUPTI's clock runs on across a restart on one host)."""

    def __init__(self, pairs: list[tuple[int, int, int]]) -> None:
        self.pairs = sorted(pairs)
        self.keys = [p[0] for p in self.pairs]
        self.first: dict[int, tuple[int, int]] = {}
        for cupti_ns, t_ns, attempt in self.pairs:
            self.first.setdefault(attempt, (cupti_ns, t_ns))

    @classmethod
    def of(cls, r: RankTrace) -> DeviceClock | None:
        clock = (r.attrs.get(schema.CUPTI_ATTR) or {}).get("clock") or []
        pairs = [(int(p[0]), int(p[1]), int(p[2]) if len(p) > 2 else 0) for p in clock]
        return cls(pairs) if pairs else None

    def attempt_at(self, cupti_ns: int) -> int:
        return self.pairs[max(bisect.bisect_right(self.keys, cupti_ns) - 1, 0)][2]

    def to_host(self, cupti_ns: int, attempt: int) -> int:
        armed_cupti, armed_t = self.first.get(attempt, self.pairs[0][:2])
        return cupti_ns - armed_cupti + armed_t


def _device_rows(r: RankTrace, table: str) -> Iterator[dict[str, Any]]:
    t = r.table(table)
    kernel_names = r.names("kernel")
    cols = {
        c: t[c].tolist() for c in ("step", "micro", "seq", "corr", "start_ns", "end_ns", "device", "stream")
    }
    extra = {c: t[c].tolist() for c in (("name",) if table == "kernels" else ("kind", "bytes"))}
    for i in range(len(t)):
        row: dict[str, Any] = {c: int(v[i]) for c, v in cols.items()}
        if table == "kernels":
            code = int(extra["name"][i])
            row["label"] = kernel_names[code] if 0 <= code < len(kernel_names) else f"kernel {code}"
        else:
            kind = int(extra["kind"][i])
            row["label"] = (
                schema.COPY_KINDS[kind] if 0 <= kind < len(schema.COPY_KINDS) else f"copy kind {kind}"
            )
            row["bytes"] = int(extra["bytes"][i])
        yield row


def _json_float(x: float) -> float | str:
    """Strict JSON has no NaN: a non-finite loss becomes its name."""
    return x if np.isfinite(x) else str(x)
