"""Reading a local trace never leaves it, never blocks on a special file, and never sizes an
allocation from a count a ``zarr.json`` claims (the end-to-end crafted traces are in
tests/system/test_untrusted_trace.py)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import zarr

from fsdp_replay.errors import TraceFormatError
from fsdp_replay.trace import reader
from fsdp_replay.trace.store import UnsafeTraceFile, open_root


def _store(tmp_path: Path) -> Path:
    root = zarr.open_group(str(tmp_path / "t"), mode="w")
    root.create_array("a", data=np.arange(100, dtype=np.int64), chunks=(10,))
    return tmp_path / "t"


def _read(folder: Path) -> np.ndarray:
    return np.asarray(open_root(str(folder), mode="r")["a"][:])  # type: ignore[index]


def test_a_plain_folder_reads(tmp_path: Path) -> None:
    assert _read(_store(tmp_path)).tolist() == list(range(100))


@pytest.mark.parametrize("kind", ["fifo", "link-to-fifo", "link-out", "link-to-dir"])
def test_special_files_and_links_out_are_refused_unread(tmp_path: Path, kind: str) -> None:
    folder = _store(tmp_path)
    chunk = folder / "a" / "c" / "3"
    chunk.unlink()
    outside = tmp_path / "outside"
    if kind == "fifo":
        os.mkfifo(chunk)
    elif kind == "link-to-fifo":
        os.mkfifo(outside)
        chunk.symlink_to(outside)
    elif kind == "link-out":
        outside.write_bytes(b"SECRET" * 100)
        chunk.symlink_to(outside)
    else:
        outside.mkdir()
        (folder / "a" / "c").rename(tmp_path / "c-moved")
        (folder / "a" / "c").symlink_to(tmp_path / "c-moved")  # a folder link out of the trace
    result: list[BaseException | None] = []

    def read() -> None:
        try:
            _read(folder)
            result.append(None)
        except BaseException as e:
            result.append(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(10)
    assert result, "the read blocked"
    assert isinstance(result[0], UnsafeTraceFile), result
    assert "SECRET" not in str(result[0])


def test_a_link_inside_the_trace_is_read(tmp_path: Path) -> None:
    folder = _store(tmp_path)
    chunk = folder / "a" / "c" / "3"
    (folder / "a" / "copy").write_bytes(chunk.read_bytes())
    chunk.unlink()
    chunk.symlink_to(folder / "a" / "copy")
    assert _read(folder).tolist() == list(range(100))  # a link that stays inside: harmless


def test_a_claimed_shape_does_not_size_an_allocation(tmp_path: Path) -> None:
    folder = _store(tmp_path)
    meta = folder / "a" / "zarr.json"
    doc = json.loads(meta.read_text())
    doc["shape"] = [10**12]
    meta.write_text(json.dumps(doc))
    arr = open_root(str(folder), mode="r")["a"]
    with pytest.raises(TraceFormatError, match="more than a trace holds"):
        reader._read_array(arr, "a")  # type: ignore[arg-type]
    doc["shape"], doc["chunk_grid"]["configuration"]["chunk_shape"] = [40 << 20], [1 << 20]
    meta.write_text(json.dumps(doc))
    arr = open_root(str(folder), mode="r")["a"]
    with pytest.raises(TraceFormatError, match="in 40 chunks, of which 10 are there"):
        reader._read_array(arr, "a")  # type: ignore[arg-type]
