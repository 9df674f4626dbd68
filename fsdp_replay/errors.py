"""One error root for everything fsdp-replay raises on purpose.

Each error also subclasses the builtin a caller would expect (zarr-python's habit), so
``except FileNotFoundError`` keeps working for code that does not know about us.
"""

from __future__ import annotations


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


class ReplayMismatchError(FsdpReplayError, RuntimeError):
    """A replay cannot start: the trace was recorded from another script, world size or torch."""
