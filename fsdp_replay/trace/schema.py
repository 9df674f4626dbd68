"""The one versioned trace schema every component imports.

Two on-disk forms share it:

- the **spool**: what the in-process agent appends while training runs (``spool.py``), one
  folder per rank of checksummed records holding JSON events and raw blobs;
- the **trace**: the Zarr v3 store the collector builds from spools (``collect.py``), one group
  per rank, one 1-D array per field, and content-addressed blobs shared by all ranks.

``docs/trace-format.md`` specifies both; ``tests/trace/test_schema.py`` pins the key sets below so
that a change here is a deliberate format change.
"""

from __future__ import annotations

import hashlib
import re
from typing import Final

# Re-exported: the event vocabulary is defined in events.py, the op table in ops.py.
from fsdp_replay.trace.events import (
    EV_AGENT_ERROR as EV_AGENT_ERROR,
)
from fsdp_replay.trace.events import (
    EV_ALIVE as EV_ALIVE,
)
from fsdp_replay.trace.events import (
    EV_BATCH as EV_BATCH,
)
from fsdp_replay.trace.events import (
    EV_COLLECTIVE as EV_COLLECTIVE,
)
from fsdp_replay.trace.events import (
    EV_COMPILED as EV_COMPILED,
)
from fsdp_replay.trace.events import (
    EV_CUPTI as EV_CUPTI,
)
from fsdp_replay.trace.events import (
    EV_CUPTI_STATE as EV_CUPTI_STATE,
)
from fsdp_replay.trace.events import (
    EV_DROP as EV_DROP,
)
from fsdp_replay.trace.events import (
    EV_END as EV_END,
)
from fsdp_replay.trace.events import (
    EV_FILES as EV_FILES,
)
from fsdp_replay.trace.events import (
    EV_FLIGHT_DUMP as EV_FLIGHT_DUMP,
)
from fsdp_replay.trace.events import (
    EV_KERNEL_OP as EV_KERNEL_OP,
)
from fsdp_replay.trace.events import (
    EV_MEMORY as EV_MEMORY,
)
from fsdp_replay.trace.events import (
    EV_MODULE_FP as EV_MODULE_FP,
)
from fsdp_replay.trace.events import (
    EV_MODULES as EV_MODULES,
)
from fsdp_replay.trace.events import (
    EV_NUMERICS as EV_NUMERICS,
)
from fsdp_replay.trace.events import (
    EV_OOM as EV_OOM,
)
from fsdp_replay.trace.events import (
    EV_OP_FP as EV_OP_FP,
)
from fsdp_replay.trace.events import (
    EV_PROCESS_GROUP as EV_PROCESS_GROUP,
)
from fsdp_replay.trace.events import (
    EV_RANK_START as EV_RANK_START,
)
from fsdp_replay.trace.events import (
    EV_RNG as EV_RNG,
)
from fsdp_replay.trace.events import (
    EV_SNAPSHOT as EV_SNAPSHOT,
)
from fsdp_replay.trace.events import (
    EV_STATE as EV_STATE,
)
from fsdp_replay.trace.events import (
    EV_STEP as EV_STEP,
)
from fsdp_replay.trace.events import (
    EV_STUCK as EV_STUCK,
)
from fsdp_replay.trace.events import (
    EV_URANDOM as EV_URANDOM,
)
from fsdp_replay.trace.events import (
    EVENT_KEYS as EVENT_KEYS,
)
from fsdp_replay.trace.events import (
    NO_BLOB as NO_BLOB,
)
from fsdp_replay.trace.events import (
    OPTIONAL_EVENT_KEYS as OPTIONAL_EVENT_KEYS,
)
from fsdp_replay.trace.events import (
    TENSOR_FIELDS as TENSOR_FIELDS,
)
from fsdp_replay.trace.ops import (
    C10D_OPS as C10D_OPS,
)
from fsdp_replay.trace.ops import (
    P2P_OPS as P2P_OPS,
)
from fsdp_replay.trace.ops import (
    RECV_OPS as RECV_OPS,
)
from fsdp_replay.trace.ops import (
    SEND_OPS as SEND_OPS,
)

# Bumped on any change a reader of the previous version would misread.
# 2: the sk64 fingerprint algorithm, steps.agent_cpu_ns / writer_cpu_ns (step.cpu_ns).
# 3: each rank group lists its arrays with their lengths and digests (ARRAYS_ATTR) and says how far
#    its record is complete (COMPLETENESS_ATTR); `alive` events; blobs carry a completion mark.
# 4: CUDA kernels and copies captured by CUPTI (tables `kernels`, `copies`; `cupti` and
#    `cupti_state` events; rank attributes `kernel_names`, `cupti`); the micro-steps' ends and the
#    CUDA caching allocator (tables `micro_steps`, `allocs`, `memory_steps`; `memory` and `oom`
#    events; `step.micro_t_ns`; rank attributes `ooms`, `alloc_site_names`).
# 5: snapshot blobs are raw tensor bytes behind a JSON index (agent/snapshot_blob.py), no longer
#    torch.save pickles; the optional `signature` of the root and of each rank group
#    (trace/signing.py); the optional `rank_start.script.started`.
FORMAT_VERSION: Final = 5
# Readers accept these; anything else raises TraceVersionError. A version-1 trace has no
# agent_cpu_ns/writer_cpu_ns columns in `steps` and no sk64 fingerprints. Versions 1 and 2 have no
# array list, so a missing chunk of theirs cannot be told from zeros, and no completeness record:
# readers derive it from the rank's end event and damage list.
# Snapshots of versions 1-4 are pickles: they load through torch's weights-only allow-list.
READABLE_VERSIONS: Final = frozenset({1, 2, 3, 4, 5})

# ---------------------------------------------------------------------------------------------
# Paths (relative to the output folder of `fsdp-replay record --out DIR`).
SPOOL_DIR: Final = "spool"
TRACE_DIR: Final = "trace.zarr"
RANK_SPOOL_FMT: Final = "rank-{rank:05d}"
SEGMENT_FMT: Final = "seg-{index:06d}.fsrs"
SEGMENT_RE: Final = re.compile(r"^seg-(\d{6})\.fsrs$")
RANK_SPOOL_RE: Final = re.compile(r"^rank-(\d{5})$")
RANK_GROUP_FMT: Final = "rank_{rank:05d}"
BLOBS_GROUP: Final = "blobs"
ROOT_ATTR: Final = "fsdp_replay"
# Rank-group attributes (format 3): {"<table>/<column>": {"len": n, "blake2b": hex}} for every
# column array, and how far the rank's record is complete (see docs/trace-format.md#completeness).
ARRAYS_ATTR: Final = "arrays"
COMPLETENESS_ATTR: Final = "completeness"
# Blob arrays get this attribute once all their bytes are written: a blob without it was left
# by a collector that was killed mid-write, and is rewritten.
BLOB_COMPLETE_ATTR: Final = "complete"
# The collector's own state in a rank group (readers ignore both): the rank attribute holding
# where the next collection resumes (trace/rank_store.py), and the table of the spool's blob ids.
COLLECTOR_ATTR: Final = "collector"
COLLECTOR_TABLE: Final = "_collector"

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
# Blob ids from here on are the payload flight recorder's (`--payloads window:N`): events name
# such a blob before it is written (it is held in memory), and it is written only if the run fails
# (a `flight_dump` event follows). One the spool never holds was not kept: no payload, no loss.
FLIGHT_BLOB_BASE: Final = 1 << 48
AGENT_CPU_PARTS: Final = ("collectives", "tape", "payloads", "snapshots", "cxx")
"""The parts of the hooks' CPU time the step and end counters carry as ``agent_cpu_<part>_ns``
(session 14 on): the collectives' hooks, the tape's Python path, keeping payloads' bytes and
snapshots (inside the other hooks), the C++ kernel and tape hook. Parts of ``agent_cpu_ns``."""
STEP_WAIT_COUNTERS: Final = ("payload_wait_ns", "blob_bytes", "blob_write_ns")
"""Counters the step table carries as columns of their own (cumulative): how long the training
waited for room for payloads (``--when-full wait``), and the writer's payload bytes and time."""
# A collective in flight this long is written down as `stuck` (so a hang killed by SIGKILL still
# shows where each rank waited).
STUCK_AFTER_NS: Final = 2_000_000_000
# A `state` event's bounds (agent/state_dump.py): frames per thread (the innermost kept), threads.
STATE_MAX_FRAMES: Final = 48
STATE_MAX_THREADS: Final = 32
# Segments roll over past this size so a damaged file costs at most one segment.
SEGMENT_MAX_BYTES: Final = 64 << 20

# ---------------------------------------------------------------------------------------------
# Events (the "type" field of a KIND_EVENT record): one TypedDict each, in events.py, from which
# the key sets are derived. A tensor inside an event is an events.Tensor (a JSON list).

# A rank whose writer has had nothing to write for this long writes an `alive` event: a rank
# killed while busy elsewhere still shows how far it got, and desync can tell "never issued"
# from "not written yet".
ALIVE_EVERY_NS: Final = 1_000_000_000

# Fingerprint algorithms (see docs/trace-format.md#fingerprints); `algo` is one of these names.
FP_ZLIB64: Final = "zlib64"  # CPU: crc32(bytes) << 32 | (sum of little-endian int64 words) mod 2**32
FP_LIN64: Final = "lin64"  # CUDA: position-weighted sums of int32 words, mixed to 64 bits
FP_SK64: Final = "sk64"  # CPU, large tensors: crc32 of the row and column sums of int64 words
FINGERPRINT_ALGOS: Final = (FP_ZLIB64, FP_LIN64, FP_SK64)
# On the CPU, tensors of at least this many bytes get sk64 (two vectorized passes, several times
# faster than crc32), smaller ones zlib64 (fewer calls: the fixed cost dominates).
SK64_MIN_BYTES: Final = 64 << 10

# Collective ops: the table is ops.py. The trace stores the name table per rank (attrs
# "op_names"), so newer ops need no schema change.

# Environment variables: every one is recorded (redacted: trace/redact.py). A replay sets them as
# recorded except these, which belong to the machine and the shell the replay runs in (exact
# names, then prefixes); the launch's own (RANK, MASTER_*, ...) are handled by replayer/launch.py.
ENV_MACHINE: Final = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "PWD",
        "OLDPWD",
        "SHLVL",
        "_",
        "HOSTNAME",
        "HOST",
        "TERM",
        "COLORTERM",
        "DISPLAY",
        "MAIL",
        "TMPDIR",
        "TEMP",
        "TMP",
        "LD_LIBRARY_PATH",
        "LD_PRELOAD",
        "PYTHONHOME",
        "PYTHONSTARTUP",
        "VIRTUAL_ENV",
        "LS_COLORS",
        "EDITOR",
        "PAGER",
        "MANPATH",
        "SESSION_MANAGER",
        "WINDOWID",
        "STY",
    }
)
ENV_MACHINE_PREFIXES: Final = (
    "SSH_",
    "XDG_",
    "TERM_",
    "TMUX",
    "DBUS_",
    "CONDA_",
    "PYENV_",
    "KUBERNETES_",
    "GIT_",
    "LESS",
    "VSCODE_",
    "PIP_",
)
# Variables that make a process load code from a path or a module name they give (the dynamic
# loader's, the interpreter's, a shell's, CUDA's and NCCL's plug-ins): a trace is untrusted input,
# so a replay never takes them from it, except under `replay --trust-trace` (replayer/launch.py).
ENV_LOADS_CODE: Final = frozenset(
    {
        "PYTHONBREAKPOINT",
        "PYTHONINSPECT",
        "PYTHONUSERBASE",
        "PYTHONPLATLIBDIR",
        "PYTHONEXECUTABLE",
        "PYTHONPYCACHEPREFIX",
        "BASH_ENV",
        "ENV",
        "CUDA_INJECTION64_PATH",
        "NCCL_NET_PLUGIN",
        "NCCL_TUNER_PLUGIN",
        "NCCL_PROFILER_PLUGIN",
        "NCCL_ENV_PLUGIN",
        "MPLBACKEND",
    }
)
ENV_LOADS_CODE_PREFIXES: Final = ("LD_", "DYLD_")
# What replaces a secret in argv, env, run.json and any text the tool writes (a URL keeps all but
# its password). The rules that decide what is a secret are in redact.py and docs/trace-format.md
# ("What is redacted"). Without a run's key the marker is REDACTED; with one (``fsdp-replay record``
# makes one per run, trace/redact_key.py) it carries the first 16 hex digits of HMAC-SHA256(key,
# the replaced text), so that a machine holding the key can tell whether a value of its own is the
# recorded one, while the trace alone tells nothing about the value.
REDACTED: Final = "<redacted>"
REDACTED_KEYED_FMT: Final = "<redacted:hmac-sha256:{digest}>"
REDACTED_DIGEST_HEX_CHARS: Final = 16
REDACTED_RE: Final = re.compile(r"<redacted(?::hmac-sha256:[0-9a-f]{16})?>")


def is_redacted(value: object) -> bool:
    """Whether ``value`` is one redaction marker, whole: a value that was a secret entirely."""
    return isinstance(value, str) and REDACTED_RE.fullmatch(value) is not None


def has_redacted(value: object) -> bool:
    """Whether ``value`` holds a redaction marker anywhere (a URL's password, an argument)."""
    return isinstance(value, str) and REDACTED_RE.search(value) is not None


# ---------------------------------------------------------------------------------------------
# Trace (Zarr) layout: each rank group holds these tables, each a group of equal-length 1-D
# column arrays (docs/trace-format.md#tables-and-columns).
TABLES: dict[str, dict[str, str]] = {
    "collectives": {
        "seq": "int64",
        "step": "int64",
        "micro": "int32",
        "op": "int16",
        "pg": "int32",
        "reduce_op": "int16",
        "root": "int32",
        "t_ns": "int64",
        "dur_ns": "int64",
        "tensor_start": "int64",
        "tensor_count": "int32",
    },
    "tensors": {
        "coll": "int64",
        "role": "uint8",
        "dtype": "int16",
        "shape_start": "int64",
        "ndim": "int16",
        "nbytes": "int64",
        "fp": "uint64",
        "algo": "int16",
        "nonfinite": "bool",
        "payload": "int64",
        "device": "int16",
    },
    "batches": {
        "step": "int64",
        "micro": "int32",
        "index": "int64",
        "loader": "int32",
        "structure": "int32",
        "tensor_start": "int64",
        "tensor_count": "int32",
        "rng": "int64",
    },
    "batch_tensors": {
        "batch": "int64",
        "dtype": "int16",
        "shape_start": "int64",
        "ndim": "int16",
        "nbytes": "int64",
        "fp": "uint64",
        "algo": "int16",
        "nonfinite": "bool",
        "payload": "int64",
        "device": "int16",
    },
    "steps": {
        "step": "int64",
        "micro_steps": "int32",
        "colls": "int64",
        "t_ns": "int64",
        "param_start": "int64",
        "param_count": "int32",
        "loss_start": "int64",
        "loss_count": "int32",
        "nonfinite": "bool",
        "agent_cpu_ns": "int64",
        "writer_cpu_ns": "int64",
        # the parts of agent_cpu_ns (AGENT_CPU_PARTS), cumulative; absent from older traces
        **{f"cpu_{part}_ns": "int64" for part in AGENT_CPU_PARTS},
        # cumulative (absent from older traces; -1 where the agent did not count): the wall time
        # the training waited for room for payloads (--when-full wait), the payload bytes the
        # writer wrote and the wall time it spent writing them
        **dict.fromkeys(STEP_WAIT_COUNTERS, "int64"),
    },
    "step_params": {"fp": "uint64", "nonfinite": "bool", "algo": "int16"},
    "losses": {"value": "float64"},
    "shapes": {"dim": "int64"},
    "rng": {"step": "int64", "payload": "int64", "python": "int64", "torch": "int64", "numpy": "int64"},
    "payloads": {"digest_hi": "uint64", "digest_lo": "uint64", "nbytes": "int64"},
    # the nondeterministic-kernel tape: one row per call, one tape_tensors row per output
    "tape": {
        "seq": "int64",
        "step": "int64",
        "micro": "int32",
        "op": "int16",
        "tensor_start": "int64",
        "tensor_count": "int32",
    },
    "tape_tensors": {
        "call": "int64",
        "dtype": "int16",
        "shape_start": "int64",
        "ndim": "int16",
        "nbytes": "int64",
        "fp": "uint64",
        "algo": "int16",
        "nonfinite": "bool",
        "payload": "int64",
        "device": "int16",
    },
    "module_fps": {
        "step": "int64",
        "micro": "int32",
        "idx": "int64",
        "name": "int32",
        "kind": "uint8",
        "fp": "uint64",
        "algo": "int16",
        "nonfinite": "bool",
    },
    "op_fps": {
        "step": "int64",
        "idx": "int64",
        "op": "int16",
        "module": "int32",
        "in_fp": "uint64",
        "out_fp": "uint64",
    },
    # format 4: CUDA kernels and copies captured by CUPTI (agent/cupti), one row per record, in
    # launch (correlation id) order; start_ns/end_ns are CUPTI's device timestamps (CUPTI_ATTR
    # holds the pair that maps them to t_ns); name: a code in the rank's "kernel_names"
    "kernels": {
        "step": "int64",
        "micro": "int32",
        "seq": "int64",
        "corr": "int64",
        "start_ns": "int64",
        "end_ns": "int64",
        "device": "int16",
        "stream": "int32",
        "name": "int32",
    },
    "copies": {
        "step": "int64",
        "micro": "int32",
        "seq": "int64",
        "corr": "int64",
        "start_ns": "int64",
        "end_ns": "int64",
        "device": "int16",
        "stream": "int32",
        "kind": "int16",
        "bytes": "int64",
    },
    # format 4: each backward()'s end; the CUDA caching allocator's actions (in --alloc-history
    # steps) and counters (every step) (agent/allocations.py)
    "micro_steps": {"step": "int64", "micro": "int32", "t_ns": "int64"},
    "allocs": {
        "step": "int64",
        "micro": "int32",
        "t_ns": "int64",
        "action": "int16",
        "addr": "int64",
        "bytes": "int64",
        "stream": "int64",
        "device": "int16",
        "site": "int32",
    },
    "memory_steps": {
        "step": "int64",
        "device": "int16",
        "allocated_end": "int64",
        "reserved_end": "int64",
        "requested_end": "int64",
        "allocated_peak": "int64",
        "reserved_peak": "int64",
        "alloc_retries": "int64",
        "ooms": "int64",
        "history": "int64",
        "requested_base": "int64",
        "reserved_base": "int64",
        "moved": "bool",
    },
}
MODULE_KIND_CODES: Final = {"fwd": 0, "bwd": 1}
# copies.kind: what a copy moved (CUPTI's memcpy kinds; array copies are "other") and memsets.
COPY_KIND_CODES: Final = {"other": 0, "htod": 1, "dtoh": 2, "dtod": 3, "htoh": 4, "ptop": 5, "memset": 6}
COPY_KINDS: Final = tuple(COPY_KIND_CODES)  # code -> kind
# cupti_state.state: what the CUPTI capture did (docs/trace-format.md#cupti_state).
CUPTI_STATES: Final = ("off", "armed", "disarmed", "paused", "lost", "error")
# Rank-group attribute (format 4): {"states": [cupti_state events], "clock": [[cupti_ns, t_ns, attempt]]}.
CUPTI_ATTR: Final = "cupti"
# allocs.action: torch's allocator trace actions (``torch.cuda.memory._snapshot()``'s
# ``device_traces[*][*].action``) as codes; an action not listed here is left out, not misread.
ALLOC_ACTION_CODES: Final = {
    "alloc": 0,
    "free_requested": 1,
    "free_completed": 2,
    "segment_alloc": 3,
    "segment_free": 4,
    "segment_map": 5,
    "segment_unmap": 6,
    "oom": 7,
    "snapshot": 8,
}
ALLOC_ACTIONS: Final = tuple(ALLOC_ACTION_CODES)  # code -> action
MODULE_KINDS: Final = tuple(MODULE_KIND_CODES)  # code -> kind
# tensors.role: the events' role letters as codes, and the codes' names in reports.
# "j": the objects a rank sent into an object collective, serialized canonically (agent/objects.py).
ROLE_CODES: Final = {"i": 0, "o": 1, "": 2, "j": 3}
ROLE_INPUT: Final = ROLE_CODES["i"]
ROLE_OUTPUT: Final = ROLE_CODES["o"]
ROLE_OBJECTS: Final = ROLE_CODES["j"]
ROLE_LETTERS: Final = {code: letter for letter, code in ROLE_CODES.items()}
ROLE_NAMES: Final = {
    ROLE_INPUT: "input",
    ROLE_OUTPUT: "output",
    ROLE_CODES[""]: "",
    ROLE_OBJECTS: "objects sent",
}


def blob_path(digest: str) -> str:
    """Where the blob of ``digest`` lives in the trace: ``blobs/<digest[:2]>/<digest>``."""
    return f"{BLOBS_GROUP}/{digest[:2]}/{digest}"


def digest_of(data: bytes | memoryview) -> str:
    """A blob's name: BLAKE2b-128 of its bytes, 32 hex digits."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()
