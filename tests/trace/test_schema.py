"""The trace schema is pinned, the layering rules hold, and the two fingerprint implementations agree.

A failure in the pins means the on-disk format changed: bump ``schema.FORMAT_VERSION`` (or mark the
new key optional), update ``docs/trace-format.md``, then update the literal here.
"""

from __future__ import annotations

import ast
from pathlib import Path

from fsdp_replay.agent import capture
from fsdp_replay.trace import schema

PACKAGE = Path(__file__).resolve().parents[2] / "fsdp_replay"


# -- pins -------------------------------------------------------------------------------------
def test_format_version() -> None:
    assert schema.FORMAT_VERSION == 5
    assert frozenset({1, 2, 3, 4, 5}) == schema.READABLE_VERSIONS
    assert schema.FORMAT_VERSION in schema.READABLE_VERSIONS


def test_event_keys_pinned() -> None:
    expected = {
        "rank_start": {
            "type",
            "format_version",
            "rank",
            "world_size",
            "local_rank",
            "pid",
            "host",
            "argv",
            "orig_argv",
            "executable",
            "cwd",
            "env",
            "versions",
            "threads",
            "determinism",
            "script",
            "policy",
            "start_ns",
            "fingerprint_algos",
        },
        "pg": {"type", "pg", "name", "ranks", "backend", "size", "group_rank"},
        "coll": {
            "type",
            "seq",
            "step",
            "micro",
            "op",
            "pg",
            "reduce_op",
            "root",
            "t_ns",
            "dur_ns",
            "tensors",
        },
        "batch": {"type", "step", "micro", "index", "loader", "structure", "tensors"},
        "step": {"type", "step", "micro_steps", "colls", "params", "loss", "t_ns"},
        "rng": {"type", "step", "states"},
        "snapshot": {"type", "step", "blob", "nbytes", "params"},
        "modules": {"type", "modules"},
        "mod": {"type", "step", "micro", "idx", "name", "kind", "fp", "algo", "nonfinite"},
        "agent_error": {"type", "where", "message", "traceback"},
        "drop": {"type", "what", "count", "nbytes", "reason"},
        "stuck": {"type", "seq", "step", "op", "pg", "t_ns", "waited_ns"},
        "alive": {"type", "seq", "step", "t_ns"},
        "state": {
            "type",
            "id",
            "reason",
            "t_ns",
            "t_wall_ns",
            "step",
            "micro",
            "seq",
            "recording",
            "inflight",
            "threads",
            "threads_dropped",
        },
        "kop": {"type", "seq", "step", "micro", "op", "tensors"},
        "files": {"type", "read", "written", "overflow"},
        "urandom": {"type", "calls", "overflow"},
        "numerics": {"type", "step", "flags"},
        "compiled": {"type", "step", "calls", "graphs"},
        "aop": {"type", "step", "idx", "name", "module", "in_fp", "out_fp"},
        "flight_dump": {
            "type",
            "reason",
            "detail",
            "first_step",
            "last_step",
            "snapshot_step",
            "blobs",
            "nbytes",
            "dropped",
            "t_ns",
        },
        "memory": {"type", "step", "device", "stats"},
        "oom": {
            "type",
            "step",
            "micro",
            "t_ns",
            "device",
            "requested",
            "device_total",
            "device_free",
            "stats",
            "blob",
            "nbytes",
        },
        "cupti": {"type", "kernels", "copies", "names", "name_base"},
        "cupti_state": {"type", "state", "reason", "step", "t_ns"},
        "end": {"type", "reason", "steps", "colls", "t_ns", "counters"},
    }
    assert {k: set(v) for k, v in schema.EVENT_KEYS.items()} == expected


def test_optional_event_keys_pinned() -> None:
    assert {k: set(v) for k, v in schema.OPTIONAL_EVENT_KEYS.items()} == {
        "coll": {"extra", "async"},
        "batch": {"rng"},
        "files": {"listed"},
        "end": {"inflight", "exception"},
        "step": {"cpu_ns", "counters", "micro_t_ns"},
        "memory": {"actions", "sites", "full", "base", "moved", "error", "final"},
        "agent_error": {"step", "seq"},
        "rank_start": {"t0_wall_ns", "numerics"},
        "compiled": {"modules", "error"},
        "cupti_state": {"clock", "detail"},
        "flight_dump": {"hole_step"},
    }
    for ev, keys in schema.OPTIONAL_EVENT_KEYS.items():
        assert ev in schema.EVENT_KEYS
        assert not keys & schema.EVENT_KEYS[ev], f"{ev}: a key is both required and optional"


def test_tensor_fields_pinned() -> None:
    assert schema.TENSOR_FIELDS == ("role", "dtype", "shape", "fp", "algo", "nonfinite", "blob", "device")
    assert schema.NO_BLOB == -1
    assert schema.FINGERPRINT_ALGOS == ("zlib64", "lin64", "sk64")
    assert schema.SK64_MIN_BYTES == 64 << 10


def test_spool_constants_pinned() -> None:
    assert schema.SEGMENT_MAGIC == b"FSRSPOOL"
    assert schema.RECORD_MAGIC == 0xF5D4
    assert schema.RECORD_HEADER == "<HBBIII"
    assert schema.RECORD_HEADER_SIZE == 16
    assert (schema.KIND_EVENT, schema.KIND_BLOB) == (1, 2)
    assert schema.FLIGHT_BLOB_BASE == 1 << 48
    assert schema.SEGMENT_FMT.format(index=3) == "seg-000003.fsrs"
    assert schema.RANK_SPOOL_FMT.format(rank=3) == "rank-00003"
    assert schema.RANK_GROUP_FMT.format(rank=3) == "rank_00003"
    assert (schema.SPOOL_DIR, schema.TRACE_DIR, schema.BLOBS_GROUP, schema.ROOT_ATTR) == (
        "spool",
        "trace.zarr",
        "blobs",
        "fsdp_replay",
    )


def test_tables_pinned() -> None:
    expected = {
        "collectives": {
            "seq": "int64",
            "step": "int64",
            "micro": "int32",
            "op": "int16",
            "pg": "int32",
            "reduce_op": "int16",
            "root": "int32",
            "t_ns": "int64",
            "dur_ns": "int64",
            "tensor_start": "int64",
            "tensor_count": "int32",
        },
        "tensors": {
            "coll": "int64",
            "role": "uint8",
            "dtype": "int16",
            "shape_start": "int64",
            "ndim": "int16",
            "nbytes": "int64",
            "fp": "uint64",
            "algo": "int16",
            "nonfinite": "bool",
            "payload": "int64",
            "device": "int16",
        },
        "batches": {
            "step": "int64",
            "micro": "int32",
            "index": "int64",
            "loader": "int32",
            "structure": "int32",
            "tensor_start": "int64",
            "tensor_count": "int32",
            "rng": "int64",
        },
        "batch_tensors": {
            "batch": "int64",
            "dtype": "int16",
            "shape_start": "int64",
            "ndim": "int16",
            "nbytes": "int64",
            "fp": "uint64",
            "algo": "int16",
            "nonfinite": "bool",
            "payload": "int64",
            "device": "int16",
        },
        "steps": {
            "step": "int64",
            "micro_steps": "int32",
            "colls": "int64",
            "t_ns": "int64",
            "param_start": "int64",
            "param_count": "int32",
            "loss_start": "int64",
            "loss_count": "int32",
            "nonfinite": "bool",
            "agent_cpu_ns": "int64",
            "writer_cpu_ns": "int64",
            "cpu_collectives_ns": "int64",
            "cpu_tape_ns": "int64",
            "cpu_payloads_ns": "int64",
            "cpu_snapshots_ns": "int64",
            "cpu_cxx_ns": "int64",
            "payload_wait_ns": "int64",
            "blob_bytes": "int64",
            "blob_write_ns": "int64",
        },
        "step_params": {"fp": "uint64", "nonfinite": "bool", "algo": "int16"},
        "losses": {"value": "float64"},
        "shapes": {"dim": "int64"},
        "rng": {"step": "int64", "payload": "int64", "python": "int64", "torch": "int64", "numpy": "int64"},
        "payloads": {"digest_hi": "uint64", "digest_lo": "uint64", "nbytes": "int64"},
        "tape": {
            "seq": "int64",
            "step": "int64",
            "micro": "int32",
            "op": "int16",
            "tensor_start": "int64",
            "tensor_count": "int32",
        },
        "tape_tensors": {
            "call": "int64",
            "dtype": "int16",
            "shape_start": "int64",
            "ndim": "int16",
            "nbytes": "int64",
            "fp": "uint64",
            "algo": "int16",
            "nonfinite": "bool",
            "payload": "int64",
            "device": "int16",
        },
        "module_fps": {
            "step": "int64",
            "micro": "int32",
            "idx": "int64",
            "name": "int32",
            "kind": "uint8",
            "fp": "uint64",
            "algo": "int16",
            "nonfinite": "bool",
        },
        "kernels": {
            "step": "int64",
            "micro": "int32",
            "seq": "int64",
            "corr": "int64",
            "start_ns": "int64",
            "end_ns": "int64",
            "device": "int16",
            "stream": "int32",
            "name": "int32",
        },
        "copies": {
            "step": "int64",
            "micro": "int32",
            "seq": "int64",
            "corr": "int64",
            "start_ns": "int64",
            "end_ns": "int64",
            "device": "int16",
            "stream": "int32",
            "kind": "int16",
            "bytes": "int64",
        },
        "op_fps": {
            "step": "int64",
            "idx": "int64",
            "op": "int16",
            "module": "int32",
            "in_fp": "uint64",
            "out_fp": "uint64",
        },
        "micro_steps": {"step": "int64", "micro": "int32", "t_ns": "int64"},
        "allocs": {
            "step": "int64",
            "micro": "int32",
            "t_ns": "int64",
            "action": "int16",
            "addr": "int64",
            "bytes": "int64",
            "stream": "int64",
            "device": "int16",
            "site": "int32",
        },
        "memory_steps": {
            "step": "int64",
            "device": "int16",
            "allocated_end": "int64",
            "reserved_end": "int64",
            "requested_end": "int64",
            "allocated_peak": "int64",
            "reserved_peak": "int64",
            "alloc_retries": "int64",
            "ooms": "int64",
            "history": "int64",
            "requested_base": "int64",
            "reserved_base": "int64",
            "moved": "bool",
        },
    }
    assert expected == schema.TABLES
    # the column order is the order the docs list them in
    assert {t: list(c) for t, c in schema.TABLES.items()} == {t: list(c) for t, c in expected.items()}
    assert schema.ROLE_CODES == {"i": 0, "o": 1, "": 2, "j": 3}
    assert schema.COPY_KIND_CODES == {
        "other": 0,
        "htod": 1,
        "dtoh": 2,
        "dtod": 3,
        "htoh": 4,
        "ptop": 5,
        "memset": 6,
    }
    assert schema.CUPTI_STATES == ("off", "armed", "disarmed", "paused", "lost", "error")
    assert schema.CUPTI_ATTR == "cupti"
    assert schema.ALLOC_ACTIONS == (
        "alloc",
        "free_requested",
        "free_completed",
        "segment_alloc",
        "segment_free",
        "segment_map",
        "segment_unmap",
        "oom",
        "snapshot",
    )


def test_the_spec_documents_every_key_table_and_column() -> None:
    doc = (PACKAGE.parent / "docs" / "trace-format.md").read_text()
    missing = [f"event {ev!r}" for ev in schema.EVENT_KEYS if f"`{ev}`" not in doc]
    for ev, keys in [*schema.EVENT_KEYS.items(), *schema.OPTIONAL_EVENT_KEYS.items()]:
        missing += [f"{ev}.{k}" for k in sorted(keys) if f"`{k}`" not in doc]
    missing += [f"tensor field {f}" for f in schema.TENSOR_FIELDS if f"`{f}`" not in doc]
    for table, columns in schema.TABLES.items():
        missing += [f"table {table}"] if f"`{table}`" not in doc else []
        missing += [f"{table}.{c}" for c in columns if f"`{c}`" not in doc]
    assert not missing, f"docs/trace-format.md does not mention: {missing}"
    assert f"version {schema.FORMAT_VERSION}" in doc.splitlines()[0]


# -- the recorder writes only what the schema declares ----------------------------------------
def _event_type(node: ast.expr) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "schema":
        value = getattr(schema, node.attr)
        assert isinstance(value, str)
        return value
    return None


def _recorder_event_dicts() -> list[tuple[str, set[str], bool, str]]:
    """(type, literal keys, has ** unpacking, file:line) of each dict literal with a "type" key, in
    every module of the recording agent that writes events (the recorder and its parts)."""
    found = []
    for path in sorted((PACKAGE / "agent").rglob("*.py")):
        text = path.read_text()
        if "schema.EV_" not in text:
            continue  # writes no events (a dict with a "type" key there is something else)
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Dict):
                continue
            keys = [k.value if isinstance(k, ast.Constant) else None for k in node.keys]
            if "type" not in keys:
                continue
            where = f"{path.relative_to(PACKAGE)}:{node.lineno}"
            ev = _event_type(node.values[keys.index("type")])
            assert ev is not None, f"{where}: event type is not a literal or schema.EV_*"
            literal = {k for k in keys if isinstance(k, str)}
            found.append((ev, literal, None in keys, where))
    return found


def test_recorder_event_types_are_in_the_schema() -> None:
    found = _recorder_event_dicts()
    types = {ev for ev, *_ in found}
    assert types >= {
        "rank_start",
        "pg",
        "coll",
        "batch",
        "step",
        "rng",
        "snapshot",
        "modules",
        "agent_error",
        "end",
    }
    for ev, keys, unpacks, line in found:
        assert ev in schema.EVENT_KEYS, f"{line}: event type {ev!r} is not in schema.EVENT_KEYS"
        allowed = schema.EVENT_KEYS[ev] | schema.OPTIONAL_EVENT_KEYS.get(ev, frozenset())
        assert keys <= allowed, f"{line}: {ev} keys not in the schema: {sorted(keys - allowed)}"
        if not unpacks:
            missing = schema.EVENT_KEYS[ev] - keys
            assert not missing, f"{line}: {ev} lacks required keys {sorted(missing)}"


def test_rank_start_keys_match_process_info() -> None:
    (literal,) = [keys for ev, keys, _, _ in _recorder_event_dicts() if ev == schema.EV_RANK_START]
    # rank_start = literal keys + process_info() + "script" (added on the writer thread)
    written = literal | set(capture.process_info(0, 1, 0)) | {"script"}
    optional = schema.OPTIONAL_EVENT_KEYS[schema.EV_RANK_START]
    assert written - optional == schema.EVENT_KEYS[schema.EV_RANK_START]
