"""Signed traces: the collector signs the root's and each rank's attributes; a change anywhere
they cover, another key, a stripped signature and a partly signed trace are each told apart."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import pytest
from spool_gen import write_run

from fsdp_replay.errors import ConfigError
from fsdp_replay.sidecar.ship import Shipper, ShipStats
from fsdp_replay.trace import schema, signing
from fsdp_replay.trace.collect import Collector, collect
from fsdp_replay.trace.reader import Trace


@pytest.fixture
def key(tmp_path: Path) -> signing.SigningKey:
    path = tmp_path / "key"
    path.write_bytes(os.urandom(24).hex().encode() + b"\n")
    return signing.load_key(path)


def _signed(tmp_path: Path, key: signing.SigningKey | None) -> Path:
    spools = tmp_path / "spool"
    write_run(spools, steps=4)
    trace = tmp_path / "trace.zarr"
    collect(spools, trace, signing_key=key)
    return trace


def _edit(group: Path, change: object) -> None:
    doc = json.loads((group / "zarr.json").read_text())
    change(doc["attributes"])  # type: ignore[operator]
    (group / "zarr.json").write_text(json.dumps(doc))


def test_a_signed_trace_checks_with_its_key_only(tmp_path: Path, key: signing.SigningKey) -> None:
    trace = Trace.open(_signed(tmp_path, key))
    assert trace.signature(key) == (f"signed by key {key.key_id}: the signature matches", False)
    line, bad = trace.signature(None)
    assert not bad and "give its key" in line and key.key_id in line
    other = signing.SigningKey(b"another key, sixteen bytes+", signing.key_id(b"another key, sixteen bytes+"))
    line, bad = trace.signature(other)
    assert bad and "not by the key given" in line


@pytest.mark.parametrize(
    ("where", "change", "words", "bad_without_key"),
    [
        (
            "rank_00001",
            lambda a: a["rank_start"].update(orig_argv=["python", "-c", "x"]),
            "DOES NOT MATCH for rank 1",
            False,
        ),
        (
            "rank_00000",
            lambda a: a["arrays"]["payloads/nbytes"].update(len=1),
            "DOES NOT MATCH for rank 0",
            False,
        ),
        ("", lambda a: a[schema.ROOT_ATTR].update(ranks=[0]), "DOES NOT MATCH for the root", False),
        ("rank_00000", lambda a: a.pop("signature"), "partly signed", True),
        ("rank_00000", lambda a: a["signature"].update(alg="none"), "DOES NOT MATCH for rank 0", True),
    ],
)
def test_any_change_after_signing_is_found(
    tmp_path: Path, key: signing.SigningKey, where: str, change: object, words: str, bad_without_key: bool
) -> None:
    path = _signed(tmp_path, key)
    _edit(path / where, change)
    line, bad = Trace.open(path).signature(key)
    assert bad and words in line, line
    line, bad = Trace.open(path).signature(None)  # without the key: only what shows without it
    assert bad == bad_without_key, line


def test_an_unsigned_trace_says_so_and_a_key_refuses_it(tmp_path: Path, key: signing.SigningKey) -> None:
    trace = Trace.open(_signed(tmp_path, None))
    line, bad = trace.signature(None)
    assert not bad and line.startswith("not signed")
    line, bad = trace.signature(key)
    assert bad and "not signed, and a key was given" in line


def test_an_unsigned_collection_over_a_signed_trace_leaves_it_unsigned(
    tmp_path: Path, key: signing.SigningKey
) -> None:
    """A collection without the key rewrites the attributes: it must not leave stale signatures
    that would then not match (the trace says it is unsigned instead)."""
    path = _signed(tmp_path, key)
    collector = Collector(tmp_path / "spool", path, strict=True)
    try:
        collector.collect(final=True)
    finally:
        collector.close()
    line, bad = Trace.open(path).signature(None)
    assert not bad and line.startswith("not signed"), line


def test_key_files_are_checked(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_bytes(b"too short")
    with pytest.raises(ConfigError, match="at least 16"):
        signing.load_key(short)
    with pytest.raises(ConfigError, match="not a regular file"):
        signing.load_key(tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        signing.load_key(fifo)  # and does not block
    with pytest.raises(ConfigError, match="No such file"):
        signing.load_key(tmp_path / "missing")
    good = tmp_path / "good"
    good.write_bytes(b"0123456789abcdef\n")
    k = signing.load_key(good)
    assert k.secret == b"0123456789abcdef" and k.key_id.startswith("k-") and "0123" not in repr(k)


# -- the sidecar signs what it collects with the key its Secret mounts -------------------------
def _ship(tmp_path: Path, key_file: str) -> Path:
    write_run(tmp_path / schema.SPOOL_DIR, steps=3)
    shipper = Shipper(
        str(tmp_path),
        "",
        interval_s=0,
        keep_spools=True,
        signing_key=key_file,
        stats=ShipStats(),
        lock=threading.Lock(),
    )
    assert shipper.ship(final=True)
    return tmp_path / schema.TRACE_DIR


def test_the_sidecar_signs_with_the_mounted_key(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_bytes(os.urandom(32).hex().encode())
    trace = Trace.open(_ship(tmp_path, str(key_file)))
    line, bad = trace.signature(signing.load_key(key_file))
    assert not bad and "the signature matches" in line


def test_a_missing_key_leaves_the_trace_unsigned_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="fsdp_replay.sidecar.ship"):
        trace = Trace.open(_ship(tmp_path, str(tmp_path / "no-such-key")))
    assert trace.signature(None)[0].startswith("not signed")
    assert any("collected UNSIGNED" in r.getMessage() for r in caplog.records)
