"""The events of a spool, defined once: a TypedDict per event type, and the tensor entry.

Each event is a JSON object whose ``type`` is one of the ``EV_*`` names below; its keys are
exactly the TypedDict's required keys plus at most its optional ones. ``EVENT_KEYS`` and
``OPTIONAL_EVENT_KEYS`` (re-exported by ``schema``) are derived from these types, so the types are
the one definition that writers, the collector and readers share (``docs/trace-format.md``
specifies each). A tensor inside an event is a ``Tensor``: a named tuple, written as a JSON list.
"""

from __future__ import annotations

from typing import Any, Final, NamedTuple, TypedDict

EV_RANK_START: Final = "rank_start"
EV_PROCESS_GROUP: Final = "pg"
EV_COLLECTIVE: Final = "coll"
EV_BATCH: Final = "batch"
EV_STEP: Final = "step"
EV_RNG: Final = "rng"
EV_SNAPSHOT: Final = "snapshot"
EV_MODULES: Final = "modules"
EV_MODULE_FP: Final = "mod"
EV_AGENT_ERROR: Final = "agent_error"
EV_DROP: Final = "drop"
EV_STUCK: Final = "stuck"
EV_ALIVE: Final = "alive"
EV_KERNEL_OP: Final = "kop"
EV_FILES: Final = "files"
EV_URANDOM: Final = "urandom"
EV_NUMERICS: Final = "numerics"
EV_COMPILED: Final = "compiled"
EV_OP_FP: Final = "aop"
EV_MEMORY: Final = "memory"
EV_OOM: Final = "oom"
EV_FLIGHT_DUMP: Final = "flight_dump"
EV_CUPTI: Final = "cupti"
EV_CUPTI_STATE: Final = "cupti_state"
EV_STATE: Final = "state"
EV_END: Final = "end"


class Tensor(NamedTuple):
    """A tensor as coll, batch and snapshot events record it (a JSON list in this order)."""

    role: str
    """``"i"`` (an input, before the op), ``"o"`` (an output, after it), ``""`` (batches, params)."""
    dtype: str
    shape: list[int]
    fp: Any
    """The fingerprint (an int once written; a pending device value while in the agent)."""
    algo: str
    nonfinite: Any
    blob: Any
    """The spool blob id of its bytes, or ``NO_BLOB``."""
    device: str


TENSOR_FIELDS: Final = Tensor._fields
NO_BLOB: Final = -1


class _RankStart(TypedDict):
    type: str
    format_version: int
    rank: int
    world_size: int
    local_rank: int
    pid: int
    host: str
    argv: list[str]
    orig_argv: list[str]
    executable: str
    cwd: str
    env: dict[str, str]
    versions: dict[str, Any]
    threads: dict[str, Any]
    determinism: dict[str, Any]
    script: dict[str, Any]
    policy: dict[str, Any]
    start_ns: int
    fingerprint_algos: dict[str, Any]


class RankStart(_RankStart, total=False):
    t0_wall_ns: int
    """Wall-clock ns of the rank's ``t_ns == 0`` (format 3)."""
    numerics: dict[str, Any]
    """The replay key when recording started (``trace/numerics.py``; format 3)."""


class ProcessGroup(TypedDict):
    type: str
    pg: int
    name: str
    ranks: list[int]
    backend: str
    size: int
    group_rank: int


# "async" is a keyword: the optional keys are declared in the functional form, as a base.
_CollOptional = TypedDict("_CollOptional", {"extra": dict[str, Any], "async": bool}, total=False)


class Coll(_CollOptional):
    type: str
    seq: int
    step: int
    micro: int
    op: str
    pg: int
    reduce_op: str | None
    root: int | None
    t_ns: int
    dur_ns: int
    tensors: list[Tensor]


class _Batch(TypedDict):
    type: str
    step: int
    micro: int
    index: int
    loader: int
    structure: Any
    tensors: list[Tensor]


class Batch(_Batch, total=False):
    rng: int
    """Format 4: the blob of the process's RNG states right after the fetch, present only where the
    fetch changed them (a dataset or collate function drawing random numbers in the process)."""


class _Step(TypedDict):
    type: str
    step: int
    micro_steps: int
    colls: int
    params: list[list[Any]]
    loss: list[float]
    t_ns: int


class Step(_Step, total=False):
    cpu_ns: list[int]
    """``[agent hooks, writer]``: cumulative CPU ns recording has cost the rank."""
    counters: dict[str, int]
    """The agent's counters so far (``agent/counters.py``), for the sidecar's metrics."""
    micro_t_ns: list[int]
    """When each of the step's ``backward()`` calls returned (format 4): the micro-steps' ends."""


class Rng(TypedDict):
    type: str
    step: int
    states: dict[str, Any]


class Snapshot(TypedDict):
    type: str
    step: int
    blob: int
    nbytes: int
    params: list[list[Any]]


class Modules(TypedDict):
    type: str
    modules: list[dict[str, Any]]


class ModuleFp(TypedDict):
    type: str
    step: int
    micro: int
    idx: int
    name: str
    kind: str
    fp: int
    algo: str
    nonfinite: bool


class _AgentError(TypedDict):
    type: str
    where: str
    message: str
    traceback: str


class AgentError(_AgentError, total=False):
    step: int
    seq: int


class _Files(TypedDict):
    """Files the program read (before writing them) and wrote since the last ``files`` event."""

    type: str
    read: list[dict[str, Any]]
    """``{"path", "size", "mtime_ns", "sha256"}`` (sha256 None above 1 MiB)."""
    written: list[dict[str, Any]]
    """``{"path", "existed"}``: written, created, renamed or removed; whether it existed before."""
    overflow: int
    """Paths not kept beyond the ledger's bound (``agent/files.py``)."""


class Files(_Files, total=False):
    listed: list[dict[str, Any]]
    """Format 4: folders the program listed (``os.listdir``/``scandir``, glob, ``Path.iterdir``):
    ``{"path", "entries": [[name, is_dir, size, mtime_ns], ...], "truncated"}``, so a replay where
    the folder is gone (a dataset's) still lists it."""


class OpFp(TypedDict):
    """One op of the ``--op-fingerprints`` window (``agent/op_tap.py``)."""

    type: str
    step: int
    idx: int
    """Its number among the window's ops of the step, from 0."""
    name: str
    """The overload: ``aten::mm``, ``aten::add_.Tensor``, ``my_ext::op``."""
    module: str
    """The module whose forward ran it ("" in backward and outside modules)."""
    in_fp: int
    out_fp: int


class Urandom(TypedDict):
    """What ``os.urandom`` returned to the program since the last ``urandom`` event."""

    type: str
    calls: list[list[Any]]
    """``[n, hex]`` per call, in order."""
    overflow: int
    """Calls not kept beyond the bounds (``agent/entropy.py``)."""


class Numerics(TypedDict):
    """Flags of the replay key that changed during ``step`` (in effect from its end on)."""

    type: str
    step: int
    flags: dict[str, Any]


class _Compiled(TypedDict):
    type: str
    step: int
    """The step during which (or, at the end, after which) the graphs ran."""
    calls: dict[str, int]
    """Calls of each Inductor graph (by its key) since the last ``compiled`` event."""
    graphs: list[dict[str, Any]]
    """Graphs first run since the last event: ``{"graph", "devices", "kernels", "n_kernels",
    "aten_calls", "nondeterministic"}`` (``agent/compiled.py``)."""


class Compiled(_Compiled, total=False):
    modules: list[str]
    """In the first event: the named modules that run compiled."""
    error: str
    """Why some compiled calls were not counted."""


class Drop(TypedDict):
    type: str
    what: str
    count: int
    nbytes: int
    reason: str


class Stuck(TypedDict):
    type: str
    seq: int
    step: int
    op: str
    pg: int
    t_ns: int
    waited_ns: int


class KernelOp(TypedDict):
    """One call of an op on the nondeterministic-kernel tape (``agent/tape.py``)."""

    type: str
    seq: int
    step: int
    micro: int
    op: str
    tensors: list[Tensor]


class _FlightDump(TypedDict):
    """The payload flight recorder (``--payloads window:N``, ``agent/flight.py``) wrote what it
    held, because the run failed; written after the blobs and the snapshot it names."""

    type: str
    reason: str
    """``nonfinite``, ``exception``, ``oom``, ``sigterm`` or ``stuck``."""
    detail: str
    first_step: int
    """The spool now holds the payloads of steps ``first_step..last_step`` (some written by an
    earlier dump) and, unless ``snapshot_step`` is -1, the snapshot of ``first_step``."""
    last_step: int
    """The step in progress when the dump was taken (its payloads so far)."""
    snapshot_step: int
    blobs: int
    """Payload blobs this dump wrote (RNG states included)."""
    nbytes: int
    dropped: int
    """Payloads dropped at the memory bound (--window-bytes) since the last dump. A dump never
    names a step range with a hole in it: ``first_step..last_step`` is empty when no complete
    window reached the failure (then ``hole_step`` says which step could not be held whole)."""
    t_ns: int


class FlightDump(_FlightDump, total=False):
    hole_step: int
    """The last step whose payloads the flight recorder could not all hold (the window restarted
    at the next snapshot): present where it left no complete window for this dump."""


class _Memory(TypedDict):
    type: str
    step: int
    device: int
    """The CUDA device index whose allocator this is (the rank's current device)."""
    stats: dict[str, int]
    """torch's allocator counters at the step's end (``agent/allocations.py`` STATS)."""


class Memory(_Memory, total=False):
    """The CUDA caching allocator during one step (format 4; ``agent/allocations.py``)."""

    actions: list[list[int]]
    """The allocator's actions in a history step, in order: ``[micro, t_ns, action, addr, bytes,
    stream, device, site]`` (action: ``ALLOC_ACTION_CODES``; site: index into ``sites`` or -1)."""
    sites: list[str]
    full: bool
    """The step had more actions than torch's ring holds: its earliest are missing."""
    base: dict[str, int]
    """``{"requested", "reserved"}`` bytes when the step's history began."""
    moved: bool
    """torch's counters moved while the history was read and cleared at the step's end (another
    thread allocated or freed): those actions are in no step's ``actions``."""
    error: str
    """Why this process records no allocator history."""
    final: bool
    """Written at the end of recording for the step in progress (its actions; no step ended)."""


class Oom(TypedDict):
    """The CUDA caching allocator could not allocate (format 4): its snapshot at that moment."""

    type: str
    step: int
    micro: int
    t_ns: int
    device: int
    requested: int
    """Bytes asked for (-1: not known, when seen only as the uncaught exception at exit)."""
    device_total: int
    """The device's memory, or the allowed part of it (``set_per_process_memory_fraction``)."""
    device_free: int
    """What the driver reported free."""
    stats: dict[str, int]
    blob: int
    """The blob of ``torch.cuda.memory._snapshot()`` as JSON, or ``NO_BLOB`` past the first few."""
    nbytes: int


class Cupti(TypedDict):
    """CUDA kernels and copies captured by CUPTI (format 4; ``agent/cupti``), a batch of rows."""

    type: str
    kernels: list[list[int]]
    """``[step, micro, seq, corr, start_ns, end_ns, device, stream, name]``: ``name`` is a code in
    this process's kernel-name table (``names``)."""
    copies: list[list[int]]
    """``[step, micro, seq, corr, start_ns, end_ns, device, stream, kind, bytes]`` (``COPY_KINDS``)."""
    names: list[str]
    """Kernel names first used in this event; the first gets code ``name_base``."""
    name_base: int


class _CuptiState(TypedDict):
    type: str
    state: str
    """``off``, ``armed``, ``disarmed``, ``paused``, ``lost`` or ``error`` (``CUPTI_STATES``)."""
    reason: str
    step: int
    t_ns: int


class CuptiState(_CuptiState, total=False):
    """The CUPTI capture started, stopped, stood aside or gave up (format 4; ``agent/cupti``)."""

    clock: list[int]
    """``[cupti_ns, t_ns]``: a CUPTI timestamp and the rank's ``t_ns`` read together when armed."""
    detail: dict[str, Any]
    """What was found: libcupti's version and path, the subscriber mode, the probes' results."""


class Alive(TypedDict):
    type: str
    seq: int
    step: int
    t_ns: int


class State(TypedDict):
    """What a process was doing when a dump request (``RUN/spool/dump-request``,
    ``trace/dump_request.py``) asked: written by the agent's writer thread (``agent/state_dump.py``),
    once per request id, even while the training thread is blocked."""

    type: str
    id: int
    """The request's id."""
    reason: str
    """The request's reason (``stuck ranks [0]``, ``fsdp-replay dump``)."""
    t_ns: int
    t_wall_ns: int
    step: int
    micro: int
    seq: int
    """The position: the step, micro-step and next collective's sequence number."""
    recording: bool
    """False where the agent had stopped recording after an internal error (the stacks still hold)."""
    inflight: dict[str, Any] | None
    """The collective the rank waits in (seq, step, op, pg, t_ns, waited_ns), or None."""
    threads: list[dict[str, Any]]
    """The Python threads, the main thread first: name, ident, main, agent (one of ours), frames
    (``[file, line, function, source, lib]``, outermost first, at most ``STATE_MAX_FRAMES``, the
    innermost kept) and frames_dropped."""
    threads_dropped: int


class _End(TypedDict):
    type: str
    reason: str
    steps: int
    colls: int
    t_ns: int
    counters: dict[str, int]


class End(_End, total=False):
    inflight: dict[str, Any] | None
    exception: str | None


EVENT_TYPES: Final[dict[str, Any]] = {
    EV_RANK_START: RankStart,
    EV_PROCESS_GROUP: ProcessGroup,
    EV_COLLECTIVE: Coll,
    EV_BATCH: Batch,
    EV_STEP: Step,
    EV_RNG: Rng,
    EV_SNAPSHOT: Snapshot,
    EV_MODULES: Modules,
    EV_MODULE_FP: ModuleFp,
    EV_AGENT_ERROR: AgentError,
    EV_DROP: Drop,
    EV_FILES: Files,
    EV_URANDOM: Urandom,
    EV_NUMERICS: Numerics,
    EV_COMPILED: Compiled,
    EV_OP_FP: OpFp,
    EV_STUCK: Stuck,
    EV_ALIVE: Alive,
    EV_MEMORY: Memory,
    EV_OOM: Oom,
    EV_KERNEL_OP: KernelOp,
    EV_FLIGHT_DUMP: FlightDump,
    EV_CUPTI: Cupti,
    EV_CUPTI_STATE: CuptiState,
    EV_STATE: State,
    EV_END: End,
}
EVENT_KEYS: Final[dict[str, frozenset[str]]] = {
    ev: frozenset(t.__required_keys__) for ev, t in EVENT_TYPES.items()
}
OPTIONAL_EVENT_KEYS: Final[dict[str, frozenset[str]]] = {
    ev: frozenset(t.__optional_keys__) for ev, t in EVENT_TYPES.items() if t.__optional_keys__
}
