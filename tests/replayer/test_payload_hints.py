"""What a replay says when the trace holds no payload for a step (``replayer/verify.py``): from the
policy the recording ran under, what it dropped, and with a flight recorder, what it dumped."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from fsdp_replay.replayer.verify import missing_payload_hint


def _rec(
    policy: str, dumps: list[dict[str, Any]] | None = None, snapshots: tuple[int, ...] = (0,), **counters: int
) -> Any:
    attrs: dict[str, Any] = {"end": {"counters": counters}}
    if dumps is not None:
        attrs["flight_dumps"] = dumps

    def snapshot_at_or_before(step: int) -> dict[str, Any] | None:
        best = [s for s in snapshots if s <= step]
        return {"step": max(best)} if best else None

    return SimpleNamespace(
        meta={"policy": {"payloads": policy}}, attrs=attrs, snapshot_at_or_before=snapshot_at_or_before
    )


def _dump(first: int, last: int, reason: str = "nonfinite", dropped: int = 0) -> dict[str, Any]:
    return {"first_step": first, "last_step": last, "reason": reason, "dropped": dropped}


def test_a_step_outside_every_dump_names_the_dumped_steps() -> None:
    hint = missing_payload_hint(_rec("window:4", [_dump(4, 9)]), 2, 0)
    assert "step 2 is in none" in hint and "4..9 (nonfinite)" in hint and "--from-step 4" in hint
    assert "although" not in hint


def test_a_window_run_that_never_failed_wrote_no_payload_and_says_so() -> None:
    hint = missing_payload_hint(_rec("window:4", []), 3, 0)
    assert "wrote none" in hint and "--payloads all" in hint


def test_a_step_inside_a_dump_missing_its_payload_names_the_drops() -> None:
    hint = missing_payload_hint(_rec("window:4", [_dump(4, 9, dropped=3)], flight_blobs_dropped=3), 6, 4)
    assert "left out 3 payloads" in hint and "--window-bytes" in hint and "--payload-ring-bytes" in hint


def test_steps_and_all_policies_keep_their_hints() -> None:
    assert "steps:0-..." not in missing_payload_hint(_rec("all"), 3, 0)
    hint = missing_payload_hint(_rec("steps:0-1"), 3, 2)
    assert "needs the payloads of those steps" in hint and "steps:2-..." in hint
    assert "--to-step" not in hint  # step 2 itself was not kept: no shorter replay helps
    hint = missing_payload_hint(_rec("steps:2-3,4"), 5, 2)  # --to-step past the kept run
    assert "or replay no further than step 4 (--to-step 4)" in hint
    # a replay from before the kept steps: the first of them with a snapshot to start from
    hint = missing_payload_hint(_rec("steps:2-3,8-9", snapshots=(0, 8)), 0, 0)
    assert "or replay the steps it kept: --from-step 8" in hint
    hint = missing_payload_hint(_rec("steps:2-3,8-9", snapshots=(0, 2, 8)), 0, 0)
    assert "or replay the steps it kept: --from-step 2" in hint
    assert "steps it kept" not in missing_payload_hint(_rec("steps:2-3"), 0, 0)  # no snapshot to start from
    hint = missing_payload_hint(_rec("steps:8-", snapshots=(0, 8)), 0, 0)  # an open range
    assert "or replay the steps it kept: --from-step 8" in hint
    hint = missing_payload_hint(_rec("all", blobs_dropped=5, blob_bytes_dropped=5_000_000), 3, 0)
    assert "dropped 5 of them" in hint and "--max-pending-bytes" in hint


def test_a_window_run_with_drops_is_explained_by_its_dumps_not_the_writer_bound() -> None:
    rec = _rec("window:4", [_dump(4, 9)], blobs_dropped=2, flight_blobs_dropped=2)
    hint = missing_payload_hint(rec, 1, 0)
    assert "step 1 is in none" in hint and "--max-pending-bytes" not in hint


def test_a_trace_without_payloads_points_to_the_all_rank_replay() -> None:
    hint = missing_payload_hint(_rec("none"), 0, 0)
    assert "recorded with --payloads none" in hint and "no rank of it can be replayed alone" in hint
    assert "fsdp-replay replay TRACE --all-ranks" in hint and "--payloads all" in hint
    rec = _rec("none")
    rec.trace = SimpleNamespace(url="/runs/my run/trace.zarr")  # the replay's trace, quoted for a shell
    assert "fsdp-replay replay '/runs/my run/trace.zarr' --all-ranks" in missing_payload_hint(rec, 2, 0)
    # a flight recorder's run that never failed wrote no payload either
    assert "--all-ranks" in missing_payload_hint(_rec("window:4", []), 3, 0)
    assert "--all-ranks" not in missing_payload_hint(_rec("steps:0-1"), 3, 2)
