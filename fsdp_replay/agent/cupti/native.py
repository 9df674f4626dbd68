"""CUPTI's buffers read in native code (``_records.cpp``): build, load, take batches as arrays.

The capture (``activity.py``) uses it unless ``FSDP_REPLAY_CUPTI_NATIVE=0`` or it cannot be built
or loaded (no C++ compiler, record layouts it does not know): then cupti-python's per-record
callback (``records.extract``) does the same work in Python, and the capture's ``cupti_state``
detail says which path ran and why (``decoder``, ``decoder_reason``).

The library needs no CUPTI header: it calls the libcupti that cupti-python loaded (by its path)
and reads each record's fields at the offsets cupti-python's record dtypes give
(``layout_from_dtypes``), which must agree across every version of a record kind that
cupti-python knows (CUPTI appends fields; the ones we read stay where they are). It is compiled
with the system's C++ compiler, once per source, into the cache folder of the other native
libraries (~1 s).
"""

from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fsdp_replay.agent.cupti import records
from fsdp_replay.agent.cxx import kernel as builder

SOURCE = Path(__file__).resolve().with_name("_records.cpp")
ABI = 2  # FSDPR_CUPTI_ABI of the source this module is written for
MEMSET_CODE = 255  # the copy kind the library gives a memset
# What the library reads, in its ``Field`` order: (record family, cupti-python's field, width).
FIELDS: tuple[tuple[str, str, int], ...] = (
    *(("kernel", f, w) for f, w in (("start", 8), ("end", 8), ("device_id", 4), ("stream_id", 4), ("correlation_id", 4), ("name", 8))),
    *(("memcpy", f, w) for f, w in (("copy_kind", 1), ("bytes", 8), ("start", 8), ("end", 8), ("device_id", 4), ("stream_id", 4), ("correlation_id", 4))),
    *(("memset", f, w) for f, w in (("bytes", 8), ("start", 8), ("end", 8), ("device_id", 4), ("stream_id", 4), ("correlation_id", 4))),
    *(("api", f, w) for f, w in (("start", 8), ("thread_id", 4), ("correlation_id", 4))),
    *(("external_correlation", f, w) for f, w in (("external_kind", 4), ("external_id", 8), ("correlation_id", 4))),
)  # fmt: skip
FAMILIES = ("kernel", "memcpy", "memset", "api", "external_correlation")
N_COUNTS = 10


class NativeError(RuntimeError):
    """The library cannot read this CUPTI's records (the message says why)."""


def family_dtypes(module: Any) -> dict[str, list[tuple[str, np.dtype]]]:
    """cupti-python's record dtypes per family: ``activity_kernel10_dtype`` and its other
    versions for ``kernel``, ``activity_api_dtype`` for ``api`` (not ``memcpy_pto_p``: another kind)."""
    out: dict[str, list[tuple[str, np.dtype]]] = {f: [] for f in FAMILIES}
    for name in dir(module):
        m = re.fullmatch(r"activity_([a-z_]+?)(\d*)_dtype", name)
        if m and m.group(1) in out:
            out[m.group(1)].append((name, getattr(module, name)))
    return out


def layout_from_dtypes(dtypes: Mapping[str, list[tuple[str, np.dtype]]]) -> list[int]:
    """The offsets of ``FIELDS``: the same in every version of a family, with the width we read."""
    offsets: list[int] = []
    for family, field, width in FIELDS:
        found: set[int] = set()
        versions = dtypes.get(family) or []
        if not versions:
            raise NativeError(f"no record dtype for CUPTI's {family} records")
        for name, dtype in versions:
            if dtype.fields is None or field not in dtype.fields:
                raise NativeError(f"{name} has no field {field!r}")
            ftype, offset = dtype.fields[field][:2]
            if ftype.itemsize != width:
                raise NativeError(f"{name}.{field} is {ftype.itemsize} bytes, not {width}")
            found.add(int(offset))
        if len(found) != 1:
            raise NativeError(f"{family}.{field} is at different offsets across versions: {sorted(found)}")
        offsets.append(found.pop())
    return offsets


def build(source: Path = SOURCE) -> Path:
    """The library, compiled into the cache folder if it is not there (~1 s)."""
    key = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    target = builder.cache_dir() / f"cupti-{key}" / "_records.so"
    if target.exists():
        return target
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise NativeError("no C++ compiler (g++) on PATH")
    return builder.compile_into(
        target,
        lambda _tmp, out: [
            [cxx, "-O2", "-std=c++17", "-shared", "-fPIC", str(source), "-ldl", "-o", str(out)]
        ],
        NativeError,
    )


class NativeRecords:
    """The loaded library, set up for one libcupti (``libcupti``: its path, already loaded)."""

    def __init__(
        self,
        libcupti: str,
        offsets: list[int],
        kinds: records.Kinds,
        buffer_bytes: int,
        library: Path | None = None,
    ) -> None:
        path = str(library or build())
        try:
            self.lib = lib = ctypes.CDLL(path)
        except OSError as e:
            raise NativeError(f"cannot load {path}: {e}") from e
        if lib.fsdpr_cupti_abi() != ABI:
            raise NativeError(f"{path} is from another version")
        lib.fsdpr_cupti_error.restype = ctypes.c_char_p
        lib.fsdpr_cupti_parse.restype = ctypes.c_int64
        lib.fsdpr_cupti_parse.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        codes = (kinds.kernel, kinds.memcpy, kinds.memset, kinds.runtime, kinds.driver, kinds.external)
        rc = lib.fsdpr_cupti_init(
            libcupti.encode(),
            (ctypes.c_int64 * len(offsets))(*offsets),
            (ctypes.c_uint32 * len(codes))(*codes),
            ctypes.c_uint32(kinds.ext_kind),
            ctypes.c_int64(buffer_bytes),
        )
        if rc != 0:
            raise NativeError(self.error())
        # CUPTI's copy kind (or MEMSET_CODE) -> the trace's code; anything else: 0 ("other")
        self._copy_codes = np.zeros(256, dtype=np.uint64)
        for cupti_kind, code in kinds.copy_kinds.items():
            if 0 <= cupti_kind < MEMSET_CODE:
                self._copy_codes[cupti_kind] = code
        self._copy_codes[MEMSET_CODE] = records.MEMSET_KIND
        self.buffers = 0
        self.records = 0

    def error(self) -> str:
        return (self.lib.fsdpr_cupti_error() or b"").decode(errors="replace")

    def register(self) -> None:
        """Make the library's buffer callbacks CUPTI's (again, after another client's)."""
        if self.lib.fsdpr_cupti_register() != 0:
            raise NativeError(self.error())

    def detach(self) -> None:
        """Ask for CUPTI's dynamic detach (``cuptiFinalize`` at the next CUDA API call's exit);
        ``detached`` says when it happened. Raises NativeError where it cannot be asked."""
        if self.lib.fsdpr_cupti_detach() != 0:
            raise NativeError(self.error())

    def detached(self) -> int:
        """0 none asked, 1 asked, 2 finalizing, 3 done (read once), or -(cuptiFinalize's error)."""
        return int(self.lib.fsdpr_cupti_detached())

    def discard(self, on: bool) -> None:
        """While on, completed buffers are counted (``Arrays.dropped``), not kept."""
        self.lib.fsdpr_cupti_discard(int(on))

    def parse(self, buffer: Any, valid: int) -> int:
        """Read a buffer of records as CUPTI's callback does (tests)."""
        return int(self.lib.fsdpr_cupti_parse(buffer, valid))

    def take(self) -> records.Arrays:
        """Everything read since the last ``take`` (call from one thread at a time)."""
        counts = (ctypes.c_int64 * N_COUNTS)()
        self.lib.fsdpr_cupti_take(counts)
        nk, nc, na, ne, _, name_bytes, other, dropped, buffers, total = counts
        kernels = np.empty((nk, records.KERNEL_WORDS), dtype=np.uint64)
        copies = np.empty((nc, records.COPY_WORDS), dtype=np.uint64)
        api = np.empty((na, records.API_WORDS), dtype=np.uint64)
        ext = np.empty((ne, records.EXT_WORDS), dtype=np.uint64)
        names = ctypes.create_string_buffer(max(name_bytes, 1))
        self.lib.fsdpr_cupti_copy(
            *(a.ctypes.data_as(ctypes.c_void_p) for a in (kernels, copies, api, ext)), names
        )
        if nc:
            copies[:, 5] = self._copy_codes[copies[:, 5] & 0xFF]
        new = names.raw[:name_bytes].split(b"\0")[:-1] if name_bytes else []
        self.buffers, self.records = int(buffers), int(total)
        return records.Arrays(
            kernels, copies, api, ext, [n.decode(errors="replace") for n in new], int(other), int(dropped)
        )
