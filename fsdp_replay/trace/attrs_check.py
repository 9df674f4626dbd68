"""The attributes of a trace checked before anything uses them: types, ranges and counts.

A trace is untrusted input: a ``world_size`` of 10^9 must not size an allocation, and an ``end``
that is a list must not reach code that expects a dict and raise a ``TypeError`` there. The root's
attributes are checked when a trace is opened (``Trace.open``), each rank's when its attributes
are first read (``RankTrace.attrs``); a violation is a ``TraceFormatError`` naming the attribute.

Only the shapes the readers rely on are checked. A key the spec does not name is tolerated (a
newer agent's optional attribute), and so is a missing one (an older agent's trace: readers use
defaults); a value of the wrong type, a negative count or an impossible rank is not.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

from fsdp_replay.errors import TraceFormatError

MAX_WORLD_SIZE: Final = 1 << 20
"""The largest world a trace may claim (about a million ranks)."""
MAX_NAMES: Final = 1 << 22
"""The most entries a name table (``op_names``, ``kernel_names``, ...) may hold."""

Check = Callable[[Any, str], None]


def _fail(where: str, what: str) -> TraceFormatError:
    return TraceFormatError(f"attribute {where} {what}")


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def integer(lo: int | None = None, hi: int | None = None, *, null: bool = False) -> Check:
    def check(v: Any, where: str) -> None:
        if v is None and null:
            return
        if not isinstance(v, int) or isinstance(v, bool):
            raise _fail(where, f"is a {_kind(v)}, not an integer")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise _fail(
                where,
                f"is {v}, outside {lo if lo is not None else '-inf'}..{hi if hi is not None else 'inf'}",
            )

    return check


def string(*, null: bool = False) -> Check:
    def check(v: Any, where: str) -> None:
        if not (isinstance(v, str) or (v is None and null)):
            raise _fail(where, f"is a {_kind(v)}, not a string")

    return check


def boolean(v: Any, where: str) -> None:
    if not isinstance(v, bool):
        raise _fail(where, f"is a {_kind(v)}, not true or false")


def anything(v: Any, where: str) -> None:
    return None


def listing(item: Check = anything, *, most: int | None = None, null: bool = False) -> Check:
    def check(v: Any, where: str) -> None:
        if v is None and null:
            return
        if not isinstance(v, list):
            raise _fail(where, f"is a {_kind(v)}, not a list")
        if most is not None and len(v) > most:
            raise _fail(where, f"has {len(v)} entries, more than {most}")
        if item is not anything:
            for i, x in enumerate(v):
                item(x, f"{where}[{i}]")

    return check


def mapping(
    fields: Mapping[str, Check] | None = None, *, values: Check | None = None, null: bool = False
) -> Check:
    """A dict; ``fields``: the checks of the keys present (missing ones are an older agent's);
    ``values``: one check for every value."""

    def check(v: Any, where: str) -> None:
        if v is None and null:
            return
        if not isinstance(v, dict):
            raise _fail(where, f"is a {_kind(v)}, not an object")
        for k, f in (fields or {}).items():
            if k in v:
                f(v[k], f"{where}.{k}")
        if values is not None:
            for k, x in v.items():
                values(x, f"{where}.{k}")

    return check


_count = integer(0)
_step = integer(-1)
_names = listing(string(), most=MAX_NAMES)
_strings = listing(string())

RANK_START: Final = mapping(
    {
        "rank": integer(0, MAX_WORLD_SIZE - 1),
        "world_size": integer(1, MAX_WORLD_SIZE),
        "local_rank": integer(0, MAX_WORLD_SIZE - 1, null=True),
        "pid": integer(0, null=True),
        "argv": _strings,
        "orig_argv": _strings,
        "executable": string(null=True),
        "cwd": string(null=True),
        "env": mapping(values=string()),
        "script": mapping({"path": string(null=True), "sha256": string(null=True)}, null=True),
        "versions": mapping(null=True),
        "threads": mapping(values=integer(null=True), null=True),
        "policy": mapping(null=True),
    }
)

RANK_ATTRS: Final[dict[str, Check]] = {
    "rank": integer(0, MAX_WORLD_SIZE - 1),
    "rank_start": mapping(null=True),
    "process_groups": listing(
        mapping(
            {
                "pg": integer(0),
                "name": string(null=True),
                "ranks": listing(integer(0, MAX_WORLD_SIZE - 1), null=True),
                "size": integer(0, MAX_WORLD_SIZE, null=True),
            }
        )
    ),
    "files": mapping({"read": listing(mapping()), "written": listing(mapping())}),
    "urandom": mapping({"calls": listing(listing()), "overflow": _count}),
    "numerics_changes": listing(mapping()),
    "compiled": mapping({k: listing() for k in ("graphs", "calls", "modules", "errors")}),
    "snapshots": listing(
        mapping(
            {
                "step": integer(0),
                "payload": integer(-1),
                "nbytes": integer(0, null=True),
                "params": listing(listing()),
            }
        )
    ),
    "modules": listing(mapping({"name": string(), "path": string(), "sha256": string(null=True)})),
    "end": mapping(
        {
            "reason": string(null=True),
            "steps": integer(0, null=True),
            "colls": integer(0, null=True),
            "counters": mapping(null=True),
        },
        null=True,
    ),
    "agent_errors": listing(),
    "drops": listing(),
    "structures": listing(mapping()),
    "attempts": _count,
    "stuck": listing(mapping()),
    "last_alive": mapping(null=True),
    "ooms": listing(mapping({"payload": integer(-1)})),
    "flight_dumps": listing(mapping()),
    "state_dumps": listing(mapping()),
    "flight_unwritten": _count,
    "damage": listing(),
    "unread_events": mapping(),
    "payload_missing": _count,
    "cupti": mapping(null=True),
    "completeness": mapping(
        {"complete": boolean, "through_step": _step, "prefix": boolean, "reasons": _strings}
    ),
    "collector": mapping(),
    "arrays": mapping(values=mapping({"len": _count, "blake2b": string()})),
    "signature": mapping(),
}

ROOT_META: Final = mapping(
    {
        "format_version": integer(),
        "kind": string(),
        "ranks": listing(integer(0, MAX_WORLD_SIZE - 1), most=MAX_WORLD_SIZE),
        "world_size": integer(1, MAX_WORLD_SIZE, null=True),
        "run": mapping(null=True),
    }
)


def check_root(meta: dict[str, Any], url: str) -> None:
    """The root's ``fsdp_replay`` attribute: its types, and ranks inside the world it claims."""
    try:
        ROOT_META(meta, "fsdp_replay")
        ranks, world = meta.get("ranks", []), meta.get("world_size")
        if len(set(ranks)) != len(ranks):
            raise _fail("fsdp_replay.ranks", "lists a rank twice")
        if world is not None and ranks and max(ranks) >= world:
            raise _fail("fsdp_replay.ranks", f"names rank {max(ranks)} of a world of {world}")
    except TraceFormatError as e:
        raise TraceFormatError(str(e), path=f"{url}/zarr.json") from None


def check_rank(attrs: dict[str, Any], rank: int, world: int | None, where: str) -> None:
    """A rank group's attributes: each known one's type and range, and the rank they describe."""
    try:
        for key, check in RANK_ATTRS.items():
            if key in attrs:
                check(attrs[key], key)
        for key, value in attrs.items():
            if key.endswith("_names"):
                _names(value, key)
        start = attrs.get("rank_start")
        if start is not None:
            RANK_START(start, "rank_start")
        for key, value in (("rank", attrs.get("rank")), ("rank_start.rank", (start or {}).get("rank"))):
            if value is not None and value != rank:
                raise _fail(key, f"is {value}, in the group of rank {rank}")
        claimed = (start or {}).get("world_size")
        if world is not None and claimed is not None and claimed > world:
            raise _fail("rank_start.world_size", f"is {claimed}; the trace's world is {world}")
    except TraceFormatError as e:
        raise TraceFormatError(str(e), path=f"{where}/zarr.json") from None
