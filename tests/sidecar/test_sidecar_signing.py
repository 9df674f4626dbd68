"""The sidecar signs the traces it collects with the key its Secret mounts; without a readable key
it still collects, unsigned, and says so in its log."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import pytest

from fsdp_replay.sidecar.ship import Shipper, ShipStats
from fsdp_replay.trace import schema, signing
from fsdp_replay.trace.reader import Trace
from tests.trace.spool_gen import write_run


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
