"""The collective ops a trace names, defined once: each op's family and the traits readers need.

A trace stores op names as strings (the rank attribute ``op_names``), so an op that is not listed
here still records and replays; only the analyses that need a trait (which ops are point to
point, whose shapes agree across a group, which ones gather) fall back to the conservative answer.
The agent-only traits (which inputs can be fingerprinted late, which ops can be completed at the
program's wait) stay with the agent, keyed by these names (``agent/collectives.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

FUNCTIONAL_NAMESPACE: Final = "_c10d_functional"

# Families: what the op computes, whatever its calling convention.
ALL_GATHER: Final = "all_gather"
REDUCE_SCATTER: Final = "reduce_scatter"
ALL_REDUCE: Final = "all_reduce"
BROADCAST: Final = "broadcast"
REDUCE: Final = "reduce"
ALL_TO_ALL: Final = "all_to_all"
GATHER: Final = "gather"
SCATTER: Final = "scatter"
SEND: Final = "send"
RECV: Final = "recv"
BARRIER: Final = "barrier"


@dataclass(frozen=True, slots=True)
class OpInfo:
    name: str
    """The name a trace stores: the c10d dispatcher op (``_allgather_base_``) or the functional op
    with its namespace (``_c10d_functional.all_gather_into_tensor``)."""
    family: str
    """What it computes (``ALL_GATHER``, ``REDUCE_SCATTER``, ...)."""
    same_shape: bool
    """Its tensors have the same dtypes and shapes on every member of the group (all-gather
    inputs, all-reduce buffers); others (all-to-all with splits, gather/scatter lists on the root)
    are compared across ranks by op, reduce op, tensor count and dtypes only."""
    functional: bool = False
    """A functional collective: its result is its output, valid after ``wait_tensor``."""

    @property
    def p2p(self) -> bool:
        """Point to point: pairwise, not ordered per process group."""
        return self.family in (SEND, RECV)

    @property
    def all_gather(self) -> bool:
        """Its output holds every rank's input, in rank order."""
        return self.family == ALL_GATHER


def _c10d(name: str, family: str, same_shape: bool) -> OpInfo:
    return OpInfo(name, family, same_shape)


def _functional(name: str, family: str, same_shape: bool = True) -> OpInfo:
    return OpInfo(f"{FUNCTIONAL_NAMESPACE}.{name}", family, same_shape, functional=True)


# The c10d dispatcher ops, then the functional ones (DTensor, FSDP2's redistribution,
# torch.compile'd collectives). Checked against what torch 2.11 and 2.13 register (the claimed range)
# by tests/agent/test_dispatcher_ops.py: an op this list lacks must be in NOT_TAKEN below.
OPS: Final[tuple[OpInfo, ...]] = (
    _c10d("allgather_", ALL_GATHER, True),
    _c10d("_allgather_base_", ALL_GATHER, True),
    _c10d("allgather_coalesced_", ALL_GATHER, True),
    _c10d("allgather_into_tensor_coalesced_", ALL_GATHER, True),
    _c10d("reduce_scatter_", REDUCE_SCATTER, True),
    _c10d("_reduce_scatter_base_", REDUCE_SCATTER, True),
    _c10d("reduce_scatter_tensor_coalesced_", REDUCE_SCATTER, True),
    _c10d("allreduce_", ALL_REDUCE, True),
    _c10d("allreduce_coalesced_", ALL_REDUCE, True),
    _c10d("broadcast_", BROADCAST, True),
    _c10d("reduce_", REDUCE, True),
    _c10d("alltoall_", ALL_TO_ALL, False),
    _c10d("alltoall_base_", ALL_TO_ALL, False),
    _c10d("gather_", GATHER, False),
    _c10d("scatter_", SCATTER, False),
    _c10d("send", SEND, False),
    _c10d("recv_", RECV, False),
    _c10d("recv_any_source_", RECV, False),
    _c10d("barrier", BARRIER, True),
    _functional("all_reduce", ALL_REDUCE),
    _functional("all_reduce_", ALL_REDUCE),
    _functional("all_reduce_coalesced", ALL_REDUCE),
    _functional("all_reduce_coalesced_", ALL_REDUCE),
    _functional("all_gather_into_tensor", ALL_GATHER),
    _functional("all_gather_into_tensor_out", ALL_GATHER),
    _functional("all_gather_into_tensor_coalesced", ALL_GATHER),
    _functional("reduce_scatter_tensor", REDUCE_SCATTER),
    _functional("reduce_scatter_tensor_out", REDUCE_SCATTER),
    _functional("reduce_scatter_tensor_coalesced", REDUCE_SCATTER),
    _functional("all_to_all_single", ALL_TO_ALL, same_shape=False),
    _functional("broadcast", BROADCAST),
    _functional("broadcast_", BROADCAST),
)
BY_NAME: Final[dict[str, OpInfo]] = {op.name: op for op in OPS}

C10D_OPS: Final = tuple(op.name for op in OPS if not op.functional)
FUNCTIONAL_OPS: Final = tuple(op.name.split(".", 1)[1] for op in OPS if op.functional)
SEND_OPS: Final = frozenset(op.name for op in OPS if op.family == SEND)
RECV_OPS: Final = frozenset(op.name for op in OPS if op.family == RECV)
P2P_OPS: Final = SEND_OPS | RECV_OPS
SAME_SHAPE_OPS: Final = frozenset(op.name for op in OPS if op.same_shape)
ALL_GATHER_OPS: Final = frozenset(op.name for op in OPS if op.all_gather)
# Collective ops torch registers that the agent does not take itself, and why: most reach one of the
# ops above through the process group's methods, and are recorded under that op's name.
NOT_TAKEN: Final[dict[str, str]] = {
    "monitored_barrier_": "moves no data (gloo only: a barrier that names the ranks that did not arrive)",
    "_c10d_functional.isend": "torch >= 2.13; reaches send through the process group",
    "_c10d_functional.irecv": "torch >= 2.13; reaches recv_ through the process group",
    "_c10d_functional.batch_p2p_ops": "torch >= 2.13; reaches send and recv_ through the process group",
    "_dtensor.shard_dim_alltoall": "reaches alltoall_base_ through the process group",
}
# Ops whose tensors a rank other than the root only receives into (often a fresh torch.empty):
# not data on that rank, so replay and diff do not compare them as inputs.
RECEIVED_OFF_ROOT: Final = frozenset({"broadcast_", "broadcast"})


def info(name: str) -> OpInfo | None:
    """The op's entry, or None for a name this version does not know (a newer torch's op)."""
    return BY_NAME.get(name)
