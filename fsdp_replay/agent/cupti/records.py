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

import numpy as np

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
# Words per row of ``Arrays``.
KERNEL_WORDS, COPY_WORDS, API_WORDS, EXT_WORDS = 6, 7, 3, 2


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
    dropped: int = 0  # as ``Arrays.dropped`` (the Python path counts those in its callback)

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
class Arrays:
    """One batch as arrays of 64-bit words, kernel names as codes: what the native library
    (``native.py``) takes out, and what ``Interner.arrays`` makes of a ``Batch``."""

    kernels: np.ndarray
    """(n, KERNEL_WORDS): corr, start, end, device, stream, name code"""
    copies: np.ndarray
    """(n, COPY_WORDS): corr, start, end, device, stream, the trace's copy kind code, bytes"""
    api: np.ndarray
    """(n, API_WORDS): corr, start, thread id"""
    ext: np.ndarray
    """(n, EXT_WORDS): corr, external id (of the agent's external kind)"""
    names: list[str]
    """the kernel names first seen in this batch: the codes after all earlier batches' names"""
    other: int = 0
    dropped: int = 0
    """kernel and copy records counted, not kept (the native library was told to discard)"""

    @property
    def records(self) -> int:
        return len(self.kernels) + len(self.copies)


def _words(rows: list[Any], width: int) -> np.ndarray:
    return np.array(rows, dtype=np.uint64).reshape(len(rows), width)


class Interner:
    """Kernel names -> codes in order of first appearance, for a ``Batch`` of the Python path."""

    def __init__(self) -> None:
        self.codes: dict[str, int] = {}

    def arrays(self, batch: Batch) -> Arrays:
        codes, new = self.codes, []
        kernels = []
        for corr, start, end, device, stream, name in batch.kernels:
            code = codes.get(name)
            if code is None:
                code = codes[name] = len(codes)
                new.append(name)
            kernels.append((corr, start, end, device, stream, code))
        return Arrays(
            _words(kernels, KERNEL_WORDS),
            _words(batch.copies, COPY_WORDS),
            _words(batch.api, API_WORDS),
            _words(batch.ext, EXT_WORDS),
            new,
            batch.other,
        )


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


_EMPTY_API = np.empty((0, API_WORDS), dtype=np.uint64)
_EMPTY_EXT = np.empty((0, EXT_WORDS), dtype=np.uint64)
_AGENT = np.uint64(AGENT_EXT_ID)
_NONE = -1  # a field of a position that is not known


def _first_per_key(keys: np.ndarray, *by: np.ndarray) -> np.ndarray:
    """Indices of one row per distinct key: the first in the order ``by`` (last = primary) and
    then arrival, sorted by key."""
    order = np.lexsort((np.arange(len(keys)), *by, keys))
    k = keys[order]
    first = np.ones(len(k), dtype=bool)
    first[1:] = k[1:] != k[:-1]
    return order[first]


def _lookup(table_keys: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index into the sorted ``table_keys``, found) for each of ``keys``."""
    if not len(table_keys):
        return np.zeros(len(keys), dtype=np.int64), np.zeros(len(keys), dtype=bool)
    i = np.minimum(np.searchsorted(table_keys, keys), len(table_keys) - 1)
    return i, table_keys[i] == keys


class Decoder:
    """Joins and places records batch by batch (writer thread), on arrays. API and external
    correlation records arrive with their launch, kernel and copy records when the device has
    run them, so they are kept for one more batch; the marks back to the oldest launch kept."""

    def __init__(self) -> None:
        self.interner = Interner()  # for the Python path's batches
        # Kernel names come numbered in order of first appearance among all records; the trace
        # numbers only those of the rows it keeps (not the agent's own kernels), in row order.
        self._source_names: list[str] = []
        self._code_map = np.full(0, -1, dtype=np.int64)  # source code -> the trace's, or -1
        self.name_count = 0  # the trace's kernel names so far: the next batch's name_base
        self._api = [_EMPTY_API, _EMPTY_API]  # (older, newer) batches
        self._ext = [_EMPTY_EXT, _EMPTY_EXT]
        self._pos_ts: list[int] = []
        self._positions: list[tuple[int, int, int]] = []
        self._agent: dict[int, tuple[list[int], list[bool]]] = {}

    # -- state kept across batches ----------------------------------------------------------
    def _add(self, batch: Arrays, marks: Marks) -> None:
        self._api = [self._api[1], batch.api]
        self._ext = [self._ext[1], batch.ext]
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

    def forget_launches(self) -> None:
        """A window ended and its last batch is decoded: every launch kept has had its kernels and
        copies, so the launches (API and external correlation records) are let go. They must
        be: once CUPTI is finalized (between windows, or by another profiler) correlation ids
        start over, and a kept launch would claim a new window's kernel of the same id."""
        self._api = [_EMPTY_API, _EMPTY_API]
        self._ext = [_EMPTY_EXT, _EMPTY_EXT]

    def _prune(self) -> None:
        """Drop the marks before the oldest launch still kept (but the last one before it, which
        still says where that launch was)."""
        starts = [int(a[:, 1].min()) for a in self._api if len(a)]
        if not starts:
            return
        horizon = min(starts)
        cut = max(0, bisect.bisect_right(self._pos_ts, horizon) - 1)
        del self._pos_ts[:cut], self._positions[:cut]
        for times, states in self._agent.values():
            cut = max(0, bisect.bisect_right(times, horizon) - 1)
            del times[:cut], states[:cut]

    def _positions_at(self, ts: np.ndarray) -> np.ndarray:
        """(n, 3) positions in force at each time (the first mark's before it; -1 with no marks)."""
        if not self._positions:
            return np.full((len(ts), 3), _NONE, dtype=np.int64)
        i = np.searchsorted(np.asarray(self._pos_ts, dtype=np.uint64), ts, side="right")
        return np.asarray(self._positions, dtype=np.int64)[np.maximum(i - 1, 0)]

    def _agent_at(self, tids: np.ndarray, ts: np.ndarray) -> np.ndarray:
        """Whether each launch (thread, host time) came inside the agent's own work."""
        out = np.zeros(len(ts), dtype=bool)
        for tid in np.unique(tids).tolist():
            marks = self._agent.get(int(tid))
            if not marks or not marks[0]:
                continue
            rows = np.flatnonzero(tids == tid)
            i = np.searchsorted(np.asarray(marks[0], dtype=np.uint64), ts[rows], side="right")
            states = np.asarray([False, *marks[1]], dtype=bool)
            out[rows] = states[i]
        return out

    def _trace_codes(self, source: np.ndarray, new_names: list[str]) -> np.ndarray:
        """The trace's codes of these rows' names, numbering (into ``new_names``) those first
        seen, in row order."""
        codes, first = np.unique(source, return_index=True)
        unnumbered = self._code_map[codes] < 0
        if unnumbered.any():
            fresh = codes[unnumbered][np.argsort(first[unnumbered], kind="stable")]
            self._code_map[fresh] = np.arange(self.name_count, self.name_count + len(fresh))
            self.name_count += len(fresh)
            new_names += [self._source_names[i] for i in fresh.tolist()]
        return self._code_map[source]

    # -- one batch ----------------------------------------------------------------------------
    def decode(self, batch: Arrays | Batch, marks: Marks) -> Decoded:
        if isinstance(batch, Batch):
            batch = self.interner.arrays(batch)
        self._add(batch, marks)
        out = Decoded([], [], [], self.name_count)
        if batch.names:
            self._source_names += batch.names
            grow = len(self._source_names) - len(self._code_map)
            self._code_map = np.concatenate([self._code_map, np.full(grow, -1, dtype=np.int64)])
        k, c = batch.kernels, batch.copies
        nk = len(k)
        rows = np.concatenate([k[:, :3], c[:, :3]]) if nk + len(c) else np.empty((0, 3), np.uint64)
        is_copy = np.arange(len(rows)) >= nk
        # correlation order (a launch's kernels before its copies, then as they came)
        order = np.lexsort((np.arange(len(rows)), is_copy, rows[:, 0]))
        start, end = rows[order, 1], rows[order, 2]
        complete = (start > 0) & (end >= start)
        out.incomplete = int(len(order) - complete.sum())
        order = order[complete]
        corr = rows[order, 0]
        n = len(order)

        # the launch's external id (the agent's wins where several were pushed) and API record
        ext_all = np.concatenate(self._ext)
        api_all = np.concatenate(self._api)
        none = np.empty(0, dtype=np.int64)
        ext_rows = _first_per_key(ext_all[:, 0], (ext_all[:, 1] & _AGENT) == 0) if len(ext_all) else none
        api_rows = _first_per_key(api_all[:, 0]) if len(api_all) else none
        ext_tab, api_tab = ext_all[ext_rows], api_all[api_rows]
        ei, has_ext = _lookup(ext_tab[:, 0], corr)
        ai, has_api = _lookup(api_tab[:, 0], corr)
        ext_id = np.where(has_ext, ext_tab[ei, 1] if len(ext_tab) else 0, 0).astype(np.uint64)
        ours = has_ext & ((ext_id & _AGENT) != 0)
        encoded = has_ext & ~ours & (ext_id != np.uint64(UNENCODABLE))

        where = np.full((n, 3), _NONE, dtype=np.int64)
        # 1. where the launch said it was (its position id)
        s1 = (ext_id & np.uint64(_SEQ_MAX)).astype(np.int64)
        micro = ((ext_id >> np.uint64(SEQ_BITS)) & np.uint64(_MICRO_MAX)).astype(np.int64)
        step = (ext_id >> np.uint64(SEQ_BITS + MICRO_BITS)).astype(np.int64)
        where[encoded] = np.stack([step, micro, s1 - 1], axis=1)[encoded]
        # 2. an id that says no position (the agent's, unencodable) and no API record: the latest
        latest = ~encoded & has_ext & ~has_api
        if latest.any() and self._positions:
            where[latest] = self._positions[-1]
        # 3. by the launch's host time: whose (marks, where no id was pushed) and where
        timed = ~encoded & has_api
        if timed.any():
            a_start, a_tid = api_tab[ai[timed], 1], api_tab[ai[timed], 2]
            where[timed] = self._positions_at(a_start)
            bare = ~has_ext[timed]
            agent = self._agent_at(a_tid[bare], a_start[bare])
            sel = np.flatnonzero(timed)[bare]
            ours[sel] = agent
            out.by_time = int((~agent).sum())
        # 4. a record whose launch left no record (none should) takes the place of the launch just
        # before it in correlation order, as the program's: leaving out the program's work on a
        # guess would be worse than keeping one of ours
        unknown = ~has_ext & ~has_api
        if unknown.any():
            known_at = np.where(unknown, -1, np.arange(n))
            prev = np.maximum.accumulate(known_at)
            first = self._positions_at(np.zeros(1, dtype=np.uint64))[0]
            where[unknown] = np.where((prev >= 0)[:, None], where[np.maximum(prev, 0)], first)[unknown]

        out.agent = int(ours.sum())
        keep = ~ours
        src, copy_rows, where = order[keep], is_copy[order[keep]], where[keep]
        kern_idx = src[~copy_rows]
        copy_idx = src[copy_rows] - nk
        if len(kern_idx):
            kept = k[kern_idx].astype(np.int64)
            kept[:, 5] = self._trace_codes(kept[:, 5], out.names)
            out.kernels = np.concatenate([where[~copy_rows], kept], axis=1).tolist()
        if len(copy_idx):
            out.copies = np.concatenate([where[copy_rows], c[copy_idx].astype(np.int64)], axis=1).tolist()
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
