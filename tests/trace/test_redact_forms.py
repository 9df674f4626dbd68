"""Credentials by what they look like: every planted form is redacted wherever it stands (env, argv,
free text), with detect-secrets and, as the documented degradation, without it; what only looks
like a secret is kept; markers are keyed; the replay's notes never print a secret.

A real recording with the forms planted is ``tests/system/test_credentials_nowhere.py``.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from credential_forms import (
    ARGV_FORMS,
    ENV_FORMS,
    FORMS,
    KEPT_ARGV,
    KEPT_ENV,
    KEPT_TEXT,
    TEXT_FORMS,
    Form,
    alnum,
)

from fsdp_replay.trace import redact, redact_key, schema, secret_scan

KEY = "0f" * 32
MARKER_RE = re.compile(r"<redacted:hmac-sha256:[0-9a-f]{16}>")


@pytest.fixture(params=["detect-secrets", "own rules"])
def detector(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each test twice: with detect-secrets, and as on an image without it (its own rules alone)."""
    if request.param == "own rules":
        monkeypatch.setattr(secret_scan, "scanner", lambda: None)
    else:
        assert secret_scan.scanner() is not None, "detect-secrets is a dependency: pip install -e ."
    redact.clear_cache()  # its results depend on the detector
    yield str(request.param)
    redact.clear_cache()


def _outputs(form: Form) -> list[str]:
    out = []
    if form.env:
        out.append(repr(redact.redact_env(form.env, KEY)))
    if form.argv:
        out.append(repr(redact.redact_argv(["train.py", *form.argv], KEY)))
        out.append(redact.scrub_text(" ".join(["python", "train.py", *form.argv]), KEY))
    if form.text:
        out.append(redact.scrub_text(form.text, KEY))
        out.append(redact.scrub_text(repr(RuntimeError(form.text)), KEY))
    return out


def test_at_least_twenty_forms() -> None:
    assert len(FORMS) >= 20 and ENV_FORMS and ARGV_FORMS and TEXT_FORMS


@pytest.mark.parametrize("form", FORMS, ids=lambda f: f.name)
def test_each_form_is_redacted(form: Form, detector: str) -> None:
    for out in _outputs(form):
        for needle in form.needles:
            assert needle not in out, f"{form.name} ({detector}): {out}"
        assert MARKER_RE.search(out), out


def test_partial_redaction_keeps_the_rest_readable(detector: str) -> None:
    env = redact.redact_env(
        {
            "DATABASE_URL": "postgresql://app:pw-7Hx2@db.internal:5432/app",
            "WAREHOUSE_JDBC": "jdbc:postgresql://db:5432/app?user=svc&password=jdbc-9Qz&ssl=true",
            "DB_LOGIN": "svc:login-3Kd",
        },
        KEY,
    )
    m = r"<redacted:hmac-sha256:[0-9a-f]{16}>"
    assert re.fullmatch(rf"postgresql://app:{m}@db.internal:5432/app", env["DATABASE_URL"])
    assert re.fullmatch(
        rf"jdbc:postgresql://db:5432/app\?user=svc&password={m}&ssl=true", env["WAREHOUSE_JDBC"]
    )
    assert re.fullmatch(rf"svc:{m}", env["DB_LOGIN"])
    argv = redact.redact_argv(["train.py", "--login", "svc:pw-8Lm", "mysql", "-uroot", "-pmy-4Rt"], KEY)
    assert re.fullmatch(rf"svc:{m}", argv[2]) and argv[4] == "-uroot" and re.fullmatch(rf"-p{m}", argv[5])
    text = redact.scrub_text(
        "RuntimeError: cannot reach postgres://admin:ex-5Wq@db:5432/x (after 3 tries)", KEY
    )
    assert re.fullmatch(rf"RuntimeError: cannot reach postgres://admin:{m}@db:5432/x \(after 3 tries\)", text)


def test_what_only_looks_like_a_secret_is_kept(detector: str) -> None:
    assert redact.redact_argv(KEPT_ARGV, KEY) == KEPT_ARGV
    assert redact.redact_env(KEPT_ENV, KEY) == dict(sorted(KEPT_ENV.items()))
    for line in KEPT_TEXT:
        assert redact.scrub_text(line, KEY) == line


def test_detect_secrets_adds_to_the_own_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """A form only detect-secrets knows (its keyword list has Spanish): found with it, not without."""
    value = "contrasena: " + alnum(10)
    assert schema.is_redacted(redact.redact_value(value, KEY))
    monkeypatch.setattr(secret_scan, "scanner", lambda: None)
    assert redact.redact_value(value, KEY) == value


def test_the_marker_is_keyed_per_run() -> None:
    a = redact.marker("hunter2", KEY)
    assert MARKER_RE.fullmatch(a) and a == redact.marker("hunter2", KEY)
    assert a != redact.marker("hunter3", KEY) and a != redact.marker("hunter2", "1e" * 32)
    assert redact.marker("hunter2") == schema.REDACTED  # no key: the plain marker
    for marker in (a, schema.REDACTED):
        assert schema.is_redacted(marker) and schema.has_redacted(f"https://u:{marker}@host/x")
    assert not schema.is_redacted(f"https://u:{a}@host/x") and not schema.has_redacted("<redacted:md5:00>")
    assert redact.scrub_text(a, KEY) == a and redact.redact_value(a, KEY) == a  # idempotent


def test_a_replay_with_the_key_tells_its_own_value_from_another() -> None:
    recorded = redact.redact_env({"REDIS_PW": "pw-1", "DATABASE_URL": "postgresql://a:pw-2@db/x"}, KEY)
    assert redact.same_value("REDIS_PW", "pw-1", recorded["REDIS_PW"], KEY) is True
    assert redact.same_value("REDIS_PW", "pw-9", recorded["REDIS_PW"], KEY) is False
    assert (
        redact.same_value("DATABASE_URL", "postgresql://a:pw-2@db/x", recorded["DATABASE_URL"], KEY) is True
    )
    assert (
        redact.same_value("DATABASE_URL", "postgresql://a:pw-9@db/x", recorded["DATABASE_URL"], KEY) is False
    )
    assert redact.same_value("REDIS_PW", "pw-1", recorded["REDIS_PW"], "") is None  # no key: unknown


def test_the_key_is_never_recorded_and_kept_beside_the_trace(tmp_path: Path) -> None:
    env = {redact_key.KEY_ENV: KEY, "HOME": "/root"}
    assert redact.redact_env(env, KEY) == {"HOME": "/root"}
    given = redact_key.for_run(tmp_path, env)
    path = tmp_path / redact_key.KEY_FILE
    assert given == KEY and path.read_text().strip() == KEY
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    other = tmp_path / "other"
    other.mkdir()
    made = redact_key.for_run(other, {})  # none given: a random one
    assert re.fullmatch(r"[0-9a-f]{64}", made) and made != KEY
    (tmp_path / schema.TRACE_DIR).mkdir()
    assert redact_key.find(str(tmp_path / schema.TRACE_DIR), {}) == KEY
    assert redact_key.find("s3://bucket/run/trace.zarr", {}) == ""
    assert redact_key.find("s3://bucket/run/trace.zarr", {redact_key.KEY_ENV: "k2"}) == "k2"


def test_replay_notes_never_print_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp_replay.replayer.launch import replay_env

    recorded = {
        "DATABASE_URL": "postgresql://app:rec-pw-1@db/x",
        "REDIS_PW": "rec-pw-2",
        "API_BASE": "https://api.example.com/v1",
        "DATA_DIR": "/data/a",
    }
    meta = {"env": redact.redact_env(recorded, KEY)}
    mine = {
        "DATABASE_URL": "postgresql://app:my-pw-1@db/x",
        "REDIS_PW": "rec-pw-2",
        "API_BASE": "https://api.example.com/v1?token=" + alnum(20),
        "DATA_DIR": "/data/b",
    }
    for k, v in mine.items():
        monkeypatch.setenv(k, v)
    notes: list[str] = []
    env = replay_env(meta, 0, 1, "cpu", notes, redact_key=KEY)
    text = "\n".join(notes)
    for secret in ("rec-pw-1", "my-pw-1", "rec-pw-2", mine["API_BASE"][-20:]):
        assert secret not in text, text
    assert env["DATABASE_URL"] == mine["DATABASE_URL"] and env["REDIS_PW"] == "rec-pw-2"  # the caller's own
    assert "REDIS_PW from your environment: the recorded value" in text
    assert "DATABASE_URL from your environment is used and differs from the recorded run's" in text
    assert "API_BASE from your environment is used; it differs from the recorded run's" in text
    assert "DATA_DIR=/data/b from your environment is used; the recorded run had DATA_DIR=/data/a" in text


def test_scrub_doc_keeps_the_shape() -> None:
    doc = {"a": ["x", 1, 2.5, None, ("https://u:pw-3@h/x", True)], "n": {"k": "y"}}
    out = redact.scrub_doc(doc, KEY)
    assert out["a"][:4] == ["x", 1, 2.5, None] and isinstance(out["a"][4], tuple)
    assert MARKER_RE.search(out["a"][4][0]) and out["n"] == {"k": "y"}


def test_without_detect_secrets_one_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "detect_secrets", None)  # import fails, as on an image without it
    secret_scan.scanner.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=secret_scan.__name__):
            assert secret_scan.scanner() is None
            assert secret_scan.scanner() is None
            assert redact.redact_env({"REDIS_PW": "x"}, KEY)["REDIS_PW"].startswith("<redacted:")
        lines = [r for r in caplog.records if "detect-secrets is not available" in r.getMessage()]
        assert len(lines) == 1
    finally:
        secret_scan.scanner.cache_clear()


IMPORT_PROBE = """
import logging, sys, time, warnings
shown, saved = warnings.showwarning, logging._warnings_showwarning
t0 = time.perf_counter()
from fsdp_replay.trace import secret_scan
scanner = secret_scan.scanner()
took = time.perf_counter() - t0
assert scanner is not None
assert warnings.showwarning is shown and logging._warnings_showwarning is saved, "captureWarnings left on"
import detect_secrets.settings as s
assert s.get_settings.cache_info().currsize == 0, "detect-secrets' global settings were made"
assert not any(n.startswith("torch") for n in sys.modules), "the trace never imports torch"
print(f"{took:.3f} {scanner.version}")
"""


def test_detect_secrets_leaves_the_process_as_it_found_it() -> None:
    """Loaded in a fresh interpreter: no warnings capture left on, no global settings made."""
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "error"},
    )
    assert proc.returncode == 0, proc.stderr
    took, version = proc.stdout.split()
    assert version.startswith("1.") and float(took) < 5


def test_a_reports_own_fingerprints_are_kept_where_a_credential_beside_them_is_not() -> None:
    # a replay report's divergence names the recorded and replayed fingerprints as 16 hex digits:
    # an entropy rule reads them as a credential, but they are this tool's own digests
    doc = {
        "first_divergence": {"expected_fp": "6cf7e7c138eaafb3", "actual_fp": "afce7bb138ef22c1"},
        "notes": ["token AKIAIOSFODNN7EXAMPLE in a note"],
    }
    out = redact.scrub_doc(doc)
    assert out["first_divergence"] == doc["first_divergence"]
    assert "AKIAIOSFODNN7EXAMPLE" not in out["notes"][0]
