"""The native reader of CUPTI's buffers (``agent/cupti/_records.cpp``, ``native.py``), on the CPU.

Real parts: the library is compiled with the system's C++ compiler and walks its buffers with a
real libcupti's ``cuptiActivityGetNextRecord`` (which needs no GPU). The records are written into
the buffer in CUPTI 13's binary layout, described by numpy dtypes with the fields, offsets and
sizes cupti-python's record dtypes have (``activity_kernel10_dtype`` ...); the reader takes its
offsets from those dtypes as it takes them from cupti-python's on a GPU. The same records then go
through the Python path (``records.extract``): both must give the same rows.
"""

from __future__ import annotations

import ctypes
import glob
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_cupti import KINDS, _window

from fsdp_replay.agent.cupti import native, records
from fsdp_replay.agent.cupti.records import Batch, Decoder, Marks

# CUPTI 13's record sizes and the offsets of the fields we read (cupti-python 13.4's dtypes).
LAYOUT_13 = {
    "kernel": (216, {"kind": (0, "u4"), "start": (16, "u8"), "end": (24, "u8"), "device_id": (40, "u4"),
                     "stream_id": (48, "u4"), "correlation_id": (92, "u4"), "name": (104, "u8")}),
    "memcpy": (96, {"kind": (0, "u4"), "copy_kind": (4, "u1"), "bytes": (8, "u8"), "start": (16, "u8"),
                    "end": (24, "u8"), "device_id": (32, "u4"), "stream_id": (40, "u4"), "correlation_id": (44, "u4")}),
    "memset": (88, {"kind": (0, "u4"), "bytes": (8, "u8"), "start": (16, "u8"), "end": (24, "u8"),
                    "device_id": (32, "u4"), "stream_id": (40, "u4"), "correlation_id": (44, "u4")}),
    "api": (40, {"kind": (0, "u4"), "start": (8, "u8"), "end": (16, "u8"), "thread_id": (28, "u4"),
                 "correlation_id": (32, "u4")}),
    "external_correlation": (24, {"kind": (0, "u4"), "external_kind": (4, "u4"), "external_id": (8, "u8"),
                                  "correlation_id": (16, "u4")}),
}  # fmt: skip
FAMILY_OF = {
    KINDS.kernel: "kernel",
    KINDS.memcpy: "memcpy",
    KINDS.memset: "memset",
    KINDS.runtime: "api",
    KINDS.driver: "api",
    KINDS.external: "external_correlation",
}


def _dtype(family: str, layout: dict[str, tuple[int, dict[str, tuple[int, str]]]] = LAYOUT_13) -> np.dtype:
    size, fields = layout[family]
    return np.dtype(
        {
            "names": list(fields),
            "formats": [f for _, f in fields.values()],
            "offsets": [o for o, _ in fields.values()],
            "itemsize": size,
        }
    )


def _libcupti() -> str:
    """A libcupti of CUPTI 13 on this machine (the CUDA toolkit's or a wheel's), or skip."""
    candidates = [
        os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "lib64", "libcupti.so"),
        *glob.glob("/usr/local/cuda*/lib64/libcupti.so*"),
        *glob.glob(
            os.path.join(
                sys.prefix, "lib", "python3*", "site-packages", "nvidia", "cu13", "lib", "libcupti.so*"
            )
        ),
    ]
    for path in candidates:
        if not os.path.exists(path):
            continue
        try:
            version = ctypes.c_uint32(0)
            if ctypes.CDLL(path).cuptiGetVersion(ctypes.byref(version)) == 0 and version.value // 10000 == 13:
                return path
        except OSError:
            continue
    pytest.skip("needs a CUPTI 13 libcupti (the CUDA 13 toolkit's lib64, or the nvidia-cuda-cupti wheel)")


@pytest.fixture(scope="module")
def reader() -> native.NativeRecords:
    if shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("needs a C++ compiler (g++)")
    path = _libcupti()
    offsets = native.layout_from_dtypes({f: [(f"activity_{f}_dtype", _dtype(f))] for f in native.FAMILIES})
    return native.NativeRecords(path, offsets, KINDS, 1 << 20)


class Buffer:
    """Records in CUPTI's binary layout, one after another (8-byte aligned, as CUPTI writes them)."""

    def __init__(self, activities: list[Any]) -> None:
        self.keep: list[Any] = []  # the kernel names' C strings, alive while the buffer is read
        parts = []
        for a in activities:
            family = FAMILY_OF.get(a.kind)
            if family is None:
                continue  # a kind whose record size this test does not know
            dtype = _dtype(family)
            row = np.zeros(1, dtype=dtype)
            for name in dtype.names:
                value = getattr(a, name)
                if name == "name":
                    c = ctypes.create_string_buffer(value.encode())
                    self.keep.append(c)
                    value = ctypes.addressof(c)
                row[name] = value
            parts.append(row.tobytes())
        data = b"".join(parts)
        self.size = len(data)
        self.raw = (ctypes.c_uint8 * max(self.size, 1)).from_buffer_copy(data or b"\0")

    def read_by(self, reader: native.NativeRecords) -> int:
        return reader.parse(ctypes.addressof(self.raw), self.size)


def _same(a: records.Decoded, b: records.Decoded) -> None:
    assert (a.kernels, a.copies, a.names, a.name_base) == (b.kernels, b.copies, b.names, b.name_base)
    assert (a.agent, a.incomplete, a.by_time) == (b.agent, b.incomplete, b.by_time)


def test_native_batches_decode_to_the_python_paths_rows(reader: native.NativeRecords) -> None:
    first, marks, second = _window()
    reader.take()  # whatever an earlier test left
    n_first = Buffer(first).read_by(reader)
    assert n_first == len(first) - 1  # every record but the overhead one this test leaves out
    a1 = reader.take()
    assert (len(a1.kernels), len(a1.copies), len(a1.api), len(a1.ext)) == (6, 1, 8, 5)
    assert a1.names == ["_Z4gemmv", "_Z8gemm_bwdv", "ncclDevKernel_AllReduce", "fp_kernel"]
    Buffer(second).read_by(reader)
    a2 = reader.take()
    assert a2.names == ["_Z6adam_stepv"]  # fp_kernel was numbered in the first batch
    assert reader.buffers == 2 and reader.records >= n_first

    native_dec, python_dec = Decoder(), Decoder()
    b1, b2 = Batch(), Batch()
    records.extract([a for a in first if a.kind in FAMILY_OF], KINDS, b1)
    records.extract(second, KINDS, b2)
    _same(native_dec.decode(a1, marks), python_dec.decode(b1, marks))
    later = Marks(positions=[(4300, 2, 0, 5)])
    d2 = native_dec.decode(a2, later)
    _same(d2, python_dec.decode(b2, later))
    # the copy kinds went through the same table: htod, dtoh, htoa (not one we name: other), memset
    assert {r[8] for r in d2.copies} == {schema_code("dtoh"), schema_code("other")}


def schema_code(name: str) -> int:
    from fsdp_replay.trace.schema import COPY_KIND_CODES

    return COPY_KIND_CODES[name]


def test_while_discarding_records_are_counted_not_kept(reader: native.NativeRecords) -> None:
    first, _, _ = _window()
    reader.take()
    reader.discard(True)
    try:
        Buffer(first).read_by(reader)
        taken = reader.take()
    finally:
        reader.discard(False)
    assert taken.dropped == 7 and taken.records == 0 and not len(taken.api) and not len(taken.ext)
    Buffer(first).read_by(reader)
    assert reader.take().records == 7


def test_a_record_libcupti_does_not_know_ends_the_walk(reader: native.NativeRecords) -> None:
    first, _, _ = _window()
    reader.take()
    buf = Buffer(first[:2])  # an API record, then ours
    raw = bytearray(bytes(buf.raw)[: buf.size]) + (9999).to_bytes(4, "little") + bytes(36)
    data = (ctypes.c_uint8 * len(raw)).from_buffer_copy(raw)
    assert reader.parse(ctypes.addressof(data), len(raw)) == 2
    taken = reader.take()
    assert len(taken.api) == 1 and len(taken.ext) == 1


def test_layouts_must_agree_across_versions_and_widths() -> None:
    good = {f: [(f"activity_{f}_dtype", _dtype(f))] for f in native.FAMILIES}
    offsets = native.layout_from_dtypes(good)
    assert len(offsets) == len(native.FIELDS) and offsets[:3] == [16, 24, 40]
    moved = {**LAYOUT_13, "kernel": (224, {**LAYOUT_13["kernel"][1], "start": (8, "u8")})}
    with pytest.raises(native.NativeError, match="different offsets"):
        native.layout_from_dtypes(
            {**good, "kernel": [*good["kernel"], ("activity_kernel11_dtype", _dtype("kernel", moved))]}
        )
    narrow = {**LAYOUT_13, "api": (40, {**LAYOUT_13["api"][1], "thread_id": (28, "u2")})}
    with pytest.raises(native.NativeError, match="2 bytes, not 4"):
        native.layout_from_dtypes({**good, "api": [("activity_api_dtype", _dtype("api", narrow))]})
    with pytest.raises(native.NativeError, match="no record dtype"):
        native.layout_from_dtypes({**good, "memset": []})


def test_family_dtypes_finds_every_version_and_not_peer_copies() -> None:
    class Module:
        activity_kernel9_dtype = _dtype("kernel")
        activity_kernel10_dtype = _dtype("kernel")
        activity_memcpy6_dtype = _dtype("memcpy")
        activity_memcpy_pto_p4_dtype = _dtype("memcpy")
        activity_api_dtype = _dtype("api")
        activity_external_correlation_dtype = _dtype("external_correlation")

    found = native.family_dtypes(Module)
    assert sorted(n for n, _ in found["kernel"]) == ["activity_kernel10_dtype", "activity_kernel9_dtype"]
    assert [n for n, _ in found["memcpy"]] == ["activity_memcpy6_dtype"]
    assert found["memset"] == []


def test_the_library_source_is_what_the_build_compiles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FSDP_REPLAY_CACHE", str(tmp_path))
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    built = native.build()
    assert built.exists() and built.parent.parent == tmp_path / "kernels"
    assert native.build() == built  # cached


def test_a_detach_that_cupti_refuses_is_an_error_naming_the_call(reader: native.NativeRecords) -> None:
    """CUPTI's dynamic detach (``fsdpr_cupti_detach``: a subscription whose first API exit calls
    ``cuptiFinalize``) with a real libcupti: on a machine without a GPU driver CUPTI refuses the
    subscription, which is a NativeError naming the call and its code, and nothing is pending
    (the capture then stays attached between windows, saying why). The detach itself, and a
    capture armed again after it, are checked on a GPU (``tests/system/test_cupti_gpu.py``)."""
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("a GPU driver is here: CUPTI would accept the subscription (the GPU test's case)")
    with pytest.raises(native.NativeError, match=r"cuptiSubscribe returned \d+"):
        reader.detach()
    assert reader.detached() == 0
