"""What recording stores a step, said after the first steps (``agent/budget.py``)."""

from __future__ import annotations

from fsdp_replay.agent.budget import StepCost, report

GB = 10**9


def _cost(total_tape: int, step_s: float, rate: float | None, snap: int = 4 * GB, every: int = 4) -> StepCost:
    return StepCost(
        {"tape": total_tape, "collectives": 200 << 20, "batches": 64 << 10}, step_s, rate, snap, every
    )


def test_nothing_stored_says_nothing() -> None:
    assert report(StepCost({"tape": 0, "collectives": 0, "batches": 0}, 0.2, None, 0, 0), "none") is None


def test_a_writer_that_keeps_up_says_so() -> None:
    line = report(_cost(GB // 10, 0.5, 2.0 * GB), "all")
    assert line is not None and "a step stores" in line and "tape 0.10 GB" in line and "it keeps up" in line
    assert "to the spool on disk" in line and "a 4.00 GB snapshot every 4 steps" in line


def test_bytes_a_step_the_disk_cannot_take_say_how_long_the_training_waits_and_what_to_choose() -> None:
    line = report(_cost(2 * GB, 0.25, 1.9 * GB), "all")
    assert line is not None and "the training will wait about" in line
    assert "--payloads window:N" in line and "steps:A-B" in line
    wait = float(line.split("wait about ")[1].split(" s")[0])
    assert abs(wait - ((2 * GB + (200 << 20) + (64 << 10)) / (1.9 * GB) - 0.25)) < 0.01


def test_the_flight_recorder_says_what_it_holds_against_its_bound() -> None:
    inside = report(_cost(GB // 2, 0.25, None), "window:4", window_bytes=64 * GB)
    assert inside is not None and "held in host memory" in inside and "within its bound of 64.00 GB" in inside
    over = report(_cost(2 * GB, 0.25, None), "window:4", window_bytes=8 * GB)
    assert over is not None and "over its bound of 8.00 GB" in over and "--window-bytes" in over
