"""The collector and reader: hand-written spools in, Zarr trace out, read back with clear errors.

The spools are written with ``SpoolWriter`` in the shapes the recorder uses (see
``fsdp_replay/agent/recorder.py``), for two ranks that share some payload bytes; no torch run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

from fsdp_replay.errors import TraceFormatError, TraceNotFoundError, TraceVersionError
from fsdp_replay.trace import schema, spool
from fsdp_replay.trace.collect import CollectReport, collect
from fsdp_replay.trace.fingerprint import fingerprint
from fsdp_replay.trace.rank_builder import UnknownEventError
from fsdp_replay.trace.reader import Trace
from fsdp_replay.trace.schema import blob_path, digest_of

NUMPY_DTYPES = {"float32": np.float32, "int64": np.int64, "bfloat16": np.uint16, "int32": np.int32}


@dataclass
class Tensor:
    role: str
    dtype: str
    data: np.ndarray  # for bfloat16: the raw uint16 words
    algo: str = "zlib64"
    device: str = "cpu"
    stored: bool = True
    blob: int = schema.NO_BLOB

    @property
    def raw(self) -> bytes:
        return np.ascontiguousarray(self.data).tobytes()

    @property
    def fp(self) -> int:
        return fingerprint(self.algo, self.raw)

    @property
    def nonfinite(self) -> bool:
        return self.data.dtype.kind == "f" and not np.isfinite(self.data.sum())

    def entry(self) -> list[Any]:
        return [
            self.role,
            self.dtype,
            list(self.data.shape),
            self.fp,
            self.algo,
            self.nonfinite,
            self.blob,
            self.device,
        ]


@dataclass
class RankSpool:
    """Writes one rank's spool like the agent does, and remembers what it wrote."""

    folder: Path
    rank: int
    colls: list[dict[str, Any]] = field(default_factory=list)
    coll_tensors: list[list[Tensor]] = field(default_factory=list)
    batch_tensors: list[list[Tensor]] = field(default_factory=list)
    blobs: dict[int, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.w = spool.SpoolWriter(self.folder, self.rank)

    def blob(self, raw: bytes) -> int:
        blob_id = len(self.blobs)
        self.w.append(schema.KIND_BLOB, {"blob": blob_id, "nbytes": len(raw)}, raw)
        self.blobs[blob_id] = raw
        return blob_id

    def event(self, ev: dict[str, Any]) -> None:
        self.w.append(schema.KIND_EVENT, ev)

    def tensors(self, ts: list[Tensor]) -> list[list[Any]]:
        for t in ts:
            if t.stored:
                t.blob = self.blob(t.raw)
        return [t.entry() for t in ts]

    def coll(self, op: str, ts: list[Tensor], **kw: Any) -> None:
        ev = {
            "type": "coll",
            "seq": len(self.colls),
            "step": 0,
            "micro": 0,
            "op": op,
            "pg": 0,
            "reduce_op": None,
            "root": None,
            "t_ns": 1000 * len(self.colls),
            "dur_ns": 10 + len(self.colls),
            **kw,
        }
        ev["tensors"] = self.tensors(ts)
        self.colls.append(ev)
        self.coll_tensors.append(ts)
        self.event(ev)


SHARED_PARAM = np.arange(64, dtype=np.float32) / 7  # an all-gather output: the same on every rank
SHARED_GRAD = np.linspace(-1, 1, 16, dtype=np.float32)  # an all-reduce output: the same too
SNAPSHOT_STEP0 = b"PK\x03\x04 a torch.save archive " * 50


def write_rank(
    root: Path, rank: int, world: int = 2, after_step: tuple[dict[str, Any], ...] = ()
) -> RankSpool:
    rs = RankSpool(spool.rank_dir(root, rank), rank)
    g = np.random.default_rng(rank)
    rs.event(
        {
            "type": "rank_start",
            "format_version": 1,
            "rank": rank,
            "world_size": world,
            "local_rank": rank,
            "pid": 1000 + rank,
            "host": "node0",
            "argv": ["train.py", "--steps", "1"],
            "orig_argv": ["python", "train.py", "--steps", "1"],
            "executable": "/usr/bin/python",
            "cwd": "/work",
            "env": {"WORLD_SIZE": str(world), "RANK": str(rank)},
            "versions": {"python": "3.11.7", "torch": "2.13.0+cpu"},
            "threads": {"intra_op": 1, "inter_op": 1},
            "determinism": {"use_deterministic_algorithms": False},
            "policy": {"payloads": "all", "payload_inputs": False, "snapshot_every": 0, "sync_steps": True},
            "start_ns": 1_700_000_000_000_000_000,
            "fingerprint_algos": {"cpu": "zlib64", "cuda": "lin64"},
            "script": {"path": "/work/train.py", "sha256": "ab" * 32},
        }
    )
    rng0 = json.dumps({"python": [3, [rank, 1, 2], None], "torch": "AAAA"}).encode()
    rs.event({"type": "rng", "step": -1, "states": {"python": 11, "torch": 22 + rank, "blob": rs.blob(rng0)}})
    rs.event(
        {
            "type": "pg",
            "pg": 0,
            "name": "0",
            "ranks": list(range(world)),
            "backend": "gloo",
            "size": world,
            "group_rank": rank,
        }
    )
    snap = SNAPSHOT_STEP0 + bytes([rank])
    rs.event(
        {
            "type": "snapshot",
            "step": 0,
            "blob": rs.blob(snap),
            "nbytes": len(snap),
            "params": [["w", "float32", [32], 123, "zlib64", False]],
        }
    )
    tokens = g.integers(0, 100, (2, 8), dtype=np.int64)
    batch = [Tensor("", "int64", tokens), Tensor("", "int64", np.roll(tokens, 1, axis=1))]
    rs.event(
        {
            "type": "batch",
            "step": 0,
            "micro": 0,
            "index": 0,
            "loader": 0,
            "structure": {"l": [{"T": 0}, {"T": 1}]},
            "tensors": rs.tensors(batch),
        }
    )
    rs.batch_tensors.append(batch)
    shard = SHARED_PARAM[rank * 32 : (rank + 1) * 32]
    rs.coll(
        "_allgather_base_",
        [Tensor("i", "float32", shard, stored=False), Tensor("o", "float32", SHARED_PARAM)],
    )
    grad = g.standard_normal(16).astype(np.float32)
    rs.coll(
        "allreduce_",
        [
            Tensor("i", "float32", grad, stored=False),
            Tensor("o", "float32", SHARED_GRAD, algo="lin64", device="cuda"),
        ],
        reduce_op="SUM",
        pg=0,
    )
    # the same all-gather again (backward): the agent would alias it; here it is a second blob
    rs.coll(
        "_allgather_base_",
        [Tensor("i", "float32", shard, stored=False), Tensor("o", "float32", SHARED_PARAM)],
    )
    bf16 = (np.arange(6, dtype=np.uint16) + 0x3F80).reshape(2, 3)
    rs.coll("broadcast_", [Tensor("o", "bfloat16", bf16, algo="lin64")], root=0, extra={"root_rank": 0})
    rs.coll("barrier", [], micro=1)
    rs.event(
        {
            "type": "step",
            "step": 0,
            "micro_steps": 2,
            "colls": len(rs.colls),
            "params": [[5, False, "zlib64"], [6, rank == 1, "lin64"]],
            "loss": [2.5, 2.25 if rank == 0 else float("nan")],
            "t_ns": 99_000,
        }
    )
    for ev in after_step:
        rs.event(ev)
    rng1 = json.dumps({"python": [3, [rank, 9], None], "torch": "BBBB"}).encode()
    rs.event(
        {"type": "rng", "step": 1, "states": {"python": 12, "torch": 23, "numpy": 7, "blob": rs.blob(rng1)}}
    )
    rs.event({"type": "modules", "modules": [{"name": "model", "path": "/work/model.py", "sha256": None}]})
    rs.event(
        {
            "type": "end",
            "reason": "exit",
            "steps": 1,
            "colls": len(rs.colls),
            "t_ns": 100_000,
            "counters": {"events": 12},
            "inflight": None,
        }
    )
    rs.w.close()
    return rs


Built = tuple[Path, CollectReport, list[RankSpool]]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Built]:
    """Spools of two ranks and their trace, built once: tests copy what they change."""
    root = tmp_path_factory.mktemp("built") / schema.SPOOL_DIR
    ranks = [write_rank(root, r) for r in range(2)]
    out = root.parent / schema.TRACE_DIR
    report = collect(root, out, run={"command": ["torchrun", "train.py"], "exit_code": 0})
    return root, (out, report, ranks)


@pytest.fixture
def trace(built: tuple[Path, Built]) -> Built:
    """The shared trace: read it, never change it (use ``trace_copy`` for that)."""
    return built[1]


@pytest.fixture
def trace_copy(built: tuple[Path, Built], tmp_path: Path) -> Built:
    out, report, ranks = built[1]
    copy = tmp_path / schema.TRACE_DIR
    shutil.copytree(out, copy)
    return copy, report, ranks


@pytest.fixture
def spools(built: tuple[Path, Built], tmp_path: Path) -> tuple[Path, list[RankSpool]]:
    """A private copy of the spools (under tmp_path/run/spool), to damage."""
    root = tmp_path / "run" / schema.SPOOL_DIR
    shutil.copytree(built[0], root)
    return root, built[1][2]


def blob_arrays(trace_path: Path) -> dict[str, int]:
    """digest -> nbytes of every array under blobs/, read with plain zarr."""
    root = zarr.open_group(str(trace_path), mode="r")
    out = {}
    for prefix, group in root[schema.BLOBS_GROUP].groups():  # type: ignore[union-attr]
        for digest, arr in group.arrays():
            assert digest[:2] == prefix
            out[digest] = arr.shape[0]
    return out


# -- a good trace -----------------------------------------------------------------------------
def test_root_and_rank_attributes(trace: Built) -> None:
    out, report, _ = trace
    t = Trace.open(out)
    assert t.meta["format_version"] == schema.FORMAT_VERSION and t.meta["kind"] == "trace"
    assert t.ranks == [0, 1] and t.world_size == 2
    assert t.meta["run"] == {"command": ["torchrun", "train.py"], "exit_code": 0}
    assert not report.damaged and all(r.clean_end for r in report.ranks)
    for rank in (0, 1):
        a = t.rank(rank).attrs
        assert a["rank"] == rank and a["attempts"] == 1
        assert a["rank_start"]["type"] == "rank_start" and a["rank_start"]["pid"] == 1000 + rank
        assert a["process_groups"] == [
            {"pg": 0, "name": "0", "ranks": [0, 1], "backend": "gloo", "size": 2, "group_rank": rank}
        ]
        assert a["modules"] == [{"name": "model", "path": "/work/model.py", "sha256": None}]
        assert a["end"] == {
            "reason": "exit",
            "steps": 1,
            "colls": 5,
            "t_ns": 100_000,
            "counters": {"events": 12},
            "inflight": None,
        }
        assert a["structures"] == [{"l": [{"T": 0}, {"T": 1}]}]
        assert a["agent_errors"] == [] and a["drops"] == []
        assert a["damage"] == [] and a["payload_missing"] == 0
        assert a["op_names"] == ["_allgather_base_", "allreduce_", "broadcast_", "barrier"]
        assert a["reduce_op_names"] == ["SUM"]
        assert a["dtype_names"] == ["int64", "float32", "bfloat16"]
        assert a["algo_names"] == ["zlib64", "lin64"]
        assert a["device_names"] == ["cpu", "cuda"]
        (snap,) = a["snapshots"]
        assert snap["step"] == 0 and snap["params"] == [["w", "float32", [32], 123, "zlib64", False]]
        data = t.rank(rank).payload(snap["payload"])
        assert data == SNAPSHOT_STEP0 + bytes([rank]) and snap["nbytes"] == len(data)


def test_collective_and_tensor_tables(trace: Built) -> None:
    out, _, ranks = trace
    t = Trace.open(out)
    for rs in ranks:
        r = t.rank(rs.rank)
        c, ts = r.collectives, r.tensors
        ops, reduce_ops = r.names("op"), r.names("reduce_op")
        assert len(c) == len(rs.colls) == 5
        assert c["seq"].tolist() == [0, 1, 2, 3, 4]
        assert [ops[i] for i in c["op"]] == [ev["op"] for ev in rs.colls]
        assert [reduce_ops[i] if i >= 0 else None for i in c["reduce_op"]] == [None, "SUM", None, None, None]
        assert c["root"].tolist() == [-1, -1, -1, 0, -1]
        assert c["micro"].tolist() == [0, 0, 0, 0, 1]
        assert c["t_ns"].tolist() == [ev["t_ns"] for ev in rs.colls]
        assert c["dur_ns"].tolist() == [ev["dur_ns"] for ev in rs.colls]
        assert c["tensor_count"].tolist() == [2, 2, 2, 1, 0]
        assert c["tensor_start"].tolist() == [0, 2, 4, 6, 7]
        assert len(ts) == 7
        dtypes, algos, devices = r.names("dtype"), r.names("algo"), r.names("device")
        for row, ev in enumerate(rs.colls):
            start = int(c["tensor_start"][row])
            for k, want in enumerate(rs.coll_tensors[row]):
                i = start + k
                assert ts["coll"][i] == row
                assert ts["role"][i] == {"i": 0, "o": 1}[want.role]
                assert dtypes[ts["dtype"][i]] == want.dtype
                assert r.shape(int(ts["shape_start"][i]), int(ts["ndim"][i])) == want.data.shape
                assert ts["nbytes"][i] == want.data.nbytes
                assert int(ts["fp"][i]) == want.fp and algos[ts["algo"][i]] == want.algo
                assert devices[ts["device"][i]] == want.device
                assert bool(ts["nonfinite"][i]) is want.nonfinite
                assert bool(ts["payload"][i] >= 0) is want.stored, (ev["op"], k)


def test_batch_step_rng_tables(trace: Built) -> None:
    out, _, ranks = trace
    t = Trace.open(out)
    for rs in ranks:
        r = t.rank(rs.rank)
        b, bt = r.batches, r.batch_tensors
        assert [b[k].tolist() for k in ("step", "micro", "index", "loader", "structure")] == [[0]] * 5
        assert b["tensor_start"].tolist() == [0] and b["tensor_count"].tolist() == [2]
        assert bt["batch"].tolist() == [0, 0]
        for i, want in enumerate(rs.batch_tensors[0]):
            assert r.shape(int(bt["shape_start"][i]), int(bt["ndim"][i])) == (2, 8)
            assert int(bt["fp"][i]) == want.fp and bt["nbytes"][i] == 128
            got = np.frombuffer(r.payload(int(bt["payload"][i])), dtype=np.int64).reshape(2, 8)
            assert np.array_equal(got, want.data)
        s = r.steps
        assert s["step"].tolist() == [0] and s["micro_steps"].tolist() == [2] and s["colls"].tolist() == [5]
        assert s["param_start"].tolist() == [0] and s["param_count"].tolist() == [2]
        assert s["loss_start"].tolist() == [0] and s["loss_count"].tolist() == [2]
        # rank 1: a non-finite parameter and a NaN loss
        assert s["nonfinite"].tolist() == [rs.rank == 1]
        p = r.table("step_params")
        assert p["fp"].tolist() == [5, 6] and p["nonfinite"].tolist() == [False, rs.rank == 1]
        assert [r.names("algo")[a] for a in p["algo"]] == ["zlib64", "lin64"]
        losses = r.table("losses")["value"]
        assert losses[0] == 2.5 and (losses[1] == 2.25 if rs.rank == 0 else np.isnan(losses[1]))
        rng = r.table("rng")
        assert rng["step"].tolist() == [-1, 1]
        assert rng["python"].tolist() == [11, 12] and rng["torch"].tolist() == [22 + rs.rank, 23]
        assert rng["numpy"].tolist() == [-1, 7]  # -1: numpy was not imported
        doc = json.loads(r.payload(int(rng["payload"][0])))
        assert doc["python"][1][0] == rs.rank


def test_identical_payloads_are_stored_once(trace: Built) -> None:
    out, report, ranks = trace
    distinct = {raw for rs in ranks for raw in rs.blobs.values()}
    assert len(distinct) < sum(len(rs.blobs) for rs in ranks)  # the fixture does repeat bytes
    arrays = blob_arrays(out)
    assert arrays == {digest_of(raw): len(raw) for raw in distinct}
    assert sum(r.blobs_written for r in report.ranks) == len(distinct)
    # rank 1 finds SHARED_PARAM, SHARED_GRAD and the bf16 broadcast already written by rank 0
    assert report.ranks[1].blobs_shared == 3
    t = Trace.open(out)
    for rs in ranks:
        p = t.rank(rs.rank).payloads
        per_rank = set(rs.blobs.values())
        assert len(p) == len(per_rank)  # one row per distinct digest, even for two blob ids
        digests = {t.rank(rs.rank).payload_digest(i) for i in range(len(p))}
        assert digests == {digest_of(raw) for raw in per_rank}
        assert p["nbytes"].tolist() == [len(t.rank(rs.rank).payload(i)) for i in range(len(p))]
    # both all-gathers of a rank point at the same payload row
    for rs in ranks:
        ts = t.rank(rs.rank).tensors
        assert ts["payload"][1] == ts["payload"][5] >= 0


def test_payloads_round_trip_and_verify(trace: Built) -> None:
    out, _, ranks = trace
    t = Trace.open(out)
    for rs in ranks:
        r = t.rank(rs.rank)
        ts = r.tensors
        algos, dtypes = r.names("algo"), r.names("dtype")
        for i in range(len(ts)):
            row = int(ts["payload"][i])
            if row < 0:
                with pytest.raises(TraceNotFoundError, match="no payload stored"):
                    r.payload(row)
                continue
            algo, fp = algos[ts["algo"][i]], int(ts["fp"][i])
            data = r.payload(row, verify=(algo, fp))
            shape = r.shape(int(ts["shape_start"][i]), int(ts["ndim"][i]))
            arr = np.frombuffer(data, dtype=NUMPY_DTYPES[dtypes[ts["dtype"][i]]]).reshape(shape)
            want = rs.coll_tensors[int(ts["coll"][i])][i - int(r.collectives["tensor_start"][ts["coll"][i]])]
            assert np.array_equal(arr, want.data)
            with pytest.raises(TraceFormatError, match="do not match their fingerprint"):
                r.payload(row, verify=(algo, fp ^ 1))


def test_collect_twice_is_idempotent(built: tuple[Path, Built], trace_copy: Built) -> None:
    out, _, _ = trace_copy
    before = blob_arrays(out)
    seq_before = Trace.open(out).rank(0).collectives["seq"].tolist()
    again = collect(built[0], out)
    assert sum(r.blobs_written for r in again.ranks) == 0
    assert blob_arrays(out) == before
    t = Trace.open(out)
    assert t.rank(0).collectives["seq"].tolist() == seq_before
    assert t.meta["run"]["exit_code"] == 0  # kept from the first collect


# -- damaged spools ---------------------------------------------------------------------------
def _record_offset(folder: Path, match: Any) -> tuple[Path, int, int]:
    """(segment, offset, end) of the first record for which match(record) is true."""
    (seg,) = spool.segments(folder)
    records = list(spool.read_segment(seg))
    for k, rec in enumerate(records):
        if match(rec):
            end = records[k + 1].offset if k + 1 < len(records) else seg.stat().st_size
            return seg, rec.offset, end
    raise AssertionError("no such record")


def _flip(path: Path, pos: int) -> None:
    data = bytearray(path.read_bytes())
    data[pos] ^= 0xFF
    path.write_bytes(bytes(data))


def test_damaged_event_record_loses_only_itself(spools: tuple[Path, list[RankSpool]]) -> None:
    root, _ = spools
    seg, start, end = _record_offset(
        root / "rank-00001", lambda r: r.kind == schema.KIND_EVENT and r.obj.get("seq") == 1
    )
    _flip(seg, (start + end) // 2)
    out = root.parent / schema.TRACE_DIR
    report = collect(root, out)
    assert report.damaged
    assert report.ranks[0].damage == []
    (dmg,) = report.ranks[1].damage
    assert str(seg) in dmg and f"at byte {start}" in dmg and "checksum mismatch" in dmg
    t = Trace.open(out)
    assert t.rank(0).collectives["seq"].tolist() == [0, 1, 2, 3, 4]
    r1 = t.rank(1)
    assert r1.collectives["seq"].tolist() == [0, 2, 3, 4]
    assert r1.attrs["damage"] == [dmg]
    assert r1.attrs["end"]["reason"] == "exit" and len(r1.steps) == 1
    with pytest.raises(TraceFormatError, match="checksum mismatch") as e:
        collect(root, out, strict=True)
    assert str(seg) in str(e.value)


def test_damaged_blob_record_is_a_missing_payload(spools: tuple[Path, list[RankSpool]]) -> None:
    root, ranks = spools
    batch_blob = ranks[0].batch_tensors[0][0].blob
    seg, _, end = _record_offset(
        root / "rank-00000", lambda r: r.kind == schema.KIND_BLOB and r.obj["blob"] == batch_blob
    )
    _flip(seg, end - 1)
    out = root.parent / schema.TRACE_DIR
    report = collect(root, out)
    assert report.ranks[0].payload_missing == 1 and len(report.ranks[0].damage) == 1
    r0 = Trace.open(out).rank(0)
    assert r0.attrs["payload_missing"] == 1
    assert r0.batch_tensors["payload"][0] == -1 and r0.batch_tensors["payload"][1] >= 0
    assert len(r0.collectives) == 5


def test_event_missing_a_required_key_is_named(tmp_path: Path) -> None:
    root = tmp_path / schema.SPOOL_DIR
    w = spool.SpoolWriter(spool.rank_dir(root, 0), 0)
    w.append(schema.KIND_EVENT, {"type": "coll", "step": 0, "op": "barrier", "tensors": []})
    w.close()
    try:
        report = collect(root, tmp_path / schema.TRACE_DIR)
    except TraceFormatError as e:
        assert str(w.segment_path) in str(e) and "seq" in str(e)
    else:
        assert report.damaged and str(w.segment_path) in report.ranks[0].damage[0]


def test_an_event_type_from_a_newer_agent_is_counted_and_ends_the_complete_record_there(
    tmp_path: Path,
) -> None:
    """Not damage: the collector keeps reading, counts the unknown type, and the record is complete
    only up to the step before it (what the event said is not known); inspect says which version
    wrote it and what to do. ``strict`` refuses it."""
    root = tmp_path / schema.SPOOL_DIR
    write_rank(root, 0, world=1, after_step=({"type": "from_the_future", "step": 0, "t_ns": 99_500},))
    out = tmp_path / schema.TRACE_DIR
    report = collect(root, out)
    assert report.ranks[0].damage == []
    r0 = Trace.open(out).rank(0)
    assert r0.attrs["unread_events"] == {"from_the_future": 1}
    assert r0.attrs["damage"] == []
    assert r0.attrs["end"]["reason"] == "exit" and len(r0.steps) == 1  # the rest was read
    completeness = r0.attrs[schema.COMPLETENESS_ATTR]
    assert not completeness["complete"] and completeness["through_step"] == 0, completeness
    assert any("'from_the_future' that this fsdp-replay" in r for r in completeness["reasons"]), completeness
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_replay", "inspect", str(tmp_path), "--json"],
        capture_output=True,
        text=True,
    )
    found = [f for f in json.loads(proc.stdout)["findings"] if f["kind"] == "unread_events"]
    assert len(found) == 1 and "from_the_future (1)" in found[0]["message"], found
    with pytest.raises(UnknownEventError, match="from_the_future"):
        collect(root, tmp_path / "strict.zarr", strict=True)


def test_no_spools_is_a_format_error(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="no rank spools found"):
        collect(tmp_path / "spool", tmp_path / "trace.zarr")


# -- damaged traces ---------------------------------------------------------------------------
def _garble(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 3, len(data) // 3 + 8):
        data[i % len(data)] ^= 0xA5
    path.write_bytes(bytes(data))


def test_corrupt_column_chunk_names_the_array(trace_copy: Built) -> None:
    out, _, _ = trace_copy
    _garble(out / "rank_00000" / "collectives" / "seq" / "c" / "0")
    r = Trace.open(out).rank(0)
    assert r.collectives["op"].tolist() == [0, 1, 0, 2, 3]  # other columns still read
    with pytest.raises(TraceFormatError) as e:
        r.collectives["seq"]
    msg = str(e.value)
    assert "rank_00000/collectives/seq" in msg and "chunk c/0" in msg
    assert e.value.__cause__ is None and e.value.__suppress_context__


def test_corrupt_blob_chunk_names_the_blob(trace_copy: Built) -> None:
    out, _, _ = trace_copy
    r = Trace.open(out).rank(0)
    row = int(r.tensors["payload"][1])
    digest = r.payload_digest(row)
    _garble(out / blob_path(digest) / "c" / "0")
    with pytest.raises(TraceFormatError) as e:
        r.payload(row)
    assert f"blobs/{digest[:2]}/{digest}" in str(e.value) and "chunk c/0" in str(e.value)


def test_missing_blob_is_not_found(trace_copy: Built) -> None:
    out, _, _ = trace_copy
    r = Trace.open(out).rank(0)
    row = int(r.tensors["payload"][1])
    shutil.rmtree(out / blob_path(r.payload_digest(row)))
    with pytest.raises(TraceNotFoundError, match="payload blob missing"):
        r.payload(row)


def test_open_missing_path(tmp_path: Path) -> None:
    with pytest.raises(TraceNotFoundError, match="no such trace"):
        Trace.open(tmp_path / "nope")


def test_open_zarr_group_that_is_not_a_trace(tmp_path: Path) -> None:
    zarr.open_group(str(tmp_path / "g"), mode="w").attrs["something"] = 1
    with pytest.raises(TraceFormatError, match="not an fsdp-replay trace"):
        Trace.open(tmp_path / "g")
    zarr.open_group(str(tmp_path / "h"), mode="w").attrs[schema.ROOT_ATTR] = {"kind": "spool"}
    with pytest.raises(TraceFormatError, match="not an fsdp-replay trace"):
        Trace.open(tmp_path / "h")


def test_open_folder_that_is_not_zarr(spools: tuple[Path, list[RankSpool]]) -> None:
    root, _ = spools
    with pytest.raises(TraceFormatError) as e:
        Trace.open(root)  # a spool folder, not a trace
    assert not isinstance(e.value, TraceNotFoundError)


def _set_version(out: Path, version: Any) -> None:
    g = zarr.open_group(str(out), mode="r+")
    meta = dict(g.attrs[schema.ROOT_ATTR])  # type: ignore[arg-type]
    meta["format_version"] = version
    g.attrs[schema.ROOT_ATTR] = meta


def test_open_newer_version(trace_copy: Built) -> None:
    out, _, _ = trace_copy
    _set_version(out, 99)
    with pytest.raises(TraceVersionError, match="version 99") as e:
        Trace.open(out)
    assert str(out) in str(e.value) and isinstance(e.value, TraceFormatError)


def test_unknown_rank_is_not_found(trace: Built) -> None:
    out, _, _ = trace
    with pytest.raises(TraceNotFoundError, match=r"rank 7 is not in this trace \(ranks: \[0, 1\]\)"):
        Trace.open(out).rank(7)


# -- the CLI on bad traces --------------------------------------------------------------------
def _inspect(path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_REPLAY_")}
    return subprocess.run(
        [sys.executable, "-m", "fsdp_replay", "inspect", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_cli_inspect_bad_traces_exit_3(trace_copy: Built, tmp_path: Path) -> None:
    out, _, _ = trace_copy
    broken = tmp_path / "broken.zarr"
    shutil.copytree(out, broken)
    _garble(broken / "rank_00000" / "collectives" / "op" / "c" / "0")  # a column inspect reads
    _set_version(out, 99)
    cases = {out: "version 99", broken: "collectives/op", tmp_path / "missing": "no such trace"}
    for path, what in cases.items():
        proc = _inspect(path)
        assert proc.returncode == 3, (path, proc.stdout, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr
        assert lines[0].startswith("fsdp-replay: unusable trace: ") and what in lines[0]
        assert "Traceback" not in proc.stderr + proc.stdout


def test_cli_inspect_piped_keeps_every_column(trace: Built) -> None:
    out, _, _ = trace
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS",) and not k.startswith("FSDP_REPLAY_")}
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_replay", "inspect", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    header = next(line for line in proc.stdout.splitlines() if "rank" in line and "steps" in line)
    for column in ("collectives", "batches", "snapshots", "payloads (outputs)", "payload steps", "end"):
        assert column in header, header  # piped into a file: not cut to 80 columns
    cells = [line for line in proc.stdout.splitlines() if line.startswith(("│", "┃"))]
    assert cells and not any("…" in line for line in cells), cells
