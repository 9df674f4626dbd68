"""The replay's view of the files (``replayer/overlay.py``) built from every rank's ledger, without
installing it: what a rank created is hidden from all, what changed after the run began is named.
The view as installed in a replayed program: ``test_replay.py`` and ``test_resume_if_present.py``."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

import pytest

from fsdp_replay.replayer import overlay
from fsdp_replay.replayer.report import file_cause, late_note, render_text


@pytest.fixture(autouse=True)
def _real_functions(monkeypatch: pytest.MonkeyPatch) -> None:
    """The functions the view calls through, as ``install`` keeps them (nothing is patched here)."""
    monkeypatch.setattr(overlay, "_real", overlay.originals())


def _ledger(
    written: list[tuple[str, bool]] | None = None, read: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """A rank's ``files`` attribute: ``written`` as (path, whether it existed)."""
    return {
        "read": read or [],
        "written": [{"path": p, "existed": e} for p, e in written or []],
        "listed": [],
    }


def _view(tmp: Path, job: overlay.JobFiles) -> overlay.Overlay:
    return overlay.Overlay(tmp / "private", set(job.created), job.known, [], None, job)


def test_a_file_any_rank_created_is_hidden_from_every_rank(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    ckpt, config = work / "resume.pt", work / "config.json"
    ckpt.write_bytes(b"rank 0's checkpoint")
    config.write_text("{}")
    ledgers = {0: _ledger(written=[(str(ckpt), False)]), 1: _ledger()}
    for rank in (0, 1):
        for live in (False, True):
            job = overlay.job_files(ledgers, rank, start_ns=None, live=live)
            assert job.created == {str(ckpt)} and job.writers == {str(ckpt): [0]}
            view = _view(tmp_path, job)
            with pytest.raises(FileNotFoundError):
                view.open(str(ckpt), "rb")
            assert view.listdir(str(work)) == ["config.json"]
            assert [e.name for e in view.scandir(str(work))] == ["config.json"]
            # the replay's own write goes to its private folder, and is then what it reads
            with view.open(str(ckpt), "wb") as f:
                f.write(b"the replay's")
            with view.open(str(ckpt), "rb") as f:
                assert f.read() == b"the replay's"
            assert ckpt.read_bytes() == b"rank 0's checkpoint"  # the recorded job's, untouched
            (tmp_path / "private" / str(ckpt).lstrip("/")).unlink()


def test_a_path_one_rank_created_is_created_although_another_found_it_there(tmp_path: Path) -> None:
    path = str(tmp_path / "shared.pt")
    ledgers = {0: _ledger(written=[(path, False)]), 1: _ledger(written=[(path, True)])}
    job = overlay.job_files(ledgers, 1, start_ns=None, live=True)
    assert job.created == {path} and job.writers == {path: [0, 1]}


def test_a_file_another_rank_created_that_this_rank_read_is_shown_alone_but_not_live(tmp_path: Path) -> None:
    folder = tmp_path / "ckpts"
    folder.mkdir()
    (folder / "a.pt").write_bytes(b"a")
    (folder / "b.pt").write_bytes(b"b")
    read = [{"path": str(folder / "a.pt"), "size": 1, "mtime_ns": 0, "sha256": None}]
    ledgers = {
        0: _ledger(written=[(str(folder), False), (str(folder / "a.pt"), False)]),
        1: _ledger(read=read),
    }
    alone = overlay.job_files(ledgers, 1, start_ns=None, live=False)
    assert alone.shown == {str(folder / "a.pt")}
    view = _view(tmp_path, alone)
    with view.open(str(folder / "a.pt"), "rb") as f:  # it met it in the recorded run
        assert f.read() == b"a"
    assert view.listdir(str(folder)) == ["a.pt"]  # the folder rank 0 made leads to it; b.pt stays hidden
    with pytest.raises(FileNotFoundError):
        view.open(str(folder / "b.pt"), "rb")
    live = overlay.job_files(ledgers, 1, start_ns=None, live=True)  # rank 0 runs again and makes it
    assert not live.shown
    with pytest.raises(FileNotFoundError):
        _view(tmp_path, live).open(str(folder / "a.pt"), "rb")


def test_a_read_of_a_file_modified_after_the_run_began_is_listed_with_its_writers(tmp_path: Path) -> None:
    old, new, same = tmp_path / "old.txt", tmp_path / "overwritten.pt", tmp_path / "read-then.bin"
    for p in (old, new, same):
        p.write_bytes(p.name.encode())
    start_ns = time.time_ns()
    os.utime(old, ns=(start_ns - 10**9, start_ns - 10**9))  # before the run: as the run found it
    os.utime(new, ns=(start_ns + 10**9, start_ns + 10**9))
    os.utime(same, ns=(start_ns + 10**9, start_ns + 10**9))
    digest = hashlib.sha256(same.read_bytes()).hexdigest()
    as_read = {
        "path": str(same),
        "size": same.stat().st_size,
        "mtime_ns": 0,
        "sha256": digest,
        "during_run": True,
    }
    ledgers = {0: _ledger(written=[(str(new), True)]), 1: _ledger(read=[as_read])}
    view = _view(tmp_path, overlay.job_files(ledgers, 1, start_ns=start_ns, live=False))
    for p in (old, new, same, new):
        with view.open(str(p), "rb") as f:
            f.read()
    os.stat(str(new))  # metadata only: not a read of its content
    assert view.late == [{"path": str(new), "mtime_ns": start_ns + 10**9, "written_by": [0]}]
    # without a start (a trace from before rank_start.start_ns), nothing is listed
    quiet = _view(tmp_path, overlay.job_files(ledgers, 1, start_ns=None, live=False))
    with quiet.open(str(new), "rb") as f:
        f.read()
    assert quiet.late == []


def _diverged(files: dict[str, Any], first: dict[str, Any]) -> dict[str, Any]:
    first = {"rank": 1, "step": 1, "micro": 0, "seq": None, "op": None, "pg": None, **first}
    first.setdefault("what", first["kind"])
    return {
        "status": "diverged",
        "rank": 1,
        "first_divergence": first,
        "divergences": [first],
        "files": files,
    }


def test_a_late_read_is_the_likely_cause_instead_of_the_module_fingerprints_hint() -> None:
    late = [{"path": "/w/resume.pt", "mtime_ns": 1, "written_by": [0]}]
    report = _diverged({"late_reads": late}, {"kind": "loss", "detail": "loss 1.0; recorded 2.0"})
    text = render_text(report)
    assert (
        "likely cause: /w/resume.pt is not as the recorded run found it (rank 0 of the recorded job wrote it "
        "during the run); the replay read it as it is now" in text
    ), text
    assert "--module-fingerprints" not in text
    assert "--module-fingerprints" in render_text(_diverged({}, {"kind": "loss"}))
    # a changed input the recorded run read comes first, with who wrote it
    changed = [{"path": "/w/resume.pt", "what": "its content differs (sha256)", "written_by": [0, 2]}]
    cause = file_cause({"files": {"changed_inputs": changed, "late_reads": late}})
    assert cause == (
        "/w/resume.pt changed since the recording (its content differs (sha256); ranks 0, 2 of the recorded "
        "job wrote it during the run); the recorded run read it"
    )
    assert "is not as the recorded run found it" in (
        file_cause({"files": {"late_reads": [{"path": "/x"}]}}) or ""
    )
    assert late_note([]) is None
    assert "1 file last modified after the recorded run began (/w/resume.pt, written by rank 0" in (
        late_note(late) or ""
    )


@pytest.mark.parametrize(
    ("first", "where"),
    [
        (
            {"kind": "ended_early", "seq": 3, "detail": "the program ended after 3 collectives"},
            "at step 1 micro-step 0, after 3 collectives",
        ),
        (
            {"kind": "collective_input", "seq": 3, "op": "allreduce_", "pg": 0},
            "collective #3 allreduce_ on process group 0",
        ),
        ({"kind": "collective_input", "seq": 3, "op": "allreduce_"}, "collective #3 allreduce_\n"),
        ({"kind": "collective_input", "seq": 3}, "collective #3\n"),
    ],
)
def test_a_divergence_at_a_collective_never_prints_none(first: dict[str, Any], where: str) -> None:
    text = render_text(_diverged({}, first))
    assert "None" not in text and where in text, text
