"""What the replayed rank is expected to do: its recorded events, indexed for the replay.

Loaded once at start-up from rank R's group only (columns are read whole, per table), so a rank of
a 512-rank trace reads 1/512 of the metadata. Payloads are read lazily and kept in a bounded cache
(FSDP2 gathers the same parameters in forward and backward).
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fsdp_replay.agent import capture
from fsdp_replay.errors import TraceFormatError, TraceNotFoundError
from fsdp_replay.trace.reader import RankTrace, Trace
from fsdp_replay.trace.schema import MODULE_KINDS, ROLE_LETTERS

PAYLOAD_CACHE_BYTES = 1 << 30
PREFETCH_AHEAD = 64  # collectives


@dataclass(frozen=True, slots=True)
class ExpectedTensor:
    role: str
    dtype: str
    shape: tuple[int, ...]
    fp: int
    algo: str
    nonfinite: bool
    payload: int
    device: str = "cpu"


@dataclass(frozen=True, slots=True)
class ExpectedColl:
    seq: int
    step: int
    micro: int
    op: str
    pg: int
    reduce_op: str | None
    tensors: tuple[ExpectedTensor, ...]

    def role(self, role: str) -> list[ExpectedTensor]:
        return [t for t in self.tensors if t.role == role]


@dataclass(frozen=True, slots=True)
class ExpectedTapeCall:
    """One recorded call of an op on the nondeterministic-kernel tape."""

    seq: int
    step: int
    micro: int
    op: str
    tensors: tuple[ExpectedTensor, ...]


@dataclass(frozen=True, slots=True)
class ExpectedStep:
    step: int
    micro_steps: int
    colls: int
    params: tuple[tuple[int, bool, str], ...]
    losses: tuple[float, ...]


def _name(names: list[str], code: int, default: str) -> str:
    return names[code] if 0 <= code < len(names) else default


def torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise TraceFormatError(f"dtype {name!r} is unknown to this torch ({torch.__version__})")
    return dt


class RankRecord:
    def __init__(self, trace: Trace, rank: int, *, trusted: bool = False) -> None:
        self.trusted = trusted  # replay --trust-trace: the user vouches for the trace
        self.trace = trace
        self.rank_trace: RankTrace = trace.rank(rank)
        self.rank = rank
        rt = self.rank_trace
        self.meta = rt.meta
        self.attrs = rt.attrs
        self.completeness = rt.completeness
        names = {k: rt.names(k) for k in ("op", "dtype", "reduce_op", "algo", "device")}
        c, t = rt.collectives, rt.tensors
        dims = rt.table("shapes")["dim"]
        self.colls: dict[int, ExpectedColl] = {}
        t_cols = {
            k: t[k] for k in ("role", "dtype", "shape_start", "ndim", "fp", "algo", "nonfinite", "payload")
        }
        for i, seq in enumerate(c["seq"].tolist()):
            start, count = int(c["tensor_start"][i]), int(c["tensor_count"][i])
            tensors = tuple(
                ExpectedTensor(
                    ROLE_LETTERS[int(t_cols["role"][j])],
                    names["dtype"][int(t_cols["dtype"][j])],
                    tuple(
                        int(d)
                        for d in dims[
                            int(t_cols["shape_start"][j]) : int(t_cols["shape_start"][j])
                            + int(t_cols["ndim"][j])
                        ]
                    ),
                    int(t_cols["fp"][j]),
                    names["algo"][int(t_cols["algo"][j])],
                    bool(t_cols["nonfinite"][j]),
                    int(t_cols["payload"][j]),
                )
                for j in range(start, start + count)
            )
            rop = int(c["reduce_op"][i])
            self.colls[int(seq)] = ExpectedColl(
                int(seq),
                int(c["step"][i]),
                int(c["micro"][i]),
                names["op"][int(c["op"][i])],
                int(c["pg"][i]),
                None if rop < 0 else names["reduce_op"][rop],
                tensors,
            )
        s = rt.steps
        sp = rt.table("step_params")
        losses = rt.table("losses")["value"]
        self.steps: dict[int, ExpectedStep] = {}
        for i, step in enumerate(s["step"].tolist()):
            ps, pc = int(s["param_start"][i]), int(s["param_count"][i])
            ls, lc = int(s["loss_start"][i]), int(s["loss_count"][i])
            self.steps[int(step)] = ExpectedStep(
                int(step),
                int(s["micro_steps"][i]),
                int(s["colls"][i]),
                tuple(
                    (int(sp["fp"][j]), bool(sp["nonfinite"][j]), names["algo"][int(sp["algo"][j])])
                    for j in range(ps, ps + pc)
                ),
                tuple(float(x) for x in losses[ls : ls + lc]),
            )
        rng = rt.table("rng")
        self.rng: dict[int, dict[str, Any]] = {}
        for i, step in enumerate(rng["step"].tolist()):
            self.rng[int(step)] = {
                "payload": int(rng["payload"][i]),
                **{k: int(rng[k][i]) for k in ("python", "torch", "numpy") if int(rng[k][i]) >= 0},
            }
        self.snapshots = {int(sn["step"]): sn for sn in self.attrs.get("snapshots", [])}
        self.process_groups = {int(pg["pg"]): pg for pg in self.attrs.get("process_groups", [])}
        b, bt = rt.batches, rt.batch_tensors
        self.batches: list[dict[str, Any]] = []
        structures = self.attrs.get("structures", [])
        rng_rows = b["rng"] if b.has("rng") else None  # format 4: the RNG after a fetch that drew
        for i in range(len(b)):
            start, count = int(b["tensor_start"][i]), int(b["tensor_count"][i])
            self.batches.append(
                {
                    "step": int(b["step"][i]),
                    "micro": int(b["micro"][i]),
                    "loader": int(b["loader"][i]),
                    "index": int(b["index"][i]),
                    "rng": int(rng_rows[i]) if rng_rows is not None else -1,
                    "structure": structures[int(b["structure"][i])],
                    "tensors": [
                        ExpectedTensor(
                            "",
                            names["dtype"][int(bt["dtype"][j])],
                            tuple(
                                int(d)
                                for d in dims[
                                    int(bt["shape_start"][j]) : int(bt["shape_start"][j]) + int(bt["ndim"][j])
                                ]
                            ),
                            int(bt["fp"][j]),
                            names["algo"][int(bt["algo"][j])],
                            bool(bt["nonfinite"][j]),
                            int(bt["payload"][j]),
                            _name(names["device"], int(bt["device"][j]), "cpu"),
                        )
                        for j in range(start, start + count)
                    ],
                }
            )
        self.modules: dict[int, list[tuple[int, str, str, int, str]]] = collections.defaultdict(list)
        if rt.has_table("module_fps"):  # not in a trace written before module fingerprints existed
            mt = rt.table("module_fps")
            mod_names = rt.names("module")
            for i in np.argsort(mt["idx"], kind="stable").tolist() if len(mt) else []:
                self.modules[int(mt["step"][i])].append(
                    (
                        int(mt["micro"][i]),
                        mod_names[int(mt["name"][i])],
                        MODULE_KINDS[int(mt["kind"][i])],
                        int(mt["fp"][i]),
                        names["algo"][int(mt["algo"][i])],
                    )
                )
        self.ops: dict[int, list[tuple[str, str, int, int]]] = collections.defaultdict(list)
        if rt.has_table("op_fps"):  # recorded with --op-fingerprints (format 3)
            ot, mod_names = rt.table("op_fps"), rt.names("module")
            for i in np.lexsort((ot["idx"], ot["step"])).tolist() if len(ot) else []:
                self.ops[int(ot["step"][i])].append(
                    (
                        names["op"][int(ot["op"][i])],
                        mod_names[int(ot["module"][i])],
                        int(ot["in_fp"][i]),
                        int(ot["out_fp"][i]),
                    )
                )
        self.tape = self._tape(rt, names, dims)
        self._cache: collections.OrderedDict[int, torch.Tensor] = collections.OrderedDict()
        self._cache_bytes = 0
        self._lock = threading.Lock()
        self._progress = threading.Condition()
        self._consumer = 0

    @staticmethod
    def _tape(rt: RankTrace, names: dict[str, list[str]], dims: Any) -> dict[int, ExpectedTapeCall]:
        """The tape's calls by number (none for traces written before it existed)."""
        if not rt.has_table("tape"):
            return {}
        k, kt = rt.table("tape"), rt.table("tape_tensors")
        if not len(k):
            return {}
        cols = {c: kt[c] for c in ("dtype", "shape_start", "ndim", "fp", "algo", "nonfinite", "payload")}
        out: dict[int, ExpectedTapeCall] = {}
        for i, seq in enumerate(k["seq"].tolist()):
            start, count = int(k["tensor_start"][i]), int(k["tensor_count"][i])
            tensors = tuple(
                ExpectedTensor(
                    "o",
                    names["dtype"][int(cols["dtype"][j])],
                    tuple(
                        int(d)
                        for d in dims[
                            int(cols["shape_start"][j]) : int(cols["shape_start"][j]) + int(cols["ndim"][j])
                        ]
                    ),
                    int(cols["fp"][j]),
                    names["algo"][int(cols["algo"][j])],
                    bool(cols["nonfinite"][j]),
                    int(cols["payload"][j]),
                )
                for j in range(start, start + count)
            )
            out[int(seq)] = ExpectedTapeCall(
                int(seq), int(k["step"][i]), int(k["micro"][i]), names["op"][int(k["op"][i])], tensors
            )
        return out

    @property
    def world_size(self) -> int:
        return int(self.meta.get("world_size", self.trace.world_size or 1))

    def first_seq_of_step(self, step: int) -> int:
        for seq, coll in self.colls.items():
            if coll.step >= step:
                return seq
        return len(self.colls)

    def snapshot_at_or_before(self, step: int) -> dict[str, Any] | None:
        best = [s for s in self.snapshots if s <= step and self.snapshots[s].get("payload", -1) >= 0]
        return self.snapshots[max(best)] if best else None

    def blob(self, row: int) -> bytes:
        return self.rank_trace.payload(row)

    def snapshot_state(self, row: int) -> dict[str, Any]:
        """The snapshot stored in payload ``row``, decoded without running anything from the trace
        (an older agent's pickled snapshot as a pickle only under ``replay --trust-trace``)."""
        return capture.decode_snapshot(self.blob(row), trusted=self.trusted)

    def _load(self, t: ExpectedTensor) -> torch.Tensor:
        with self._lock:
            hit = self._cache.get(t.payload)
            if hit is not None:
                self._cache.move_to_end(t.payload)
                return hit
        data = self.rank_trace.payload(t.payload, verify=(t.algo, t.fp))  # read + verify, no lock held
        hit = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data
            else torch.empty(0, dtype=torch.uint8)
        )
        with self._lock:
            if t.payload not in self._cache:
                self._cache[t.payload] = hit
                self._cache_bytes += len(data)
                while self._cache_bytes > PAYLOAD_CACHE_BYTES and len(self._cache) > 1:
                    _, old = self._cache.popitem(last=False)
                    self._cache_bytes -= old.numel()
        return hit

    def tensor(self, t: ExpectedTensor) -> torch.Tensor:
        """The recorded bytes of ``t`` as a CPU tensor (verified against its fingerprint once)."""
        if t.payload < 0:
            raise TraceNotFoundError("payload not recorded")
        return self._load(t).view(torch_dtype(t.dtype)).reshape(t.shape)

    # -- read-ahead ------------------------------------------------------------------------
    def start_prefetch(self) -> None:
        """Read the payloads of the next collectives on a thread, ahead of the replay.

        Reading, decompressing and verifying a payload takes milliseconds; the replay knows the
        order it will need them in, so a thread keeps PREFETCH_AHEAD collectives ahead of it.
        """
        thread = threading.Thread(target=self._prefetch, name="fsdp-replay-prefetch", daemon=True)
        thread.start()

    def advance(self, seq: int) -> None:
        """The replay has reached collective ``seq``."""
        with self._progress:
            self._consumer = seq
            self._progress.notify()

    def _prefetch(self) -> None:
        try:
            for seq in sorted(self.colls):
                with self._progress:
                    while seq > self._consumer + PREFETCH_AHEAD:
                        self._progress.wait(1.0)
                if seq < self._consumer:
                    continue
                for t in self.colls[seq].tensors:
                    if t.role == "o" and t.payload >= 0:
                        self._load(t)
        except Exception:  # the replay reads what it needs itself and reports any error then
            return
