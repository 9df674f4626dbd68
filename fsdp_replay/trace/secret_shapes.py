"""What credentials look like inside a value or a line of text: fsdp-replay's own value rules.

Each rule finds spans of text to replace (``Found``): a known token shape, a URL's password, the
value of a secret query or connection-string parameter (``?token=``, ``;Password=``), the value
after a secret flag inside a command written as text (``--pw X``, ``--login user:pw``, ``mysql
-pX``), a secret header (``Authorization: Basic ...``), a private key block, or a random-looking
string (``looks_random``). ``redact.py`` replaces them, with detect-secrets' findings
(``secret_scan.py``); docs/trace-format.md ("What is redacted") states them for users.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

from fsdp_replay.trace.secret_names import (
    login_name,
    secret_flag,
    secret_name,
    secret_param,
    text_secret_name,
)


@dataclass(frozen=True, slots=True)
class Found:
    """Text ``[start, end)`` to replace. ``whole``: inside a value (an argument, an env var's
    value), the whole value is replaced, not the span: the rest may be part of the credential."""

    start: int
    end: int
    whole: bool = False


# -- known shapes -----------------------------------------------------------------------------
# Credentials with a known shape, anywhere (not inside a longer word: "task-...").
TOKEN_RE: Final = re.compile(
    r"(?<![A-Za-z0-9])(?:"
    r"hf_[A-Za-z0-9]{20,}"  # Hugging Face
    r"|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}"  # GitHub
    r"|(?:AKIA|ASIA)[0-9A-Z]{16}"  # AWS access key ids
    r"|xox[abpr]-[A-Za-z0-9-]{10,}"  # Slack
    r"|sk-(?=[A-Za-z0-9_-]*[0-9])[A-Za-z0-9_-]{20,}"  # OpenAI, Anthropic (sk-proj-, sk-ant-)
    r"|[rs]k_(?:live|test)_[A-Za-z0-9]{16,}"  # Stripe
    r"|glpat-[A-Za-z0-9_-]{20,}"  # GitLab
    r"|eyJ[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{10,}\.[A-Za-z0-9_-]{5,}"  # JWT: header.payload.signature
    r"|https://hooks\.slack\.com/(?:services|workflows|triggers)/[A-Za-z0-9/_-]+"  # Slack webhooks
    r"|https://(?:canary\.|ptb\.)?discord(?:app)?\.com/api/webhooks/[A-Za-z0-9/_-]+"  # Discord webhooks
    r")|(?i:\bbearer\s+[A-Za-z0-9._~+/-]{8,})"
    # HTTP basic credentials: base64 with a digit, + / or = (not "basic training")
    r"|(?i:\bbasic\s+)(?=[A-Za-z0-9+/]*[0-9+/=])[A-Za-z0-9+/]{8,}=*"
)
# A private key, from its BEGIN line to its END line (or the end of the text).
PRIVATE_KEY_RE: Final = re.compile(
    r"-----BEGIN[A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----"
    r"(?:.*?-----END[A-Z0-9 ]*PRIVATE KEY(?: BLOCK)?-----|.*\Z)|PuTTY-User-Key-File-\d.*\Z",
    re.DOTALL,
)
# scheme://user:password@host: only the password is replaced, so the rest stays readable. The
# password runs to the last "@" before the path, so an unescaped "@" in it is hidden too.
URL_PASSWORD_RE: Final = re.compile(
    r"(?P<head>(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)(?P<pw>[^/\s]+)@"
)
# scheme://KEY@host, a key as the user (a Sentry DSN): 16+ letters and digits, both.
URL_KEY_USER_RE: Final = re.compile(
    r"(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]*://(?P<key>(?=[A-Za-z_-]*[0-9])(?=[0-9_-]*[A-Za-z])[A-Za-z0-9_-]{16,})@"
)
# name=value: a query parameter (?token=), a connection-string field (;Password=, JDBC, ODBC,
# Azure's AccountKey=), an assignment in a message or a source line (password="x").
PARAM_RE: Final = re.compile(
    r"(?:(?<=(?P<ctx>[?&;]))|(?<=[,({\s\"'])|^)(?P<name>[A-Za-z_][A-Za-z0-9_.-]*)(?P<eq>\s*=\s*)"
    r"(?P<value>\"[^\"]*\"|'[^']*'|[^\s&;#,(){}\[\]\"']+)"
)
# Name: value, a header given as an argument (-H "X-Api-Key: ...") or in a message; the value of
# an auth scheme (Basic, Bearer, ...) is the word after it.
HEADER_RE: Final = re.compile(
    r"(?:(?<=[\s\"'{,(])|^)(?P<name>[A-Za-z][A-Za-z0-9_.-]*)[\"']?\s*:(?![=:])\s*(?P<q>[\"']?)"
    r"(?P<value>(?P<scheme>(?i:(?:basic|bearer|digest|token|negotiate|apikey)\s+))?[^\s,;\"'(){}\[\]]+)"
)
# What a name like KeyError or SessionWarning is: an exception's class, not a header.
_NOT_HEADER_SUFFIXES: Final = ("error", "exception", "warning")
# A flag and its value inside a command written as text: --pw X, --login=user:pw, -p X.
FLAG_VALUE_RE: Final = re.compile(
    r"(?:(?<=[\s\"'])|^)(?P<flag>--?[A-Za-z][A-Za-z0-9_.-]*)(?:=|\s+)(?!--)(?P<value>[^\s\"']+)"
)
# In free text, an unquoted value after a secret name counts when an identifier could not be it
# (a digit, a symbol: hunter2, p@ss): ``key=lambda``, ``token = None``, ``secret=get()`` are code.
_IDENTIFIER_RE: Final = re.compile(r"[A-Za-z_][A-Za-z_.]*")
# user:password as a login flag's value; the user is kept.
LOGIN_VALUE_RE: Final = re.compile(r"[^\s:/@]+:(?P<pw>\S+)")
# mysql -uroot -phunter2: the password attached to -p, in a mysql-like command written as text.
MYSQL_PW_RE: Final = re.compile(
    r"(?<![\w.-])(?:mysql[\w-]*|mariadb[\w-]*)(?:\s+\S+){0,30}?\s-p(?P<pw>[^\s\"']+)"
)

# -- random strings ---------------------------------------------------------------------------
RANDOM_MIN_CHARS: Final = 24
RANDOM_MIN_HEX_CHARS: Final = 32
RANDOM_MIN_SEGMENT_CHARS: Final = 10
RANDOM_MIN_ENTROPY_BITS: Final = 3.5
RANDOM_MIN_CLASS_CHANGES: Final = 0.3
RANDOM_MAX_MEAN_WORD_CHARS: Final = 3.0
RUN_RE: Final = re.compile(r"[A-Za-z0-9+/=_-]+")
_SEGMENT_SPLIT_RE: Final = re.compile(r"[+/=_-]")
_HEX_RE: Final = re.compile(r"[0-9a-fA-F]+")
# Words of an identifier: a capitalized or lower-case word, an acronym, a number.
_WORD_RE: Final = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|[0-9]+")
UUID_RE: Final = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
# An image pinned by digest (``repo@sha256:<64 hex>``, lower case as OCI writes it): the hash of
# public bytes, kept so that a replay Job can run the recorded image (injector/identity.py).
IMAGE_DIGEST_RE: Final = re.compile(r"@sha256:[0-9a-f]{64}(?![0-9A-Za-z])")
# A trace's own blob path (``blobs/<2 hex>/<32 hex>``, schema.blob_path): the digest of recorded
# bytes, named in the errors about that blob.
BLOB_PATH_RE: Final = re.compile(r"(?<![0-9A-Za-z])blobs/[0-9a-f]{2}/[0-9a-f]{32}(?![0-9A-Za-z])")


def entropy_bits(s: str) -> float:
    """Shannon entropy of the characters of s, in bits per character."""
    n = len(s)
    return -sum(c / n * math.log2(c / n) for c in Counter(s).values()) if n else 0.0


def _char_class(c: str) -> int:
    return 0 if c.islower() else 1 if c.isupper() else 2


def class_changes(segments: list[str]) -> float:
    """Of the adjacent character pairs inside segments, the fraction that change between lower
    case, upper case and digit: about 0.6 for random base64 and 0.47 for hex, under 0.3 for the
    words-and-numbers of paths and model names (``llama3-8b``, ``n01440764``, ``MiniLM``)."""
    pairs = changes = 0
    for seg in segments:
        for a, b in itertools.pairwise(seg):
            pairs += 1
            changes += _char_class(a) != _char_class(b)
    return changes / pairs if pairs else 0.0


def mean_word_chars(s: str) -> float:
    """Mean length of the words of s (``_WORD_RE``): 4 to 6 for camel-case class names
    (``Pix2StructForConditionalGeneration``), about 2 for random base64."""
    words = _WORD_RE.findall(s)
    return sum(map(len, words)) / len(words) if words else 0.0


def _letters_and_digits(s: str) -> bool:
    return any(c.isdigit() for c in s) and any(c.isalpha() for c in s)


def looks_random(run: str) -> bool:
    """Whether a run of base64/base64url characters (``[A-Za-z0-9+/=_-]``) looks like a random
    credential. Segments are its pieces between ``+ / = _ -``. Random when it mixes letters and
    digits, is not a canonical UUID (torchrun's run id), and either a segment is 32+ hex digits
    (API keys; also git SHAs and digests: accepted false positives), or it has 24+ characters, a
    segment of 10+, entropy of 3.5+ bits per character, class changes (``class_changes``) of 0.3+
    and words (``mean_word_chars``) of under 3 characters on average.
    """
    core = run.strip("=")
    if len(core) < RANDOM_MIN_CHARS or UUID_RE.fullmatch(core):
        return False
    if not _letters_and_digits(core):
        return False
    segments = [s for s in _SEGMENT_SPLIT_RE.split(core) if s]
    if any(
        len(s) >= RANDOM_MIN_HEX_CHARS and _HEX_RE.fullmatch(s) and _letters_and_digits(s) for s in segments
    ):
        return True
    return (
        max(map(len, segments)) >= RANDOM_MIN_SEGMENT_CHARS
        and entropy_bits(core) >= RANDOM_MIN_ENTROPY_BITS
        and class_changes(segments) >= RANDOM_MIN_CLASS_CHANGES
        and mean_word_chars(core) < RANDOM_MAX_MEAN_WORD_CHARS
    )


def masked(text: str) -> str:
    """``text`` with the public hashes the rules must not take for keys (a pinned image's digest,
    a trace's blob path) blanked, at the same length, so that spans found in it are spans of ``text``."""
    blank = IMAGE_DIGEST_RE.sub(lambda m: " " * len(m[0]), text)
    return BLOB_PATH_RE.sub(lambda m: " " * len(m[0]), blank)


# -- the rules --------------------------------------------------------------------------------
def _quoted(start: int, end: int, text: str) -> tuple[int, int]:
    """A quoted value's span without its quotes (they stay readable)."""
    if end - start >= 2 and text[start] in "\"'" and text[end - 1] == text[start]:
        return start + 1, end - 1
    return start, end


def _params(text: str, free: bool) -> Iterator[Found]:
    for m in PARAM_RE.finditer(text):
        value = m["value"]
        if m["ctx"] or not free:  # a query string or a connection string; or a whole value
            if secret_param(m["name"]):
                yield Found(*_quoted(*m.span("value"), text))
        elif text_secret_name(m["name"]) and (
            (value[0] in "\"'" and len(value) > 2) or (m["eq"] == "=" and not _IDENTIFIER_RE.fullmatch(value))
        ):
            yield Found(*_quoted(*m.span("value"), text))


def _headers(text: str, free: bool) -> Iterator[Found]:
    for m in HEADER_RE.finditer(text):
        name = m["name"].lower()
        if name.endswith(_NOT_HEADER_SUFFIXES):
            continue
        value = m["scheme"] or m["q"] or not _IDENTIFIER_RE.fullmatch(m["value"])
        # a whole value that is a header; in free text a strong name and a value that is not code
        if (not free and m.start() == 0 and secret_name(name)) or (free and text_secret_name(name) and value):
            yield Found(*m.span("value"), whole=True)


def _flag_values(text: str, free: bool) -> Iterator[Found]:
    for m in FLAG_VALUE_RE.finditer(text):
        flag, (start, end) = m["flag"], m.span("value")
        if free and not flag.startswith("--") and flag not in ("-p", "-u"):
            continue  # in prose and code a single dash is mostly a minus sign
        if secret_flag(flag):
            yield Found(start, end)
        elif login_name(flag) and (login := LOGIN_VALUE_RE.fullmatch(m["value"])) is not None:
            yield Found(start + login.start("pw"), end)


def random_pieces(start: int, run: str) -> list[Found]:
    """A random-looking run of free text that holds a ``/`` (a URL, a path): its pieces between
    ``/`` that look random on their own (a commit's SHA in a link), or the whole run."""
    at, pieces = start, []
    for piece in run.split("/"):
        if looks_random(piece):
            pieces.append(Found(at, at + len(piece), whole=True))
        at += len(piece) + 1
    return pieces or [Found(start, start + len(run), whole=True)]


def _random_runs(text: str, free: bool) -> Iterator[Found]:
    for m in RUN_RE.finditer(text):
        if looks_random(m[0]):
            yield from (
                random_pieces(m.start(), m[0]) if free and "/" in m[0] else [Found(*m.span(), whole=True)]
            )


def find(text: str, *, free: bool = False) -> list[Found]:
    """Every span of ``text`` that the rules take for a credential (overlapping ones too).
    ``free``: ``text`` is free text (a message, a line of source), where an assignment or a
    ``Name: value`` counts only with a stricter name and a value that is not code."""
    text = masked(text)
    out = [Found(m.start(), m.end(), whole=True) for m in TOKEN_RE.finditer(text)]
    out += [Found(m.start(), m.end(), whole=True) for m in PRIVATE_KEY_RE.finditer(text)]
    out += [Found(*m.span("pw")) for m in URL_PASSWORD_RE.finditer(text)]
    out += [Found(*m.span("key")) for m in URL_KEY_USER_RE.finditer(text)]
    out += [Found(*m.span("pw")) for m in MYSQL_PW_RE.finditer(text)]
    out += _params(text, free)
    out += _headers(text, free)
    out += _flag_values(text, free)
    out += _random_runs(text, free)
    return out
