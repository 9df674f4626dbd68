"""JSON Patch (RFC 6902) as the injector writes it, and a small applier for ``inject -f``.

Paths are JSON Pointers (RFC 6901): ``~`` is written ``~0`` and ``/`` is written ``~1`` inside a
token, which matters for annotation keys such as ``fsdp-replay.io/injected``. The applier knows the
operations the injector emits (``add``, ``replace``, ``remove``, ``test``) and the ``-`` index; the
tests check it against the ``jsonpatch`` library on every fixture.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal, TypedDict


class _OpBase(TypedDict):
    op: Literal["add", "replace", "remove", "test"]
    path: str


class Op(_OpBase, total=False):
    """One JSON Patch operation (``value`` for all but ``remove``)."""

    value: Any


def escape(token: str | int) -> str:
    """One reference token of a JSON Pointer: ``a/b~c`` -> ``a~1b~0c`` (``~`` first, as RFC 6901 says)."""
    return str(token).replace("~", "~0").replace("/", "~1")


def unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def pointer(*tokens: str | int) -> str:
    """The JSON Pointer to ``tokens``: ``pointer("metadata", "annotations", "a/b")`` -> ``/metadata/annotations/a~1b``."""
    return "".join("/" + escape(t) for t in tokens)


def add(path: str, value: Any) -> Op:
    return {"op": "add", "path": path, "value": value}


def replace(path: str, value: Any) -> Op:
    return {"op": "replace", "path": path, "value": value}


def prefixed(ops: Iterable[Op], prefix: str) -> list[Op]:
    """``ops`` re-rooted under ``prefix`` (a pod's ops applied to a pod template inside a Deployment)."""
    return [{**op, "path": prefix + op["path"]} for op in ops]


def apply(doc: Any, ops: Iterable[Op]) -> Any:
    """``doc`` with ``ops`` applied in order, changed in place (and returned)."""
    for op in ops:
        tokens = [unescape(t) for t in op["path"].split("/")[1:]] if op["path"] else []
        if not tokens:
            if op["op"] in ("add", "replace"):
                doc = op["value"]
            continue
        parent = doc
        for token in tokens[:-1]:
            parent = parent[int(token)] if isinstance(parent, list) else parent[token]
        last = tokens[-1]
        kind = op["op"]
        if isinstance(parent, list):
            index = len(parent) if last == "-" else int(last)
            if kind == "add":
                parent.insert(index, op["value"])
            elif kind == "replace":
                parent[index] = op["value"]
            elif kind == "remove":
                del parent[index]
            elif parent[index] != op["value"]:
                raise ValueError(f"test failed at {op['path']}")
        elif kind in ("add", "replace"):
            if kind == "replace" and last not in parent:
                raise KeyError(f"replace: nothing at {op['path']}")
            parent[last] = op["value"]
        elif kind == "remove":
            del parent[last]
        elif parent.get(last) != op["value"]:
            raise ValueError(f"test failed at {op['path']}")
    return doc
