"""NCCL calls seen by the uprobes, counted per (rank, op, communicator) for the metrics.

``NcclStats.on_event`` is the probe's callback: it runs once per NCCL call on the probe's polling
thread, so it reads the raw record fields (``event.record``) rather than building ``Event.args``
(the dict costs ~2 us a record, docs/sidecar-ebpf.md), resolves labels from small dicts, and adds
to one counter list. Bytes are what the call names: ``count x dtype size`` (``nccl.DTYPE_BYTES``),
not what crosses the wire (an all-reduce moves about 2x that, an all-gather's count is per rank).

Label cardinality is bounded: ``rank`` comes from the process's RANK (the daemon tells us, from
discovery), ``op`` is the NCCL function, ``comm`` a short, stable name for the communicator of a
collective or point-to-point call ("" for the other functions: creation, destruction, groups):

- ``ncclConfig_t.commName`` where the creation call gave one (torch names its communicators);
- else ``id-<crc32 of the ncclUniqueId digest>`` for ``ncclCommInitRank*``: the same on every rank
  of one communicator, so ranks of a pod share a label;
- ``split-<crc>`` / ``shrink-<crc>`` from the parent's label and the color (ranks that split with
  one color share the new communicator, and the label);
- ``ptr-<crc of pid and pointer>`` for a communicator created before the probe attached;
- at most ``max_comms`` distinct labels; further communicators are counted under ``other``.
Never a pid or a sequence number.
"""

from __future__ import annotations

import re
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from fsdp_replay.sidecar.ebpf import nccl, records
from fsdp_replay.sidecar.ebpf.events import Event
from fsdp_replay.sidecar.ebpf.signatures import Signature

OTHER = "other"
NO_COMM = ""
"""The comm label of calls that take no communicator (ncclGroupStart, ncclGroupEnd)."""
_U32 = 0xFFFFFFFF
_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.:/-]")
# Count parameter of each collective (the element count the call names).
_COUNT_PARAMS = ("count", "recvcount", "sendcount")
_FORGETS = frozenset({"ncclCommDestroy", "ncclCommAbort"})
_DTYPE_BYTES = nccl.DTYPE_BYTES


@dataclass(frozen=True, slots=True)
class NcclSeries:
    """One exported series: the totals of one (rank, op, comm)."""

    rank: str
    op: str
    comm: str
    calls: int
    bytes: int
    failed: int
    """Calls that returned something else than ncclSuccess (0) (ncclInProgress included)."""
    latency_ns: int
    """Host-side latency summed over the calls (entry to return: the enqueue, not the GPU's work)."""


@dataclass(frozen=True, slots=True)
class _Plan:
    """Where one function's interesting arguments are in the record's args slots."""

    op: str
    count: int = -1
    dtype: int = -1
    comm: int = -1
    comm_id: int = -1
    color: int = -1
    creates: bool = False
    forgets: bool = False


def _plan(sig: Signature) -> _Plan:
    names = [p.name for p in sig.params]

    def at(*candidates: str) -> int:
        return next((names.index(c) for c in candidates if c in names), -1)

    return _Plan(
        op=sig.name,
        count=at(*_COUNT_PARAMS),
        dtype=at("datatype"),
        comm=at("comm"),
        comm_id=at("commId"),
        color=at("color", "excludeRanksCount"),
        creates=sig.new_comm_param is not None,
        forgets=sig.name in _FORGETS and "comm" in names,
    )


class NcclStats:
    """Totals of the NCCL calls delivered by a ``Probe`` built with the same ``signatures``."""

    def __init__(self, signatures: Sequence[Signature] = nccl.API, *, max_comms: int = 64) -> None:
        self._plans = [_plan(s) for s in signatures]
        self.max_comms = max_comms
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, int, str], list[int]] = {}
        self._ranks: dict[int, str] = {}
        self._comms: dict[tuple[int, int], str] = {}
        self._labels: set[str] = set()
        self.events = 0
        """Records handed to on_event."""
        self.comms_over_limit = 0
        """Communicators counted under "other" because max_comms labels were taken."""

    # -- the daemon's side --------------------------------------------------------------------
    def set_rank(self, pid: int, rank: int | None) -> None:
        """The rank label of ``pid``'s calls (its RANK; None: "")."""
        with self._lock:
            self._ranks[pid] = "" if rank is None else str(rank)

    def forget(self, pid: int) -> None:
        """``pid`` exited: drop its rank and communicator tables (its totals stay)."""
        with self._lock:
            self._ranks.pop(pid, None)
            for key in [k for k in self._comms if k[0] == pid]:
                del self._comms[key]

    # -- the probe's side ---------------------------------------------------------------------
    def on_event(self, event: Event) -> None:
        """The probe callback: one NCCL call. Collectives and point-to-point calls are counted per
        communicator; the others (creation, destruction, groups) under comm="" (one series per
        rank and function, not per communicator)."""
        rec = event.record
        pid, probe_id, args = rec.pid, rec.probe_id, rec.args
        plan = self._plans[probe_id]
        with self._lock:
            self.events += 1
            if plan.count >= 0:
                ptr = args[plan.comm]
                comm = self._comms.get((pid, ptr)) or self._unknown(pid, ptr)
                nbytes = args[plan.count] * _DTYPE_BYTES.get(args[plan.dtype] & _U32, 0)
            else:
                comm, nbytes = NO_COMM, 0
                if plan.creates:
                    self._created(pid, plan, rec)
                elif plan.forgets:
                    self._comms.pop((pid, args[plan.comm]), None)
            key = (self._ranks.get(pid, ""), probe_id, comm)
            totals = self._counts.get(key)
            if totals is None:
                totals = self._counts[key] = [0, 0, 0, 0]
            totals[0] += 1
            totals[1] += nbytes
            totals[2] += rec.ret != 0
            totals[3] += rec.latency_ns

    def _created(self, pid: int, plan: _Plan, rec: records.Record) -> None:
        new = int(rec.new_comm)
        name = _NAME_CHARS.sub("_", records.comm_name(rec))
        args = rec.args
        if name:
            label = name
        elif plan.comm_id >= 0:
            label = f"id-{zlib.crc32(int(args[plan.comm_id]).to_bytes(8, 'little')):08x}"
        elif plan.comm >= 0:  # split / shrink: from the parent and the color (or excluded count)
            parent = self._comms.get((pid, int(args[plan.comm]))) or self._unknown(pid, int(args[plan.comm]))
            color = int(args[plan.color]) & _U32 if plan.color >= 0 else 0
            kind = "split" if plan.op == "ncclCommSplit" else "shrink"
            label = f"{kind}-{zlib.crc32(f'{parent}/{color}'.encode()):08x}"
        else:  # ncclCommInitAll: one process's devices
            label = f"all-{zlib.crc32(f'{pid}:{new}'.encode()):08x}"
        if new:
            self._comms[(pid, new)] = self._limited(label)

    def _unknown(self, pid: int, ptr: int) -> str:
        label = self._limited(f"ptr-{zlib.crc32(f'{pid}:{ptr}'.encode()):08x}")
        self._comms[(pid, ptr)] = label
        return label

    def _limited(self, label: str) -> str:
        if label in self._labels:
            return label
        if len(self._labels) >= self.max_comms:
            self.comms_over_limit += 1
            return OTHER
        self._labels.add(label)
        return label

    # -- the collector's side -----------------------------------------------------------------
    def series(self) -> list[NcclSeries]:
        """Every (rank, op, comm) seen so far, with its totals."""
        with self._lock:
            items = [(k, list(v)) for k, v in self._counts.items()]
        return [
            NcclSeries(rank, self._plans[probe_id].op, comm, *totals)
            for (rank, probe_id, comm), totals in sorted(items)
        ]
