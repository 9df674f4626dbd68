"""CUPTI's activity records -> the trace's kernel and copy rows (``cupti`` events).

Two halves, on two threads:

- ``extract`` runs in CUPTI's buffer-completed callback. cupti-python hands it a list of record
  objects that view CUPTI's buffer, which is reused once the callback returns, so the fields we
  keep are copied out there, into plain tuples: nothing else (a few attribute reads per record).
- ``Decoder.decode`` runs on the agent's writer thread, in batches: it joins each kernel or copy
  with its launch (the runtime or driver API record of the same correlation id, and the external
  correlation id pushed for it), decides whose it is and where in the program it was launched,
  interns kernel names, and returns the rows.

Where a record was launched (step, micro-step, collective sequence number) comes from the
external correlation id CUPTI attached to its launch (``ext_position``) where there is one: the
training thread keeps an id pushed that says where it is. Launches from other threads (the
autograd engine's, in backward) carry none; they are placed by time, from the launch's host
timestamp and the agent's boundary marks (``Marks``), which are taken on CUPTI's clock. The agent's
own launches (its fingerprints, payload copies) carry ``AGENT_EXT_ID`` and are left out and counted.

No import of cupti-python here: the record kinds' codes come in a ``Kinds``, so that the decoding
is tested on the CPU with records built like cupti-python's.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fsdp_replay.trace import schema
from fsdp_replay.trace.schema import COPY_KIND_CODES

# External correlation ids, pushed by the agent on CUPTI's per-thread stack of one external kind:
# bit 63 set means "the agent's own work"; otherwise the id says where the program is.
AGENT_EXT_ID = 1 << 63
SEQ_BITS, MICRO_BITS, STEP_BITS = 27, 8, 28
_SEQ_MAX, _MICRO_MAX, _STEP_MAX = (1 << SEQ_BITS) - 1, (1 << MICRO_BITS) - 1, (1 << STEP_BITS) - 1
# A position that does not fit the fields: such launches are placed by time instead.
UNENCODABLE = (1 << 63) - 1
MEMSET_KIND = COPY_KIND_CODES["memset"]
# Rows of an event are cut into chunks of this many, so that no spool record grows large.
ROWS_PER_EVENT = 4096


def ext_position(step: int, micro: int, seq: int) -> int:
    """The external correlation id for a position: step, micro-step and the current collective's
    sequence number (-1 before the first) in 63 bits, or ``UNENCODABLE``."""
    s1 = seq + 1
    if not (0 <= step < _STEP_MAX and 0 <= micro < _MICRO_MAX and 0 <= s1 < _SEQ_MAX):
        return UNENCODABLE
    return (step << (SEQ_BITS + MICRO_BITS)) | (micro << SEQ_BITS) | s1


def position_of(ext_id: int) -> tuple[int, int, int] | None:
    """(step, micro, seq) of an id from ``ext_position``; None for the agent's and unencodable ids."""
    if ext_id & AGENT_EXT_ID or ext_id == UNENCODABLE:
        return None
    s1 = ext_id & _SEQ_MAX
    micro = (ext_id >> SEQ_BITS) & _MICRO_MAX
    step = ext_id >> (SEQ_BITS + MICRO_BITS)
    return step, micro, s1 - 1


@dataclass(frozen=True, slots=True)
class Kinds:
    """CUPTI's codes for what ``extract`` reads (from cupti-python's enums, at run time)."""

    kernel: int
    memcpy: int
    memset: int
    runtime: int
    driver: int
    external: int
    ext_kind: int
    """The external correlation kind the agent pushes its ids on."""
    copy_kinds: Mapping[int, int]
    """CUPTI's memcpy kind -> ``COPY_KIND_CODES`` (anything else: ``other``)."""


@dataclass(slots=True)
class Batch:
    """What the callback copied out of the records, until the writer decodes it."""

    kernels: list[tuple[int, int, int, int, int, str]] = field(default_factory=list)
    """(corr, start, end, device, stream, name)"""
    copies: list[tuple[int, int, int, int, int, int, int]] = field(default_factory=list)
    """(corr, start, end, device, stream, kind code, bytes)"""
    api: list[tuple[int, int, int]] = field(default_factory=list)
    """(corr, start, thread id) of runtime and driver API calls"""
    ext: list[tuple[int, int]] = field(default_factory=list)
    """(corr, external id) of the agent's external kind"""
    other: int = 0
    """records of kinds we did not ask for (another client's, while it owned CUPTI)"""

    @property
    def records(self) -> int:
        """The kernel and copy records it holds."""
        return len(self.kernels) + len(self.copies)


def extract(activities: Iterable[Any], kinds: Kinds, out: Batch) -> None:
    """Copy each record's fields into ``out`` (in the buffer callback: see the module's doc)."""
    kernels, copies, api, ext = out.kernels.append, out.copies.append, out.api.append, out.ext.append
    k_kernel, k_runtime, k_driver, k_ext, k_memcpy, k_memset = (
        kinds.kernel,
        kinds.runtime,
        kinds.driver,
        kinds.external,
        kinds.memcpy,
        kinds.memset,
    )
    copy_kinds, ext_kind, other = kinds.copy_kinds, kinds.ext_kind, 0
    for a in activities:
        k = a.kind
        if k == k_kernel:
            kernels((a.correlation_id, a.start, a.end, a.device_id, a.stream_id, a.name))
        elif k in (k_runtime, k_driver):
            api((a.correlation_id, a.start, a.thread_id))
        elif k == k_ext:
            if a.external_kind == ext_kind:
                ext((a.correlation_id, a.external_id))
        elif k == k_memcpy:
            copies(
                (
                    a.correlation_id,
                    a.start,
                    a.end,
                    a.device_id,
                    a.stream_id,
                    copy_kinds.get(a.copy_kind, 0),
                    a.bytes,
                )
            )
        elif k == k_memset:
            copies((a.correlation_id, a.start, a.end, a.device_id, a.stream_id, MEMSET_KIND, a.bytes))
        else:
            other += 1
    out.other += other


@dataclass(slots=True)
class Marks:
    """The agent's marks, on CUPTI's clock: where the program was from each time on, and on
    each thread, when the agent's own work began and ended."""

    positions: list[tuple[int, int, int, int]] = field(default_factory=list)
    """(cupti ns, step, micro, seq)"""
    agent: list[tuple[int, int, bool]] = field(default_factory=list)
    """(cupti ns, thread id, on)"""


@dataclass(slots=True)
class Decoded:
    kernels: list[list[int]]
    copies: list[list[int]]
    names: list[str]
    name_base: int
    agent: int = 0
    """kernels and copies of the agent's own, left out"""
    incomplete: int = 0
    """records without device timestamps (CUPTI could not time them), dropped"""
    by_time: int = 0
    """rows placed by time (launched where no position id was pushed)"""


class Decoder:
    """Joins and places records batch by batch (writer thread). API and external correlation
    records arrive with their launch, kernel and copy records when the device has run them, so
    they are kept for one more batch; the marks back to the oldest launch kept."""

    def __init__(self) -> None:
        self.names: dict[str, int] = {}
        self._api: list[dict[int, tuple[int, int]]] = [{}, {}]  # (older, newer) batches
        self._ext: list[dict[int, int]] = [{}, {}]
        self._pos_ts: list[int] = []
        self._positions: list[tuple[int, int, int]] = []
        self._agent: dict[int, tuple[list[int], list[bool]]] = {}
        self._by_time = 0

    # -- state kept across batches ----------------------------------------------------------
    def _add(self, batch: Batch, marks: Marks) -> None:
        self._api = [self._api[1], {corr: (start, tid) for corr, start, tid in batch.api}]
        ext: dict[int, int] = {}
        for corr, ext_id in batch.ext:
            # the agent's id wins: a launch inside our own work on the training thread carries it
            if not ext.get(corr, 0) & AGENT_EXT_ID:
                ext[corr] = ext_id
        self._ext = [self._ext[1], ext]
        if marks.positions:
            # stable by time: marks taken in the same nanosecond keep the order they were taken in
            merged = sorted(
                [
                    *zip(self._pos_ts, self._positions, strict=True),
                    *((ts, (step, micro, seq)) for ts, step, micro, seq in marks.positions),
                ],
                key=lambda m: m[0],
            )
            self._pos_ts = [ts for ts, _ in merged]
            self._positions = [p for _, p in merged]
        for ts, tid, on in marks.agent:  # each thread's marks are in the order it took them
            times, states = self._agent.setdefault(tid, ([], []))
            i = bisect.bisect_right(times, ts)
            times.insert(i, ts)
            states.insert(i, on)

    def _prune(self) -> None:
        """Drop the marks before the oldest launch still kept (but the last one before it, which
        still says where that launch was)."""
        starts = [start for api in self._api for start, _ in api.values()]
        if not starts:
            return
        horizon = min(starts)
        cut = max(0, bisect.bisect_right(self._pos_ts, horizon) - 1)
        del self._pos_ts[:cut], self._positions[:cut]
        for times, states in self._agent.values():
            cut = max(0, bisect.bisect_right(times, horizon) - 1)
            del times[:cut], states[:cut]

    def _agent_at(self, tid: int, ts: int) -> bool:
        marks = self._agent.get(tid)
        if marks is None:
            return False
        i = bisect.bisect_right(marks[0], ts)
        return marks[1][i - 1] if i else False

    def _position_at(self, ts: int) -> tuple[int, int, int] | None:
        if not self._positions:
            return None
        i = bisect.bisect_right(self._pos_ts, ts)
        return self._positions[max(i - 1, 0)]

    def _place(self, corr: int) -> tuple[tuple[int, int, int] | None, bool] | None:
        """(position, whether it is the agent's) of the launch of ``corr``, or None when no
        record of that launch is known."""
        ext = self._ext[1].get(corr)
        if ext is None:
            ext = self._ext[0].get(corr)
        api = self._api[1].get(corr) or self._api[0].get(corr)
        if ext is None and api is None:
            return None
        ours = ext is not None and bool(ext & AGENT_EXT_ID)
        position = position_of(ext) if ext is not None else None
        if position is not None:
            return position, ours
        if api is None:
            return self._position_at(self._pos_ts[-1] if self._pos_ts else 0), ours
        start, tid = api
        if ext is None:
            ours = self._agent_at(tid, start)  # launched where no id was pushed: the marks say whose
            self._by_time += not ours
        return self._position_at(start), ours

    # -- one batch ----------------------------------------------------------------------------
    def decode(self, batch: Batch, marks: Marks) -> Decoded:
        self._add(batch, marks)
        new_names: list[str] = []
        out = Decoded([], [], new_names, len(self.names))
        kernels, copies = batch.kernels, batch.copies
        order = sorted(
            [(k[0], 0, i) for i, k in enumerate(kernels)] + [(c[0], 1, i) for i, c in enumerate(copies)]
        )
        # A record whose launch left no record (none should) takes the place of the launch just
        # before it in correlation order, as the program's: leaving out the program's work on a
        # guess would be worse than keeping one of ours.
        last: tuple[int, int, int] | None = self._position_at(0)
        for corr, is_copy, i in order:
            start, end = (copies[i][1], copies[i][2]) if is_copy else (kernels[i][1], kernels[i][2])
            if start <= 0 or end < start:
                out.incomplete += 1
                continue
            place = self._place(corr)
            position, ours = (last, False) if place is None else place
            last = position
            if ours:
                out.agent += 1
                continue
            where = list(position) if position is not None else [-1, -1, -1]
            if is_copy:
                _, _, _, device, stream, kind, nbytes = copies[i]
                out.copies.append([*where, corr, start, end, device, stream, kind, nbytes])
            else:
                _, _, _, device, stream, name = kernels[i]
                code = self.names.get(name)
                if code is None:
                    code = self.names[name] = len(self.names)
                    new_names.append(name)
                out.kernels.append([*where, corr, start, end, device, stream, code])
        out.by_time, self._by_time = self._by_time, 0
        self._prune()
        return out


def events_of(decoded: Decoded) -> list[dict[str, Any]]:
    """The ``cupti`` events of a decoded batch, its rows cut into ``ROWS_PER_EVENT``."""
    k, c = decoded.kernels, decoded.copies
    if not (k or c or decoded.names):
        return []
    events: list[dict[str, Any]] = []
    names, base = decoded.names, decoded.name_base
    for i in range(0, max(len(k), len(c), 1), ROWS_PER_EVENT):
        events.append(
            {
                "type": schema.EV_CUPTI,
                "kernels": k[i : i + ROWS_PER_EVENT],
                "copies": c[i : i + ROWS_PER_EVENT],
                "names": names,
                "name_base": base,
            }
        )
        base, names = base + len(names), []
    return events
