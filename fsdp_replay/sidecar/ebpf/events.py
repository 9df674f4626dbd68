"""What the probe hands out: decoded call records, counters, and what was attached where."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fsdp_replay.sidecar.ebpf import records
from fsdp_replay.sidecar.ebpf.signatures import INT, Signature

_U64_SIGN = 1 << 63
_U64_RANGE = 1 << 64


@dataclass(frozen=True, slots=True)
class Attachment:
    """What was attached in one library file."""

    path: str
    """The path bcc attached to (in our mount namespace)."""
    file_id: tuple[int, int]
    """(st_dev, st_ino): the identity of the file, which is what uprobes attach to."""
    probed: dict[str, str]
    """API name -> the ELF symbol probed for it."""
    missing: tuple[str, ...]
    """API names this library does not define (another version): skipped."""
    aliases: dict[str, str] = field(default_factory=dict)
    """API name -> API name already probed at the same address (not probed twice)."""


@dataclass(frozen=True, slots=True)
class ProbeStats:
    """Counters from the kernel maps and the delivery path. Every lost event is in ``lost``."""

    entries: int
    """Calls that passed the pid filter (kernel)."""
    emitted: int
    """Records the kernel put into the buffer."""
    delivered: int
    """Records handed to the callback."""
    output_full: int
    """Records dropped because the ring buffer (perf: the per-CPU buffer) was full."""
    inflight_full: int
    """Calls dropped at entry because the in-flight map was full."""
    perf_lost: int
    """Records the perf buffer reported lost (perf transport only): failed submits already in
    ``output_full``, reported again in a "lost" record written before the next record that fits
    (so possibly late, or never when nothing follows)."""
    callback_errors: int
    hits: dict[str, int]
    """Per function: calls that passed the pid filter."""

    @property
    def lost(self) -> int:
        # A failed perf submit is also reported by the perf buffer's lost callback: the same
        # records, counted on both sides, so only the larger count is lost.
        return self.inflight_full + max(self.output_full, self.perf_lost)


class Event:
    """One decoded record: a call to a probed function (or one still in flight)."""

    __slots__ = ("record", "signature")

    def __init__(self, record: records.Record, signature: Signature) -> None:
        self.record = record
        self.signature = signature

    @property
    def function(self) -> str:
        return self.signature.name

    @property
    def pid(self) -> int:
        return int(self.record.pid)

    @property
    def tid(self) -> int:
        return int(self.record.tid)

    @property
    def ts_ns(self) -> int:
        return int(self.record.ts_ns)

    @property
    def latency_ns(self) -> int:
        return int(self.record.latency_ns)

    @property
    def ret(self) -> int:
        return int(self.record.ret)

    @property
    def kind(self) -> int:
        return int(self.record.kind)

    @property
    def flags(self) -> int:
        return int(self.record.flags)

    @property
    def new_comm(self) -> int:
        return int(self.record.new_comm)

    @property
    def nranks(self) -> int:
        return int(self.record.nranks)

    @property
    def rank(self) -> int:
        return int(self.record.rank)

    @property
    def comm_name(self) -> str:
        return records.comm_name(self.record)

    @property
    def args(self) -> dict[str, int]:
        """Arguments by parameter name; ints signed, pointers and sizes unsigned."""
        params = self.signature.params
        values: list[int] = self.record.args[: len(params)]
        return {
            p.name: v - _U64_RANGE if p.kind == INT and v >= _U64_SIGN else v
            for p, v in zip(params, values, strict=True)
        }

    def __repr__(self) -> str:
        kind = records.KIND_NAMES.get(self.kind, str(self.kind))
        return (
            f"Event({self.function} {kind} pid={self.pid} tid={self.tid} ret={self.ret} "
            f"latency_ns={self.latency_ns} args={self.args})"
        )


Callback = Callable[[Event], None]
