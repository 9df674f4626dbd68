"""How a recorded rank's uncaught exception is kept (``agent/recorder.py``) and shown
(``trace/completeness.exception_text``): one line, the original error of a DataLoader worker's
re-raised one included."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from fsdp_replay.agent.recorder import _uncaught_exception
from fsdp_replay.replayer.serve import BatchServer
from fsdp_replay.trace.completeness import exception_text

WORKER = (
    "Caught OSError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
    + '  File "/opt/venv/torch/utils/data/_utils/worker.py", line 374, in _worker_loop\n'
    "    data = fetcher.fetch(index)\n" * 8 + "OSError: corrupt sample 77\n"
)


@pytest.mark.parametrize(
    ("recorded", "shown"),
    [
        ("ValueError('boom at step 5')", "ValueError: boom at step 5"),
        ("KeyboardInterrupt()", "KeyboardInterrupt"),
        ('RuntimeError("it\'s \\"quoted\\"")', 'RuntimeError: it\'s "quoted"'),
        ("torch.OutOfMemoryError('CUDA out of memory.')", "torch.OutOfMemoryError: CUDA out of memory."),
        ("Traceback (most recent call last):\n  ...\nRuntimeError: boom\n", "RuntimeError: boom"),
        (
            "DistBackendError('NCCL error in: ProcessGroupNCCL.cpp:1, unhandled system error\\nLast error:\\n"
            "remote process exited or there was a network error')",
            "DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1, unhandled system error / Last error: / "
            "remote process exited or there was a network error",
        ),
        # an older agent's 500 characters, cut inside the message: its first line
        (
            "OSError('Caught OSError in DataLoader worker process 0.\\nOriginal Traceback (most",
            "OSError: Caught OSError in DataLoader worker process 0.",
        ),
    ],
)
def test_a_recorded_exception_is_one_line(recorded: str, shown: str) -> None:
    assert exception_text(recorded) == shown


def test_a_dataloader_workers_error_keeps_its_original_error_through_the_agents_shortening(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "last_exc", OSError(WORKER), raising=False)
    monkeypatch.setattr(sys, "last_value", OSError(WORKER), raising=False)
    kept = _uncaught_exception()
    assert kept is not None and len(kept) <= 500 < len(repr(OSError(WORKER)))
    assert exception_text(kept) == (
        "OSError: Caught OSError in DataLoader worker process 0. (original: OSError: corrupt sample 77)"
    )
    assert len(exception_text("ValueError('" + "x" * 900 + "')")) == 300


def test_a_record_cut_by_a_dataloader_workers_death_points_to_the_live_loader() -> None:
    class Ended(Exception):
        pass

    def record_ended(where: str) -> None:  # the replayer's ends the process
        raise Ended(where)

    for died, hint in ((repr(OSError(WORKER)), True), ("ValueError('boom')", False)):
        rec = SimpleNamespace(batches=[{"loader": 0}] * 7, attrs={"end": {"exception": died}})
        server = BatchServer(rec, "auto", 0, -1, lambda step, missing: "bytes", [], record_ended)  # type: ignore[arg-type]
        with pytest.raises(Ended) as ended:
            server.past_the_end(7, map_style=True)
        assert str(ended.value).startswith("before batch 7 (the recording holds 7)")
        assert ("--data live runs the program's own DataLoader" in str(ended.value)) is hint, ended.value
