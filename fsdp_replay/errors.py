"""One error root for everything fsdp-replay raises on purpose.

Each error also subclasses the builtin a caller would expect (zarr-python's habit), so
``except FileNotFoundError`` keeps working for code that does not know about us.
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """What every command's exit code means (``docs/exit-codes.md``)."""

    OK = 0  # success; a replay that is bit-exact; an analysis that found nothing
    FOUND = 1  # a replay that diverged; an analysis that found a NaN, a desync, a difference
    USAGE = 2  # a bad option or environment variable
    UNUSABLE = 3  # the input cannot be used: missing, damaged, foreign, incomplete, or refused
    INTERRUPTED = 130  # stopped by Ctrl-C (SIGINT), as a shell reports it; 128 + N for signal N

    @staticmethod
    def killed_by(signum: int) -> int:
        """The exit code of a command stopped by signal ``signum`` (the shell's 128 + N)."""
        return 128 + signum


class FsdpReplayError(Exception):
    """Root of every error fsdp-replay raises deliberately."""


class ConfigError(FsdpReplayError, ValueError):
    """An option or environment variable has an unusable value."""


class TraceNotFoundError(FsdpReplayError, FileNotFoundError):
    """The trace (or one of its ranks or arrays) does not exist."""


class TraceFormatError(FsdpReplayError, ValueError):
    """A trace or spool is unreadable: truncated, corrupt, or not ours. Names the file."""

    def __init__(self, message: str, *, path: str | None = None, offset: int | None = None) -> None:
        where = ""
        if path is not None:
            where = f"{path}" + (f" at byte {offset}" if offset is not None else "") + ": "
        super().__init__(where + message)
        self.path = path
        self.offset = offset


class TraceVersionError(TraceFormatError):
    """The trace was written by a format version this build cannot read."""


class TraceIncompleteError(TraceFormatError):
    """The trace is readable but does not hold what was asked for: the record of a rank ends
    (a kill, an agent error, damage) before the steps a replay or analysis needs."""


class ReplayMismatchError(FsdpReplayError, RuntimeError):
    """A replay cannot start: the trace was recorded from another script, world size or torch."""
