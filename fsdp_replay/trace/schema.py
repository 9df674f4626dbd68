"""The one versioned trace schema every component imports.

Two on-disk forms share it:

- the **spool**: what the in-process agent appends while training runs (``spool.py``), one
  folder per rank of checksummed records holding JSON events and raw blobs;
- the **trace**: the Zarr v3 store the collector builds from spools (``collect.py``), one group
  per rank, one 1-D array per field, and content-addressed blobs shared by all ranks.

``docs/trace-format.md`` specifies both; ``tests/test_schema.py`` pins the key sets below so
that a change here is a deliberate format change.
"""

from __future__ import annotations

import re
from typing import Final

# Bumped on any change a reader of the previous version would misread.
# 2: the sk64 fingerprint algorithm, steps.agent_cpu_ns / writer_cpu_ns (step.cpu_ns).
# 3: each rank group lists its arrays with their lengths and digests (ARRAYS_ATTR) and says how far
#    its record is complete (COMPLETENESS_ATTR); `alive` events; blobs carry a completion mark.
FORMAT_VERSION: Final = 3
# Readers accept these; anything else raises TraceVersionError. A version-1 trace has no
# agent_cpu_ns/writer_cpu_ns columns in `steps` and no sk64 fingerprints. Versions 1 and 2 have no
# array list, so a missing chunk of theirs cannot be told from zeros, and no completeness record:
# readers derive it from the rank's end event and damage list.
READABLE_VERSIONS: Final = frozenset({1, 2, 3})

# ---------------------------------------------------------------------------------------------
# Paths (relative to the output folder of `fsdp-replay record --out DIR`).
SPOOL_DIR: Final = "spool"
TRACE_DIR: Final = "trace.zarr"
RANK_SPOOL_FMT: Final = "rank-{rank:05d}"
SEGMENT_FMT: Final = "seg-{index:06d}.fsrs"
SEGMENT_RE: Final = re.compile(r"^seg-(\d{6})\.fsrs$")
RANK_SPOOL_RE: Final = re.compile(r"^rank-(\d{5})$")
RANK_GROUP_FMT: Final = "rank_{rank:05d}"
RANK_GROUP_RE: Final = re.compile(r"^rank_(\d{5})$")
BLOBS_GROUP: Final = "blobs"
ROOT_ATTR: Final = "fsdp_replay"
# Rank-group attributes (format 3): {"<table>/<column>": {"len": n, "blake2b": hex}} for every
# column array, and how far the rank's record is complete (see docs/trace-format.md#completeness).
ARRAYS_ATTR: Final = "arrays"
COMPLETENESS_ATTR: Final = "completeness"
# Blob arrays get this attribute once all their bytes are written: a blob without it was left
# by a collector that was killed mid-write, and is rewritten.
BLOB_COMPLETE_ATTR: Final = "complete"

# ---------------------------------------------------------------------------------------------
# Spool records. A segment starts with SEGMENT_MAGIC + a JSON header line; then records, each
# a fixed header (RECORD_HEADER) followed by `length` body bytes whose CRC-32 is `crc`.
SEGMENT_MAGIC: Final = b"FSRSPOOL"
RECORD_MAGIC: Final = 0xF5D4
# magic u16, kind u8, flags u8, length u32, crc32 u32, json_length u32 (little endian)
RECORD_HEADER: Final = "<HBBIII"
RECORD_HEADER_SIZE: Final = 16
KIND_EVENT: Final = 1  # body: JSON event
KIND_BLOB: Final = 2  # body: JSON {"blob": id, "nbytes": n} then n raw bytes
RECORD_KINDS: Final = frozenset({KIND_EVENT, KIND_BLOB})
# A collective in flight this long is written down as `stuck` (so a hang killed by SIGKILL still
# shows where each rank waited).
STUCK_AFTER_NS: Final = 2_000_000_000
# Segments roll over past this size so a damaged file costs at most one segment.
SEGMENT_MAX_BYTES: Final = 64 << 20

# ---------------------------------------------------------------------------------------------
# Events (the "type" field of a KIND_EVENT record) and the keys each one carries.
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
EV_END: Final = "end"

EVENT_KEYS: Final[dict[str, frozenset[str]]] = {
    EV_RANK_START: frozenset(
        {
            "type",
            "format_version",
            "rank",
            "world_size",
            "local_rank",
            "pid",
            "host",
            "argv",
            "orig_argv",
            "executable",
            "cwd",
            "env",
            "versions",
            "threads",
            "determinism",
            "script",
            "policy",
            "start_ns",
            "fingerprint_algos",
        }
    ),
    EV_PROCESS_GROUP: frozenset({"type", "pg", "name", "ranks", "backend", "size", "group_rank"}),
    EV_COLLECTIVE: frozenset(
        {"type", "seq", "step", "micro", "op", "pg", "reduce_op", "root", "t_ns", "dur_ns", "tensors"}
    ),
    EV_BATCH: frozenset({"type", "step", "micro", "index", "loader", "structure", "tensors"}),
    EV_STEP: frozenset({"type", "step", "micro_steps", "colls", "params", "loss", "t_ns"}),
    EV_RNG: frozenset({"type", "step", "states"}),
    EV_SNAPSHOT: frozenset({"type", "step", "blob", "nbytes", "params"}),
    EV_MODULES: frozenset({"type", "modules"}),
    EV_MODULE_FP: frozenset({"type", "step", "micro", "idx", "name", "kind", "fp", "algo", "nonfinite"}),
    EV_AGENT_ERROR: frozenset({"type", "where", "message", "traceback"}),
    EV_DROP: frozenset({"type", "what", "count", "nbytes", "reason"}),
    EV_STUCK: frozenset({"type", "seq", "step", "op", "pg", "t_ns", "waited_ns"}),
    EV_ALIVE: frozenset({"type", "seq", "step", "t_ns"}),
    EV_END: frozenset({"type", "reason", "steps", "colls", "t_ns", "counters"}),
}
# Keys an event may carry beyond EVENT_KEYS; readers tolerate only these extras.
OPTIONAL_EVENT_KEYS: Final[dict[str, frozenset[str]]] = {
    EV_COLLECTIVE: frozenset({"extra", "async"}),
    # the uncaught exception the process died of (repr), or null
    EV_END: frozenset({"inflight", "exception"}),
    # [agent hooks, writer thread] CPU ns so far: what recording has cost the process, by step
    EV_STEP: frozenset({"cpu_ns"}),
    # where recording stopped: the step and collective sequence number in progress
    EV_AGENT_ERROR: frozenset({"step", "seq"}),
    # wall-clock time (time.time_ns) of t_ns == 0, so that ranks' event times can be compared
    EV_RANK_START: frozenset({"t0_wall_ns"}),
}
# A rank whose writer has had nothing to write for this long writes an `alive` event: a rank
# killed while busy elsewhere still shows how far it got, and desync can tell "never issued"
# from "not written yet".
ALIVE_EVERY_NS: Final = 1_000_000_000

# A tensor as recorded in coll/batch/step events: a JSON list with these fields, in order.
# role: "i" (input, before the op) / "o" (output, after) / "" (batches, params).
TENSOR_FIELDS: Final = ("role", "dtype", "shape", "fp", "algo", "nonfinite", "blob", "device")
NO_BLOB: Final = -1

# Fingerprint algorithms (see docs/trace-format.md#fingerprints); `algo` is one of these names.
FP_ZLIB64: Final = "zlib64"  # CPU: crc32(bytes) << 32 | (sum of little-endian int64 words) mod 2**32
FP_LIN64: Final = "lin64"  # CUDA: position-weighted sums of int32 words, mixed to 64 bits
FP_SK64: Final = "sk64"  # CPU, large tensors: crc32 of the row and column sums of int64 words
FINGERPRINT_ALGOS: Final = (FP_ZLIB64, FP_LIN64, FP_SK64)
# On the CPU, tensors of at least this many bytes get sk64 (two vectorized passes, several times
# faster than crc32), smaller ones zlib64 (fewer calls: the fixed cost dominates).
SK64_MIN_BYTES: Final = 64 << 10

# Collective ops as the c10d dispatcher names them (torch 2.4 .. 2.13). The trace stores the
# name table per rank (attrs "op_names") so newer ops need no schema change.
C10D_OPS: Final = (
    "allgather_",
    "_allgather_base_",
    "allgather_coalesced_",
    "allgather_into_tensor_coalesced_",
    "reduce_scatter_",
    "_reduce_scatter_base_",
    "reduce_scatter_tensor_coalesced_",
    "allreduce_",
    "allreduce_coalesced_",
    "broadcast_",
    "reduce_",
    "alltoall_",
    "alltoall_base_",
    "gather_",
    "scatter_",
    "send",
    "recv_",
    "recv_any_source_",
    "barrier",
)

# Point-to-point ops: which side of the "tensors" argument they use.
SEND_OPS: Final = frozenset({"send"})
RECV_OPS: Final = frozenset({"recv_", "recv_any_source_"})
P2P_OPS: Final = SEND_OPS | RECV_OPS

# Environment variables recorded verbatim (after redaction) when set. Exact names, then prefixes.
ENV_ALLOW: Final = frozenset(
    {
        "WORLD_SIZE",
        "RANK",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "ROLE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "PYTHONHASHSEED",
        "CUBLAS_WORKSPACE_CONFIG",
        "CUDA_VISIBLE_DEVICES",
        "CUDA_LAUNCH_BLOCKING",
        "PYTORCH_CUDA_ALLOC_CONF",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING",
        "TORCH_DISTRIBUTED_DEBUG",
        "OPENBLAS_CORETYPE",
        "OPENBLAS_NUM_THREADS",
        "PYTHONPATH",
        "TORCHELASTIC_RUN_ID",
    }
)
ENV_ALLOW_PREFIXES: Final = ("NCCL_", "TORCH_", "CUDNN_", "FSDP_REPLAY_", "GLOO_", "CUBLAS")
# What replaces a secret in argv, env and run.json (a URL keeps all but its password). The rules
# that decide what is a secret are in redact.py and docs/trace-format.md ("What is redacted").
REDACTED: Final = "<redacted>"
