"""inspect's findings from a summary: what they say, and the command they lead to."""

from __future__ import annotations

from typing import Any

from fsdp_replay.analysis.findings import (
    PROBLEM,
    WARNING,
    _caused_by,
    _causes,
    _peer_ended,
    _rank_findings,
    flight_findings,
    rank_replay,
    replay_through,
)


def _rank(rank: int, *, killed: bool, with_payload: int) -> dict[str, Any]:
    return {
        "rank": rank,
        "steps": 48,
        "end": None if killed else {"reason": "exit"},
        "payload_coverage": {
            "outputs": 969,
            "with_payload": with_payload,
            "steps": "0-47" if with_payload == 969 else "none",
            "partial_steps": "0-47" if 0 < with_payload < 969 else "none",
        },
        "environment": {"policy": {"payloads": "window:4"}},
        "flight_recorder": {"dumps": [], "unwritten": 1181},
    }


def _ended(with_payload: int) -> dict[str, Any]:
    (ended,) = [
        f
        for f in _rank_findings(_rank(1, killed=True, with_payload=with_payload), "run")
        if f["kind"] == "ended"
    ]
    return ended


def test_a_killed_rank_without_whole_payload_steps_leads_to_the_all_rank_replay() -> None:
    assert "did not finish recording" in _ended(0)["message"]
    assert _ended(0)["next"].startswith("fsdp-replay replay run --all-ranks")
    assert _ended(200)["next"].startswith("fsdp-replay replay run --all-ranks")  # only some outputs a step
    assert _ended(969)["next"] == "fsdp-replay replay run --rank 1"


def test_a_flight_recorder_that_wrote_nothing_says_whether_a_rank_was_killed() -> None:
    (note,) = flight_findings(
        [_rank(0, killed=True, with_payload=0), _rank(1, killed=True, with_payload=0)], "run"
    )
    assert "ranks 0, 1 ended without closing their record" in note["message"]
    assert "no rank failed" not in note["message"] and note["next"] == "fsdp-replay replay run --all-ranks"
    (note,) = flight_findings([_rank(0, killed=False, with_payload=0)], "run")
    assert "wrote no payloads: no rank failed" in note["message"]


def test_the_replay_offered_is_one_the_payloads_allow() -> None:
    def offered(steps: str, outputs: int = 200, n: int = 10) -> str:
        cov = {"outputs": outputs, "with_payload": 1, "steps": steps}
        return rank_replay({"rank": 2, "steps": n, "payload_coverage": cov}, "run")

    assert offered("0-10") == "fsdp-replay replay run --rank 2"
    assert offered("6-8,10") == "fsdp-replay replay run --rank 2 --from-step 6 --to-step 8"
    assert offered("0-3") == "fsdp-replay replay run --rank 2 --to-step 3"
    assert offered("7") == "fsdp-replay replay run --rank 2 --from-step 7 --to-step 7"
    assert offered("none").startswith("fsdp-replay replay run --all-ranks")
    assert offered("none", outputs=0) == "fsdp-replay replay run --rank 2"  # no collectives to answer


def test_the_replay_offered_for_a_nan_covers_its_step_from_a_snapshot() -> None:
    def offered(steps: str, snapshots: list[int], outputs: int = 200) -> str:
        cov = {"outputs": outputs, "with_payload": 1, "steps": steps}
        return replay_through(
            {"rank": 1, "steps": 20, "snapshots": snapshots, "payload_coverage": cov}, 12, "run"
        )

    alone = "fsdp-replay replay run --rank 1 --from-step 12 --to-step 12"
    assert offered("0-19", [0]) == alone
    assert offered("8-13", [8]) == alone  # a flight recorder's dump: its snapshot and steps
    assert offered("10-13", [0, 10]) == alone
    assert offered("10-13", [0, 8]).startswith(
        "fsdp-replay replay run --all-ranks --to-step 12"
    )  # 8, 9 missing
    assert offered("none", [0]).startswith("fsdp-replay replay run --all-ranks --to-step 12")
    assert offered("none", [0], outputs=0) == alone


def test_an_interrupted_rank_leads_to_desync_and_a_crash_to_its_replay() -> None:
    def ended(exception: str) -> dict[str, Any]:
        r = _rank(0, killed=False, with_payload=969)
        r["end"] = {"reason": "exit", "exception": exception}
        (f,) = [f for f in _rank_findings(r, "run") if f["kind"] == "ended"]
        return f

    ctrl_c = ended("Traceback (most recent call last):\n  ...\nKeyboardInterrupt()")
    assert "interrupted (SIGINT" in ctrl_c["message"] and ctrl_c["next"] == "fsdp-replay desync run"
    crash = ended("Traceback (most recent call last):\n  ...\nRuntimeError: boom\n")
    assert crash["message"].endswith("uncaught exception after 48 steps: RuntimeError: boom")
    assert crash["next"] == "fsdp-replay replay run --rank 0"


def test_a_rank_that_lost_its_peer_is_a_consequence_of_the_rank_that_raised() -> None:
    def rank(rk: int, exception: str | None, killed: bool = False) -> dict[str, Any]:
        r = _rank(rk, killed=killed, with_payload=969)
        if exception is not None:
            r["end"] = {"reason": "exit", "exception": exception}
        return r

    gloo = "RuntimeError('[../pair.cc:553] Connection closed by peer [127.0.0.1]:30123. This is typically caused by a remote worker crashing.')"
    nccl = "torch.distributed.DistBackendError: NCCL communicator was aborted on rank 2."
    ranks = [rank(0, gloo), rank(1, "ValueError('boom at step 5')"), rank(2, nccl), rank(3, None)]
    assert [_peer_ended(r) for r in ranks] == [True, False, True, False]
    assert _causes(ranks) == [1]
    (cause,) = [f for f in _rank_findings(ranks[1], "run", []) if f["kind"] == "ended"]
    assert cause["severity"] == PROBLEM and "ValueError" in cause["message"]
    (lost,) = [f for f in _rank_findings(ranks[0], "run", [1]) if f["kind"] == "ended"]
    assert lost["severity"] == WARNING, lost
    assert lost["message"].endswith("most likely a consequence of rank 1's end (above)")
    # a killed rank is a cause too; where every rank only lost a peer, each stays a problem
    assert _causes([rank(0, gloo), rank(1, None, killed=True)]) == [1]
    assert _causes([rank(0, gloo), rank(1, nccl)]) == []
    (alone,) = [f for f in _rank_findings(ranks[0], "run", []) if f["kind"] == "ended"]
    assert alone["severity"] == PROBLEM
    # torchrun's SIGTERM to the rest after one rank raised: a consequence; a preemption's alone: a cause
    stopped = _rank(4, killed=False, with_payload=969)
    stopped["end"] = {"reason": "SIGTERM"}
    assert _caused_by(stopped, _causes([*ranks, stopped]), [*ranks, stopped]) == [1]
    (term,) = [f for f in _rank_findings(stopped, "run", [1]) if f["kind"] == "ended"]
    assert (
        term["severity"] == WARNING
        and "the launcher stopped it, most likely a consequence of rank 1's" in term["message"]
    )
    assert _causes([stopped, rank(0, gloo)]) == [4]
    assert _caused_by(stopped, [4], [stopped, rank(0, gloo)]) == []
    assert _caused_by(ranks[0], [4], [stopped, ranks[0]]) == [4]
