"""The worked example in docs/trace-format.md runs as written against a fresh trace: the spec is
enough to read a trace with plain zarr and numpy, and to check a payload against its digest and
its fingerprint."""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

import pytest
from harness import REPO, record


@pytest.mark.slow
def test_the_trace_format_example_runs_as_written(tmp_path: Path) -> None:
    doc = (REPO / "docs" / "trace-format.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
    example = next(b for b in blocks if 'zarr.open_group("fmtrun/trace.zarr"' in b)
    rec, _ = record(tmp_path, 2, "--steps", "4", record_args=("--snapshot-every", "2"), name="fmtrun")
    out = io.StringIO()
    cwd = os.getcwd()
    os.chdir(rec.parent)
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(example, "docs/trace-format.md", "exec"), {})
    finally:
        os.chdir(cwd)
    lines = out.getvalue().splitlines()
    assert re.match(r"^0 _allgather_base_ \['(zlib64|sk64):[0-9a-f]{16}'\]$", lines[0]), lines
    assert lines[-1] in ("zlib64 fingerprint ok", "sk64 fingerprint ok"), lines
