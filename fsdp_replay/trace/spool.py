"""The per-rank spool: an append-only, checksummed record log (stdlib only).

The agent writes it from a background thread inside the training process, so it does no
compression and imports nothing but the standard library. The collector reads it back.

Layout of a rank folder ``spool/rank-00003/``: segments ``seg-000000.fsrs``, ``seg-000001.fsrs``...
A segment is ``SEGMENT_MAGIC``, a little-endian u32 length and a JSON header, then records::

    u16 magic | u8 kind | u8 flags | u32 length | u32 crc(body) | u32 json_length | body

where ``body`` is ``json_length`` bytes of UTF-8 JSON followed by ``length - json_length`` raw
bytes (blob records only). ``crc`` is the body's CRC-32 (zlib's), or with ``FLAG_CRC32C`` in
``flags`` its CRC-32C (Castagnoli), which the writer uses for payloads of ``CRC32C_MIN_BYTES`` and
more where ``google_crc32c`` runs in hardware: about 10 GB/s a core where zlib's CRC-32 makes
about 1.2, the difference between a writer that keeps up with 2 GB of taped results a step and
one that holds the training back. A process killed mid-write leaves at most one truncated record
at the tail of its last segment; readers report it and keep everything before it.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdp_replay.errors import TraceFormatError, TraceVersionError
from fsdp_replay.trace import schema

_HEADER = struct.Struct(schema.RECORD_HEADER)
FLAG_CRC32C = 0x01  # the record's crc is CRC-32C, not zlib's CRC-32
CRC32C_MIN_BYTES = 1 << 16  # smaller bodies keep zlib's CRC-32 (a call's fixed cost dominates)
RESERVE_FILE = "reserve"
_U32 = struct.Struct("<I")
_IOV_MAX = 512  # pieces per writev (Linux allows 1024)
assert _HEADER.size == schema.RECORD_HEADER_SIZE


def rank_dir(spool_root: str | os.PathLike[str], rank: int) -> Path:
    return Path(spool_root) / schema.RANK_SPOOL_FMT.format(rank=rank)


def _hardware_crc32c() -> Any:
    """libcrc32c's ``crc32c_extend`` (the library ``google_crc32c`` ships, through ctypes: its
    Python ``extend`` takes ``bytes`` only, and a copy of each payload would cost what the
    checksum saves), where its hardware implementation is installed; else None."""
    try:
        import google_crc32c
    except ImportError:
        return None
    if getattr(google_crc32c, "implementation", "") != "c":
        return None
    here = Path(google_crc32c.__file__).parent
    for lib in sorted([*here.parent.glob("google_crc32c.libs/libcrc32c*.so*"), *here.glob("libcrc32c*.so*")]):
        try:
            fn = ctypes.CDLL(str(lib)).crc32c_extend
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_uint32
        fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        return fn
    return None


_CRC32C = _hardware_crc32c()


def _address(buf: Any) -> tuple[int, int, Any]:
    """The address and size of a buffer's bytes, and what keeps them alive (no copy)."""
    if isinstance(buf, ctypes.Array):
        return ctypes.addressof(buf), ctypes.sizeof(buf), buf
    view = memoryview(buf).cast("B")
    if not view.readonly:
        arr = (ctypes.c_char * view.nbytes).from_buffer(view)
        return ctypes.addressof(arr), view.nbytes, arr
    import numpy as np  # a read-only buffer (a reader's mapped segment)

    a = np.frombuffer(view, dtype=np.uint8)
    return int(a.ctypes.data), view.nbytes, a


def crc32c(data: Any, crc: int = 0) -> int:
    """CRC-32C of ``data`` (continuing ``crc``); TraceFormatError where no implementation is here."""
    if _CRC32C is None:
        try:
            import google_crc32c
        except ImportError as e:
            raise TraceFormatError(
                "a spool record's checksum is CRC-32C and the google-crc32c package is not installed here"
            ) from e
        return int(google_crc32c.extend(crc, bytes(data)))
    if not memoryview(data).nbytes:
        return crc
    addr, n, _alive = _address(data)
    return int(_CRC32C(crc, addr, n))


def encode_record(kind: int, obj: Any, raw: bytes | memoryview | None = None) -> list[bytes | memoryview]:
    """The pieces of one record, ready for ``os.writev`` (the raw part is not copied).

    ``obj`` is JSON-encoded here unless it is already ``bytes`` of JSON.
    """
    js = obj if isinstance(obj, bytes) else json.dumps(obj, separators=(",", ":")).encode()
    rawlen = 0 if raw is None else memoryview(raw).nbytes
    flags = 0
    if rawlen >= CRC32C_MIN_BYTES and _CRC32C is not None:
        flags = FLAG_CRC32C
        crc = crc32c(raw, crc32c(js))
    else:
        crc = zlib.crc32(js)
        if raw is not None:
            crc = zlib.crc32(raw, crc)
    header = _HEADER.pack(schema.RECORD_MAGIC, kind, flags, len(js) + rawlen, crc, len(js))
    return [header, js] if raw is None else [header, js, raw]


def _write_all(fd: int, pieces: list[bytes | memoryview]) -> None:
    """One ``writev``; short writes (some filesystems) are finished with ``write``."""
    size = sum(memoryview(p).nbytes for p in pieces)
    written = os.writev(fd, pieces)
    if written < size:
        rest = memoryview(b"".join(bytes(p) for p in pieces))[written:]
        while rest:
            rest = rest[os.write(fd, rest) :]


class SpoolWriter:
    """Appends records to one rank's spool folder; one writer per rank, never shared.

    Each record is written with one ``writev`` at the current end of the segment. If a write
    fails (a full disk), the segment is cut back to the last whole record and the error is
    re-raised, so a failed write never leaves a half record in the middle of the log.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        rank: int,
        *,
        max_segment_bytes: int | None = None,
        reserve_bytes: int = 0,
    ):
        self.folder = Path(folder)
        self.rank = rank
        self.max_segment_bytes = max_segment_bytes or schema.SEGMENT_MAX_BYTES
        self.folder.mkdir(parents=True, exist_ok=True)
        existing = sorted(
            int(m.group(1)) for p in self.folder.iterdir() if (m := schema.SEGMENT_RE.match(p.name))
        )
        # A restarted process (or a second agent in one rank folder) never appends to old files.
        self._index = (existing[-1] + 1) if existing else 0
        self._fd = -1
        self._offset = 0
        self.bytes_written = 0
        self.records_written = 0
        self.reserve = self.folder / RESERVE_FILE
        self.reserve_bytes = 0
        self._open_segment()
        if reserve_bytes:
            self._make_reserve(reserve_bytes)

    def _make_reserve(self, nbytes: int) -> None:
        """Hold back disk space for metadata: released when the disk fills (``release_reserve``).

        A disk with less room than asked gets a smaller reserve (halving down to 64 KiB).
        """
        while nbytes >= 64 << 10:
            try:
                fd = os.open(self.reserve, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    os.posix_fallocate(fd, 0, nbytes)
                finally:
                    os.close(fd)
                self.reserve_bytes = nbytes
                return
            except OSError:
                self.reserve.unlink(missing_ok=True)
                nbytes //= 2

    def release_reserve(self) -> bool:
        """Give the reserved space back to the filesystem. True if there was a reserve."""
        try:
            self.reserve.unlink()
        except FileNotFoundError:
            return False
        return True

    @property
    def segment_path(self) -> Path:
        return self.folder / schema.SEGMENT_FMT.format(index=self._index)

    def _open_segment(self) -> None:
        header = json.dumps(
            {
                "format_version": schema.FORMAT_VERSION,
                "rank": self.rank,
                "segment": self._index,
                "created_ns": time.time_ns(),
            }
        ).encode()
        fd = os.open(self.segment_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        data = schema.SEGMENT_MAGIC + _U32.pack(len(header)) + header
        try:
            os.write(fd, data)
        except OSError:
            os.close(fd)
            os.unlink(self.segment_path)
            raise
        self._fd = fd
        self._offset = len(data)

    def append(self, kind: int, obj: Any, raw: bytes | memoryview | None = None) -> int:
        """Append one record; returns its size. Raises OSError (and leaves no partial record)."""
        return self._append_pieces(encode_record(kind, obj, raw), 1)

    def append_many(self, records: list[tuple[int, bytes]]) -> int:
        """Append several JSON records (``(kind, json bytes)``) with as few ``writev`` calls as
        possible; all or none are written (OSError leaves the segment as it was). Returns bytes."""
        pieces: list[bytes | memoryview] = []
        for kind, data in records:
            pieces += encode_record(kind, data)
        return self._append_pieces(pieces, len(records))

    def _append_pieces(self, pieces: list[bytes | memoryview], records: int) -> int:
        size = sum(memoryview(p).nbytes for p in pieces)
        if self._fd < 0:  # a roll-over failed earlier (full disk): try the next segment again
            self._index += 1
            self._open_segment()
        elif self._offset + size > self.max_segment_bytes and self.records_written:
            self.roll()
        start = self._offset
        try:
            for i in range(0, len(pieces), _IOV_MAX):
                _write_all(self._fd, pieces[i : i + _IOV_MAX])
        except OSError:
            try:
                os.ftruncate(self._fd, start)
                os.lseek(self._fd, start, os.SEEK_SET)
            except OSError:
                pass
            raise
        self._offset += size
        self.bytes_written += size
        self.records_written += records
        return size

    def roll(self) -> None:
        """Close the current segment and start the next one."""
        fd, self._fd = self._fd, -1  # never keep a closed descriptor another file may reuse
        os.close(fd)
        self._index += 1
        self._open_segment()

    def sync(self) -> None:
        """fsync the current segment (survives a machine crash, not only a process kill)."""
        os.fsync(self._fd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.release_reserve()


@dataclass(frozen=True, slots=True)
class Record:
    kind: int
    obj: Any
    raw: memoryview
    path: Path
    offset: int


@dataclass(slots=True)
class Damage:
    """A part of a spool that could not be read; everything outside it was."""

    path: str
    offset: int
    nbytes: int
    reason: str
    records_lost: bool = True  # False for a damaged segment header whose records were all read

    def __str__(self) -> str:
        return f"{self.path} at byte {self.offset}: {self.reason} ({self.nbytes} bytes skipped)"


@dataclass(slots=True)
class SegmentReport:
    records: int = 0
    damage: list[Damage] = field(default_factory=list)


def _segment_body_start(data: memoryview, path: Path) -> tuple[dict[str, Any], int]:
    magic = schema.SEGMENT_MAGIC
    if len(data) < len(magic) + 4 or bytes(data[: len(magic)]) != magic:
        raise TraceFormatError("not an fsdp-replay spool segment (bad magic)", path=str(path), offset=0)
    (hlen,) = _U32.unpack_from(data, len(magic))
    start = len(magic) + 4
    try:
        header = json.loads(bytes(data[start : start + hlen]))
    except ValueError as e:
        raise TraceFormatError(f"unreadable segment header: {e}", path=str(path), offset=start) from None
    version = header.get("format_version")
    if version not in schema.READABLE_VERSIONS:
        raise TraceVersionError(
            f"spool format version {version!r}; this fsdp-replay reads {sorted(schema.READABLE_VERSIONS)}",
            path=str(path),
        )
    return header, start + hlen


def _try_record(data: memoryview, pos: int) -> tuple[int, int, int, int] | str:
    """Parse the record at pos: (kind, length, json_length, end) or the reason it is bad."""
    if pos + _HEADER.size > len(data):
        return "truncated record header"
    magic, kind, flags, length, crc, jlen = _HEADER.unpack_from(data, pos)
    if magic != schema.RECORD_MAGIC or kind not in schema.RECORD_KINDS or jlen > length:
        return "bad record header"
    end = pos + _HEADER.size + length
    if end > len(data):
        return f"truncated record (needs {length} bytes, {len(data) - pos - _HEADER.size} present)"
    body = data[pos + _HEADER.size : end]
    if (crc32c(body) if flags & FLAG_CRC32C else zlib.crc32(body)) != crc:
        return "checksum mismatch"
    return kind, length, jlen, end


def _resync(data: memoryview, pos: int) -> int:
    """The next offset after pos where a whole, valid record starts (or len(data))."""
    needle = struct.pack("<H", schema.RECORD_MAGIC)
    raw = data.obj if isinstance(data.obj, bytes | bytearray) else bytes(data)
    p = pos + 1
    while True:
        p = raw.find(needle, p)
        if p < 0:
            return len(data)
        if not isinstance(_try_record(data, p), str):
            return p
        p += 1


def read_segment(
    path: str | os.PathLike[str],
    report: SegmentReport | None = None,
    *,
    strict: bool = False,
    recover: bool = False,
) -> Iterator[Record]:
    """Yield the records of one segment in order.

    Damage (a truncated tail, a checksum mismatch) is appended to ``report`` and reading resumes at
    the next valid record, so one bad record loses only itself. With ``strict``, the first damage
    raises TraceFormatError naming the file and offset instead. A damaged segment header raises
    too, unless ``recover``: then it is reported and every valid record after it is still read
    (records carry their own checksums). A segment of another format version always raises.
    """
    p = Path(path)
    report = report if report is not None else SegmentReport()
    try:
        data = memoryview(p.read_bytes())
    except FileNotFoundError:
        raise TraceFormatError("spool segment disappeared while reading", path=str(p)) from None
    try:
        _, pos = _segment_body_start(data, p)
    except TraceVersionError:
        raise
    except TraceFormatError as e:
        short = len(data) < len(schema.SEGMENT_MAGIC) + 4
        # A process killed between creating a segment and writing its header leaves it short.
        if strict or not (short or recover):
            raise
        if short:
            report.damage.append(Damage(str(p), 0, len(data), f"truncated segment header ({e})"))
            return
        pos = _resync(data, -1)
        # The header's length field, if it survived, says where the first record should start.
        body = len(schema.SEGMENT_MAGIC) + 4 + _U32.unpack_from(data, len(schema.SEGMENT_MAGIC))[0]
        whole = pos == body or (pos == len(data) and body >= len(data))
        reason = f"damaged segment header ({e})" + ("; every record after it was read" if whole else "")
        report.damage.append(Damage(str(p), 0, pos, reason, records_lost=not whole))
    while pos < len(data):
        parsed = _try_record(data, pos)
        if isinstance(parsed, str):
            nxt = _resync(data, pos)
            dmg = Damage(str(p), pos, nxt - pos, parsed)
            if strict:
                raise TraceFormatError(f"{parsed} ({nxt - pos} bytes unreadable)", path=str(p), offset=pos)
            report.damage.append(dmg)
            pos = nxt
            continue
        kind, _length, jlen, end = parsed
        body = pos + _HEADER.size
        try:
            obj = json.loads(bytes(data[body : body + jlen]))
        except ValueError as e:  # the header (outside the checksum) was damaged
            if strict:
                raise TraceFormatError(f"record body is not JSON: {e}", path=str(p), offset=pos) from None
            nxt = _resync(data, pos)
            report.damage.append(Damage(str(p), pos, nxt - pos, f"damaged record header ({e})"))
            pos = nxt
            continue
        report.records += 1
        yield Record(kind, obj, data[body + jlen : end], p, pos)
        pos = end


def segments(folder: str | os.PathLike[str]) -> list[Path]:
    """The segment files of one rank folder, in write order."""
    f = Path(folder)
    if not f.is_dir():
        raise TraceFormatError("spool rank folder not found", path=str(f))
    found = [(int(m.group(1)), p) for p in f.iterdir() if (m := schema.SEGMENT_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def spool_ranks(spool_root: str | os.PathLike[str]) -> dict[int, Path]:
    """rank -> folder for every rank folder under a spool root."""
    root = Path(spool_root)
    out: dict[int, Path] = {}
    if root.is_dir():
        for p in root.iterdir():
            if (m := schema.RANK_SPOOL_RE.match(p.name)) and p.is_dir():
                out[int(m.group(1))] = p
    return dict(sorted(out.items()))


def read_rank(
    folder: str | os.PathLike[str], report: SegmentReport | None = None, *, strict: bool = False
) -> Iterator[Record]:
    """Yield every record of one rank, segment after segment; a damaged segment header costs
    only that header (unless ``strict``)."""
    for seg in segments(folder):
        yield from read_segment(seg, report, strict=strict, recover=not strict)
