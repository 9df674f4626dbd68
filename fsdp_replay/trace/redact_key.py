"""The key of a run's redaction markers: made per run, kept beside the trace, never in it.

``fsdp-replay record`` makes a random key for each run (unless ``FSDP_REPLAY_REDACT_KEY`` gives
one: a team that shares a key can compare across runs), hands it to the ranks in that variable,
and keeps it in the run folder, outside the trace folder (``RUN/redact.key``, mode 0600). The
agent never records that variable (``redact.redact_env``). A marker is then
``<redacted:hmac-sha256:<16 hex>>`` (``schema.REDACTED_KEYED_FMT``): a replay on a machine that
has the key tells whether its own value of a redacted variable is the recorded one; the trace,
copied to an object store or to a colleague, holds neither the value nor the key.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from fsdp_replay.options import ENV_PREFIX

KEY_ENV: Final = ENV_PREFIX + "REDACT_KEY"
# In the run folder (``record --out``), beside ``run.json`` and ``trace.zarr``, never inside the trace.
KEY_FILE: Final = "redact.key"
KEY_BYTES: Final = 32


def from_env(env: Mapping[str, str] | None = None) -> str:
    """The key the process was given (empty: none, markers are plain ``<redacted>``)."""
    return (os.environ if env is None else env).get(KEY_ENV, "").strip()


def for_run(run: Path, env: Mapping[str, str] | None = None) -> str:
    """The key of a new recording into run folder ``run``: the one given in ``FSDP_REPLAY_REDACT_KEY``,
    else a new random one; written to ``RUN/redact.key`` (mode 0600) either way."""
    key = from_env(env) or secrets.token_hex(KEY_BYTES)
    path = run / KEY_FILE
    tmp = path.with_name(f"{KEY_FILE}.{os.getpid()}.tmp")
    try:  # made 0600 from the start (an atomic_write made it 0644 for a moment)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return key


def find(trace_url: str, env: Mapping[str, str] | None = None) -> str:
    """The key to check a replay's own values against the markers of the trace at ``trace_url``:
    ``FSDP_REPLAY_REDACT_KEY``, else ``redact.key`` of the run folder holding a local trace; empty
    where there is none."""
    given = from_env(env)
    if given or "://" in trace_url:
        return given
    where = Path(trace_url)
    for folder in (where, where.parent):
        path = folder / KEY_FILE
        try:
            return path.read_text().strip()
        except OSError:
            continue
    return ""
