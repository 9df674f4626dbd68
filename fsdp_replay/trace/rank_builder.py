"""One rank's spool events -> rows of its tables and its attributes.

The collector (``collect.py``) reads a rank's records in spool order and hands them here: events
become rows of the rank's tables (``schema.TABLES``), blobs are stored once under their digest
(reused only when finished and matching it), and ``completeness`` notes what breaks the record.
Rows are held here only until the collector flushes them into the store (``rank_store.py``):
``base[table]`` rows are there already, and row numbers that rows refer to (a tensor's collective,
a payload row) count them, so a collection builds on what an earlier one wrote.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zarr

from fsdp_replay.errors import TraceFormatError
from fsdp_replay.trace import completeness, dtypes, schema, spool
from fsdp_replay.trace.schema import (
    AGENT_CPU_PARTS,
    ALLOC_ACTIONS,
    MODULE_KIND_CODES,
    ROLE_CODES,
    STEP_WAIT_COUNTERS,
    TABLES,
    blob_path,
    digest_of,
)
from fsdp_replay.trace.store import BLOB_CHUNK, DEFAULT_BLOB_CODEC, blob_codecs


class UnknownEventError(TraceFormatError):
    """An event of a type this version does not know: written by a newer agent (its version is in
    the rank's ``rank_start``), not damage."""

    def __init__(self, kind: str, *, path: str | None = None, offset: int | None = None) -> None:
        super().__init__(f"unknown event type {kind!r}", path=path, offset=offset)
        self.kind = kind


HELD_TABLES = ("tensors", "batch_tensors", "tape_tensors", "rng")
"""The tables whose ``payload`` column may name a payload the flight recorder held."""


class Names:
    """A string table stored in the rank's attrs: code = index."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self._codes: dict[str, int] = {}

    def code(self, name: str | None) -> int:
        if name is None:
            return -1
        c = self._codes.get(name)
        if c is None:
            c = self._codes[name] = len(self.names)
            self.names.append(name)
        return c


def write_rate(counters: dict[str, Any]) -> float | None:
    """The writer's payload bytes a second of its writing (``blob_bytes`` over ``blob_write_ns``),
    or None where it wrote none or did not count."""
    nbytes, ns = int(counters.get("blob_bytes", 0)), int(counters.get("blob_write_ns", 0))
    return nbytes / (ns / 1e9) if nbytes > 0 and ns > 0 else None


@dataclass(slots=True)
class RankReport:
    rank: int
    records: int = 0  # read from the spool by this collection
    collectives: int = 0
    steps: int = 0
    batches: int = 0
    blobs_written: int = 0  # by this collection (and their bytes)
    blobs_shared: int = 0  # new to this rank, already in the store
    blob_bytes: int = 0
    payload_missing: int = 0
    payloads_dropped: int = 0  # by the agent (disk full, memory bound), from its end counters
    window: bool = False  # a --payloads window:N run: its memory bound is --window-bytes
    ring_full_drops: int = 0  # of payloads_dropped: no room in a GPU's payload ring
    payload_waits: int = 0  # times the training waited for room for a payload (--when-full wait)
    payload_wait_ns: int = 0  # how long in all
    writer_rate: float | None = None  # the writer's payload bytes a second of its writing, if it wrote
    damage: list[str] = field(default_factory=list)
    clean_end: bool = False
    error: str | None = None  # the rank could not be collected at all (its group was not written)
    completeness: dict[str, Any] = field(default_factory=dict)
    rows_written: int = 0  # rows this collection handed to the store (appended or rewritten)
    collected_bytes: int = 0  # spool bytes the trace holds (read up to), of the rank's segments now
    rebuilt: str = ""  # why a group in the store was not taken over, but built again from the spool


@dataclass(slots=True)
class CollectReport:
    trace: str
    ranks: list[RankReport] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def damaged(self) -> bool:
        return any(r.damage or r.error for r in self.ranks)


class RankBuilder:
    """Accumulates one rank's events into columns; blobs go straight to the store."""

    def __init__(
        self,
        root: zarr.Group,
        rank: int,
        report: RankReport,
        verified: set[str],
        *,
        blob_codec: str = DEFAULT_BLOB_CODEC,
    ) -> None:
        self.root = root
        self.rank = rank
        self.report = report
        self.blob_codec = blob_codec
        self.verified = verified  # blob digests written or checked by this collect (all ranks)
        self.tracker = completeness.Tracker()
        self.progress = completeness.Progress()
        # Rows not in the store yet; base: rows that are (flushed by rank_store.RankStore).
        self.cols: dict[str, dict[str, list[Any]]] = {t: {c: [] for c in cs} for t, cs in TABLES.items()}
        self.base: dict[str, int] = dict.fromkeys(TABLES, 0)
        # The first row of the current process attempt in the tables whose rows are sorted within
        # an attempt, or hold the flight recorder's references (resolved when it ends).
        self.attempt_rows: dict[str, int] = dict.fromkeys(TABLES, 0)
        self.held = False  # rows of this attempt refer to payloads the flight recorder held
        self.resolve_jobs: list[tuple[dict[str, int], dict[int, int]]] = []  # for rows in the store
        self.new_blob_ids: list[tuple[int, int, int]] = []  # (attempt, spool blob id, payload row)
        self.pending_damage: list[str] = []  # damage after the last record read (no record after it yet)
        self.names = {k: Names() for k in ("op", "dtype", "reduce_op", "algo", "device", "module")}
        self.names["alloc_site"] = Names()  # allocs.site (format 4)
        self.names["kernel"] = Names()  # kernels.name (format 4)
        self.attrs: dict[str, Any] = {
            "rank_start": None,
            "process_groups": [],
            "files": {"read": [], "written": [], "listed": [], "overflow": 0},
            "urandom": {"calls": [], "overflow": 0},
            "numerics_changes": [],
            "compiled": {"graphs": [], "calls": [], "modules": [], "errors": []},
            "snapshots": [],
            "modules": [],
            "end": None,
            "agent_errors": [],
            "drops": [],
            "structures": [],
            "attempts": 0,
            "stuck": [],
            "last_alive": None,
            "ooms": [],
            "flight_dumps": [],  # format 3 readers ignore both (docs/trace-format.md)
            "state_dumps": [],  # answers to dump requests (`state` events); absent in older traces
            "flight_unwritten": 0,
            "damage": [],  # every damaged spool record skipped, of every collection
            "unread_events": {},  # event type -> count: written by a newer agent than this collector
            "payload_missing": 0,
        }
        self.attrs[schema.CUPTI_ATTR] = {"states": [], "clock": []}
        self._kernel_codes: dict[int, int] = {}  # a process's kernel-name code (per attempt) -> ours
        self._structures: dict[str, int] = {}
        self.blob_payload: dict[int, int] = {}  # spool blob id (per attempt) -> payload row
        self._digests: dict[str, int] = {}

    # -- blobs --------------------------------------------------------------------------------
    def blob(self, blob_id: int, raw: memoryview) -> None:
        digest = digest_of(raw)
        row = self._digests.get(digest)
        if row is None:
            path = blob_path(digest)
            if self._reusable(path, digest, raw.nbytes):
                self.report.blobs_shared += 1
            else:
                arr = self.root.create_array(
                    path,
                    shape=(raw.nbytes,),
                    dtype="uint8",
                    chunks=(min(BLOB_CHUNK, max(raw.nbytes, 1)),),
                    compressors=blob_codecs(self.blob_codec),
                    fill_value=0,
                    overwrite=True,
                )
                if raw.nbytes:
                    arr[:] = np.frombuffer(raw, dtype=np.uint8)
                # Written after the bytes: a collect killed before this line leaves a blob that
                # the next one sees as unfinished and writes again.
                arr.attrs[schema.BLOB_COMPLETE_ATTR] = True
                self.verified.add(digest)
                self.report.blobs_written += 1
                self.report.blob_bytes += raw.nbytes
            row = self.n("payloads")
            hi, lo = int(digest[:16], 16), int(digest[16:], 16)
            self.cols["payloads"]["digest_hi"].append(hi)
            self.cols["payloads"]["digest_lo"].append(lo)
            self.cols["payloads"]["nbytes"].append(raw.nbytes)
            self._digests[digest] = row
        self.blob_payload[blob_id] = row
        self.new_blob_ids.append((max(0, int(self.attrs["attempts"]) - 1), blob_id, row))

    def n(self, table: str) -> int:
        """Rows of ``table`` so far: in the store and held here."""
        return self.base[table] + len(next(iter(self.cols[table].values())))

    def held_rows(self) -> int:
        """Rows held here, not in the store yet."""
        return sum(len(next(iter(cols.values()))) for cols in self.cols.values())

    def _reusable(self, path: str, digest: str, nbytes: int) -> bool:
        """A blob already in the store may stand for these bytes: finished and, unless this
        collect wrote or checked it, read back and matching its digest."""
        if digest in self.verified:
            return True
        try:
            arr = self.root[path]
            ok = (
                isinstance(arr, zarr.Array)
                and arr.shape == (nbytes,)
                and arr.attrs.get(schema.BLOB_COMPLETE_ATTR) is True
                and digest_of(np.ascontiguousarray(arr[:]).tobytes()) == digest
            )
        except Exception:  # absent, or damaged in any way: written again
            return False
        if ok:
            self.verified.add(digest)
        return ok

    def _payload(self, blob_id: int) -> int:
        if blob_id == schema.NO_BLOB:
            return -1
        row = self.blob_payload.get(blob_id)
        if row is None and blob_id >= schema.FLIGHT_BLOB_BASE:
            # Held by the flight recorder when the event was written: its blob comes after (if a
            # failure dumped it). Kept as -2 - id until ``end_attempt``.
            self.held = True
            return -2 - blob_id
        if row is None:
            self.attrs["payload_missing"] += 1
            return -1
        return row

    def end_attempt(self) -> None:
        """The process attempt ended (its ``end`` event, a new attempt, or the last collection):
        the flight recorder's blobs (``_payload``) -> payload rows, or -1 where no failure wrote
        them (not kept: no loss). Rows held here are resolved now; rows of this attempt already in
        the store by the next flush (``resolve_jobs``)."""
        if not self.held:
            return
        flight = {i: r for i, r in self.blob_payload.items() if i >= schema.FLIGHT_BLOB_BASE}
        for table in HELD_TABLES:
            col = self.cols[table]["payload"]
            for i, v in enumerate(col):
                if v <= -2:
                    row = flight.get(-2 - v)
                    if row is None:
                        self.attrs["flight_unwritten"] += 1
                    col[i] = -1 if row is None else row
        first = {t: self.attempt_rows[t] for t in HELD_TABLES if self.attempt_rows[t] < self.base[t]}
        if first:
            self.resolve_jobs.append((first, flight))
        self.held = False

    # -- events -------------------------------------------------------------------------------
    def _shape(self, shape: list[int]) -> int:
        start = self.n("shapes")
        self.cols["shapes"]["dim"].extend(shape)
        return start

    def _tensor_cols(self, t: list[Any]) -> dict[str, Any]:
        role, dtype, shape, fp, algo, nonfinite, blob, device = t
        del role
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtypes.itemsize(dtype)
        return {
            "dtype": self.names["dtype"].code(dtype),
            "shape_start": self._shape(shape),
            "ndim": len(shape),
            "nbytes": nbytes,
            "fp": int(fp),
            "algo": self.names["algo"].code(algo),
            "nonfinite": bool(nonfinite),
            "payload": self._payload(int(blob)),
            "device": self.names["device"].code(device),
        }

    def event(self, ev: dict[str, Any], where: spool.Record) -> None:
        kind = ev.get("type")
        handler: Callable[[dict[str, Any]], None] | None = getattr(self, f"_ev_{kind}", None)
        required = schema.EVENT_KEYS.get(str(kind))
        if handler is None or required is None:
            raise UnknownEventError(str(kind), path=str(where.path), offset=where.offset)
        missing = required - ev.keys()
        if missing:
            raise TraceFormatError(
                f"{kind} event lacks {sorted(missing)}", path=str(where.path), offset=where.offset
            )
        handler(ev)

    def _ev_rank_start(self, ev: dict[str, Any]) -> None:
        if self.attrs["rank_start"] is None:
            self.attrs["rank_start"] = ev
        self.attrs["attempts"] += 1
        if self.attrs["attempts"] > 1:
            # A restarted rank (torchelastic) starts a new attempt: blob ids restart too (the
            # collector flushed the last attempt's rows before this event: ``new_attempt``).
            self.end_attempt()
            self.blob_payload = {}
            self._kernel_codes = {}  # and so do its kernel-name codes
        self.attempt_rows = {t: self.n(t) for t in TABLES}

    def new_attempt(self, ev: dict[str, Any]) -> bool:
        """Whether ``ev`` starts a new process attempt of a rank that has begun one already: the
        collector flushes the earlier attempt's rows first (rows are sorted within an attempt)."""
        return ev.get("type") == schema.EV_RANK_START and int(self.attrs["attempts"]) > 0

    def _ev_files(self, ev: dict[str, Any]) -> None:
        files = self.attrs["files"]
        files["read"].extend(ev["read"])
        files["written"].extend(ev["written"])
        files["listed"].extend(ev.get("listed", []))
        files["overflow"] = max(files["overflow"], int(ev["overflow"]))

    def _ev_urandom(self, ev: dict[str, Any]) -> None:
        drawn = self.attrs["urandom"]
        drawn["calls"].extend(ev["calls"])
        drawn["overflow"] = max(drawn["overflow"], int(ev["overflow"]))

    def _ev_numerics(self, ev: dict[str, Any]) -> None:
        self.attrs["numerics_changes"].append({"step": int(ev["step"]), "flags": dict(ev["flags"])})

    def _ev_compiled(self, ev: dict[str, Any]) -> None:
        ran = self.attrs["compiled"]
        ran["graphs"].extend(ev["graphs"])
        ran["calls"].extend([int(ev["step"]), graph, int(n)] for graph, n in ev["calls"].items())
        ran["modules"] = sorted({*ran["modules"], *ev.get("modules", [])})
        if ev.get("error") and ev["error"] not in ran["errors"]:
            ran["errors"].append(ev["error"])

    def _ev_pg(self, ev: dict[str, Any]) -> None:
        self.attrs["process_groups"].append({k: v for k, v in ev.items() if k != "type"})

    def _ev_coll(self, ev: dict[str, Any]) -> None:
        c = self.cols["collectives"]
        tstart = self.n("tensors")
        row = self.n("collectives")
        for t in ev["tensors"]:
            cols = self._tensor_cols(t)
            cols["coll"] = row
            cols["role"] = ROLE_CODES[t[0]]
            for k, v in cols.items():
                self.cols["tensors"][k].append(v)
        root = ev.get("root")
        values = {
            "seq": ev["seq"],
            "step": ev["step"],
            "micro": ev["micro"],
            "op": self.names["op"].code(ev["op"]),
            "pg": ev["pg"],
            "reduce_op": self.names["reduce_op"].code(ev["reduce_op"]),
            "root": -1 if root is None else int(root),
            "t_ns": ev["t_ns"],
            "dur_ns": ev["dur_ns"],
            "tensor_start": tstart,
            "tensor_count": len(ev["tensors"]),
        }
        for k, v in values.items():
            c[k].append(v)
        self.progress.coll(int(ev["seq"]), int(ev["step"]))

    def _ev_batch(self, ev: dict[str, Any]) -> None:
        b = self.cols["batches"]
        row = self.n("batches")
        tstart = self.n("batch_tensors")
        for t in ev["tensors"]:
            cols = self._tensor_cols(t)
            cols["batch"] = row
            for k, v in cols.items():
                self.cols["batch_tensors"][k].append(v)
        key = json.dumps(ev["structure"], sort_keys=True)
        sid = self._structures.get(key)
        if sid is None:
            sid = self._structures[key] = len(self.attrs["structures"])
            self.attrs["structures"].append(ev["structure"])
        values = {
            "step": ev["step"],
            "micro": ev["micro"],
            "index": ev["index"],
            "loader": ev["loader"],
            "structure": sid,
            "tensor_start": tstart,
            "tensor_count": len(ev["tensors"]),
            "rng": self._payload(int(ev["rng"])) if "rng" in ev else -1,
        }
        for k, v in values.items():
            b[k].append(v)
        self.progress.batch(int(ev["loader"]), int(ev["index"]), int(ev["step"]))

    def _ev_kop(self, ev: dict[str, Any]) -> None:
        k = self.cols["tape"]
        row = self.n("tape")
        tstart = self.n("tape_tensors")
        for t in ev["tensors"]:
            cols = self._tensor_cols(t)
            cols["call"] = row
            for col, v in cols.items():
                self.cols["tape_tensors"][col].append(v)
        values = {
            "seq": ev["seq"],
            "step": ev["step"],
            "micro": ev["micro"],
            "op": self.names["op"].code(ev["op"]),
            "tensor_start": tstart,
            "tensor_count": len(ev["tensors"]),
        }
        for col, v in values.items():
            k[col].append(v)
        self.progress.tape_call(int(ev["seq"]), int(ev["step"]))

    def _ev_step(self, ev: dict[str, Any]) -> None:
        self.tracker.step_done(int(ev["step"]))
        s = self.cols["steps"]
        p = self.cols["step_params"]
        pstart = self.n("step_params")
        for fp, nf, algo in ev["params"]:
            p["fp"].append(int(fp))
            p["nonfinite"].append(bool(nf))
            p["algo"].append(self.names["algo"].code(algo))
        lstart = self.n("losses")
        losses = [float(x) for x in ev["loss"]]
        self.cols["losses"]["value"].extend(losses)
        nonfinite = any(nf for _, nf, _ in ev["params"]) or any(not np.isfinite(x) for x in losses)
        values = {
            "step": ev["step"],
            "micro_steps": ev["micro_steps"],
            "colls": ev["colls"],
            "t_ns": ev["t_ns"],
            "param_start": pstart,
            "param_count": len(ev["params"]),
            "loss_start": lstart,
            "loss_count": len(losses),
            "nonfinite": nonfinite,
            "agent_cpu_ns": int(ev.get("cpu_ns", (-1, -1))[0]),
            "writer_cpu_ns": int(ev.get("cpu_ns", (-1, -1))[1]),
        }
        counters = ev.get("counters") or {}
        for part in AGENT_CPU_PARTS:
            values[f"cpu_{part}_ns"] = int(counters.get(f"agent_cpu_{part}_ns", -1))
        for name in STEP_WAIT_COUNTERS:
            values[name] = int(counters.get(name, -1))
        for k, v in values.items():
            s[k].append(v)
        ends = self.cols["micro_steps"]
        for micro, t_ns in enumerate(ev.get("micro_t_ns") or []):
            ends["step"].append(ev["step"])
            ends["micro"].append(micro)
            ends["t_ns"].append(int(t_ns))
        self.progress.step(int(ev["step"]), int(ev["colls"]))

    def _ev_memory(self, ev: dict[str, Any]) -> None:
        a = self.cols["allocs"]
        sites = [self.names["alloc_site"].code(name) for name in ev.get("sites") or []]
        actions = ev.get("actions")
        for micro, t_ns, action, addr, nbytes, stream, device, site in actions or []:
            if not 0 <= int(action) < len(ALLOC_ACTIONS):
                continue  # a code this version does not know
            for col, v in (
                ("step", ev["step"]),
                ("micro", micro),
                ("t_ns", t_ns),
                ("action", action),
                ("addr", addr),
                ("bytes", nbytes),
                ("stream", stream),
                ("device", device),
                ("site", sites[site] if 0 <= site < len(sites) else -1),
            ):
                a[col].append(v)
        if ev.get("final"):
            return  # the step in progress at the end: its actions, no step end
        stats, base = ev["stats"], ev.get("base") or {}
        m = self.cols["memory_steps"]
        for col, v in (
            ("step", ev["step"]),
            ("device", ev["device"]),
            ("allocated_end", stats.get("allocated", -1)),
            ("reserved_end", stats.get("reserved", -1)),
            ("requested_end", stats.get("requested", -1)),
            ("allocated_peak", stats.get("allocated_peak", -1)),
            ("reserved_peak", stats.get("reserved_peak", -1)),
            ("alloc_retries", stats.get("alloc_retries", -1)),
            ("ooms", stats.get("ooms", -1)),
            ("history", -1 if actions is None else len(actions)),
            ("requested_base", base.get("requested", -1)),
            ("reserved_base", base.get("reserved", -1)),
        ):
            m[col].append(int(v))
        m["moved"].append(bool(ev.get("moved", False)))

    def _ev_oom(self, ev: dict[str, Any]) -> None:
        oom = {k: v for k, v in ev.items() if k not in ("type", "blob")}
        oom["payload"] = self._payload(int(ev["blob"]))
        self.attrs["ooms"].append(oom)

    def _ev_rng(self, ev: dict[str, Any]) -> None:
        st = ev["states"]
        r = self.cols["rng"]
        r["step"].append(ev["step"])
        r["payload"].append(self._payload(int(st["blob"])))
        for k in ("python", "torch", "numpy"):
            r[k].append(int(st[k]) if k in st else -1)

    def _ev_snapshot(self, ev: dict[str, Any]) -> None:
        self.attrs["snapshots"].append(
            {
                "step": ev["step"],
                "payload": self._payload(int(ev["blob"])),
                "nbytes": ev["nbytes"],
                "params": ev["params"],
            }
        )

    def _ev_mod(self, ev: dict[str, Any]) -> None:
        m = self.cols["module_fps"]
        values = {
            "step": ev["step"],
            "micro": ev["micro"],
            "idx": ev["idx"],
            "name": self.names["module"].code(ev["name"]),
            "kind": MODULE_KIND_CODES[ev["kind"]],
            "fp": int(ev["fp"]),
            "algo": self.names["algo"].code(ev["algo"]),
            "nonfinite": bool(ev["nonfinite"]),
        }
        for k, v in values.items():
            m[k].append(v)
        self.progress.module(int(ev["step"]), int(ev["idx"]))

    def _ev_aop(self, ev: dict[str, Any]) -> None:
        m = self.cols["op_fps"]
        values = {
            "step": ev["step"],
            "idx": ev["idx"],
            "op": self.names["op"].code(ev["name"]),
            "module": self.names["module"].code(ev["module"]),
            "in_fp": int(ev["in_fp"]),
            "out_fp": int(ev["out_fp"]),
        }
        for k, v in values.items():
            m[k].append(v)

    def _ev_modules(self, ev: dict[str, Any]) -> None:
        self.attrs["modules"] = ev["modules"]

    def _ev_agent_error(self, ev: dict[str, Any]) -> None:
        self.attrs["agent_errors"].append({k: v for k, v in ev.items() if k != "type"})
        self.tracker.agent_error(ev)

    def _ev_alive(self, ev: dict[str, Any]) -> None:
        self.attrs["last_alive"] = {k: v for k, v in ev.items() if k != "type"}

    def _ev_stuck(self, ev: dict[str, Any]) -> None:
        self.attrs["stuck"].append({k: v for k, v in ev.items() if k != "type"})

    def _ev_drop(self, ev: dict[str, Any]) -> None:
        self.attrs["drops"].append({k: v for k, v in ev.items() if k != "type"})

    def _ev_cupti(self, ev: dict[str, Any]) -> None:
        names, codes = self.names["kernel"], self._kernel_codes
        for i, name in enumerate(ev["names"]):
            codes[int(ev["name_base"]) + i] = names.code(name)
        for table, rows in (("kernels", ev["kernels"]), ("copies", ev["copies"])):
            cols = self.cols[table]
            columns = list(TABLES[table])
            for row in rows:
                if len(row) != len(columns):
                    raise TraceFormatError(f"a {table} row has {len(row)} fields, not {len(columns)}")
                for col, v in zip(columns, row, strict=True):
                    cols[col].append(codes.get(int(v), -1) if table == "kernels" and col == "name" else v)

    def _ev_cupti_state(self, ev: dict[str, Any]) -> None:
        cupti = self.attrs[schema.CUPTI_ATTR]
        cupti["states"].append({k: v for k, v in ev.items() if k != "type"})
        if "clock" in ev:
            cupti["clock"].append([*ev["clock"], max(0, self.attrs["attempts"] - 1)])

    def _ev_flight_dump(self, ev: dict[str, Any]) -> None:
        self.attrs["flight_dumps"].append({k: v for k, v in ev.items() if k != "type"})

    def _ev_state(self, ev: dict[str, Any]) -> None:
        self.attrs["state_dumps"].append({k: v for k, v in ev.items() if k != "type"})

    def _ev_end(self, ev: dict[str, Any]) -> None:
        self.attrs["end"] = {k: v for k, v in ev.items() if k != "type"}
        self.end_attempt()  # the flight recorder's dump, if any, was written before the end


def jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, allow_nan=True, default=str))
