"""The per-call record, defined once: the ctypes view (user side) and the C struct (BPF side).

libbpf-tools keep a tool's event struct in one header shared by the kernel program and the
user-space loader. Here the single definition is the field list ``FIELDS``; ``Record`` (ctypes)
and ``c_struct()`` (C text inserted into the BPF program) are both generated from it, and the
program asserts at compile time that the compiler agrees with ctypes on every offset and on the
size (``c_layout_asserts()``), so the two sides cannot drift apart silently.

Fields are ordered widest first so that neither side inserts padding; every record is one
fixed-size struct (one layout to decode, one ring-buffer reservation size).
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

STRUCT_NAME = "fr_record"
MAX_ARGS = 8
"""Argument slots: NCCL's widest API (``ncclReduce``) has 8."""
COMM_NAME_BYTES = 48
"""``ncclConfig_t.commName`` is copied up to this many bytes (NUL included)."""

# Record kinds.
KIND_CALL = 1
"""Entry and return of one call, fused: latency and return value are set."""
KIND_ENTRY = 2
"""Entry only (the program was built without return probes): no latency, no return value."""
KIND_INFLIGHT = 3
"""A call entered but not returned yet, read from the in-flight map by user space (never sent)."""

# Flag bits: which optional reads failed or were skipped (the field then holds 0).
FLAG_STACK_FAULT = 1 << 0
"""An argument passed on the stack could not be read."""
FLAG_NEWCOMM_FAULT = 1 << 1
"""The communicator a creation call returned through its out-pointer could not be read."""
FLAG_CONFIG_FAULT = 1 << 2
"""``ncclConfig_t`` could not be read, or it is not one we know (magic, size)."""
FLAG_NAME_FAULT = 1 << 3
"""``ncclConfig_t.commName`` is set but its string could not be read."""

KIND_NAMES = {KIND_CALL: "call", KIND_ENTRY: "entry", KIND_INFLIGHT: "inflight"}


@dataclass(frozen=True, slots=True)
class Field:
    """One field of the record, as both sides see it."""

    name: str
    ctype: str
    """C type as written in the BPF program: u64, s64, u32, s32 or char."""
    count: int = 1
    """Array length (1: a scalar)."""
    doc: str = ""


_CTYPES: Mapping[str, Any] = {
    "u64": ctypes.c_uint64,
    "s64": ctypes.c_int64,
    "u32": ctypes.c_uint32,
    "s32": ctypes.c_int32,
    "char": ctypes.c_char,
}

FIELDS: tuple[Field, ...] = (
    Field("ts_ns", "u64", doc="entry time, bpf_ktime_get_ns() (CLOCK_MONOTONIC, ns)"),
    Field("latency_ns", "u64", doc="host-side latency, return minus entry (ns); 0 without return probes"),
    Field(
        "args",
        "u64",
        MAX_ARGS,
        doc="arguments in declaration order; ints sign-extended, a by-value struct as its FNV-1a-64",
    ),
    Field("ret", "s64", doc="return value (ncclResult_t), sign-extended; 0 without return probes"),
    Field("new_comm", "u64", doc="communicator written through a creation call's out-pointer, at return"),
    Field("pid", "u32", doc="process id (tgid)"),
    Field("tid", "u32", doc="thread id"),
    Field("probe_id", "u32", doc="index of the probed function in the program's probe list"),
    Field("kind", "u32", doc="KIND_CALL or KIND_ENTRY"),
    Field("flags", "u32", doc="FLAG_* bits"),
    Field("cpu", "u32", doc="CPU the entry ran on"),
    Field("nranks", "s32", doc="communicator creation: nranks (ndev for ncclCommInitAll); else -1"),
    Field("rank", "s32", doc="communicator creation: this rank; else -1 (unknown for split/shrink)"),
    Field("comm_name", "char", COMM_NAME_BYTES, doc="ncclConfig_t.commName, NUL-terminated, or empty"),
)


def _ctype(field: Field) -> Any:
    base = _CTYPES[field.ctype]
    return base * field.count if field.count > 1 else base


class Record(ctypes.Structure):
    """The record as user space reads it from the ring buffer (generated from ``FIELDS``)."""

    _fields_ = [(f.name, _ctype(f)) for f in FIELDS]


RECORD_SIZE = ctypes.sizeof(Record)


def c_struct() -> str:
    """The C definition of the record, for the BPF program."""
    lines = [f"struct {STRUCT_NAME} {{"]
    for f in FIELDS:
        suffix = f"[{f.count}]" if f.count > 1 else ""
        lines.append(f"    {f.ctype} {f.name}{suffix};  /* {f.doc} */")
    lines.append("};")
    return "\n".join(lines)


def c_layout_asserts() -> str:
    """Compile-time checks that the C compiler lays the struct out exactly as ctypes does."""
    lines = [
        f"_Static_assert(sizeof(struct {STRUCT_NAME}) == {RECORD_SIZE}, "
        f'"struct {STRUCT_NAME}: size differs from records.py");'
    ]
    for f in FIELDS:
        offset = getattr(Record, f.name).offset
        lines.append(
            f"_Static_assert(__builtin_offsetof(struct {STRUCT_NAME}, {f.name}) == {offset}, "
            f'"struct {STRUCT_NAME}.{f.name}: offset differs from records.py");'
        )
    return "\n".join(lines)


def c_constants() -> str:
    """Kinds, flags and sizes as C macros, so the program and Python share one set of numbers."""
    values = {
        "FR_MAX_ARGS": MAX_ARGS,
        "FR_COMM_NAME_BYTES": COMM_NAME_BYTES,
        "FR_KIND_CALL": KIND_CALL,
        "FR_KIND_ENTRY": KIND_ENTRY,
        "FR_FLAG_STACK_FAULT": FLAG_STACK_FAULT,
        "FR_FLAG_NEWCOMM_FAULT": FLAG_NEWCOMM_FAULT,
        "FR_FLAG_CONFIG_FAULT": FLAG_CONFIG_FAULT,
        "FR_FLAG_NAME_FAULT": FLAG_NAME_FAULT,
    }
    return "\n".join(f"#define {k} {v}" for k, v in values.items())


def decode(data: bytes | bytearray | memoryview) -> Record:
    """A copy of one raw record (ring buffers reuse their memory once the callback returns)."""
    if len(data) < RECORD_SIZE:
        raise ValueError(f"record of {len(data)} bytes, expected {RECORD_SIZE}")
    return Record.from_buffer_copy(data)


def comm_name(record: Record) -> str:
    """``commName`` as text (empty when absent)."""
    raw: bytes = record.comm_name  # ctypes strips at the first NUL
    return raw.decode("utf-8", "replace")
