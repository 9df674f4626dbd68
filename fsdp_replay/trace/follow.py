"""Follow one rank's spool while its agent writes it: each poll reads only the bytes appended since.

``spool.read_rank`` reads a finished spool; the sidecar needs the records as they arrive, without
reading a segment again from the start at every poll. ``SpoolFollower`` keeps, for the segment it
is in, the file offset up to which it has read and the bytes of an incomplete record at the tail
(kept for the next poll), and moves to the next segment once one appears (the writer opens it
only after closing the previous one, so the previous one is then complete). Parsing and damage
rules are ``spool``'s own (``_segment_body_start``, ``_try_record``, ``_resync``), so a followed
spool yields the records and the damage reports that ``read_segment`` gives for the same bytes:

- an incomplete record at the tail of the segment being written is not damage, only unfinished,
  until the segment is known complete (a later segment exists, or ``finish()``: the writer is gone);
- a damaged record in the middle is reported once a whole valid record follows it, and reading
  goes on there; one that claims more bytes than there are is damage as soon as a whole valid
  record follows it (a writer appends one record at a time);
- a writer that cut back a failed write (a full disk) and wrote again over it: the bytes held from
  the earlier poll are stale, so before reporting damage in them the follower reads them again.

Stdlib only, like ``spool``: the sidecar imports it, and so may anything that tails a spool.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from fsdp_replay.errors import TraceFormatError, TraceVersionError
from fsdp_replay.trace import schema, spool
from fsdp_replay.trace.spool import _HEADER, _U32, Damage, Record, SegmentReport

_MAGIC_LEN = len(schema.SEGMENT_MAGIC)
_decode = json.JSONDecoder().decode  # json.loads without its per-call set-up (the agent writes UTF-8)
MAX_SEGMENT_HEADER_BYTES = 1 << 20
"""A segment header is ~100 bytes of JSON; a length field beyond this is damage, not a slow write."""


class SpoolFollower:
    """Reads the records of one rank folder (``spool/rank-NNNNN``) incrementally.

    ``poll()`` returns the whole records appended since the last poll, in write order; damage goes
    to ``report`` (a ``spool.SegmentReport``, as ``read_segment`` fills it). The folder may not
    exist yet. A segment of another format version raises ``TraceVersionError`` (as
    ``read_segment`` does), and the follower then stays at that segment.

    ``start=(index, offset)`` resumes where an earlier reader stopped (``position``): segments
    before ``index`` are taken as read, and segment ``index`` is read from byte ``offset`` (0: from
    its header; otherwise a record boundary after it).
    """

    def __init__(
        self,
        rank_dir: str | os.PathLike[str],
        report: SegmentReport | None = None,
        *,
        start: tuple[int, int] | None = None,
    ) -> None:
        self.rank_dir = Path(rank_dir)
        self.report = report if report is not None else SegmentReport()
        self.bytes_read = 0
        """Bytes consumed so far: segment headers, whole records and damaged spans."""
        self.disk_bytes = 0
        """Size of the rank's segment files at the last poll."""
        self.segments_done = 0
        """Segments read to their end."""
        self._done_index = -1  # the last segment index read to its end
        self._start = start if start is not None and start[1] > 0 else None
        if start is not None:
            self._done_index = start[0] - 1
        self._index = -1  # the segment being read (-1: none open)
        self._path: Path | None = None
        self._fd = -1
        self._base = 0  # file offset of self._buf[0]
        self._buf = b""  # bytes read and not consumed yet (an incomplete record)
        self._body = False  # the segment header has been read

    @property
    def segment(self) -> Path | None:
        """The segment being read, if any."""
        return self._path

    @property
    def position(self) -> tuple[int, int]:
        """``(segment index, byte offset)`` up to which the spool has been read: what ``start``
        takes to go on from here. Offset 0 means "from the segment's header on"."""
        if self._path is None:
            return self._done_index + 1, 0
        return self._index, self._base

    def poll(self, *, segments: int | None = None) -> list[Record]:
        """The records appended since the last poll (possibly spanning several segments; with
        ``segments``, at most that many are finished before it returns, so a reader of a long
        spool holds one segment's records at a time: poll again until it returns nothing)."""
        out: list[Record] = []
        finished = 0
        while True:
            later = self._later_segments()
            if self._path is None:
                if not later:
                    return out
                if not self._open(*later[0]):
                    continue
                later = later[1:]
            out += self._read(final=False)
            if not later:
                return out
            # A later segment exists: the writer closed this one. Read what it wrote meanwhile,
            # and an incomplete tail is now damage.
            out += self._read(final=True)
            self._close(done=True)
            finished += 1
            if segments is not None and finished >= segments and out:
                return out

    def finish(self) -> list[Record]:
        """The writer is gone for good: read the rest of the current segment; its incomplete tail is
        damage. A later poll still follows any segment created afterwards (a restarted rank)."""
        out = self.poll()
        if self._path is not None:
            out += self._read(final=True)
            self._close(done=True)
        return out

    def close(self) -> None:
        """Release the open segment (the follower can poll again: it reopens where it was)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SpoolFollower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- segments -----------------------------------------------------------------------------
    def _later_segments(self) -> list[tuple[int, Path]]:
        """Segments after the last one finished (the open one included), in order; sums their sizes."""
        found: list[tuple[int, Path]] = []
        total = 0
        try:
            entries = list(os.scandir(self.rank_dir))
        except (FileNotFoundError, NotADirectoryError):
            self.disk_bytes = 0
            return []
        for entry in entries:
            m = schema.SEGMENT_RE.match(entry.name)
            if m is None:
                continue
            try:
                total += entry.stat().st_size
            except FileNotFoundError:
                continue
            index = int(m.group(1))
            if index > max(self._done_index, self._index):
                found.append((index, Path(entry.path)))
        self.disk_bytes = total
        return sorted(found)

    def _open(self, index: int, path: Path) -> bool:
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self.report.damage.append(Damage(str(path), 0, 0, "segment disappeared before it was read"))
            self._done_index = index
            return False
        self._index, self._path = index, path
        self._base, self._buf, self._body = 0, b"", False
        if self._start is not None and self._start[0] == index:
            self._base, self._body = self._start[1], True  # past the header: a record boundary
            self._start = None
        return True

    def _close(self, *, done: bool) -> None:
        self.close()
        if done:
            self._done_index = self._index
            self.segments_done += 1
        self._index, self._path = -1, None
        self._base, self._buf, self._body = 0, b"", False

    # -- reading ------------------------------------------------------------------------------
    def _read(self, *, final: bool) -> list[Record]:
        assert self._fd >= 0 and self._path is not None
        size = os.fstat(self._fd).st_size
        held = self._base + len(self._buf)
        if size < held:  # the writer cut back a failed write: what we held past the cut is gone
            self._buf = self._buf[: max(0, size - self._base)]
            held = self._base + len(self._buf)
        stale = len(self._buf)
        data = self._buf + self._pread(held, size - held) if size > held else self._buf
        records, consumed, damage, suspect, body = self._parse(data, final=final, stale=stale)
        if suspect:
            # Damage in bytes held from an earlier poll may be a write that was cut back and
            # written again since: read them again before believing it.
            data = self._pread(self._base, size - self._base)
            records, consumed, damage, _, body = self._parse(data, final=final, stale=0)
        self._body = body
        self.report.damage += damage
        self.report.records += len(records)
        self.bytes_read += consumed
        self._base += consumed
        self._buf = data[consumed:]
        return records

    def _changed(self, offset: int, held: memoryview) -> bool:
        """Whether the record header held for ``offset`` differs from the file's bytes there now."""
        n = min(_HEADER.size, len(held))
        return self._pread(offset, n) != bytes(held[:n])

    def _pread(self, offset: int, nbytes: int) -> bytes:
        chunks: list[bytes] = []
        while nbytes > 0:
            chunk = os.pread(self._fd, nbytes, offset)
            if not chunk:
                break
            chunks.append(chunk)
            offset += len(chunk)
            nbytes -= len(chunk)
        return b"".join(chunks)

    def _parse(
        self, data: bytes, *, final: bool, stale: int
    ) -> tuple[list[Record], int, list[Damage], bool, bool]:
        """(records, bytes consumed, damage, suspect, header read) for ``data`` starting at
        ``self._base``. Free of side effects, so that it can run again on bytes read again."""
        assert self._path is not None
        path, base = self._path, self._base
        mv = memoryview(data)
        records: list[Record] = []
        damage: list[Damage] = []
        pos = 0
        if not self._body:
            start = self._segment_header(mv, final=final, damage=damage)
            if start is None:
                return records, 0, damage, False, False
            if start < 0:  # a truncated header in a complete segment: all of it is damage
                return records, len(data), damage, False, True
            pos = start
        while pos < len(data):
            parsed = spool._try_record(mv, pos)
            if isinstance(parsed, str):
                nxt = spool._resync(mv, pos)
                if nxt == len(data) and not final:
                    # An unfinished record, or damage whose extent the next record will show. If
                    # it began before this poll, it may have been cut back and written anew:
                    # its header on disk says (16 bytes read again, not the whole record).
                    suspect = pos < stale and len(data) > stale and self._changed(base + pos, mv[pos:])
                    return records, pos, damage, suspect, True
                if pos < stale:
                    return records, pos, damage, True, True
                damage.append(Damage(str(path), base + pos, nxt - pos, parsed))
                pos = nxt
                continue
            kind, _length, jlen, end = parsed
            body = pos + _HEADER.size
            try:
                obj = _decode(str(mv[body : body + jlen], "utf-8"))
            except ValueError as e:  # the header (outside the checksum) was damaged
                nxt = spool._resync(mv, pos)
                if nxt == len(data) and not final:
                    break
                damage.append(Damage(str(path), base + pos, nxt - pos, f"damaged record header ({e})"))
                pos = nxt
                continue
            records.append(Record(kind, obj, mv[body + jlen : end], path, base + pos))
            pos = end
        return records, pos, damage, False, True

    def _segment_header(self, mv: memoryview, *, final: bool, damage: list[Damage]) -> int | None:
        """Where the first record starts; None: wait for more bytes; -1: the whole (final) segment
        is a truncated header. Damage is reported as ``read_segment(recover=True)`` does."""
        assert self._path is not None
        path = self._path
        if len(mv) < _MAGIC_LEN + 4:
            if not final:
                return None
            try:
                spool._segment_body_start(mv, path)
            except TraceFormatError as e:  # always: too short for the magic and the length
                damage.append(Damage(str(path), 0, len(mv), f"truncated segment header ({e})"))
            return -1
        (hlen,) = _U32.unpack_from(mv, _MAGIC_LEN)
        whole_header = len(mv) >= _MAGIC_LEN + 4 + hlen
        plausible = bytes(mv[:_MAGIC_LEN]) == schema.SEGMENT_MAGIC and hlen <= MAX_SEGMENT_HEADER_BYTES
        if plausible and not whole_header and not final:
            return None
        try:
            _, start = spool._segment_body_start(mv, path)
        except TraceVersionError:
            raise
        except TraceFormatError as e:
            start = spool._resync(mv, -1)
            if start == len(mv) and not final:
                return None  # the first record after it may still be being written
            body = _MAGIC_LEN + 4 + hlen
            whole = start == body or (start == len(mv) and body >= len(mv))
            reason = f"damaged segment header ({e})" + ("; every record after it was read" if whole else "")
            damage.append(Damage(str(path), 0, start, reason, records_lost=not whole))
        return start
