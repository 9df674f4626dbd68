"""A snapshot's bytes: raw tensor bytes behind a JSON index, decoded without pickle.

A trace is untrusted input (it travels through object stores and between people), so nothing
read from it may run code: a snapshot is not a ``torch.save`` archive (a pickle) but

    MAGIC (8 bytes) | index length (uint64, little-endian) | index (UTF-8 JSON) | tensor bytes

The index is ``{"format": 2, "tensors": [{"dtype", "shape", "offset", "nbytes"}], "state": tree}``,
where ``tree`` is the snapshot's nested state with each tensor replaced by ``{"__tensor__": i}``
and the few other non-JSON values tagged (tuples, dicts with non-string keys, non-finite floats,
dtypes, devices). ``offset`` counts from the start of the tensor bytes. Every field is checked
when decoded; a value of a type the format has no tag for is written as
``{"__unsupported__": type name}`` and left out when read (``Decoded.unsupported`` names it).

Snapshots written by older agents are ``torch.save`` archives: they load with
``weights_only=True`` (torch's allow-list of tensors and plain containers), or, where the user
names the trace trusted, as the pickle they are.
"""

from __future__ import annotations

import io
import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from fsdp_replay.errors import TraceFormatError

MAGIC: Final = b"FSRSNAP\x02"
FORMAT: Final = 2
_HEADER: Final = struct.Struct("<8sQ")
LEGACY_MAGIC: Final = b"PK\x03\x04"  # a torch.save archive (zip), from older agents
_MAX_DEPTH: Final = 64


class _Encoder:
    def __init__(self) -> None:
        self.tensors: list[dict[str, Any]] = []
        self.buffers: list[memoryview] = []
        self.offset = 0

    def tensor(self, t: torch.Tensor) -> dict[str, Any]:
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        flat = t.contiguous().reshape(-1)
        raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
        nbytes = int(raw.numel())
        self.tensors.append(
            {
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
                "offset": self.offset,
                "nbytes": nbytes,
            }
        )
        self.buffers.append(memoryview(raw.numpy()))  # type: ignore[arg-type]
        self.offset += nbytes
        return {"__tensor__": len(self.tensors) - 1}

    def value(self, x: Any) -> Any:
        if x is None or isinstance(x, bool | int | str):
            return x
        if isinstance(x, float):
            return x if math.isfinite(x) else {"__float__": repr(x)}
        if isinstance(x, torch.Tensor):
            if x.is_sparse or x.is_quantized:
                return {"__unsupported__": f"{x.layout} tensor"}
            return self.tensor(x)
        if isinstance(x, torch.dtype):
            return {"__dtype__": str(x).removeprefix("torch.")}
        if isinstance(x, torch.device):
            return {"__device__": str(x)}
        if isinstance(x, torch.Size):
            return {"__tuple__": [int(v) for v in x]}
        if isinstance(x, list):
            return [self.value(v) for v in x]
        if isinstance(x, tuple):
            return {"__tuple__": [self.value(v) for v in x]}
        if isinstance(x, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in x):
                return {k: self.value(v) for k, v in x.items()}
            return {"__dict__": [[self.value(k), self.value(v)] for k, v in x.items()]}
        return {"__unsupported__": f"{type(x).__module__}.{type(x).__qualname__}"}


def encode(state: dict[str, Any]) -> bytes:
    """The snapshot's bytes (on the writer thread: one copy of each tensor's bytes)."""
    enc = _Encoder()
    tree = enc.value(state)
    index = json.dumps(
        {"format": FORMAT, "tensors": enc.tensors, "state": tree}, separators=(",", ":"), allow_nan=False
    ).encode()
    return b"".join([_HEADER.pack(MAGIC, len(index)), index, *enc.buffers])


@dataclass(slots=True)
class Decoded:
    state: dict[str, Any]
    unsupported: list[str] = field(default_factory=list)  # values the format could not hold


class _Decoder:
    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.unsupported: list[str] = []

    def value(self, x: Any, depth: int = 0) -> Any:
        if depth > _MAX_DEPTH:
            raise TraceFormatError("the snapshot's state is nested too deeply")
        if x is None or isinstance(x, bool | int | float | str):
            return x
        if isinstance(x, list):
            return [self.value(v, depth + 1) for v in x]
        if not isinstance(x, dict):
            raise TraceFormatError(f"the snapshot's index holds a {type(x).__name__}")
        if len(x) == 1:
            ((tag, v),) = x.items()
            if tag == "__tensor__":
                if not isinstance(v, int) or not 0 <= v < len(self.tensors):
                    raise TraceFormatError(f"the snapshot names tensor {v!r}; it has {len(self.tensors)}")
                return self.tensors[v]
            if tag == "__tuple__" and isinstance(v, list):
                return tuple(self.value(i, depth + 1) for i in v)
            if tag == "__dict__" and isinstance(v, list):
                out = {}
                for pair in v:
                    if not isinstance(pair, list) or len(pair) != 2:
                        raise TraceFormatError("a dict entry of the snapshot is not a [key, value] pair")
                    key = self.value(pair[0], depth + 1)
                    if isinstance(key, list | dict | torch.Tensor):
                        raise TraceFormatError("a dict key of the snapshot is not hashable")
                    out[key] = self.value(pair[1], depth + 1)
                return _without_unsupported(out)
            if tag == "__float__" and v in ("inf", "-inf", "nan"):
                return float(v)
            if tag == "__dtype__" and isinstance(v, str):
                return _dtype(v)
            if tag == "__device__" and isinstance(v, str):
                try:
                    return torch.device(v)
                except RuntimeError:
                    raise TraceFormatError(f"the snapshot names device {v[:40]!r}") from None
            if tag == "__unsupported__":
                self.unsupported.append(str(v)[:200])
                return _UNSUPPORTED
        return _without_unsupported({str(k): self.value(v, depth + 1) for k, v in x.items()})


class _Unsupported:
    def __repr__(self) -> str:
        return "<a value the snapshot format does not hold>"


_UNSUPPORTED: Final = _Unsupported()


def _without_unsupported(d: dict[Any, Any]) -> dict[Any, Any]:
    return {k: v for k, v in d.items() if v is not _UNSUPPORTED}


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise TraceFormatError(f"the snapshot names an unknown dtype {name[:40]!r}")
    return dtype


def _tensors(entries: Any, data: bytearray, start: int) -> list[torch.Tensor]:
    if not isinstance(entries, list):
        raise TraceFormatError("the snapshot's tensor list is not a list")
    size = len(data) - start
    out = []
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            raise TraceFormatError(f"the snapshot's tensor {i} is not described by an object")
        dtype = _dtype(str(e.get("dtype")))
        shape, offset, nbytes = e.get("shape"), e.get("offset"), e.get("nbytes")
        if not (
            isinstance(shape, list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
            and isinstance(offset, int)
            and isinstance(nbytes, int)
            and 0 <= offset <= size
            and 0 <= nbytes <= size - offset
        ):
            raise TraceFormatError(f"the snapshot's tensor {i} lies outside its bytes or has a bad shape")
        numel = math.prod(shape)
        if numel * dtype.itemsize != nbytes:
            raise TraceFormatError(
                f"the snapshot's tensor {i} has {nbytes} bytes; {shape} of {dtype} takes {numel * dtype.itemsize}"
            )
        if nbytes == 0:
            out.append(torch.empty(shape, dtype=dtype))
            continue
        raw = torch.frombuffer(data, dtype=torch.uint8, count=nbytes, offset=start + offset)
        out.append(raw.view(dtype).reshape(shape))
    return out


def decode(data: bytes | bytearray, *, trusted: bool = False) -> Decoded:
    """A snapshot's state from its bytes; an older agent's ``torch.save`` archive loads with
    ``weights_only=True``, or unrestricted when ``trusted`` (the user named the trace trusted)."""
    if bytes(data[:4]) == LEGACY_MAGIC:
        return Decoded(_decode_legacy(bytes(data), trusted))
    if len(data) < _HEADER.size:
        raise TraceFormatError(f"a snapshot of {len(data)} bytes is shorter than its header")
    magic, n = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise TraceFormatError("not a snapshot (its first bytes are not a snapshot's)")
    if n > len(data) - _HEADER.size:
        raise TraceFormatError(f"the snapshot's index claims {n} bytes; the blob holds {len(data)}")
    buf = data if isinstance(data, bytearray) else bytearray(data)  # tensors share it, writable
    try:
        index = json.loads(bytes(buf[_HEADER.size : _HEADER.size + n]))
    except (UnicodeDecodeError, ValueError) as e:
        raise TraceFormatError(f"the snapshot's index is not JSON ({e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise TraceFormatError(f"the snapshot's index is not of format {FORMAT}")
    decoder = _Decoder(_tensors(index.get("tensors"), buf, _HEADER.size + n))
    state = decoder.value(index.get("state"))
    if not isinstance(state, dict):
        raise TraceFormatError("the snapshot's state is not an object")
    return Decoded(state, decoder.unsupported)


def _decode_legacy(data: bytes, trusted: bool) -> dict[str, Any]:
    import pickle

    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=not trusted)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise TraceFormatError(
            "the snapshot, written by an older fsdp-replay as a pickle, holds objects that a safe load "
            f"refuses ({first}); only for a trace you made yourself: replay --trust-trace loads it as it is"
        ) from None
    except Exception as e:
        raise TraceFormatError(
            f"the snapshot (an older agent's torch.save archive) is unreadable: {e}"
        ) from None
    if not isinstance(state, dict):
        raise TraceFormatError("the snapshot is not a dict")
    return state
