"""Dump requests: the agent's writer thread answers each request id once with the process's state.

A real recorded process (``tests/workloads/blocked.py``, one gloo rank under ``fsdp-replay
record``) records a collective and blocks its main thread; the test writes requests into its run
folder and reads its spool. The request file's parsing and the no-request cost are checked in
this process, with a real file.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import CLI, REPO, child_env, torchrun_cmd

from fsdp_replay.agent.state_dump import StateDump
from fsdp_replay.errors import TraceFormatError, TraceNotFoundError
from fsdp_replay.trace import schema, spool
from fsdp_replay.trace.dump_request import AnswerWatch, parse_request, read_request, write_request
from fsdp_replay.trace.layout import atomic_write, dump_request_path

BLOCKED = REPO / "tests" / "workloads" / "blocked.py"


def _line_of(marker: str) -> int:
    return next(i for i, line in enumerate(BLOCKED.read_text().splitlines(), 1) if marker in line)


def _events(run: Path, kind: str) -> list[dict[str, Any]]:
    folder = spool.rank_dir(run / schema.SPOOL_DIR, 0)
    if not folder.is_dir():
        return []
    records = spool.read_rank(folder, spool.SegmentReport())
    return [r.obj for r in records if r.kind == schema.KIND_EVENT and r.obj.get("type") == kind]


def _wait(what: str, probe: Any, timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = probe()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.fixture
def blocked(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    """The run folder of a recorded process blocked after its first collective."""
    run = tmp_path / "run"
    args = ["--in-event-wait"] if getattr(request, "param", "") == "event" else []
    cmd = [*CLI, "record", "--out", str(run), "--no-collect", "--", *torchrun_cmd(1, BLOCKED, *args)]
    with open(tmp_path / "job.log", "w") as log:
        job = subprocess.Popen(cmd, env=child_env(), stdout=log, stderr=log, start_new_session=True)
    try:
        _wait("the rank's first alive mark", lambda: _events(run, schema.EV_ALIVE) or job.poll() is not None)
        assert job.poll() is None, (tmp_path / "job.log").read_text()[-3000:]
        yield run
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)  # it blocks by design
        job.wait(timeout=60)


def _main_frames(ev: dict[str, Any]) -> list[list[Any]]:
    main = ev["threads"][0]
    assert main["main"] is True and main["name"] == "MainThread"
    return main["frames"]


@pytest.mark.slow
def test_a_blocked_process_answers_each_request_once_with_where_its_main_thread_is(blocked: Path) -> None:
    run = blocked
    time.sleep(2.5)  # idle ticks without a request: no answer
    assert _events(run, schema.EV_STATE) == []
    first = write_request(run, "test")
    assert first.id == 1 and read_request(run) == first
    ev = _wait("the answer to request 1", lambda: _events(run, schema.EV_STATE))[0]
    assert set(ev) == schema.EVENT_KEYS[schema.EV_STATE]
    assert (ev["id"], ev["reason"], ev["recording"], ev["inflight"]) == (1, "test", True, None)
    assert ev["seq"] == 1 and ev["step"] == 0  # one collective done, no optimizer step
    file, line, func, source, lib = _main_frames(ev)[-1]
    assert (Path(file).name, line, func) == ("blocked.py", _line_of("BLOCKED-MAIN-SLEEP"), "block")
    assert source.startswith("time.sleep(600)") and lib is False
    names = {t["name"]: t for t in ev["threads"]}
    assert names["fsdp-replay-writer"]["agent"] is True and names["waiter"]["agent"] is False
    waiter = names["waiter"]["frames"]
    assert waiter[-1][2] == "wait" and waiter[-1][4] is True  # threading.py: a library frame
    assert all(t["frames_dropped"] == 0 for t in ev["threads"])

    atomic_write(
        dump_request_path(run), json.dumps({"id": 1, "t_wall_ns": time.time_ns(), "reason": "again"})
    )
    time.sleep(2.5)  # the same id again (a new file): not answered twice
    assert [e["id"] for e in _events(run, schema.EV_STATE)] == [1]

    dump_request_path(run).write_text("{not json")  # a malformed request: ignored, recording goes on
    alive = len(_events(run, schema.EV_ALIVE))
    _wait("alive marks after the malformed request", lambda: len(_events(run, schema.EV_ALIVE)) >= alive + 2)
    assert [e["id"] for e in _events(run, schema.EV_STATE)] == [1]
    assert _events(run, schema.EV_AGENT_ERROR) == []

    second = write_request(run, "second")  # over the malformed file: an id above any answered
    assert second.id > 1
    _wait("the answer to the second request", lambda: len(_events(run, schema.EV_STATE)) == 2)
    assert [e["id"] for e in _events(run, schema.EV_STATE)] == [1, second.id]


@pytest.mark.slow
@pytest.mark.parametrize("blocked", ["event"], indirect=True)
def test_a_main_thread_in_event_wait_is_found_through_the_library_frames(blocked: Path) -> None:
    req = write_request(blocked, "event")
    watch = AnswerWatch(blocked, req.id)
    _wait("the answer", lambda: (watch.poll(), watch.answers)[1])
    frames = _main_frames(watch.answers[0])
    watch.close()
    assert frames[-1][2] == "wait" and frames[-1][4] is True  # threading.Event.wait
    program = [f for f in frames if not f[4]]
    assert program[-1][1:3] == [_line_of("BLOCKED-MAIN-EVENT"), "block"]
    assert watch.waiting() == []


def test_no_request_costs_one_stat_and_an_unchanged_request_is_not_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / schema.SPOOL_DIR).mkdir()
    dump = StateDump(str(tmp_path), born_wall_ns=0)
    calls = {"stat": 0, "open": 0}
    real_stat, real_open = os.stat, open

    def stat(*a: Any, **k: Any) -> Any:
        calls["stat"] += 1
        return real_stat(*a, **k)

    def opened(*a: Any, **k: Any) -> Any:
        calls["open"] += 1
        return real_open(*a, **k)

    monkeypatch.setattr(os, "stat", stat)
    monkeypatch.setattr("builtins.open", opened)
    position = {"t_ns": 0, "step": 0, "micro": 0, "seq": 0, "recording": True, "inflight": None}
    for _ in range(100):
        assert dump.poll(lambda: position) is None
    assert calls == {"stat": 100, "open": 0}
    monkeypatch.undo()
    write_request(tmp_path, "once")
    monkeypatch.setattr(os, "stat", stat)
    monkeypatch.setattr("builtins.open", opened)
    ev = dump.poll(lambda: position)
    assert ev is not None and ev["id"] == 1 and ev["threads"][0]["main"] is True
    calls.update(stat=0, open=0)
    for _ in range(10):
        assert dump.poll(lambda: position) is None
    assert calls == {"stat": 10, "open": 0}


def test_a_request_older_than_the_process_is_not_answered(tmp_path: Path) -> None:
    (tmp_path / schema.SPOOL_DIR).mkdir()
    write_request(tmp_path, "before")
    later = StateDump(str(tmp_path))  # born after the request
    position = {"t_ns": 0, "step": 0, "micro": 0, "seq": 0, "recording": True, "inflight": None}
    assert later.poll(lambda: position) is None
    write_request(tmp_path, "after")
    ev = later.poll(lambda: position)
    assert ev is not None and (ev["id"], ev["reason"]) == (2, "after")


def test_requests_are_checked_and_a_folder_without_a_spool_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TraceNotFoundError, match="no spool folder"):
        write_request(tmp_path, "x")
    for raw, why in (
        (b"[1]", "JSON object"),
        (b"{bad", "JSON object"),
        (b'{"id": 0, "t_wall_ns": 1}', "id is an integer >= 1"),
        (b'{"id": true, "t_wall_ns": 1}', "id is an integer >= 1"),
        (b'{"id": 1}', "t_wall_ns"),
        (b'{"id": 1, "t_wall_ns": 1, "reason": 3}', "reason is a string"),
        (b" " * 5000, "at most"),
    ):
        with pytest.raises(TraceFormatError, match=why):
            parse_request(raw, "req")
    assert parse_request(b'{"id": 3, "t_wall_ns": 5}').reason == ""
    proc = subprocess.run([*CLI, "dump", str(tmp_path)], capture_output=True, text=True, env=child_env())
    assert proc.returncode == 3 and "no rank spools" in proc.stderr
