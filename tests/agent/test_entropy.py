"""OS randomness recorded and given back (``agent/entropy.py``), in this process."""

from __future__ import annotations

import os
import random
import secrets
import uuid
from collections.abc import Iterator

import pytest

from fsdp_replay.agent import entropy


@pytest.fixture(autouse=True)
def restore_urandom() -> Iterator[None]:
    yield
    os.urandom = entropy._ORIGINAL
    random._urandom = entropy._ORIGINAL  # type: ignore[attr-defined]


def test_what_the_program_drew_is_given_back_in_order() -> None:
    rec = entropy.EntropyRecorder(lambda: True)
    rec.install()
    drawn = [uuid.uuid4(), secrets.token_hex(8), os.urandom(3)]
    recorded = rec.take()
    assert recorded is not None and [n for n, _ in recorded["calls"]] == [16, 8, 3]
    assert rec.take() is None  # nothing new
    notes: list[str] = []
    entropy.EntropyReplay(recorded, notes).install()
    assert [uuid.uuid4(), secrets.token_hex(8), os.urandom(3)] == drawn
    assert not notes
    assert len(os.urandom(3)) == 3 and not notes  # past the record: the OS's bytes


def test_a_call_of_another_size_ends_the_replay_of_entropy_with_a_note() -> None:
    rec = entropy.EntropyRecorder(lambda: True)
    rec.install()
    first = os.urandom(4)
    os.urandom(16)
    recorded = rec.take()
    notes: list[str] = []
    replay = entropy.EntropyReplay(recorded or {}, notes)
    replay.install()
    assert os.urandom(4) == first
    assert len(os.urandom(8)) == 8  # the program asks for 8 where 16 were recorded
    assert notes and "asked for 8 bytes; the recorded one for 16" in notes[0]
    assert replay.given == 1


def test_bounds_and_inactivity() -> None:
    active = [False]
    rec = entropy.EntropyRecorder(lambda: active[0])
    rec.install()
    os.urandom(4)
    assert rec.take() is None
    active[0] = True
    for _ in range(entropy.MAX_CALLS + 3):
        os.urandom(1)
    got = rec.take()
    assert got is not None and len(got["calls"]) == entropy.MAX_CALLS and got["overflow"] == 3
