"""Agent options, read once from the environment at start-up (never at import time).

Every option is an ``FSDP_REPLAY_*`` variable, which is how ``fsdp-replay record`` and the
Kubernetes injector configure a process without touching its command line.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from fsdp_replay.errors import ConfigError

ENV_PREFIX = "FSDP_REPLAY_"
MODES = ("off", "record", "replay")


@dataclass(frozen=True, slots=True)
class StepSet:
    """A set of step numbers from a spec such as ``0-3,10,20-`` (open-ended ranges allowed)."""

    ranges: tuple[tuple[int, int | None], ...] = ()
    everything: bool = False

    def __contains__(self, step: object) -> bool:
        if not isinstance(step, int):
            return False
        if self.everything:
            return True
        return any(lo <= step and (hi is None or step <= hi) for lo, hi in self.ranges)

    @property
    def empty(self) -> bool:
        return not self.everything and not self.ranges

    @classmethod
    def parse(cls, spec: str) -> StepSet:
        """``none`` | ``all`` | ``steps:SPEC`` (or a bare SPEC)."""
        spec = spec.strip()
        if spec in ("", "none"):
            return cls()
        if spec == "all":
            return cls(everything=True)
        body = spec.removeprefix("steps:")
        ranges: list[tuple[int, int | None]] = []
        for part in body.split(","):
            m = re.fullmatch(r"\s*(\d+)\s*(?:(-)\s*(\d*)\s*)?", part)
            if not m:
                raise ConfigError(f"bad step spec {spec!r}: use none, all, or steps:0-3,10,20- ")
            lo = int(m.group(1))
            hi: int | None = lo if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
            if hi is not None and hi < lo:
                raise ConfigError(f"bad step range {part!r} in {spec!r}: end before start")
            ranges.append((lo, hi))
        return cls(tuple(ranges))

    def __str__(self) -> str:
        if self.everything:
            return "all"
        if not self.ranges:
            return "none"
        return "steps:" + ",".join(
            str(lo) if hi == lo else f"{lo}-{'' if hi is None else hi}" for lo, hi in self.ranges
        )


def _int(env: Mapping[str, str], name: str, default: int, minimum: int = 0) -> int:
    raw = env.get(ENV_PREFIX + name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{ENV_PREFIX}{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ConfigError(f"{ENV_PREFIX}{name}={value} must be >= {minimum}")
    return value


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(ENV_PREFIX + name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{ENV_PREFIX}{name}={raw!r} is not a boolean (use 1 or 0)")


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentConfig:
    mode: str = "off"
    """off, record or replay."""
    out: str = ""
    """The run folder: spools go to OUT/spool, the trace to OUT/trace.zarr."""
    payloads: StepSet = field(default_factory=StepSet)
    """Steps whose collective outputs and batches are stored (``none``, ``all``, ``steps:SPEC``)."""
    payload_inputs: bool = False
    """Also store collective inputs (outputs alone suffice for replay)."""
    module_fingerprints: StepSet = field(default_factory=StepSet)
    """Steps whose module outputs and output gradients are fingerprinted (to localize divergences)."""
    snapshot_every: int = 0
    """Snapshot the rank's state every N steps (0: only at step 0)."""
    sync_steps: bool = True
    """Wait at each step end until the step's records are written (crash consistency)."""
    max_pending_bytes: int = 1 << 30
    """Payload bytes waiting for the writer beyond which new payloads are dropped (and counted)."""
    reserve_bytes: int = 16 << 20
    """Disk space held back per rank for metadata, released when payloads fill the disk."""
    cxx_kernel: str = ""
    """The C++ kernel library (``kernel.py``) that records the hot CPU collectives, or empty."""
    inject_fault: str = ""
    """Testing only: ``WHERE:N`` raises inside the agent at the N-th call of WHERE."""
    # Replay mode (set by `fsdp-replay replay`).
    trace: str = ""
    """The trace to replay from."""
    rank: int = 0
    """The recorded rank this process replays."""
    from_step: int = 0
    """Verify from this step on (restoring the latest snapshot at or before it)."""
    to_step: int = -1
    """Stop after this step (-1: run the program to its end)."""
    report: str = ""
    """Folder for report.json."""
    live: bool = False
    """All-rank replay: collectives run for real (torchrun) and are compared with the record."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"{ENV_PREFIX}MODE={self.mode!r}: expected one of {', '.join(MODES)}")
        if self.mode == "record" and not self.out:
            raise ConfigError(f"{ENV_PREFIX}OUT must name the run folder when {ENV_PREFIX}MODE=record")
        if self.mode == "replay" and not (self.trace and self.report):
            raise ConfigError(
                f"{ENV_PREFIX}TRACE and {ENV_PREFIX}REPORT are needed when {ENV_PREFIX}MODE=replay"
            )

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> AgentConfig:
        env = os.environ if env is None else env
        return cls(
            mode=env.get(ENV_PREFIX + "MODE", "off") or "off",
            out=env.get(ENV_PREFIX + "OUT", ""),
            payloads=StepSet.parse(env.get(ENV_PREFIX + "PAYLOADS", "all")),
            payload_inputs=_bool(env, "PAYLOAD_INPUTS", False),
            module_fingerprints=StepSet.parse(env.get(ENV_PREFIX + "MODULE_FINGERPRINTS", "none")),
            snapshot_every=_int(env, "SNAPSHOT_EVERY", 0),
            sync_steps=_bool(env, "SYNC_STEPS", True),
            max_pending_bytes=_int(env, "MAX_PENDING_BYTES", 1 << 30, minimum=1),
            reserve_bytes=_int(env, "RESERVE_BYTES", 16 << 20),
            cxx_kernel=env.get(ENV_PREFIX + "CXX_KERNEL_LIB", ""),
            inject_fault=env.get(ENV_PREFIX + "INJECT_FAULT", ""),
            trace=env.get(ENV_PREFIX + "TRACE", ""),
            rank=_int(env, "RANK", 0),
            from_step=_int(env, "FROM_STEP", 0),
            to_step=_int(env, "TO_STEP", -1, minimum=-1),
            report=env.get(ENV_PREFIX + "REPORT", ""),
            live=_bool(env, "LIVE", False),
        )

    def to_env(self) -> dict[str, str]:
        """The environment that makes a child process's agent use this config."""
        if self.mode == "replay":
            return {
                ENV_PREFIX + "MODE": self.mode,
                ENV_PREFIX + "TRACE": self.trace,
                ENV_PREFIX + "RANK": str(self.rank),
                ENV_PREFIX + "FROM_STEP": str(self.from_step),
                ENV_PREFIX + "TO_STEP": str(self.to_step),
                ENV_PREFIX + "REPORT": self.report,
                ENV_PREFIX + "LIVE": "1" if self.live else "0",
            }
        return {
            ENV_PREFIX + "MODE": self.mode,
            ENV_PREFIX + "OUT": self.out,
            ENV_PREFIX + "PAYLOADS": str(self.payloads),
            ENV_PREFIX + "PAYLOAD_INPUTS": "1" if self.payload_inputs else "0",
            ENV_PREFIX + "MODULE_FINGERPRINTS": str(self.module_fingerprints),
            ENV_PREFIX + "SNAPSHOT_EVERY": str(self.snapshot_every),
            ENV_PREFIX + "SYNC_STEPS": "1" if self.sync_steps else "0",
            ENV_PREFIX + "MAX_PENDING_BYTES": str(self.max_pending_bytes),
            ENV_PREFIX + "RESERVE_BYTES": str(self.reserve_bytes),
            **({ENV_PREFIX + "CXX_KERNEL_LIB": self.cxx_kernel} if self.cxx_kernel else {}),
        }
