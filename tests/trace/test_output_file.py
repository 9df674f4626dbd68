"""Files the commands write beside a trace (``export -o``, ``diff --plot``): checked before any work
(``trace/layout.output_file``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_replay.errors import ConfigError
from fsdp_replay.trace.layout import output_file
from fsdp_replay.trace.schema import TRACE_DIR


def test_an_output_file_is_never_a_folder_or_inside_a_trace_and_its_folder_is_made(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / TRACE_DIR / "rank_00000").mkdir(parents=True)
    for path, said in (
        (run / TRACE_DIR / "t.json", "is inside the trace"),
        (run / TRACE_DIR / "rank_00000" / "t.json", "is inside the trace"),
        (run / TRACE_DIR, "is a folder"),
        (tmp_path, "is a folder"),
        (tmp_path / "t.txt", "must end in .json or .json.gz"),
    ):
        with pytest.raises(ConfigError, match=said):
            output_file(str(path), "-o", (str(run),), (".json", ".json.gz"))
    # the trace named by its run folder or by itself; beside it is fine, and a new folder is made
    with pytest.raises(ConfigError, match="inside the trace"):
        output_file(str(run / TRACE_DIR / "x.png"), "--plot", (str(tmp_path / "other"), str(run / TRACE_DIR)))
    made = output_file(
        str(tmp_path / "new" / "deeper" / "t.json.gz"), "-o", (str(run),), (".json", ".json.gz")
    )
    assert made.parent.is_dir() and not made.exists()
    assert output_file(str(run / "d.png"), "--plot", (str(run), "s3://bucket/run")) == run / "d.png"
    assert not (run / TRACE_DIR / "t.json").exists()
