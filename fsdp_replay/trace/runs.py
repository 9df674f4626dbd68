"""A set of integers kept as sorted runs of consecutive values, each run with an aggregate.

The completeness of a rank (``completeness.py``) asks of each numbering it checks (steps,
collective sequence numbers, batch indices, ...) where its first gap is, and of the values below
that gap, the largest step they belong to. A collector that runs again and again as a spool grows
must answer that without going over the whole history each time: numberings are dense, so a
numbering of a million values with no gap is one run, and adding a value costs a bisection.
"""

from __future__ import annotations

from bisect import bisect_right


class Runs:
    """Integers as disjoint runs ``[start, end)``, with the largest ``tag`` added to each run."""

    __slots__ = ("_ends", "_neg_max", "_neg_tag", "_starts", "_tags", "count_negative")

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._tags: list[int] = []
        self.count_negative = 0  # values below 0 are counted, not kept (they never occur in practice)
        self._neg_tag: int | None = None
        self._neg_max = -1

    def __len__(self) -> int:
        """Distinct non-negative values held."""
        return sum(e - s for s, e in zip(self._starts, self._ends, strict=True))

    def add(self, value: int, tag: int = 0) -> None:
        if value < 0:
            self._neg_max = value if not self.count_negative else max(self._neg_max, value)
            self.count_negative += 1
            self._neg_tag = tag if self._neg_tag is None else max(self._neg_tag, tag)
            return
        starts, ends, tags = self._starts, self._ends, self._tags
        i = bisect_right(starts, value) - 1  # the run starting at or before value
        if i >= 0 and value < ends[i]:
            tags[i] = max(tags[i], tag)
            return
        joins_left = i >= 0 and ends[i] == value
        joins_right = i + 1 < len(starts) and starts[i + 1] == value + 1
        if joins_left and joins_right:  # value bridges two runs
            ends[i] = ends[i + 1]
            tags[i] = max(tags[i], tags[i + 1], tag)
            del starts[i + 1], ends[i + 1], tags[i + 1]
        elif joins_left:
            ends[i] = value + 1
            tags[i] = max(tags[i], tag)
        elif joins_right:
            starts[i + 1] = value
            tags[i + 1] = max(tags[i + 1], tag)
        else:
            starts.insert(i + 1, value)
            ends.insert(i + 1, value + 1)
            tags.insert(i + 1, tag)

    def first_gap(self) -> int | None:
        """The smallest non-negative integer missing below the largest value (None: none is);
        a negative value makes it 0, as enumerating the sorted values from 0 would."""
        if self.count_negative:
            return 0
        if not self._starts:
            return None
        if self._starts[0] != 0:
            return 0
        return self._ends[0] if len(self._starts) > 1 else None

    def first_missing(self) -> int:
        """The smallest non-negative integer not held."""
        return self._ends[0] if self._starts and self._starts[0] == 0 else 0

    def max(self) -> int | None:
        if self._ends:
            return self._ends[-1] - 1
        return self._neg_max if self.count_negative else None

    def tag_below(self, value: int) -> int | None:
        """The largest tag of the values below ``value``, where ``value`` is at most the first
        missing one (so those values are the run from 0, and any negative ones)."""
        found = self._neg_tag
        if value > 0 and self._starts and self._starts[0] == 0:
            assert value <= self._ends[0], "tag_below is asked below the first gap only"
            found = self._tags[0] if found is None else max(found, self._tags[0])
        return found
