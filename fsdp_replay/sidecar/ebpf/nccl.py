"""The NCCL host API the sidecar probes: one ``Signature`` per function, from ``nccl.h``.

Every NCCL API is exported twice at one address: ``pncclX`` (strong) and ``ncclX`` (a weak alias,
``NCCL_API`` in ``src/include/core.h``). A uprobe on either is the same probe point, so each
signature names the fallback chain ``ncclX`` -> ``pncclX`` and exactly one is attached. A function
that a library version does not export (``ncclCommShrink`` before 2.27, ``ncclAlltoAll`` before
2.28) is skipped at attach time and reported, not an error.

``ncclBcast(buff, ...)`` is not probed: it calls ``ncclBroadcast(buff, buff, ...)`` through the
exported symbol (seen in 2.28.9 and 2.32.3), so probing both would record every such call twice.
"""

from __future__ import annotations

from fsdp_replay.sidecar.ebpf.signatures import INT, SIZE, STRUCT, Param, Signature

UNIQUE_ID_BYTES = 128
"""``NCCL_UNIQUE_ID_BYTES``: ``ncclUniqueId`` is a 128-byte struct, passed by value."""


# ncclConfig_t (nccl.h, append-only and versioned by its leading size/magic/version): commName has
# been at byte 48 since it was added, after size(0) magic(8) version(12) blocking(16)
# cgaClusterSize(20) minCTAs(24) maxCTAs(28) netName(32) splitShare(40) trafficClass(44).
# A config whose size does not reach past commName comes from a header without it.
CONFIG_MAGIC = 0xCAFEBEEF
"""``NCCL_API_MAGIC``, the second field of every initialized ``ncclConfig_t``."""
CONFIG_COMM_NAME_OFFSET = 48
CONFIG_MIN_SIZE_BYTES = CONFIG_COMM_NAME_OFFSET + 8


def _api(name: str, *params: Param, **roles: str) -> Signature:
    return Signature(name=name, params=params, symbols=(name, "p" + name), **roles)


_send = Param("sendbuff")
_recv = Param("recvbuff")
_count = Param("count", SIZE)
_dtype = Param("datatype", INT)
_op = Param("op", INT)
_root = Param("root", INT)
_peer = Param("peer", INT)
_comm = Param("comm")
_stream = Param("stream")
_config = Param("config")
_newcomm = Param("newcomm")
_nranks = Param("nranks", INT)
_rank = Param("rank", INT)
_comm_id = Param("commId", STRUCT, UNIQUE_ID_BYTES)

COLLECTIVES: tuple[Signature, ...] = (
    _api("ncclAllReduce", _send, _recv, _count, _dtype, _op, _comm, _stream),
    _api("ncclReduceScatter", _send, _recv, Param("recvcount", SIZE), _dtype, _op, _comm, _stream),
    _api("ncclAllGather", _send, _recv, Param("sendcount", SIZE), _dtype, _comm, _stream),
    _api("ncclBroadcast", _send, _recv, _count, _dtype, _root, _comm, _stream),
    _api("ncclReduce", _send, _recv, _count, _dtype, _op, _root, _comm, _stream),
    _api("ncclSend", _send, _count, _dtype, _peer, _comm, _stream),
    _api("ncclRecv", _recv, _count, _dtype, _peer, _comm, _stream),
    _api("ncclAlltoAll", _send, _recv, _count, _dtype, _comm, _stream),
)

GROUPS: tuple[Signature, ...] = (
    _api("ncclGroupStart"),
    _api("ncclGroupEnd"),
)

COMMUNICATORS: tuple[Signature, ...] = (
    _api(
        "ncclCommInitRank",
        _newcomm,
        _nranks,
        _comm_id,
        _rank,
        new_comm_param="newcomm",
        nranks_param="nranks",
        rank_param="rank",
    ),
    _api(
        "ncclCommInitRankConfig",
        _newcomm,
        _nranks,
        _comm_id,
        _rank,
        _config,
        new_comm_param="newcomm",
        config_param="config",
        nranks_param="nranks",
        rank_param="rank",
    ),
    _api(
        "ncclCommInitAll",
        Param("comms"),
        Param("ndev", INT),
        Param("devlist"),
        new_comm_param="comms",
        nranks_param="ndev",
    ),
    _api(
        "ncclCommSplit",
        _comm,
        Param("color", INT),
        Param("key", INT),
        _newcomm,
        _config,
        new_comm_param="newcomm",
        config_param="config",
    ),
    _api(
        "ncclCommShrink",
        _comm,
        Param("excludeRanksList"),
        Param("excludeRanksCount", INT),
        _newcomm,
        _config,
        Param("shrinkFlags", INT),
        new_comm_param="newcomm",
        config_param="config",
    ),
    _api("ncclCommFinalize", _comm),
    _api("ncclCommAbort", _comm),
    _api("ncclCommDestroy", _comm),
)

API: tuple[Signature, ...] = COLLECTIVES + GROUPS + COMMUNICATORS
"""Everything the sidecar probes by default."""

LIBRARY_PATTERN = "libnccl.so"
"""Substring of a mapped file's path that marks it as an NCCL library."""

DTYPES = {
    0: "int8",
    1: "uint8",
    2: "int32",
    3: "uint32",
    4: "int64",
    5: "uint64",
    6: "float16",
    7: "float32",
    8: "float64",
    9: "bfloat16",
    10: "float8e4m3",
    11: "float8e5m2",
}
"""ncclDataType_t codes (2.28 .. 2.32)."""
DTYPE_BYTES = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2, 10: 1, 11: 1}
REDOPS = {0: "sum", 1: "prod", 2: "max", 3: "min", 4: "avg"}
"""ncclRedOp_t built-ins; larger values are ops from ncclRedOpCreatePreMulSum."""
RESULTS = {
    0: "ncclSuccess",
    1: "ncclUnhandledCudaError",
    2: "ncclSystemError",
    3: "ncclInternalError",
    4: "ncclInvalidArgument",
    5: "ncclInvalidUsage",
    6: "ncclRemoteError",
    7: "ncclInProgress",
}


def by_name(*names: str) -> tuple[Signature, ...]:
    """The signatures of the named API functions, in the given order."""
    table = {s.name: s for s in API}
    missing = [n for n in names if n not in table]
    if missing:
        raise ValueError(f"not NCCL functions the sidecar knows: {missing} (known: {sorted(table)})")
    return tuple(table[n] for n in names)
