"""inspect's findings from a summary: what they say, and the command they lead to."""

from __future__ import annotations

from typing import Any

from fsdp_replay.analysis.findings import _rank_findings, flight_findings


def _rank(rank: int, *, killed: bool, with_payload: int) -> dict[str, Any]:
    return {
        "rank": rank,
        "steps": 48,
        "end": None if killed else {"reason": "exit"},
        "payload_coverage": {"outputs": 969, "with_payload": with_payload, "steps": "none"},
        "environment": {"policy": {"payloads": "window:4"}},
        "flight_recorder": {"dumps": [], "unwritten": 1181},
    }


def test_a_killed_rank_without_payloads_leads_to_the_all_rank_replay() -> None:
    (ended,) = [
        f for f in _rank_findings(_rank(1, killed=True, with_payload=0), "run") if f["kind"] == "ended"
    ]
    assert "did not finish recording" in ended["message"]
    assert ended["next"].startswith("fsdp-replay replay run --all-ranks")
    (ended,) = [
        f for f in _rank_findings(_rank(1, killed=True, with_payload=200), "run") if f["kind"] == "ended"
    ]
    assert ended["next"] == "fsdp-replay replay run --rank 1"


def test_a_flight_recorder_that_wrote_nothing_says_whether_a_rank_was_killed() -> None:
    (note,) = flight_findings(
        [_rank(0, killed=True, with_payload=0), _rank(1, killed=True, with_payload=0)], "run"
    )
    assert "ranks 0, 1 ended without closing their record" in note["message"]
    assert "no rank failed" not in note["message"] and note["next"] == "fsdp-replay replay run --all-ranks"
    (note,) = flight_findings([_rank(0, killed=False, with_payload=0)], "run")
    assert "wrote no payloads: no rank failed" in note["message"]
