"""C signatures of probed functions, and where x86-64 puts each argument at function entry.

A uprobe at a function's first instruction sees the registers and the stack exactly as the
caller left them, so reading an argument means knowing the calling convention. The System V
x86-64 ABI (the only one supported here) gives the first six INTEGER-class arguments rdi, rsi,
rdx, rcx, r8, r9; every later INTEGER argument and every MEMORY-class argument (a struct larger
than 16 bytes passed by value, such as NCCL's 128-byte ``ncclUniqueId``) goes on the stack, in
declaration order, each in 8-byte-aligned slots starting just above the return address:
``[rsp + 8]`` at entry. A MEMORY argument does not take a register, so the arguments after it
move up a register (``ncclCommInitRankConfig``: rank in rdx, config in rcx).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from fsdp_replay.sidecar.ebpf.records import MAX_ARGS

REGISTERS = ("rdi", "rsi", "rdx", "rcx", "r8", "r9")
"""x86-64 integer argument registers, in order (``PT_REGS_PARM1`` .. ``PT_REGS_PARM6``)."""
STACK_ARGS_START = 8
"""At a function's first instruction, [rsp] is the return address; arguments start above it."""
MAX_STRUCT_BYTES = 256
"""Largest by-value struct whose bytes are digested in the kernel (ncclUniqueId: 128)."""

# Parameter kinds.
PTR = "ptr"
"""A pointer (or any 8-byte handle such as ncclComm_t, cudaStream_t)."""
SIZE = "size"
"""size_t, or any unsigned 64-bit integer."""
INT = "int"
"""A 32-bit int or enum (ncclDataType_t, ncclRedOp_t); sign-extended into its slot."""
STRUCT = "struct"
"""A struct passed by value (MEMORY class): its slot holds ``struct_digest`` of its bytes."""

_KINDS = (PTR, SIZE, INT, STRUCT)
_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_U64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class Param:
    """One parameter of a probed function."""

    name: str
    kind: str = PTR
    size_bytes: int = 8
    """Only for STRUCT: the struct's size (a multiple of 8, more than 16)."""

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"parameter {self.name!r}: kind {self.kind!r} is not one of {_KINDS}")
        if self.kind == STRUCT and not (
            16 < self.size_bytes <= MAX_STRUCT_BYTES and self.size_bytes % 8 == 0
        ):
            # Structs of 16 bytes or less are split over registers by the ABI; not needed here.
            raise ValueError(
                f"parameter {self.name!r}: by-value structs must be 17..{MAX_STRUCT_BYTES} bytes, "
                f"a multiple of 8 (got {self.size_bytes})"
            )


@dataclass(frozen=True, slots=True)
class Location:
    """Where an argument is at function entry: a register, or an offset above the entry rsp."""

    register: int | None
    """Index into ``REGISTERS`` (0: rdi), or None when on the stack."""
    stack_offset: int | None
    size_bytes: int

    @property
    def on_stack(self) -> bool:
        return self.stack_offset is not None


@dataclass(frozen=True, slots=True)
class Signature:
    """A function to probe: its symbol fallback chain, parameters and what to read at return."""

    name: str
    """The API name reported in records (``ncclAllReduce``)."""
    params: tuple[Param, ...] = ()
    symbols: tuple[str, ...] = ()
    """ELF symbols to try, in order; the first one the library defines is probed. Default: name."""
    returns: str = INT
    """INT (ncclResult_t), PTR, or "void" (the return register is then not read)."""
    new_comm_param: str | None = None
    """Out-pointer parameter through which the call returns a communicator (read at return)."""
    config_param: str | None = None
    """``ncclConfig_t*`` parameter whose commName is copied at entry."""
    nranks_param: str | None = None
    rank_param: str | None = None
    doc: str = ""
    locations: tuple[Location, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.symbols:
            object.__setattr__(self, "symbols", (self.name,))
        if self.returns not in (INT, PTR, "void"):
            raise ValueError(f"{self.name}: returns must be int, ptr or void, not {self.returns!r}")
        if len(self.params) > MAX_ARGS:
            raise ValueError(f"{self.name}: {len(self.params)} parameters, the record holds {MAX_ARGS}")
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: duplicate parameter names {names}")
        for role in (self.new_comm_param, self.config_param, self.nranks_param, self.rank_param):
            if role is not None and role not in names:
                raise ValueError(f"{self.name}: {role!r} is not one of its parameters {names}")
        object.__setattr__(self, "locations", locate(self.params))

    def index(self, param: str) -> int:
        return [p.name for p in self.params].index(param)

    @property
    def stack_params(self) -> tuple[str, ...]:
        return tuple(p.name for p, loc in zip(self.params, self.locations, strict=True) if loc.on_stack)


def locate(params: Sequence[Param]) -> tuple[Location, ...]:
    """The x86-64 System V location of each parameter at function entry."""
    out: list[Location] = []
    next_reg = 0
    stack = STACK_ARGS_START
    for p in params:
        if p.kind != STRUCT and next_reg < len(REGISTERS):
            out.append(Location(next_reg, None, 8))
            next_reg += 1
            continue
        size = p.size_bytes if p.kind == STRUCT else 8
        out.append(Location(None, stack, size))
        stack += (size + 7) // 8 * 8
    return tuple(out)


def struct_digest(data: bytes) -> int:
    """FNV-1a-64 over the little-endian 8-byte words of a by-value struct (what the kernel stores).

    Word-wise rather than byte-wise keeps the BPF loop short; the id of one communicator gives the
    same digest on every rank, which is what ties the ranks' records of it together."""
    if len(data) % 8:
        raise ValueError(f"struct of {len(data)} bytes is not a whole number of words")
    h = _FNV_OFFSET
    for i in range(0, len(data), 8):
        h ^= int.from_bytes(data[i : i + 8], "little")
        h = (h * _FNV_PRIME) & _U64
    return h
