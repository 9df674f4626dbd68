"""The trace schema is pinned, the layering rules hold, and the two fingerprint implementations agree.

A failure in the pins means the on-disk format changed: bump ``schema.FORMAT_VERSION`` (or mark the
new key optional), update ``docs/trace-format.md``, then update the literal here.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from fsdp_replay.agent import capture
from fsdp_replay.agent.fingerprint import fingerprint as torch_fingerprint
from fsdp_replay.trace import fingerprint as ref
from fsdp_replay.trace import schema

PACKAGE = Path(__file__).resolve().parents[1] / "fsdp_replay"


# -- pins -------------------------------------------------------------------------------------
def test_format_version() -> None:
    assert schema.FORMAT_VERSION == 3
    assert frozenset({1, 2, 3}) == schema.READABLE_VERSIONS
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
        "end": {"type", "reason", "steps", "colls", "t_ns", "counters"},
    }
    assert {k: set(v) for k, v in schema.EVENT_KEYS.items()} == expected


def test_optional_event_keys_pinned() -> None:
    assert {k: set(v) for k, v in schema.OPTIONAL_EVENT_KEYS.items()} == {
        "coll": {"extra", "async"},
        "end": {"inflight", "exception"},
        "step": {"cpu_ns", "counters"},
        "agent_error": {"step", "seq"},
        "rank_start": {"t0_wall_ns"},
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
        },
        "step_params": {"fp": "uint64", "nonfinite": "bool", "algo": "int16"},
        "losses": {"value": "float64"},
        "shapes": {"dim": "int64"},
        "rng": {"step": "int64", "payload": "int64", "python": "int64", "torch": "int64", "numpy": "int64"},
        "payloads": {"digest_hi": "uint64", "digest_lo": "uint64", "nbytes": "int64"},
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
    }
    assert expected == schema.TABLES
    # the column order is the order the docs list them in
    assert {t: list(c) for t, c in schema.TABLES.items()} == {t: list(c) for t, c in expected.items()}
    assert schema.ROLE_CODES == {"i": 0, "o": 1, "": 2}


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


def _recorder_event_dicts() -> list[tuple[str, set[str], bool, int]]:
    """(type, literal keys, has ** unpacking, line) of each dict literal with a "type" key."""
    tree = ast.parse((PACKAGE / "agent" / "recorder.py").read_text())
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Dict):
            continue
        keys = [k.value if isinstance(k, ast.Constant) else None for k in node.keys]
        if "type" not in keys:
            continue
        ev = _event_type(node.values[keys.index("type")])
        assert ev is not None, f"recorder.py:{node.lineno}: event type is not a literal or schema.EV_*"
        literal = {k for k in keys if isinstance(k, str)}
        found.append((ev, literal, None in keys, node.lineno))
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
        assert ev in schema.EVENT_KEYS, f"recorder.py:{line}: event type {ev!r} is not in schema.EVENT_KEYS"
        allowed = schema.EVENT_KEYS[ev] | schema.OPTIONAL_EVENT_KEYS.get(ev, frozenset())
        assert keys <= allowed, f"recorder.py:{line}: {ev} keys not in the schema: {sorted(keys - allowed)}"
        if not unpacks:
            missing = schema.EVENT_KEYS[ev] - keys
            assert not missing, f"recorder.py:{line}: {ev} lacks required keys {sorted(missing)}"


def test_rank_start_keys_match_process_info() -> None:
    (literal,) = [keys for ev, keys, _, _ in _recorder_event_dicts() if ev == schema.EV_RANK_START]
    # rank_start = literal keys + process_info() + "script" (added on the writer thread)
    written = literal | set(capture.process_info(0, 1, 0)) | {"script"}
    optional = schema.OPTIONAL_EVENT_KEYS[schema.EV_RANK_START]
    assert written - optional == schema.EVENT_KEYS[schema.EV_RANK_START]


# -- layering ---------------------------------------------------------------------------------
def _imports(path: Path) -> Iterator[tuple[str, int]]:
    """Every module an import statement in ``path`` names (at any depth), with its line."""
    tree = ast.parse(path.read_text())
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    package = list(rel.parts[:-1])  # the package a relative import starts from (also for __init__)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            yield mod, node.lineno
            for a in node.names:  # `from fsdp_replay.trace import collect` imports a module too
                yield f"{mod}.{a.name}", node.lineno


def _sources(component: str) -> list[Path]:
    folder = PACKAGE / component
    assert folder.is_dir(), f"{folder} is missing"
    return sorted(folder.rglob("*.py"))


def _top(mod: str) -> str:
    return mod.split(".")[0]


def _module_file(mod: str) -> Path | None:
    parts = mod.split(".")
    if parts[0] != "fsdp_replay":
        return None
    base = PACKAGE.parent.joinpath(*parts)
    for p in (base.with_suffix(".py"), base / "__init__.py"):
        if p.is_file():
            return p
    return None


def test_trace_imports_no_torch_and_no_other_component() -> None:
    bad = []
    for f in _sources("trace"):
        for mod, line in _imports(f):
            if _top(mod) == "torch":
                bad.append(f"{f.name}:{line} imports {mod}")
            elif _top(mod) == "fsdp_replay":
                ok = mod == "fsdp_replay.errors" or mod.startswith(
                    ("fsdp_replay.trace.", "fsdp_replay.errors.")
                )
                ok = ok or mod == "fsdp_replay.trace"
                if not ok:
                    bad.append(f"{f.name}:{line} imports {mod}")
    assert not bad, "fsdp_replay/trace must import neither torch nor other components:\n" + "\n".join(bad)


@pytest.mark.parametrize("component", ["sidecar", "injector"])
def test_component_never_imports_torch(component: str) -> None:
    bad = [
        f"{f.relative_to(PACKAGE)}:{line} imports {mod}"
        for f in _sources(component)
        for mod, line in _imports(f)
        if _top(mod) == "torch"
    ]
    assert not bad, "\n".join(bad)


def test_only_the_sidecar_imports_bcc() -> None:
    bad = [
        f"{f.relative_to(PACKAGE)}:{line} imports {mod}"
        for f in sorted(PACKAGE.rglob("*.py"))
        if f.relative_to(PACKAGE).parts[0] != "sidecar"
        for mod, line in _imports(f)
        if _top(mod) == "bcc"
    ]
    assert not bad, "\n".join(bad)


def test_agent_never_imports_zarr() -> None:
    """Not directly, and not through a trace module (collect, reader, store, summary import zarr)."""
    bad = []
    for f in _sources("agent"):
        seen: set[Path] = set()
        todo = [(f, [f.relative_to(PACKAGE).as_posix()])]
        while todo:
            src, chain = todo.pop()
            if src in seen:
                continue
            seen.add(src)
            for mod, line in _imports(src):
                if _top(mod) in ("zarr", "numcodecs"):
                    bad.append(" -> ".join([*chain[:-1], f"{chain[-1]}:{line}", mod]))
                target = _module_file(mod)
                # follow the agent's own modules and the trace modules it uses, not other components
                if target is not None and target.relative_to(PACKAGE).parts[0] in ("agent", "trace"):
                    todo.append((target, [*chain, target.relative_to(PACKAGE).as_posix()]))
    assert not bad, "the agent must not import zarr:\n" + "\n".join(sorted(set(bad)))


# -- fingerprints: the torch (agent) and numpy (trace) versions agree -------------------------
DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
]
SIZES = [0, 1, 3, 7, 63, 64, 65, 511, 512, 513, 1023, 1024, 1025, 4099, 100_000]
ALGOS = ["zlib64", "lin64", "sk64"]


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bit patterns (floats include NaN/Inf patterns: fingerprints hash bytes, not values)."""
    g = np.random.default_rng(seed)
    n = int(np.prod(shape, dtype=np.int64))
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    if dtype == torch.bool:
        return torch.from_numpy(g.integers(0, 2, n, dtype=np.uint8).astype(bool)).reshape(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = g.integers(0, 256, n * itemsize, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).reshape(shape).clone()


def raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's bytes in row-major order, without going through its dtype in numpy."""
    c = t.detach().contiguous().reshape(-1)
    if c.dtype == torch.bool:
        c = c.view(torch.uint8)
    return c.view(torch.uint8).numpy().tobytes()


def _agree(t: torch.Tensor, algo: str) -> None:
    fp, _nf, got_algo = torch_fingerprint(t, algo)
    assert got_algo == algo
    assert fp == ref.fingerprint(algo, raw_bytes(t)), f"{algo} {t.dtype} {tuple(t.shape)}"
    assert 0 <= fp < 1 << 64


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_and_numpy_fingerprints_agree(dtype: torch.dtype, algo: str, fp_impl: str) -> None:
    for n in SIZES:
        _agree(random_tensor((n,), dtype, seed=n), algo)


@pytest.mark.parametrize("algo", ALGOS)
def test_fingerprints_agree_on_non_contiguous_inputs(algo: str) -> None:
    for dtype in DTYPES:
        base = random_tensor((37, 129), dtype, seed=7)
        for view in (base.t(), base[:, ::3], base[::2, 5:], base[3:4].expand(6, 129), base.t()[1::4]):
            assert not view.is_contiguous() or view.storage_offset()
            _agree(view, algo)


@pytest.mark.parametrize("algo", ALGOS)
def test_fingerprints_agree_on_offset_views(algo: str, fp_impl: str) -> None:
    """Contiguous views that start inside their storage (at least one whole word long)."""
    base = random_tensor((5000,), torch.uint8, seed=3)
    for start in range(8):
        for n in (4, 5, 8, 9, 1025, 4099):
            _agree(base[start : start + n], algo)
    halves = random_tensor((300,), torch.bfloat16, seed=4)
    for start in range(4):
        _agree(halves[start : start + 5], algo)


def test_lin64_of_a_tiny_unaligned_view() -> None:
    base = torch.arange(16, dtype=torch.int8)
    for start in range(1, 4):
        for n in (0, 1, 2, 3):
            _agree(base[start : start + n], "lin64")
    _agree(torch.zeros(4, dtype=torch.bfloat16)[1:2], "lin64")  # one bf16 element at byte 2


def test_scalars_and_shapes_do_not_matter_beyond_bytes() -> None:
    t = random_tensor((6, 5), torch.float32, seed=1)
    for algo in ALGOS:
        _agree(torch.tensor(3.5), algo)
        assert torch_fingerprint(t, algo)[0] == torch_fingerprint(t.reshape(30), algo)[0]


def test_empty_input() -> None:
    assert ref.zlib64(b"") == 0
    assert ref.lin64(b"") == ref.combine_lin64(0, 0, 0, 0)
    assert ref.sk64(b"") == ref.combine_sk64(ref.sk64_crc(0, bytes(8 * ref.SK64_ROW), b""), 0)


def test_sk64_sees_sign_swaps_that_cancel_in_every_sum() -> None:
    """x and -x in the upper halves of two words differ by exactly 2**63: swapping them leaves the
    total unchanged and moves two row (or column) sums by 2**63; the sketch's CRC still sees it."""
    for d in (2, 128, 130, 1280):  # same row / same column / both differ / ten rows apart
        t = torch.zeros(4096, dtype=torch.float32)
        t[1], t[1 + d] = 3.0, -3.0
        u = t.clone()
        u[1], u[1 + d] = -3.0, 3.0
        assert torch_fingerprint(t, "sk64")[0] != torch_fingerprint(u, "sk64")[0], d
        assert ref.sk64(raw_bytes(t)) != ref.sk64(raw_bytes(u)), d


def test_recording_picks_sk64_for_cpu_tensors(fp_impl: str) -> None:
    """With the native core every CPU tensor gets sk64; the torch path keeps zlib64 below 64 KiB
    (its per-call cost would dominate there)."""
    small = torch.zeros(schema.SK64_MIN_BYTES // 4 - 1)
    large = torch.zeros(schema.SK64_MIN_BYTES // 4)
    assert torch_fingerprint(small)[2] == ("sk64" if fp_impl == "native" else "zlib64")
    assert torch_fingerprint(large)[2] == "sk64"


def test_native_nonfinite_flag_is_per_element(native_core: str) -> None:
    """The native core flags a NaN or infinite element, in every float dtype and position (also in
    the zero-padded last row and in complex numbers); finite values whose sum overflows are not."""
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        for n in (1, 63, 64, 65, 1000):
            t = torch.ones(n, dtype=dtype)
            assert not torch_fingerprint(t)[1]
            for i in {0, n // 2, n - 1}:
                for bad in (float("nan"), float("inf"), float("-inf")):
                    u = t.clone()
                    u[i] = bad
                    assert torch_fingerprint(u)[1], (dtype, n, i, bad)
    big = torch.finfo(torch.float32).max
    assert not torch_fingerprint(torch.tensor([big, big], dtype=torch.float32))[1]
    assert torch_fingerprint(torch.tensor([1 + 0j, complex(0, float("nan"))], dtype=torch.complex64))[1]
    assert not torch_fingerprint(torch.tensor([1 + 0j, 2j], dtype=torch.complex128))[1]
    assert not torch_fingerprint(torch.tensor([2**62, -1], dtype=torch.int64))[1]
    # float8 has no native rule: the torch path computes the same fingerprint
    if hasattr(torch, "float8_e5m2"):
        t = torch.ones(300).to(torch.float8_e5m2)
        assert torch_fingerprint(t)[0] == ref.fingerprint(torch_fingerprint(t)[2], raw_bytes(t))


def test_nonfinite_flag_is_the_float_sum(torch_fp: str) -> None:
    def nonfinite(t: torch.Tensor) -> bool:
        flags = {torch_fingerprint(t, algo)[1] for algo in ALGOS}
        assert len(flags) == 1
        return flags.pop()

    assert not nonfinite(torch.ones(10))
    assert nonfinite(torch.tensor([1.0, float("nan")]))
    assert nonfinite(torch.tensor([1.0, float("inf")], dtype=torch.bfloat16))
    assert nonfinite(torch.tensor([float("inf"), float("-inf")], dtype=torch.float64))
    # finite elements whose float32 sum overflows: flagged (the flag is about the sum)
    assert nonfinite(torch.tensor([3e38, 3e38], dtype=torch.float32))
    # float16 and bfloat16 are summed in float32, so 2 x 60000 does not overflow
    assert not nonfinite(torch.tensor([60000.0, 60000.0], dtype=torch.float16))
    # integers, bools and empty tensors are never non-finite
    assert not nonfinite(torch.tensor([2**62, 2**62], dtype=torch.int64))
    assert not nonfinite(torch.ones(3, dtype=torch.bool))
    assert not nonfinite(torch.empty(0))


def test_every_single_bit_flip_changes_both_fingerprints(fp_impl: str) -> None:
    data = bytearray(random_tensor((64,), torch.uint8, seed=11).numpy().tobytes())
    base = {algo: ref.fingerprint(algo, bytes(data)) for algo in ALGOS}
    for algo in ALGOS:
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        assert torch_fingerprint(t, algo)[0] == base[algo]
    for bit in range(64 * 8):
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        t = torch.frombuffer(flipped, dtype=torch.uint8).view(torch.float32)
        for algo in ALGOS:
            assert ref.fingerprint(algo, bytes(flipped)) != base[algo], (algo, bit)
            assert torch_fingerprint(t, algo)[0] != base[algo], (algo, bit)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.int64], ids=str)
def test_a_swap_of_two_unequal_elements_changes_both_fingerprints(dtype: torch.dtype, fp_impl: str) -> None:
    t = random_tensor((5000,), dtype, seed=5)
    before = {algo: torch_fingerprint(t, algo)[0] for algo in ALGOS}
    # neighbours, same word, same lin64 column one row apart, far apart, first/last
    for i, d in [
        (0, 1),
        (1, 1),
        (10, 2),
        (3, 3),
        (100, 7),
        (8, 8),
        (0, 1023),
        (5, 1024),
        (17, 1025),
        (0, 2048),
        (0, 4999),
        (1, 64),  # sk64: same row (float32: two per word, 128 per row)
        (3, 128),  # sk64: same column, next row
        (7, 512),  # sk64: same column four rows on (float32), one row on (int8)
    ]:
        u = t.clone()
        a, b = u[i].clone(), u[i + d].clone()
        if torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)):
            continue
        u[i], u[i + d] = b, a
        assert raw_bytes(u) != raw_bytes(t)
        for algo in ALGOS:
            assert torch_fingerprint(u, algo)[0] != before[algo], (algo, i, d)
            assert ref.fingerprint(algo, raw_bytes(u)) != before[algo], (algo, i, d)
