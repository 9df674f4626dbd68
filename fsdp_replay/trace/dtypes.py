"""Tensor dtypes as a trace names them, defined once: bytes per element and the numpy reading.

The names are torch's without the ``torch.`` prefix (``float32``, ``bfloat16``); a trace stores
them as strings (``dtype_names``), so a dtype that is not listed here still records; it is sized
from the bit count in its name (``float8_e4m3fn`` -> 1 byte). The torch side of the mapping (a
``torch.dtype`` to its name) lives in the agent, which is the only component with torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from fsdp_replay.errors import TraceFormatError


@dataclass(frozen=True, slots=True)
class DType:
    name: str
    itemsize: int
    numpy: str | None
    """The numpy dtype string that reads its little-endian bytes, or None where numpy has no
    such type (``bfloat16``: read as ``<u2`` and widen; the float8 formats)."""


DTYPES: Final[dict[str, DType]] = {
    d.name: d
    for d in (
        DType("bool", 1, "?"),
        DType("uint8", 1, "u1"),
        DType("int8", 1, "i1"),
        DType("int16", 2, "<i2"),
        DType("uint16", 2, "<u2"),
        DType("float16", 2, "<f2"),
        DType("bfloat16", 2, None),
        DType("int32", 4, "<i4"),
        DType("uint32", 4, "<u4"),
        DType("float32", 4, "<f4"),
        DType("complex32", 4, None),
        DType("int64", 8, "<i8"),
        DType("uint64", 8, "<u8"),
        DType("float64", 8, "<f8"),
        DType("complex64", 8, "<c8"),
        DType("complex128", 16, "<c16"),
        DType("float8_e4m3fn", 1, None),
        DType("float8_e5m2", 1, None),
        DType("float8_e4m3fnuz", 1, None),
        DType("float8_e5m2fnuz", 1, None),
    )
}


def itemsize(name: str) -> int:
    """Bytes per element; newer dtypes are sized from the bit count in their name."""
    known = DTYPES.get(name)
    if known is not None:
        return known.itemsize
    bits = re.search(r"(\d+)", name)
    if bits is None or int(bits.group(1)) % 8:
        raise TraceFormatError(f"unknown tensor dtype {name!r}")
    return int(bits.group(1)) // 8


def numpy_code(name: str) -> str | None:
    """The numpy dtype string for ``name``, or None (see ``DType.numpy``)."""
    known = DTYPES.get(name)
    return None if known is None else known.numpy
