"""Checking a trace-event document (``fsdp-replay export --perfetto``) against the Trace Event
Format: the JSON schema beside this file (with ``jsonschema``, where installed), and by hand the
same documented fields plus what a viewer needs beyond field types (every process and thread
named, complete slices on one thread nested, counters numeric). The GPU tests use it too, on a
machine that may lack ``jsonschema``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

SCHEMA_PATH = Path(__file__).resolve().parent / "trace_event_schema.json"
FIELDS = {
    "X": ({"ph", "name", "cat", "ts", "dur", "pid", "tid", "args"}, set()),
    "i": ({"ph", "name", "cat", "ts", "pid", "tid", "s"}, {"args"}),
    "C": ({"ph", "name", "ts", "pid", "args"}, {"tid"}),
    "M": ({"ph", "name", "pid", "args"}, {"tid", "ts"}),
}
METADATA_ARGS = {
    "process_name": "name",
    "thread_name": "name",
    "process_sort_index": "sort_index",
    "thread_sort_index": "sort_index",
}


def schema_validate(doc: dict[str, Any]) -> bool:
    """Validate with the JSON schema; False where ``jsonschema`` is not installed."""
    try:
        import jsonschema
    except ImportError:
        return False
    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(doc, schema, cls=jsonschema.Draft202012Validator)
    return True


def _number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def check(doc: dict[str, Any]) -> dict[str, int]:
    """Check ``doc`` strictly (raises AssertionError naming the event); returns the count by ``ph``."""
    assert isinstance(doc, dict) and set(doc) <= {"traceEvents", "displayTimeUnit", "otherData"}, sorted(doc)
    assert doc.get("displayTimeUnit", "ms") in ("ms", "ns")
    events = doc["traceEvents"]
    assert isinstance(events, list)
    counts: dict[str, int] = defaultdict(int)
    named_processes: set[int] = set()
    named_threads: set[tuple[int, int]] = set()
    used_threads: set[tuple[int, int]] = set()
    used_processes: set[int] = set()
    slices: dict[tuple[int, int], list[tuple[float, float, str]]] = defaultdict(list)
    for ev in events:
        ph = ev.get("ph")
        assert ph in FIELDS, f"unknown phase: {ev}"
        required, optional = FIELDS[ph]
        assert required <= set(ev) <= required | optional, f"fields of a {ph!r} event: {ev}"
        assert isinstance(ev["name"], str) and ev["name"], ev
        assert _id(ev["pid"]) and ("tid" not in ev or _id(ev["tid"])), ev
        assert isinstance(ev.get("args", {}), dict), ev
        if "ts" in ev:
            assert _number(ev["ts"]) and ev["ts"] >= 0, ev
        counts[ph] += 1
        if ph == "M":
            key = METADATA_ARGS.get(ev["name"])
            assert key is not None and set(ev["args"]) == {key}, ev
            value = ev["args"][key]
            assert (isinstance(value, str) and value) if key == "name" else isinstance(value, int), ev
            if ev["name"] == "process_name":
                named_processes.add(ev["pid"])
            elif ev["name"] == "thread_name":
                named_threads.add((ev["pid"], ev["tid"]))
            continue
        if ph == "X":
            assert isinstance(ev["cat"], str) and ev["cat"] and _number(ev["dur"]) and ev["dur"] >= 0, ev
            slices[(ev["pid"], ev["tid"])].append((ev["ts"], ev["ts"] + ev["dur"], ev["name"]))
            used_threads.add((ev["pid"], ev["tid"]))
        elif ph == "i":
            assert ev["s"] in ("g", "p", "t") and isinstance(ev["cat"], str), ev
        elif ph == "C":
            assert ev["args"] and all(_number(v) for v in ev["args"].values()), ev
        used_processes.add(ev["pid"])
    assert used_processes <= named_processes, (
        f"processes without a name: {sorted(used_processes - named_processes)}"
    )
    assert used_threads <= named_threads, f"threads without a name: {sorted(used_threads - named_threads)}"
    for thread, spans in slices.items():  # slices on one thread must nest (or follow each other)
        spans.sort(key=lambda s: (s[0], -s[1]))
        stack: list[tuple[float, float, str]] = []
        for span in spans:
            while stack and stack[-1][1] <= span[0] + 1e-6:
                stack.pop()
            if stack:
                assert span[1] <= stack[-1][1] + 1e-6, (
                    f"thread {thread}: {span} overlaps {stack[-1]} without nesting"
                )
            stack.append(span)
    return dict(counts)
