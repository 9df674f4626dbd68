"""The variables the recording redacted (secret-looking names or values) are not set in a replay
unless the caller sets them; a program that reads one then fails or behaves otherwise. The watch
notes which of them the replayed program looked up and did not find, so the report can name
them: every read of ``os.environ`` (``os.getenv``, ``in``, ``.get``) goes through
``__getitem__``, which the watch's subclass of ``os.environ``'s own class extends."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

_watched: set[str] = set()
_missed: list[str] = []


class _WatchedEnviron(type(os.environ)):  # type: ignore[misc]
    def __getitem__(self, key: Any) -> Any:
        try:
            return super().__getitem__(key)
        except KeyError:
            if key in _watched and key not in _missed:
                _missed.append(key)
            raise


def watch(names: Iterable[str]) -> None:
    _watched.update(n for n in names if n not in os.environ)
    if _watched and type(os.environ) is not _WatchedEnviron:
        os.environ.__class__ = _WatchedEnviron


def missed() -> list[str]:
    """The watched variables the program asked for and did not find, in the order it asked."""
    return list(_missed)


def note(names: list[str]) -> str:
    return (
        f"the program looked up {', '.join(names)}, which the recording redacted (a secret-looking name or "
        "value) and your environment does not set: set "
        + ("it" if len(names) == 1 else "them")
        + " to replay with the real value"
    )
