"""The recording agent's options, read once from the environment at start-up (never at import time).

Every option is an ``FSDP_REPLAY_*`` variable, which is how ``fsdp-replay record`` and the
Kubernetes injector configure a process without touching its command line. The replayer's options
are ``replayer/config.py``; ``boot/attach.py`` picks one by ``FSDP_REPLAY_MODE``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from fsdp_replay import options
from fsdp_replay.errors import ConfigError

ENV_PREFIX = options.ENV_PREFIX
MODES = ("off", "record", "replay")
WHEN_FULL = ("wait", "drop")


@dataclass(frozen=True, slots=True)
class StepSet:
    """A set of step numbers from a spec such as ``0-3,10,20-`` (open-ended ranges allowed), or
    the rolling window of the payload flight recorder (``window:N``, ``agent/flight.py``)."""

    ranges: tuple[tuple[int, int | None], ...] = ()
    everything: bool = False
    window: int = 0
    """``window:N``: every step's payloads are taken, but held in memory (the last N steps and
    the step in progress) and written only when the run fails; 0: not a window."""

    def __contains__(self, step: object) -> bool:
        if not isinstance(step, int):
            return False
        if self.everything or self.window:
            return True
        return any(lo <= step and (hi is None or step <= hi) for lo, hi in self.ranges)

    @property
    def empty(self) -> bool:
        return not self.everything and not self.ranges and not self.window

    def kept_through(self, step: int) -> int | None:
        """The last step of the unbroken run of steps in the set that starts at ``step``
        (``step - 1`` when ``step`` is not in it); None when that run has no end (all, a window,
        an open range)."""
        if self.everything or self.window:
            return None
        end = step - 1
        while True:
            reach = [hi for lo, hi in self.ranges if lo <= end + 1 and (hi is None or hi >= end + 1)]
            if not reach:
                return end
            if None in reach:
                return None
            end = max(h for h in reach if h is not None)

    @classmethod
    def parse(cls, spec: str) -> StepSet:
        """``none`` | ``all`` | ``steps:SPEC`` (or a bare SPEC) | ``window:N``."""
        spec = spec.strip()
        if spec in ("", "none"):
            return cls()
        if spec == "all":
            return cls(everything=True)
        if spec.startswith("window:"):
            m = re.fullmatch(r"window:\s*(\d+)\s*", spec)
            if not m or int(m.group(1)) < 1:
                raise ConfigError(f"{spec!r}: a window is window:N with N >= 1 steps")
            return cls(window=int(m.group(1)))
        body = spec.removeprefix("steps:")
        ranges: list[tuple[int, int | None]] = []
        for part in body.split(","):
            m = re.fullmatch(r"\s*(\d+)\s*(?:(-)\s*(\d*)\s*)?", part)
            if not m:
                raise ConfigError(f"{spec!r} is not a set of steps")
            lo = int(m.group(1))
            hi: int | None = lo if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
            if hi is not None and hi < lo:
                raise ConfigError(f"bad step range {part!r} in {spec!r}: end before start")
            ranges.append((lo, hi))
        return cls(tuple(ranges))

    def __str__(self) -> str:
        if self.everything:
            return "all"
        if self.window:
            return f"window:{self.window}"
        if not self.ranges:
            return "none"
        return "steps:" + ",".join(
            str(lo) if hi == lo else f"{lo}-{'' if hi is None else hi}" for lo, hi in self.ranges
        )


# The forms a step-set option takes, said with every bad value of one.
STEP_FORMS = "none, all or steps:SPEC (steps:0-3,10,20-)"
AUTO = "auto"
AUTO_GPU_POLICY = "window:4"
"""What ``--payloads auto`` (``record``'s default) records where CUDA devices are visible: the
flight recorder, with a snapshot every 4 steps. Measured on a 350M-parameter GPT-2 job on an H100
(bench/results/capture_gpt2-350m_h100_2026-12-06): ``all`` stores 1.8 GB a step and ran 3.9x a
plain step, the flight recorder 1.3x and writes only a failure's window; on the CPU a step's
payloads are small, and ``all`` lets any step of any rank be replayed alone."""

PAYLOAD_FORMS = (
    "none, all, steps:SPEC (steps:0-3,10,20-), window:N (the last N steps, kept in memory) or auto "
    f"({AUTO_GPU_POLICY} where CUDA devices are visible, else all)"
)


def parse_steps(var: str, raw: str, forms: str = STEP_FORMS) -> StepSet:
    """``raw``, the value of option ``var`` (a variable or a flag), as a StepSet; a bad one is a
    ConfigError that names ``var`` and the ``forms`` it takes."""
    try:
        return StepSet.parse(raw)
    except ConfigError as e:
        raise ConfigError(f"{var}: {e}; use {forms}") from None


def cuda_devices_visible(env: Mapping[str, str] | None = None, dev: str = "/dev") -> bool:
    """Whether this machine shows CUDA devices to a process started here (an NVIDIA device node,
    and ``CUDA_VISIBLE_DEVICES`` not set to none), without loading CUDA."""
    env = os.environ if env is None else env
    if env.get("CUDA_VISIBLE_DEVICES", "x").strip() in ("", "-1", "none", "NoDevFiles"):
        return False
    try:
        return any(re.fullmatch(r"nvidia\d+", name) for name in os.listdir(dev))
    except OSError:
        return False


def auto_payloads(gpu: bool) -> str:
    """The policy ``auto`` stands for: the flight recorder on a GPU job, every step's payloads on a CPU one."""
    return AUTO_GPU_POLICY if gpu else "all"


def parse_payloads(var: str, raw: str) -> StepSet:
    """The payload policy (``FSDP_REPLAY_PAYLOADS``, ``--payloads``): a step set, a window, or
    ``auto`` (``auto_payloads`` of whether CUDA devices are visible here)."""
    if raw.strip() == AUTO:
        raw = auto_payloads(cuda_devices_visible())
    return parse_steps(var, raw, PAYLOAD_FORMS)


def _non_negative(var: str, raw: str) -> int:
    return options.parse_int(var, raw, minimum=0)


def parse_alloc_history(var: str, raw: str) -> StepSet:
    """``off`` | ``always`` | ``steps:SPEC`` (and StepSet's ``none``/``all``); no window."""
    if raw.strip().startswith("window:"):
        raise ConfigError(f"{var}={raw!r}: use off, always or steps:SPEC")
    return parse_steps(
        var, {"off": "none", "always": "all"}.get(raw.strip(), raw), "off, always or steps:SPEC"
    )


@dataclass(frozen=True, slots=True)
class CuptiPolicy:
    """The steps whose CUDA kernels and copies CUPTI captures (``agent/cupti``): ``off``,
    ``always``, ``steps:SPEC``, or ``snapshots`` (the default): step 1 and the step before each
    periodic snapshot (``--snapshot-every N``: steps N-1, 2N-1, ...). Step 0 is never captured:
    NCCL sets its communicators up then, and a capture's flush must not overlap that."""

    steps: StepSet = field(default_factory=StepSet)
    snapshots: bool = False

    @property
    def off(self) -> bool:
        return not self.snapshots and self.steps.empty

    def includes(self, step: int, snapshot_every: int) -> bool:
        """Whether ``step`` is captured (the snapshot of step k is taken as step k-1 ends)."""
        if step < 1:
            return False
        if self.snapshots:
            return step == 1 or (snapshot_every > 0 and (step + 1) % snapshot_every == 0)
        return step in self.steps

    @classmethod
    def parse(cls, spec: str) -> CuptiPolicy:
        value = spec.strip()
        if value in ("off", "none"):
            return cls()
        if value in ("always", "all"):
            return cls(StepSet(everything=True))
        if value == "snapshots":
            return cls(snapshots=True)
        steps = StepSet.parse(value) if value.startswith("steps:") or value[:1].isdigit() else None
        if steps is None:
            raise ConfigError(f"bad CUPTI policy {spec!r}: use off, always, snapshots or steps:SPEC")
        return cls(steps)

    def __str__(self) -> str:
        if self.snapshots:
            return "snapshots"
        if self.steps.everything:
            return "always"
        return "off" if self.steps.empty else str(self.steps)


def parse_cupti(var: str, raw: str) -> CuptiPolicy:
    try:
        return CuptiPolicy.parse(raw)
    except ConfigError as e:
        raise ConfigError(f"{var}: {e}") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class RecordConfig:
    """What the agent records, read from ``FSDP_REPLAY_*`` by ``from_env`` (``record`` writes them)."""

    mode: str = "record"
    """Always ``record`` (``FSDP_REPLAY_MODE`` chooses the config: ``boot/attach.py``)."""
    out: str = ""
    """The run folder: spools go to OUT/spool, the trace to OUT/trace.zarr."""
    payloads: StepSet = field(default_factory=lambda: StepSet(everything=True))
    """Steps whose collective outputs and batches are stored (``none``, ``all``, ``steps:SPEC``), or
    ``window:N``: those of the last N steps held in memory, written only when the run fails."""
    payload_inputs: bool = False
    """Also store collective inputs (outputs alone suffice for replay)."""
    module_fingerprints: StepSet = field(default_factory=StepSet)
    """Steps whose module outputs and output gradients are fingerprinted (to localize divergences)."""
    op_fingerprints: StepSet = field(default_factory=StepSet)
    """Steps whose every op's inputs and outputs are fingerprinted (a dispatch mode: costly), so a
    replay names the first op that computed another result from the same inputs."""
    snapshot_every: int = 0
    """Snapshot the rank's state every N steps (0: only at step 0; with ``window:N``: every N,
    held in memory with the window). With ``payloads=steps:A-B``, also at A (``snapshot_step``)."""
    sync_steps: bool = True
    """Wait at each step end until the step's records are written (crash consistency)."""
    max_pending_bytes: int = 1 << 30
    """Payload bytes waiting for the writer beyond which a new payload waits for room (or, with
    ``when_full=drop``, is dropped and counted)."""
    when_full: str = "wait"
    """What a stored payload does when the writer, the pending bound or a GPU's payload ring is
    full: ``wait`` (the default: the training thread waits until there is room, the wait counted
    per step in ``payload_wait_ns``: nothing a replay needs is lost) or ``drop`` (dropped and
    counted, the training never waits). With ``window:N`` the window's memory bound is not
    waited for: a step that cannot be held whole restarts the window (``agent/flight.py``)."""
    window_bytes: int = 0
    """With ``window:N``: payload bytes the flight recorder holds in memory, beyond which its
    window starts at a later snapshot, then new payloads are dropped (and counted); 0: a quarter of
    the available memory (MemAvailable, or what the container's cgroup memory limit leaves where
    less) divided by the node's ranks (LOCAL_WORLD_SIZE), at least max_pending_bytes (``agent/flight.py``, ``window_bound``)."""
    payload_ring_bytes: int = 256 << 20
    """CUDA: the size of each device's payload ring (``agent/payload_ring.py``): a device buffer
    and a pinned host buffer of this many bytes through which stored device payloads reach the
    writer off the training stream (one device-to-device copy on it, the copy to the host on a
    side stream). A payload that finds no room waits for it (``when_full``; with ``drop``: dropped
    and counted, ``ring_full_drops``); one larger than the ring is copied on the training stream;
    0: no ring, device payloads are copied to pinned memory on the training stream."""
    reserve_bytes: int = 16 << 20
    """Disk space held back per rank for metadata, released when payloads fill the disk."""
    tape: bool = True
    """Tape the ops whose CUDA kernels are nondeterministic (``agent/tape.py``): fingerprint what
    each call computed, and store it with the step's payloads, so a replay can inject it."""
    tape_payloads: StepSet | None = None
    """Steps whose taped results are stored (default: as ``payloads``); ``none`` keeps their
    fingerprints only, so a replay names the kernel where it differs instead of injecting."""
    tape_ops: str = ""
    """More ops to tape, on the CPU and CUDA keys: ``ns::op,ns2::other`` (a custom kernel's)."""
    alloc_history: StepSet = field(default_factory=lambda: StepSet(((0, 1),)))
    """CUDA: steps whose caching-allocator actions (allocations, frees, segments) are recorded from
    torch's allocator history (``off``, ``always``, ``steps:SPEC``); a few ms at each such step's end
    on a large model (``agent/allocations.py``). Counters per step and an OOM's snapshot: always."""
    alloc_stacks: bool = False
    """CUDA: with ``alloc_history``, also record each allocation's Python stack (torch's, ~2 us per
    allocation), so that a row names the line of the program that allocated it."""
    cupti: CuptiPolicy = field(default_factory=lambda: CuptiPolicy(snapshots=True))
    """CUDA: steps whose kernels and copies CUPTI captures into the trace (``off``, ``always``,
    ``steps:SPEC``, ``snapshots``: step 1 and the step before each periodic snapshot). Needs the
    ``gpu`` extra (cupti-python); stands aside while another profiler traces (``agent/cupti``)."""
    cxx_kernel_lib: str = ""
    """The C++ kernel library (``agent/cxx/kernel.py``) that records the hot CPU collectives, or empty."""
    cxx_tape_lib: str = ""
    """The C++ tape hook's library (``agent/cxx/tape.py``) that records the taped calls of steps
    that store no payloads, or empty (the Python tape records them all)."""
    redact_key: str = field(default="", repr=False)
    """The run's redaction key (``record`` makes one per run; trace/redact_key.py): a redacted value
    becomes ``<redacted:hmac-sha256:...>`` keyed with it, so that a machine holding the key can tell
    its own value from another; empty: plain ``<redacted>``. Never recorded itself."""
    inject_fault: str = ""
    """Testing only: ``WHERE:N`` raises inside the agent at the N-th call of WHERE."""

    def __post_init__(self) -> None:
        if self.mode != "record":
            raise ConfigError(f"{ENV_PREFIX}MODE={self.mode!r}: a RecordConfig records")
        if not self.out:
            raise ConfigError(f"{ENV_PREFIX}OUT must name the run folder when {ENV_PREFIX}MODE=record")
        for name in ("snapshot_every", "reserve_bytes", "payload_ring_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{ENV_PREFIX}{name.upper()}={getattr(self, name)} must be >= 0")
        if self.max_pending_bytes < 1:
            raise ConfigError(f"{ENV_PREFIX}MAX_PENDING_BYTES={self.max_pending_bytes} must be >= 1")
        if self.when_full not in WHEN_FULL:
            raise ConfigError(
                f"{ENV_PREFIX}WHEN_FULL={self.when_full!r}: one of {', '.join(WHEN_FULL)} (wait: the "
                "training waits for room, nothing is lost; drop: payloads are dropped and counted)"
            )
        if self.window_bytes < 0:
            raise ConfigError(
                f"{ENV_PREFIX}WINDOW_BYTES={self.window_bytes} must be >= 0 (0: sized from memory)"
            )
        for name in ("module_fingerprints", "op_fingerprints", "tape_payloads"):
            value = getattr(self, name)
            if value is not None and value.window:
                raise ConfigError(
                    f"{ENV_PREFIX}{name.upper()}={value}: only {ENV_PREFIX}PAYLOADS takes a window "
                    "(it holds every stored payload, the tape's included)"
                )

    @property
    def snapshot_interval(self) -> int:
        """Steps between snapshots (0: only step 0's): ``snapshot_every``, or with a payload window
        the window's length, so that a snapshot at or before the window's start is always held."""
        return self.snapshot_every or self.payloads.window

    def snapshot_step(self, step: int) -> bool:
        """Whether the rank's state is snapshotted as ``step`` begins: every ``snapshot_interval``
        steps, and at the first step of each range of ``--payloads steps:A-B``, so that a replay of
        A..B needs the payloads of exactly those steps (from an earlier snapshot it would need the
        steps' before A too)."""
        every = self.snapshot_interval
        if every and step % every == 0:
            return True
        return any(lo == step for lo, _hi in self.payloads.ranges)

    @property
    def enabled(self) -> bool:
        return True

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RecordConfig:
        config: RecordConfig = options.from_env(
            cls,
            ENV_PREFIX,
            env,
            parsers={
                "payloads": parse_payloads,
                "tape_payloads": parse_steps,
                "module_fingerprints": parse_steps,
                "op_fingerprints": parse_steps,
                "snapshot_every": _non_negative,
                "reserve_bytes": _non_negative,
                "payload_ring_bytes": _non_negative,
                "alloc_history": parse_alloc_history,
                "cupti": parse_cupti,
            },
        )
        return config

    def to_env(self) -> dict[str, str]:
        """The environment that makes a child process's agent use this config."""
        env = {
            ENV_PREFIX + "MODE": self.mode,
            ENV_PREFIX + "OUT": self.out,
            ENV_PREFIX + "PAYLOADS": str(self.payloads),
            ENV_PREFIX + "PAYLOAD_INPUTS": "1" if self.payload_inputs else "0",
            ENV_PREFIX + "MODULE_FINGERPRINTS": str(self.module_fingerprints),
            ENV_PREFIX + "OP_FINGERPRINTS": str(self.op_fingerprints),
            ENV_PREFIX + "SNAPSHOT_EVERY": str(self.snapshot_every),
            ENV_PREFIX + "SYNC_STEPS": "1" if self.sync_steps else "0",
            ENV_PREFIX + "MAX_PENDING_BYTES": str(self.max_pending_bytes),
            ENV_PREFIX + "WHEN_FULL": self.when_full,
            ENV_PREFIX + "WINDOW_BYTES": str(self.window_bytes),
            ENV_PREFIX + "RESERVE_BYTES": str(self.reserve_bytes),
            ENV_PREFIX + "PAYLOAD_RING_BYTES": str(self.payload_ring_bytes),
            ENV_PREFIX + "TAPE": "1" if self.tape else "0",
            ENV_PREFIX + "TAPE_OPS": self.tape_ops,
            ENV_PREFIX + "ALLOC_HISTORY": str(self.alloc_history),
            ENV_PREFIX + "ALLOC_STACKS": "1" if self.alloc_stacks else "0",
            ENV_PREFIX + "CUPTI": str(self.cupti),
            **(
                {ENV_PREFIX + "TAPE_PAYLOADS": str(self.tape_payloads)}
                if self.tape_payloads is not None
                else {}
            ),
        }
        if self.cxx_kernel_lib:
            env[ENV_PREFIX + "CXX_KERNEL_LIB"] = self.cxx_kernel_lib
        if self.cxx_tape_lib:
            env[ENV_PREFIX + "CXX_TAPE_LIB"] = self.cxx_tape_lib
        if self.redact_key:
            env[ENV_PREFIX + "REDACT_KEY"] = self.redact_key
        return env


class Fault:
    """``WHERE:N`` from FSDP_REPLAY_INJECT_FAULT: raise inside the agent at the N-th WHERE."""

    def __init__(self, spec: str) -> None:
        where, _, n = spec.partition(":")
        self.where = where
        self.n = int(n or 1)
        self.count = 0

    def check(self, where: str) -> None:
        if where == self.where:
            self.count += 1
            if self.count == self.n:
                raise RuntimeError(f"fault injected by FSDP_REPLAY_INJECT_FAULT at {where} #{self.n}")
