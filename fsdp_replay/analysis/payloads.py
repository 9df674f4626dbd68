"""Payload bytes as numbers: decoding a recorded tensor, and how far two of them are apart.

The one ``magnitude`` of fsdp-replay: ``diff`` compares two traces' payloads with it and the
replayer compares a recorded payload with what the replay computed (as bytes). Numpy only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fsdp_replay.trace import dtypes


def decode(data: bytes, dtype: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(values as float64/complex/int64, raw element bit patterns) of a payload, or None."""
    if dtype == "bfloat16":
        raw = np.frombuffer(data, "<u2")
        return (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64), raw
    if dtype.startswith("float8"):
        raw = np.frombuffer(data, "u1")
        try:
            import ml_dtypes  # optional

            vals = raw.view(getattr(ml_dtypes, dtype)).astype(np.float64)
        except (ImportError, AttributeError):
            vals = raw.astype(np.float64)  # bytes compared, values not decoded
        return vals, raw
    code = dtypes.numpy_code(dtype)
    if code is None:
        return None
    arr = np.frombuffer(data, code)
    raw = arr.view(f"u{arr.dtype.itemsize}") if arr.dtype.itemsize in (1, 2, 4, 8) else arr.view("u1")
    if arr.dtype.kind == "c":
        return arr.astype(np.complex128), raw.reshape(len(arr), -1) if raw.size != arr.size else raw
    if arr.dtype.kind == "f":
        return arr.astype(np.float64), raw
    return arr.astype(np.int64), raw


def magnitude(a: bytes, b: bytes, dtype: str) -> dict[str, Any] | None:
    """How much two payloads of one tensor differ: ``numel``, ``n_differing`` (elements whose
    bits differ), ``first_index`` (flat), ``a_value``/``b_value`` there, ``max_abs_diff`` and
    ``max_rel_diff`` over the elements finite in both (None when there are none), and
    ``nonfinite_a``/``nonfinite_b`` counts. None when the dtype cannot be decoded."""
    if len(a) != len(b):
        return {"numel": None, "n_differing": None, "note": f"sizes differ ({len(a)} vs {len(b)} bytes)"}
    da, db = decode(a, dtype), decode(b, dtype)
    if da is None or db is None:
        return None
    (va, ra), (vb, rb) = da, db
    bits = ra != rb
    if bits.ndim > 1:
        bits = bits.any(axis=1)
    n_diff = int(bits.sum())
    first = int(np.argmax(bits)) if n_diff else None
    fin_a, fin_b = np.isfinite(va), np.isfinite(vb)
    both = fin_a & fin_b
    max_abs = max_rel = None
    if both.any():
        with np.errstate(all="ignore"):
            absd = np.abs(va[both] - vb[both])
            den = np.maximum(np.abs(va[both]), np.abs(vb[both]))
            rel = np.where(den > 0, absd / np.where(den > 0, den, 1), 0.0)
        max_abs, max_rel = float(absd.max()), float(rel.max())

    def scalar(x: Any) -> Any:
        if isinstance(x, complex | np.complexfloating):
            return str(complex(x))
        return float(x) if isinstance(x, float | np.floating) else int(x)

    return {
        "numel": len(va),
        "n_differing": n_diff,
        "first_index": first,
        "a_value": None if first is None else scalar(va[first]),
        "b_value": None if first is None else scalar(vb[first]),
        "max_abs_diff": max_abs,
        "max_rel_diff": max_rel,
        "nonfinite_a": int((~fin_a).sum()),
        "nonfinite_b": int((~fin_b).sum()),
    }
