"""Every kind of damage against every command: a clear error or a correct answer, never a lie.

For each damage (spool records and headers truncated or flipped; trace chunks and ``zarr.json``
missing, truncated or garbage; a foreign format version; a missing rank group or ``blobs/``; an
empty folder; a random file) and each command (``inspect``, ``replay``, ``nan``, ``desync``,
``diff``, ``collect``), the outcome must be one of:

- exit 3 with a message that names the damaged file or folder, or
- exit 0 with output that reports the damage (the part of the record that is whole was used),

and never a traceback, a hang, exit 2, or DIVERGED. The test prints the outcome counts.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from harness import CLI, record, run

from fsdp_replay.trace import schema

pytestmark = pytest.mark.slow
SMALL = ("--layers", "2", "--d-model", "64", "--seq-len", "32")
COMMANDS = ("inspect", "verify", "replay", "nan", "desync", "diff", "collect")
# Words with which an exit-0 answer reports the damage it worked around.
REPORTS_DAMAGE = ("DAMAGED", "damage", "complete only through", "record of rank", "INCOMPLETE", "missing")


def _seg(run_dir: Path, rank: int = 1) -> Path:
    return run_dir / schema.SPOOL_DIR / f"rank-{rank:05d}" / "seg-000000.fsrs"


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at % len(data)] ^= 0x5A
    path.write_bytes(bytes(data))


def _first_chunk(array_dir: Path) -> Path:
    return sorted((array_dir / "c").rglob("*"))[0]


def _a_blob(trace: Path) -> Path:
    return max((trace / "blobs").glob("*/*"), key=lambda p: sum(f.stat().st_size for f in p.rglob("*")))


# Each damage: (kind, what it does to a copy of the run folder, the path that names it, where:
# "spool" damage is seen by collect and then by everything reading its trace; "trace" damage by
# every reader of the trace; "path" damage replaces the trace by something else).
Damage = tuple[str, Callable[[Path], Path], str]


def _truncated_spool_record(r: Path) -> Path:
    seg = _seg(r)
    seg.write_bytes(seg.read_bytes()[: int(seg.stat().st_size * 0.6)])
    return seg


def _flipped_spool_record(r: Path) -> Path:
    seg = _seg(r)
    _flip(seg, int(seg.stat().st_size * 0.45))
    return seg


def _flipped_segment_magic(r: Path) -> Path:
    seg = _seg(r)
    _flip(seg, 2)
    return seg


def _garbage_segment_header(r: Path) -> Path:
    seg = _seg(r)
    data = bytearray(seg.read_bytes())
    data[12:24] = b"\x00\xff" * 6
    seg.write_bytes(bytes(data))
    return seg


def _foreign_spool_version(r: Path) -> Path:
    seg = _seg(r)
    data = seg.read_bytes()
    current = f'"format_version": {schema.FORMAT_VERSION}'.encode()
    assert current in data
    seg.write_bytes(data.replace(current, b'"format_version": 9', 1))
    return seg


def _missing_chunk(r: Path) -> Path:
    col = r / schema.TRACE_DIR / "rank_00001" / "steps" / "step"
    _first_chunk(col).unlink()
    return col


def _truncated_chunk(r: Path) -> Path:
    col = r / schema.TRACE_DIR / "rank_00001" / "tensors" / "fp"
    chunk = _first_chunk(col)
    chunk.write_bytes(chunk.read_bytes()[:7])
    return col


def _garbage_chunk(r: Path) -> Path:
    col = r / schema.TRACE_DIR / "rank_00001" / "collectives" / "op"
    _first_chunk(col).write_bytes(os.urandom(64))
    return col


def _missing_blob_chunk(r: Path) -> Path:
    blob = _a_blob(r / schema.TRACE_DIR)
    _first_chunk(blob).unlink()
    return blob


def _garbage_array_zarr_json(r: Path) -> Path:
    meta = r / schema.TRACE_DIR / "rank_00001" / "losses" / "value" / "zarr.json"
    meta.write_text('{"zarr_format": 3, "node_type": "array", "shape": [')
    return meta


def _truncated_root_zarr_json(r: Path) -> Path:
    meta = r / schema.TRACE_DIR / "zarr.json"
    meta.write_bytes(meta.read_bytes()[:40])
    return meta


def _doubled_shape(r: Path) -> Path:
    meta = r / schema.TRACE_DIR / "rank_00001" / "collectives" / "seq" / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["shape"] = [doc["shape"][0] * 2]
    meta.write_text(json.dumps(doc))
    return meta.parent


def _foreign_trace_version(r: Path) -> Path:
    meta = r / schema.TRACE_DIR / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["attributes"][schema.ROOT_ATTR]["format_version"] = 99
    meta.write_text(json.dumps(doc))
    return meta.parent


def _missing_rank_group(r: Path) -> Path:
    group = r / schema.TRACE_DIR / "rank_00001"
    shutil.rmtree(group)
    return group


def _missing_blobs(r: Path) -> Path:
    blobs = r / schema.TRACE_DIR / "blobs"
    shutil.rmtree(blobs)
    return blobs


def _empty_folder(r: Path) -> Path:
    trace = r / schema.TRACE_DIR
    shutil.rmtree(trace)
    trace.mkdir()
    return trace


def _random_file(r: Path) -> Path:
    trace = r / schema.TRACE_DIR
    shutil.rmtree(trace)
    trace.write_bytes(os.urandom(4096))
    return trace


# Damage to payload blobs is seen by what reads payloads: a replay, `inspect --verify`, and a
# collect (which rebuilds them from the spool); the other commands never read them.
BLOB_COMMANDS = ("replay", "verify", "collect")
DAMAGES: list[tuple[str, Callable[[Path], Path], str]] = [
    ("truncated spool record", _truncated_spool_record, "spool"),
    ("flipped spool record", _flipped_spool_record, "spool"),
    ("flipped segment magic", _flipped_segment_magic, "spool"),
    ("garbage segment header", _garbage_segment_header, "spool"),
    ("foreign spool version", _foreign_spool_version, "spool"),
    ("missing column chunk", _missing_chunk, "trace"),
    ("truncated column chunk", _truncated_chunk, "trace"),
    ("garbage column chunk", _garbage_chunk, "trace"),
    ("missing blob chunk", _missing_blob_chunk, "trace"),
    ("garbage array zarr.json", _garbage_array_zarr_json, "trace"),
    ("truncated root zarr.json", _truncated_root_zarr_json, "trace"),
    ("doubled array shape", _doubled_shape, "trace"),
    ("foreign trace version", _foreign_trace_version, "trace"),
    ("missing rank group", _missing_rank_group, "trace"),
    ("missing blobs/", _missing_blobs, "trace"),
    ("empty folder", _empty_folder, "trace"),
    ("random file", _random_file, "trace"),
]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("matrix")
    rec, _ = record(tmp, 2, "--steps", "3", *SMALL, record_args=("--keep-spool",))
    return rec


def _command(cmd: str, run_dir: Path, pristine: Path) -> list[str]:
    if cmd == "replay":
        return [*CLI, "replay", str(run_dir), "--rank", "1", "--report", str(run_dir / "rep")]
    if cmd == "diff":
        return [*CLI, "diff", str(pristine), str(run_dir)]
    if cmd == "collect":
        return [*CLI, "collect", str(run_dir), "--trace", str(run_dir / "recollected.zarr")]
    if cmd == "verify":
        return [*CLI, "inspect", "--verify", str(run_dir)]
    return [*CLI, cmd, str(run_dir)]


# The runs of one damage are sequential (in one copy of the run); damages run side by side, one
# per core (two on CI's machine): each command is one process, mostly on one core.
WORKERS = max(1, min(2, os.cpu_count() or 1))


def _damage_outcomes(
    name: str, damage: Callable[[Path], Path], where: str, pristine: Path, tmp: Path
) -> list[tuple[str, str]]:
    """(verdict, failure text or "") of each command against one damage, in its own copy."""
    run_dir = tmp / name.replace(" ", "-").replace("/", "")
    shutil.copytree(pristine, run_dir, symlinks=True)
    damaged = damage(run_dir)
    if where == "spool":  # the trace is rebuilt from the damaged spool first
        shutil.rmtree(run_dir / schema.TRACE_DIR)
        run([*CLI, "collect", str(run_dir)], check=False)
    named = {str(damaged.relative_to(run_dir)), damaged.name, str(damaged)}
    if where == "spool":
        named |= {str(run_dir / schema.TRACE_DIR)}  # e.g. "rank 1 is not in this trace"
    blob_damage = name in ("missing blob chunk", "missing blobs/")
    results = []
    for cmd in BLOB_COMMANDS if blob_damage else COMMANDS:
        proc = run(_command(cmd, run_dir, pristine), check=False, timeout=300)
        out = proc.stdout + proc.stderr
        verdict = _judge(cmd, where, proc.returncode, out, named)
        bad = (
            f"{name} / {cmd}: {verdict} (exit {proc.returncode})\n{out[-1500:]}"
            if verdict.startswith("BAD")
            else ""
        )
        results.append((verdict, bad))
    return results


def test_every_damage_against_every_command(pristine: Path, tmp_path: Path) -> None:
    outcomes: Counter[str] = Counter()
    failures: list[str] = []
    with ThreadPoolExecutor(WORKERS) as pool:
        runs = [pool.submit(_damage_outcomes, *d, pristine, tmp_path) for d in DAMAGES]
        for done in runs:
            for verdict, bad in done.result():
                outcomes[verdict] += 1
                if bad:
                    failures.append(bad)
    print(f"\n{len(DAMAGES)} kinds of damage, {sum(outcomes.values())} command runs: {dict(outcomes)}")
    assert sum(outcomes.values()) == len(DAMAGES) * len(COMMANDS) - 2 * (len(COMMANDS) - len(BLOB_COMMANDS))
    assert not failures, "\n\n".join(failures)


def _judge(cmd: str, where: str, code: int, out: str, named: set[str]) -> str:
    if "Traceback (most recent call last)" in out:
        return "BAD: traceback"
    if "DIVERGED" in out:
        return "BAD: DIVERGED"
    if code == 2:
        return "BAD: exit 2"
    if code == 3:
        return "exit 3 naming the file" if any(n in out for n in named) else "BAD: exit 3 without the file"
    if code == 0:
        if cmd == "collect" and where == "trace":
            return "exit 0: collect rebuilt from the spool"
        if any(w in out for w in REPORTS_DAMAGE):
            return "exit 0 reporting the damage"
        return "BAD: exit 0 without a word about the damage"
    return f"BAD: exit {code}"
