"""One rank's spool events -> its columns, attributes and array list in the trace.

The collector (``collect.py``) reads a rank's records in spool order and hands them here: events
become rows of the rank's tables (``schema.TABLES``), blobs are stored once under their digest
(reused only when finished and matching it), and ``completeness`` notes what breaks the record.
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
    ALLOC_ACTIONS,
    MODULE_KIND_CODES,
    ROLE_CODES,
    TABLES,
    blob_path,
    digest_of,
)
from fsdp_replay.trace.store import BLOB_CHUNK, COLUMN_CHUNK, blob_codecs, column_codecs


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


@dataclass(slots=True)
class RankReport:
    rank: int
    records: int = 0
    collectives: int = 0
    steps: int = 0
    batches: int = 0
    blobs_written: int = 0
    blobs_shared: int = 0
    blob_bytes: int = 0
    payload_missing: int = 0
    payloads_dropped: int = 0  # by the agent (disk full, memory bound), from its end counters
    damage: list[str] = field(default_factory=list)
    clean_end: bool = False
    error: str | None = None  # the rank could not be collected at all (its group was not written)
    completeness: dict[str, Any] = field(default_factory=dict)


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

    def __init__(self, root: zarr.Group, rank: int, report: RankReport, verified: set[str]) -> None:
        self.root = root
        self.rank = rank
        self.report = report
        self.verified = verified  # blob digests written or checked by this collect (all ranks)
        self.tracker = completeness.Tracker()
        self.cols: dict[str, dict[str, list[Any]]] = {t: {c: [] for c in cs} for t, cs in TABLES.items()}
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
            "flight_unwritten": 0,
        }
        self.attrs[schema.CUPTI_ATTR] = {"states": [], "clock": []}
        self._kernel_codes: dict[int, int] = {}  # a process's kernel-name code (per attempt) -> ours
        self._cupti_attempts: dict[str, list[int]] = {"kernels": [], "copies": []}
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
                    compressors=blob_codecs(),
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
            row = len(self.cols["payloads"]["nbytes"])
            hi, lo = int(digest[:16], 16), int(digest[16:], 16)
            self.cols["payloads"]["digest_hi"].append(hi)
            self.cols["payloads"]["digest_lo"].append(lo)
            self.cols["payloads"]["nbytes"].append(raw.nbytes)
            self._digests[digest] = row
        self.blob_payload[blob_id] = row

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
            # failure dumped it). Kept as -2 - id until ``_resolve_held``.
            return -2 - blob_id
        if row is None:
            self.report.payload_missing += 1
            return -1
        return row

    def _resolve_held(self) -> None:
        """The flight recorder's blobs (``_payload``) -> payload rows, or -1 where no failure
        wrote them (not kept: no loss); at the end, and before a new attempt reuses the ids."""
        for table in ("tensors", "batch_tensors", "tape_tensors", "rng"):
            col = self.cols[table]["payload"]
            for i, v in enumerate(col):
                if v <= -2:
                    row = self.blob_payload.get(-2 - v)
                    if row is None:
                        self.attrs["flight_unwritten"] += 1
                    col[i] = -1 if row is None else row

    # -- events -------------------------------------------------------------------------------
    def _shape(self, shape: list[int]) -> int:
        start = len(self.cols["shapes"]["dim"])
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
            raise TraceFormatError(f"unknown event type {kind!r}", path=str(where.path), offset=where.offset)
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
            # A restarted rank (torchelastic) starts a new attempt: blob ids restart too.
            self._resolve_held()
            self.blob_payload = {}
            self._kernel_codes = {}  # and so do its kernel-name codes

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
        tstart = len(self.cols["tensors"]["coll"])
        row = len(c["seq"])
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
        self.report.collectives += 1

    def _ev_batch(self, ev: dict[str, Any]) -> None:
        b = self.cols["batches"]
        row = len(b["step"])
        tstart = len(self.cols["batch_tensors"]["batch"])
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
        self.report.batches += 1

    def _ev_kop(self, ev: dict[str, Any]) -> None:
        k = self.cols["tape"]
        row = len(k["seq"])
        tstart = len(self.cols["tape_tensors"]["call"])
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

    def _ev_step(self, ev: dict[str, Any]) -> None:
        self.tracker.step_done(int(ev["step"]))
        s = self.cols["steps"]
        p = self.cols["step_params"]
        pstart = len(p["fp"])
        for fp, nf, algo in ev["params"]:
            p["fp"].append(int(fp))
            p["nonfinite"].append(bool(nf))
            p["algo"].append(self.names["algo"].code(algo))
        lstart = len(self.cols["losses"]["value"])
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
        for k, v in values.items():
            s[k].append(v)
        ends = self.cols["micro_steps"]
        for micro, t_ns in enumerate(ev.get("micro_t_ns") or []):
            ends["step"].append(ev["step"])
            ends["micro"].append(micro)
            ends["t_ns"].append(int(t_ns))
        self.report.steps += 1

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
                self._cupti_attempts[table].append(self.attrs["attempts"])

    def _sort_cupti(self) -> None:
        """Rows in launch order (attempt, then correlation id): CUPTI delivers a kernel's record
        when it completes, so a long kernel's row can come after later launches'."""
        for table in ("kernels", "copies"):
            cols, attempts = self.cols[table], self._cupti_attempts[table]
            order = sorted(range(len(attempts)), key=lambda i: (attempts[i], cols["corr"][i]))
            if order != list(range(len(order))):
                for col, values in cols.items():
                    cols[col] = [values[i] for i in order]

    def _ev_cupti_state(self, ev: dict[str, Any]) -> None:
        cupti = self.attrs[schema.CUPTI_ATTR]
        cupti["states"].append({k: v for k, v in ev.items() if k != "type"})
        if "clock" in ev:
            cupti["clock"].append([*ev["clock"], max(0, self.attrs["attempts"] - 1)])

    def _ev_flight_dump(self, ev: dict[str, Any]) -> None:
        self.attrs["flight_dumps"].append({k: v for k, v in ev.items() if k != "type"})

    def _ev_end(self, ev: dict[str, Any]) -> None:
        self.attrs["end"] = {k: v for k, v in ev.items() if k != "type"}
        self.report.clean_end = True
        self.report.payloads_dropped = int((ev.get("counters") or {}).get("blobs_dropped", 0))

    # -- output -------------------------------------------------------------------------------
    def _sort_collectives(self) -> None:
        """Rows in sequence order: deferred collectives are written when completed, not issued."""
        c = self.cols["collectives"]
        order = sorted(range(len(c["seq"])), key=c["seq"].__getitem__)
        if order == list(range(len(order))):
            return
        for col, values in c.items():
            c[col] = [values[i] for i in order]
        new_row = {old: new for new, old in enumerate(order)}
        t = self.cols["tensors"]
        t["coll"] = [new_row[i] for i in t["coll"]]

    def assess(self) -> dict[str, Any]:
        """How far this rank's record is complete (see completeness.py)."""
        c, b, m, k = (
            self.cols["collectives"],
            self.cols["batches"],
            self.cols["module_fps"],
            self.cols["tape"],
        )
        return completeness.assess(
            self.tracker,
            steps=self.cols["steps"]["step"],
            step_colls=self.cols["steps"]["colls"],
            coll_seqs=c["seq"],
            coll_steps=c["step"],
            batches=list(zip(b["loader"], b["index"], b["step"], strict=True)),
            module_fps=list(zip(m["step"], m["idx"], strict=True)),
            tape=list(zip(k["seq"], k["step"], strict=True)),
            end=self.attrs["end"],
            attempts=int(self.attrs["attempts"]),
        )

    def write(self) -> None:
        self._resolve_held()
        self._sort_collectives()
        self._sort_cupti()
        self.report.completeness = self.assess()
        group = self.root.create_group(schema.RANK_GROUP_FMT.format(rank=self.rank), overwrite=True)
        arrays: dict[str, dict[str, Any]] = {}
        for table, columns in TABLES.items():
            tg = group.create_group(table)
            for col, dtype in columns.items():
                values = np.asarray(self.cols[table][col], dtype=dtype)
                arrays[f"{table}/{col}"] = {"len": len(values), "blake2b": digest_of(values.tobytes())}
                arr = tg.create_array(
                    col,
                    shape=values.shape,
                    dtype=dtype,
                    chunks=(min(COLUMN_CHUNK, max(len(values), 1)),),
                    compressors=column_codecs(),
                    fill_value=0,
                )
                if len(values):
                    arr[:] = values
        attrs = dict(self.attrs)
        attrs.update({f"{k}_names": v.names for k, v in self.names.items()})
        attrs["damage"] = self.report.damage
        attrs["payload_missing"] = self.report.payload_missing
        attrs["rank"] = self.rank
        attrs[schema.COMPLETENESS_ATTR] = self.report.completeness
        attrs[schema.ARRAYS_ATTR] = arrays  # written last: a group without it is unfinished
        group.attrs.update(jsonable(attrs))


def jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, allow_nan=True, default=str))
