"""The verdict a replay draws from what it compared: never BIT-EXACT over nothing."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from fsdp_replay.errors import ExitCode
from fsdp_replay.replayer.agent import Replayer
from fsdp_replay.replayer.report import render_text


def _replayer(steps: list[int], colls: int) -> SimpleNamespace:
    return SimpleNamespace(
        divergences=[],
        program_error=None,
        verified_steps=steps,
        verified_colls=colls,
        seq=colls,
        to_step=-1,
        rec=SimpleNamespace(colls=[None] * colls),
    )


@pytest.mark.parametrize(
    ("steps", "colls", "status", "code"),
    [
        ([], 0, "unverified", ExitCode.UNUSABLE),  # the record ended before anything to compare
        ([], 3, "bit-exact", ExitCode.OK),  # step 0 incomplete, its first collectives matched
        ([0, 1], 40, "bit-exact", ExitCode.OK),
    ],
)
def test_the_status_follows_what_was_compared(steps: list[int], colls: int, status: str, code: int) -> None:
    for check_complete in (False, True):
        assert Replayer._final_status(_replayer(steps, colls), check_complete) == (status, code)  # type: ignore[arg-type]


def test_an_unverified_replay_says_so_and_why() -> None:
    text = render_text({"status": "unverified", "rank": 1, "reason": "nothing was compared with the record"})
    assert text.startswith("rank 1: UNVERIFIED: nothing was compared") and "BIT-EXACT" not in text


def test_an_unusable_replay_says_what_matched_before_it_stopped() -> None:
    report = {
        "status": "unusable",
        "rank": 1,
        "reason": "a payload the replay needs is not in the trace (step 9): nothing after it can be checked",
        "verified_steps": [6, 7, 8],
        "collectives_verified": 59,
    }
    lines = render_text(report).splitlines()
    assert lines[0].startswith("rank 1: UNUSABLE: a payload the replay needs")
    assert lines[1] == (
        "  before that, steps 6..8 matched the record (59 collectives): no verdict is drawn past what the trace holds"
    )


def test_one_interrupted_rank_makes_an_all_rank_replay_interrupted() -> None:
    from fsdp_replay.replayer.report import merge_reports

    ranks = [{"rank": 0, "status": "bit-exact"}, {"rank": 1, "status": "interrupted"}]
    assert merge_reports(ranks, 2)["status"] == "interrupted"
    assert merge_reports(ranks[:1], 2)["status"] == "incomplete"


def test_a_program_that_ends_early_when_stopped_is_interrupted_not_diverged(tmp_path: Path) -> None:
    """A trainer that catches SIGTERM and returns: the replay saw an early end, which the command
    line (that passed the signal on) reports as a stop, with the shell's code of that signal."""
    import json
    import signal

    from fsdp_replay.cli.replay import finish_report

    def report(status: str, name: str = "") -> Path:
        path = tmp_path / (name or status) / "report.json"
        path.parent.mkdir()
        ended = {"kind": "ended_early", "step": 3, "micro": 0, "seq": 60, "what": "the program ended early"}
        doc = {
            "status": status,
            "rank": 1,
            "reason": "",
            "verified_steps": [0, 1, 2],
            "collectives_verified": 60,
        }
        path.write_text(json.dumps({**doc, "first_divergence": ended, "divergences": [ended]}))
        return path

    path = report("diverged")
    assert finish_report(path, 0, [], signal.SIGTERM) == 128 + signal.SIGTERM
    doc = json.loads(path.read_text())
    assert doc["status"] == "interrupted" and doc["first_divergence"] is None
    assert doc["reason"].startswith("stopped by SIGTERM at step 3 after 60 collectives")
    assert finish_report(report("interrupted"), 130, []) == ExitCode.INTERRUPTED  # Ctrl-C, not passed on
    assert (
        finish_report(report("diverged", "not-stopped"), 0, []) == ExitCode.FOUND
    )  # no stop: an early end is a divergence


def test_the_fast_forward_line_counts_one_step_and_one_call_in_the_singular() -> None:
    ff = {"to_step": 3, "computed_steps": 2, "skipped_steps": 1, "root_calls_skipped": 1, "seconds": 0.1}
    base = {"status": "bit-exact", "rank": 1, "reason": "", "verified_steps": [3], "collectives_verified": 4}
    text = render_text({**base, "fast_forward": ff})
    assert "1 step run without kernels (1 model call answered with placeholders)" in text, text
    assert "BIT-EXACT over steps 3..3 (4 collectives, 1 step)" in text, text
    ff = {**ff, "skipped_steps": 898, "root_calls_skipped": 1796}
    text = render_text({**base, "fast_forward": ff})
    assert "898 steps run without kernels (1796 model calls answered" in text, text
