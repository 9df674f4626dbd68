"""What recording stores a step, said once after the first steps (``--payloads`` that keep bytes).

Before the run pays for a policy the user should know what it costs: after step 1 (step 0 warms
up) rank 0 says what a step stores by kind (taped results, collective outputs, batches) and the
snapshot's size, where it goes (the spool on disk, or host memory for the flight recorder), and
whether the writer keeps up: the rate it wrote at so far against the bytes a step, so that a
policy whose bytes a step take longer to write than the step takes says by how much it will hold
the training back, and what to choose instead.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("tape", "collectives", "batches")
"""What a stored payload is (``TensorRecorder.stored``): a taped kernel's result, a collective's
output (or input), a batch's tensors."""


def gb(n: float) -> str:
    if n >= 1e8:
        return f"{n / 1e9:.2f} GB"
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


@dataclass(frozen=True, slots=True)
class StepCost:
    """One step's figures: payload bytes by kind, the step's wall time, and the writer's rate."""

    stored: dict[str, int]
    step_s: float
    write_rate: float | None  # bytes a second of the writer's writing so far (None: it wrote none)
    snapshot_bytes: int  # the last snapshot's (0: none yet)
    snapshot_every: int  # steps between snapshots (0: step 0's only)

    @property
    def total(self) -> int:
        return sum(self.stored.values())


def report(cost: StepCost, policy: str, window_bytes: int = 0) -> str | None:
    """The line to say, or None where a step stores nothing (``--payloads none``)."""
    if cost.total <= 0:
        return None
    parts = ", ".join(f"{name} {gb(cost.stored[name])}" for name in KINDS if cost.stored.get(name))
    snap = (
        f"; a {gb(cost.snapshot_bytes)} snapshot"
        + (f" every {cost.snapshot_every} steps" if cost.snapshot_every else " at step 0")
        if cost.snapshot_bytes
        else ""
    )
    head = f"fsdp-replay: with --payloads {policy} a step stores {gb(cost.total)} ({parts}){snap}"
    if policy.startswith("window:"):
        steps = int(policy.split(":", 1)[1] or 0)
        every = cost.snapshot_every or steps
        held = cost.total * (steps + every) + cost.snapshot_bytes * 2
        fits = window_bytes <= 0 or held <= window_bytes
        return (
            f"{head}, held in host memory and written only if the run fails: about {gb(held)} for a "
            f"window of {steps} steps and two snapshots"
            + (
                f", within its bound of {gb(window_bytes)}"
                if fits
                else f", over its bound of {gb(window_bytes)} (--window-bytes): the window will be "
                "shorter, restarting at later snapshots"
            )
        )
    if cost.write_rate is None or cost.step_s <= 0:
        return f"{head}, to the spool on disk"
    write_s = cost.total / cost.write_rate
    line = (
        f"{head}, to the spool on disk; its writer took {gb(cost.write_rate)}/s so far: "
        f"{write_s:.2f} s a step's payloads, the step {cost.step_s:.2f} s"
    )
    if write_s <= cost.step_s:
        return line + ": it keeps up"
    return (
        f"{line}: the training will wait about {write_s - cost.step_s:.2f} s a step for it (--when-full "
        "wait). To record at less cost: --payloads window:N (the flight recorder: held in memory, "
        "written when the run fails) or --payloads steps:A-B (only the steps to replay)"
    )
