"""A trace is untrusted input: crafted traces run no code, read no file outside the trace, stay
within memory and time bounds, and each command says what is wrong (exit 3).

One small run is recorded (1 rank, 4 steps, snapshots every 2, signed); each test edits a copy
the way an attacker would, recomputing every digest the trace carries, so only the rules tested
stand between the crafted trace and the machine.
"""

from __future__ import annotations

import io
import json
import os
import resource
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from harness import CLI, REPO, child_env, run, torchrun_cmd

from fsdp_replay.trace import schema
from fsdp_replay.trace.schema import blob_path, digest_of

pytestmark = pytest.mark.slow

WORKLOAD = REPO / "tests" / "workloads" / "tiny_train.py"
RANK = schema.RANK_GROUP_FMT.format(rank=0)
LIMIT_S = 60  # each command answers within this, or the test fails (a hang)
MEMORY_BYTES = 1 << 30  # the analysis commands run within this address space, crafted traces too


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(run folder, signing key file) of a signed 1-rank recording with snapshots at 0 and 2."""
    tmp = tmp_path_factory.mktemp("untrusted")
    key = tmp / "signing.key"
    key.write_bytes(os.urandom(32).hex().encode())
    out = tmp / "run"
    run(
        [
            *CLI, "record", "--out", str(out), "--snapshot-every", "2", "--signing-key", str(key), "--",
            *torchrun_cmd(1, WORKLOAD, "--steps", "4"),
        ]
    )  # fmt: skip
    return out, key


def _copy(recorded: tuple[Path, Path], tmp_path: Path) -> Path:
    dest = tmp_path / "crafted"
    shutil.copytree(recorded[0], dest, symlinks=True)
    return dest / schema.TRACE_DIR


def _attrs(group: Path) -> dict[str, Any]:
    return json.loads((group / "zarr.json").read_text())["attributes"]


def _set_attrs(group: Path, change: Callable[[dict[str, Any]], None]) -> None:
    doc = json.loads((group / "zarr.json").read_text())
    change(doc["attributes"])
    (group / "zarr.json").write_text(json.dumps(doc))


def _cli(*args: str, timeout: float = LIMIT_S, bounded: bool = False) -> subprocess.CompletedProcess[str]:
    """The command line; ``bounded``: within MEMORY_BYTES of address space (not a replay: torch
    alone maps more). Its time is bounded by ``timeout``."""

    def bound() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))

    return subprocess.run(
        [*CLI, *args],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        preexec_fn=bound if bounded else None,
    )


def _refused(proc: subprocess.CompletedProcess[str], *words: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    for w in words:
        assert w in out, (w, out[-3000:])


def test_a_crafted_command_line_never_runs(recorded: tuple[Path, Path], tmp_path: Path) -> None:
    trace = _copy(recorded, tmp_path)
    marker = tmp_path / "pwned"
    cases: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
        (
            "a shell",
            lambda s: s.update(executable="/bin/sh", orig_argv=["/bin/sh", "-c", f"touch {marker}"]),
            "code given on the command line (-c)",
        ),
        (
            "python -c",
            lambda s: s.update(orig_argv=["python", "-c", f"open({str(marker)!r}, 'w')"]),
            "code given on the command line (-c)",
        ),
        (
            "no script sha256",
            lambda s: s.update(
                orig_argv=["python", str(tmp_path / "evil.py")], script={"path": None, "sha256": None}
            ),
            "does not identify",
        ),
        (
            "another script than the recorded one",
            lambda s: s.update(orig_argv=["python", str(tmp_path / "evil.py")]),
            "does not identify",
        ),
        ("an interpreter option", lambda s: s.update(orig_argv=["python", "-i", str(WORKLOAD)]), "'-i'"),
    ]
    (tmp_path / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    original = _attrs(trace / RANK)["rank_start"]
    _set_attrs(trace, lambda a: a.pop("signature"))  # a forger strips the signatures: "not signed"
    for name, change, words in cases:

        def craft(a: dict[str, Any], change: Callable[[dict[str, Any]], None] = change) -> None:
            a["rank_start"] = json.loads(json.dumps(original))
            change(a["rank_start"])
            a.pop("signature", None)

        _set_attrs(trace / RANK, craft)
        proc = _cli("replay", str(trace), "--rank", "0", "--report", str(tmp_path / f"r-{len(name)}"))
        _refused(proc, words, "--trust-trace")
        assert not marker.exists(), name
    # the replay Job renders the same check
    proc = _cli("job", str(trace), "--rank", "0", "--image", "img:1", "--namespace", "ns", "--dry-run")
    assert proc.returncode == 3 and "--trust-trace" in proc.stderr, proc.stderr[-2000:]


def _forge_blob(trace: Path, row: int, data: bytes) -> None:
    """Put ``data`` where payload ``row``'s blob was, with every digest recomputed as a forger
    would: the blob's name, the payload row, the rank's array list."""
    root = zarr.open_group(str(trace), mode="a")
    digest = digest_of(data)
    arr = root.create_array(blob_path(digest), shape=(len(data),), dtype="uint8", chunks=(len(data),))
    arr[:] = np.frombuffer(data, dtype=np.uint8)
    arr.attrs[schema.BLOB_COMPLETE_ATTR] = True
    group = root[RANK]["payloads"]
    listing = dict(root[RANK].attrs)[schema.ARRAYS_ATTR]
    for column, value in (
        ("digest_hi", int(digest[:16], 16)),
        ("digest_lo", int(digest[16:], 16)),
        ("nbytes", len(data)),
    ):
        values = np.asarray(group[column][:])
        values[row] = value
        group[column][:] = values
        listing[f"payloads/{column}"] = {"len": len(values), "blake2b": digest_of(values.tobytes())}

    def relist(a: dict[str, Any]) -> None:
        a[schema.ARRAYS_ATTR] = listing
        for snap in a["snapshots"]:
            if snap["payload"] == row:
                snap["nbytes"] = len(data)

    _set_attrs(trace / RANK, relist)


class _Boom:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_a_pickled_snapshot_never_loads_and_the_signature_finds_the_forgery(
    recorded: tuple[Path, Path], tmp_path: Path
) -> None:
    import torch

    trace = _copy(recorded, tmp_path)
    marker = tmp_path / "pwned"
    snap = next(s for s in _attrs(trace / RANK)["snapshots"] if s["step"] == 2)
    buf = io.BytesIO()
    torch.save({"format": 1, "step": 2, "optimizers": [_Boom(str(marker))], "buffers": {}}, buf)
    _forge_blob(trace, int(snap["payload"]), buf.getvalue())

    # every digest matches: an unsigned check cannot tell, and says it cannot
    verify = _cli("inspect", str(trace), "--verify")
    assert verify.returncode == 0 and "every one matches" in verify.stderr, verify.stderr[-2000:]
    assert "signed by key" in verify.stdout and "give its key" in verify.stdout, verify.stdout[-1000:]
    # the key finds it
    _refused(
        _cli("inspect", str(trace), "--verify", "--signing-key", str(recorded[1])), "DOES NOT MATCH", "rank 0"
    )
    report = tmp_path / "report"
    _refused(
        _cli(
            "replay",
            str(trace),
            "--rank",
            "0",
            "--from-step",
            "2",
            "--report",
            str(report),
            "--signing-key",
            str(recorded[1]),
        ),
        "DOES NOT MATCH",
    )
    # without the key, the pickle is refused when the snapshot is read: nothing runs
    proc = _cli("replay", str(trace), "--rank", "0", "--from-step", "2", "--report", str(tmp_path / "r2"))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3 and "a safe load refuses" in out and "--trust-trace" in out, out[-3000:]
    assert not marker.exists()


def test_the_untouched_signed_trace_replays_and_verifies(recorded: tuple[Path, Path], tmp_path: Path) -> None:
    out, key = recorded
    proc = _cli("inspect", str(out), "--verify", "--signing-key", str(key))
    assert proc.returncode == 0 and "the signature matches" in proc.stdout, (
        proc.stdout[-2000:] + proc.stderr[-2000:]
    )
    proc = _cli(
        "replay",
        str(out),
        "--rank",
        "0",
        "--from-step",
        "2",
        "--report",
        str(tmp_path / "r"),
        "--signing-key",
        str(key),
    )
    assert proc.returncode == 0 and "BIT-EXACT" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    other = tmp_path / "other.key"
    other.write_bytes(b"another key of at least sixteen bytes")
    _refused(_cli("inspect", str(out), "--signing-key", str(other)), "not by the key given")


def _snapshot_chunk(trace: Path) -> Path:
    """The first chunk of the step-2 snapshot's blob (a replay from step 2 reads it)."""
    from fsdp_replay.trace.reader import Trace

    rank = Trace.open(trace).rank(0)
    row = next(int(s["payload"]) for s in rank.attrs["snapshots"] if s["step"] == 2)
    return trace / blob_path(rank.payload_digest(row)) / "c" / "0"


def test_links_and_fifos_in_a_trace_are_never_opened(recorded: tuple[Path, Path], tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-CONTENT " * 10)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for name, plant in (
        ("a FIFO", lambda chunk: os.mkfifo(chunk)),
        ("a link to a FIFO", lambda chunk: os.symlink(fifo, chunk)),
        ("a link out of the trace", lambda chunk: os.symlink(secret, chunk)),
    ):
        trace = _copy(recorded, tmp_path)
        chunk = _snapshot_chunk(trace)
        chunk.unlink()
        plant(chunk)
        t0 = time.monotonic()
        proc = _cli("inspect", str(trace), "--verify", timeout=30, bounded=True)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 3 and "not read" in out and "TOP-SECRET" not in out, (name, out[-2000:])
        proc = _cli("replay", str(trace), "--rank", "0", "--from-step", "2", "--report", str(tmp_path / "r"))
        out = proc.stdout + proc.stderr
        assert proc.returncode == 3 and "TOP-SECRET" not in out, (name, out[-2000:])
        assert time.monotonic() - t0 < 60, name
        shutil.rmtree(trace.parent)
    # the metadata: a group's zarr.json that is a link out of the trace
    trace = _copy(recorded, tmp_path)
    (trace / RANK / "zarr.json").unlink()
    (trace / RANK / "zarr.json").symlink_to(secret)
    for command in (["inspect", str(trace)], ["nan", str(trace)], ["desync", str(trace)]):
        proc = _cli(*command, bounded=True)
        _refused(proc, "not read")
        assert "TOP-SECRET" not in proc.stdout + proc.stderr


def _wrong(value: Any) -> Any:
    """A value of another JSON type than ``value``'s."""
    if isinstance(value, dict):
        return ["a", "list"]
    if isinstance(value, list):
        return "a string"
    if isinstance(value, str):
        return {"an": "object"}
    if isinstance(value, bool) or value is None:
        return [1]
    return "a string"


def test_attributes_of_the_wrong_type_or_size_are_named(
    recorded: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every attribute of the rank group replaced by a value of another type (in this process:
    an uncaught error fails the test), and the root's counts made absurd (as commands, within
    MEMORY_BYTES): each command exits 3 naming the attribute."""
    from fsdp_replay.cli.main import main

    trace = _copy(recorded, tmp_path)
    original = _attrs(trace / RANK)
    commands = (["inspect"], ["inspect", "--verify"], ["nan", "--json"], ["desync", "--json"])
    keys = sorted(k for k in original if k not in (schema.ARRAYS_ATTR, "collector", "signature"))
    assert {"end", "snapshots", "completeness", "rank_start", "process_groups"} <= set(keys)
    for key in keys:
        _set_attrs(trace / RANK, lambda a, key=key: a.update({key: _wrong(original[key])}))
        for command in commands:
            assert main([command[0], str(trace), *command[1:]]) == 3, (key, command)
            assert f"attribute {key}" in capsys.readouterr().err, (key, command)
        _set_attrs(trace / RANK, lambda a, key=key: a.update({key: original[key]}))
    root = _attrs(trace)
    for meta in ({"world_size": 10**9}, {"ranks": [0, 0]}, {"ranks": "0"}, {"world_size": "2"}):
        _set_attrs(
            trace, lambda a, meta=meta: a.update({schema.ROOT_ATTR: {**root[schema.ROOT_ATTR], **meta}})
        )
        for command in commands if "world_size" in meta else commands[:1]:
            t0 = time.monotonic()
            _refused(_cli(command[0], str(trace), *command[1:], bounded=True), "attribute fsdp_replay")
            assert time.monotonic() - t0 < 20
    # newer than this fsdp-replay reads: said so
    _set_attrs(
        trace, lambda a: a.update({schema.ROOT_ATTR: {**root[schema.ROOT_ATTR], "format_version": 99}})
    )
    _refused(_cli("inspect", str(trace)), "newer fsdp-replay")
    # a newer fsdp-replay of the same format: read, and said
    run_meta = {**root[schema.ROOT_ATTR]["run"], "fsdp_replay": "99.0.0"}
    _set_attrs(trace, lambda a: a.update({schema.ROOT_ATTR: {**root[schema.ROOT_ATTR], "run": run_meta}}))
    capsys.readouterr()
    assert main(["inspect", str(trace)]) == 0
    assert "written by fsdp-replay 99.0.0, newer than this one" in capsys.readouterr().err
