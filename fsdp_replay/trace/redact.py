"""Keep credentials out of everything the tool writes: traces travel to object stores and to
colleagues, reports and manifests to tickets and logs.

Every environment variable is recorded (a program reads its own: a data path, a config switch);
what is recorded, there and in argv, goes through three kinds of rules, stated for users in
docs/trace-format.md ("What is redacted"):

- **names** (flags, ``NAME=value`` arguments, env var names; ``secret_names.py``): a secret name
  hides its value; a login-like name (``--login``, ``-u``) hides the password of ``user:password``.
- **values** that look like credentials on their own, wherever they appear (``secret_shapes.py``):
  known token shapes, URL passwords, secret query and connection-string parameters, private keys,
  long random strings.
- **detect-secrets** (``secret_scan.py``): its keyword, basic-auth, high-entropy and provider
  plugins, over names and values; where it is not installed the two kinds above act alone.

A redacted value becomes a marker (``marker``): ``<redacted>``, or with the run's key
(``redact_key.py``) ``<redacted:hmac-sha256:<16 hex>>``, so that a machine holding the key can
tell whether a value of its own is the recorded one. ``scrub_text`` (and ``scrub_doc`` over a JSON
document) applies the same rules to free text: exception messages, stack lines, reports, the
commands' output, rendered Jobs, metric labels.

Redaction errs towards hiding: a false positive costs a replay its recorded command line (the user
gives it after ``--``, see replayer/launch.py); a false negative leaks a credential.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import re
from collections.abc import Iterable, Mapping
from typing import Any, Final

from fsdp_replay.trace import schema, secret_scan
from fsdp_replay.trace.redact_key import KEY_ENV
from fsdp_replay.trace.secret_names import (
    login_name,
    mysql_client,
    name_parts,
    secret_flag,
    secret_name,
    secret_param,
)
from fsdp_replay.trace.secret_shapes import LOGIN_VALUE_RE, Found, entropy_bits, find, looks_random

__all__ = [
    "clear_cache",
    "entropy_bits",
    "looks_random",
    "marker",
    "name_parts",
    "redact_argv",
    "redact_env",
    "redact_value",
    "same_value",
    "scrub_doc",
    "scrub_text",
    "secret_name",
]

# Variables that hold references to secrets (Kubernetes Secret and key names), never a secret: the
# injector's record of the pod (injector/identity.py), JSON that detect-secrets' keyword plugin
# would take for secrets (``"storeSecret": "trace-store"``); the project's own value rules apply.
REFERENCE_ENV: Final = frozenset({"FSDP_REPLAY_POD_REFS"})
# Distinct texts whose scrubbed form is kept (stack lines and report strings repeat).
_CACHE_ENTRIES: Final = 8192
_CACHED_MAX_CHARS: Final = 1024
_MYSQL_ATTACHED_RE: Final = re.compile(r"-p(?P<pw>.+)")


def marker(secret: str, key: str = "") -> str:
    """What replaces ``secret``: ``<redacted>``, or with a key the first 16 hex digits of
    HMAC-SHA256(key, secret) in ``<redacted:hmac-sha256:...>``."""
    if not key:
        return schema.REDACTED
    mac = hmac.new(key.encode(), secret.encode("utf-8", "surrogatepass"), hashlib.sha256)
    return schema.REDACTED_KEYED_FMT.format(digest=mac.hexdigest()[: schema.REDACTED_DIGEST_HEX_CHARS])


# -- finding ----------------------------------------------------------------------------------
def _lines(text: str) -> Iterable[tuple[int, str]]:
    at = 0
    for line in text.splitlines(keepends=True):
        yield at, line
        at += len(line)


def _found(text: str, name: str = "", *, free: bool = False, scan: bool = True) -> list[Found]:
    """Every credential span of ``text`` (by the project's rules and detect-secrets'), less those
    that overlap a marker already there. ``name``: the variable or flag ``text`` is the value of
    (detect-secrets' keyword plugin reads ``name=text``); ``free``: free text (``find``); ``scan``:
    with detect-secrets' findings."""
    found = find(text, free=free)
    scanner = secret_scan.scanner() if scan else None
    if scanner is not None:
        own_parts = [f for f in found if not f.whole]
        scanned = [(a + at, b + at) for at, line in _lines(text) for a, b in scanner.spans(line, free=free)]
        if name:
            head = len(name) + 1
            scanned += [
                (max(a - head, 0), b - head) for a, b in scanner.assigned(f"{name}={text}") if b > head
            ]
        for a, b in scanned:
            # a finding inside a part the project's rules replace already (a URL's password,
            # password=x) is that part; any other makes the value a secret
            if not any(f.start < b and a < f.end for f in own_parts):
                found.append(Found(a, b, whole=True))
    markers = [m.span() for m in schema.REDACTED_RE.finditer(text)]
    return [f for f in found if f.end > f.start and not any(a < f.end and f.start < b for a, b in markers)]


def _replaced(text: str, found: list[Found], key: str) -> str:
    """``text`` with each span of ``found`` (overlapping ones merged) replaced by its marker."""
    spans = sorted((f.start, f.end) for f in found)
    out: list[str] = []
    at = 0
    merged: list[list[int]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    for a, b in merged:
        out += [text[at:a], marker(text[a:b], key)]
        at = b
    out.append(text[at:])
    return "".join(out)


# -- values, env and argv ---------------------------------------------------------------------
def redact_value(value: str, key: str = "", name: str = "") -> str:
    """``value`` with its credentials replaced: a URL's password, a secret parameter's value, a
    password after a flag, each on its own; any other credential (a token, a random string, a
    private key, a secret header, what detect-secrets finds) replaces the whole value. ``name``:
    what ``value`` is the value of (a variable, a flag), read by detect-secrets' keyword plugin."""
    found = _found(value, name, scan=name not in REFERENCE_ENV)
    if not found:
        return value
    if any(f.whole for f in found):
        return marker(value, key)
    return _replaced(value, found, key)


def _login_value(value: str, key: str) -> str | None:
    """``user:password`` with the password replaced; None when ``value`` is not of that form."""
    m = LOGIN_VALUE_RE.fullmatch(value)
    if m is None:
        return None
    return value[: m.start("pw")] + marker(m["pw"], key)


def redact_env(env: Mapping[str, str], key: str = "") -> dict[str, str]:
    """Every variable of env (but the redaction key itself, never recorded), with secret-looking
    names and values redacted, sorted by name."""
    out: dict[str, str] = {}
    for k, v in env.items():
        if k == KEY_ENV:
            continue
        if secret_name(k):
            out[k] = marker(v, key)
        elif login_name(k) and (login := _login_value(v, key)) is not None:
            out[k] = login
        else:
            out[k] = redact_value(v, key, name=k)
    return dict(sorted(out.items()))


def same_value(name: str, mine: str, recorded: str, key: str) -> bool | None:
    """Whether ``mine`` is the value the recording redacted into ``recorded``: redacted with the
    run's key, it gives the same markers. None without a key (or when ``recorded`` holds no keyed
    marker): the trace alone cannot tell."""
    if not key or "hmac-sha256:" not in recorded:
        return None
    return redact_env({name: mine}, key).get(name) == recorded


def _takes_no_value(arg: str) -> bool:
    """After a secret flag, an argument starting with ``--`` is the next option (or the ``--``
    separator): a boolean ``--private`` must not hide it. Anything else is the flag's value, even
    ``-x``: a password may start with a dash."""
    return arg.startswith("--")


def _secret_assignment(name: str) -> bool:
    """Whether the part before ``=`` of an argument names a secret: a flag or a name, or in a URL
    (``https://host/x?token=...``) the last query parameter's name."""
    if "://" in name:
        return secret_param(re.split(r"[?&;/]", name)[-1])
    return secret_flag(name)


def redact_argv(argv: Iterable[str], key: str = "") -> list[str]:
    """argv with secrets removed: ``--token X``, ``--api-key=X``, ``-p X``, ``PASSWORD=X``,
    ``db.password=X``, the password of ``--login user:pw``, ``mysql -pX``, and credential-looking
    values anywhere."""
    out: list[str] = []
    hide_next = login_next = mysql = False
    for arg in argv:
        if hide_next:
            hide_next = False
            if not _takes_no_value(arg):
                out.append(marker(arg, key))
                continue
        if login_next:
            login_next = False
            if not _takes_no_value(arg) and (login := _login_value(arg, key)) is not None:
                out.append(login)
                continue
        if mysql and (attached := _MYSQL_ATTACHED_RE.fullmatch(arg)) is not None:
            out.append("-p" + marker(attached["pw"], key))
            continue
        mysql = mysql or mysql_client(arg)
        name, eq, value = arg.partition("=")
        if eq and not any(c.isspace() for c in name):  # not "Authorization: Basic dXM6cHc="
            # the name part is checked as a value too: "https://u:pw@host/x?a=b" has an "="
            if _secret_assignment(name):
                hidden = marker(value, key)
            elif name.startswith("-") and login_name(name):
                hidden = _login_value(value, key) or redact_value(value, key, name=name)
            else:
                hidden = redact_value(value, key, name=name)
            out.append(f"{redact_value(name, key)}={hidden}")
        elif arg.startswith("-") and secret_flag(arg):
            out.append(arg)
            hide_next = True
        else:
            login_next = arg.startswith("-") and login_name(arg)
            out.append(redact_value(arg, key))
    return out


# -- free text --------------------------------------------------------------------------------
def _scrub(text: str, key: str) -> str:
    if not text or text.isdigit():
        return text
    found = _found(text, free=True)
    return _replaced(text, found, key) if found else text


_scrub_cached = functools.lru_cache(maxsize=_CACHE_ENTRIES)(_scrub)


def scrub_text(text: str, key: str = "") -> str:
    """``text`` with every credential-looking part replaced by its marker, the rest kept: for
    exception messages, stack lines, notes, reports and what the commands print."""
    return _scrub_cached(text, key) if len(text) <= _CACHED_MAX_CHARS else _scrub(text, key)


def clear_cache() -> None:
    """Forget the texts scrubbed so far (their result depends on whether detect-secrets is there)."""
    _scrub_cached.cache_clear()


OWN_DIGEST_KEYS = frozenset({"expected_fp", "actual_fp"})
"""Keys whose values are this tool's own fingerprints (hex text in a replay report): never a
credential, and read as one by an entropy rule, so ``scrub_doc`` keeps them."""


def scrub_doc(doc: Any, key: str = "", keep: frozenset[str] = OWN_DIGEST_KEYS) -> Any:
    """A JSON-like document (dicts, lists, strings) with ``scrub_text`` applied to every string
    value but those under a ``keep`` key; keys, numbers and other values are kept."""
    if isinstance(doc, str):
        return scrub_text(doc, key)
    if isinstance(doc, dict):
        return {k: v if k in keep else scrub_doc(v, key, keep) for k, v in doc.items()}
    if isinstance(doc, list):
        return [scrub_doc(v, key, keep) for v in doc]
    if type(doc) is tuple:
        return tuple(scrub_doc(v, key, keep) for v in doc)
    return doc
