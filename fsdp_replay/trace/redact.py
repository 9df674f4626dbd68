"""Keep credentials out of traces: traces travel to object stores and to colleagues.

Every environment variable is recorded (a program reads its own: a data path, a config switch);
what is recorded, there and in argv, goes through two kinds of rules, stated for users in
docs/trace-format.md ("What is redacted"):

- **names** (flags, ``NAME=value`` arguments, env var names): a name is split into word parts at
  non-alphanumerics, camel-case and letter/digit boundaries; one secret-naming part makes its value
  a secret. Parts, not substrings, so that ``--keep``, ``--monkey-patch`` and ``--author`` stay.
  ``-p`` (a password for mysql and friends) is one too.
- **values** that look like credentials on their own, wherever they appear: known token shapes,
  URL passwords, and long random strings (``looks_random``).

Redaction errs towards hiding: a false positive costs a replay its recorded command line (the user
gives it after ``--``, see replayer/launch.py); a false negative leaks a credential.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Final

from fsdp_replay.trace import schema

# -- names ------------------------------------------------------------------------------------
# Word parts that name a secret on their own. Plurals "tokens" and "keys" are left out on purpose:
# in training scripts they count things (--max-tokens, --num-keys).
SECRET_WORDS: Final = frozenset({"key", "pass", "pwd", "private", "creds"})
# Distinctive enough to name a secret inside a compound part too (dbpassword, clientsecret).
SECRET_INFIXES: Final = ("secret", "passw", "passphrase", "credential", "cookie", "session", "signature")
# Compound parts ending so (authtoken, hftoken, wandbapikey, oauth). A bare "key" suffix is not
# one of them: monkey, hockey.
SECRET_SUFFIXES: Final = ("token", "apikey", "accesskey", "privatekey", "authkey", "sshkey", "auth")
# A secret word directly followed by one of these names something about the secret, not the
# secret: --pad-token-id 0, --key-frames 8, --auth-type basic, --hub-private-repo true. Their
# values still go through the value rules.
NOT_SECRET_AFTER: Final = frozenset(
    {"id", "ids", "type", "types", "len", "length", "size", "count", "num", "dim", "frames", "repo"}
)
# Short flags whose value is a secret: -p is a password by mysql convention. Case-sensitive:
# `python -P` is the safe-path flag.
SECRET_SHORT_FLAGS: Final = frozenset({"-p"})

_PART_SPLIT_RE: Final = re.compile(
    r"[^A-Za-z0-9]+|(?<=[a-z])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])|(?<=[A-Za-z])(?=[0-9])|(?<=[0-9])(?=[A-Za-z])"
)


def name_parts(name: str) -> list[str]:
    """``--wandbApiKey2`` -> ``["wandb", "api", "key", "2"]``."""
    return [p.lower() for p in _PART_SPLIT_RE.split(name) if p]


def _secret_part(part: str) -> bool:
    if part in SECRET_WORDS or part.endswith(SECRET_SUFFIXES):
        return True
    if any(w in part for w in SECRET_INFIXES):
        return True
    # auth, authn, authorization, authentication; not author(s), authority
    return part.startswith("auth") and (not part.startswith("author") or part.startswith("authoriz"))


def secret_name(name: str) -> bool:
    """Whether the value of a flag, ``NAME=value`` argument or env var called ``name`` is a secret."""
    parts = name_parts(name)
    return any(
        _secret_part(p) and (i + 1 == len(parts) or parts[i + 1] not in NOT_SECRET_AFTER)
        for i, p in enumerate(parts)
    )


def _secret_flag(flag: str) -> bool:
    return flag in SECRET_SHORT_FLAGS or secret_name(flag)


# -- values -----------------------------------------------------------------------------------
# Credentials with a known shape, anywhere in a value (not inside a longer word: "task-...").
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
    r")|(?i:\bbearer\s+[A-Za-z0-9._~+/-]{8,})"
)
# scheme://user:password@host: only the password is replaced, so the rest stays readable. The
# password runs to the last "@" before the path, so an unescaped "@" in it is hidden too.
URL_PASSWORD_RE: Final = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)[^/\s]+@")
# "Name: value" (an HTTP header given as a value: -H "X-Api-Key: ..."): a secret when Name is.
HEADER_RE: Final = re.compile(r"^\s*(?P<name>[A-Za-z][A-Za-z0-9_.-]*)\s*:\s+\S")

# The random-string heuristic (looks_random), over each run of base64/base64url characters.
RANDOM_MIN_CHARS: Final = 24
RANDOM_MIN_HEX_CHARS: Final = 32
RANDOM_MIN_SEGMENT_CHARS: Final = 10
RANDOM_MIN_ENTROPY_BITS: Final = 3.5
RANDOM_MIN_CLASS_CHANGES: Final = 0.3
RANDOM_MAX_MEAN_WORD_CHARS: Final = 3.0
_RUN_RE: Final = re.compile(r"[A-Za-z0-9+/=_-]+")
_SEGMENT_SPLIT_RE: Final = re.compile(r"[+/=_-]")
_HEX_RE: Final = re.compile(r"[0-9a-fA-F]+")
# Words of an identifier: a capitalized or lower-case word, an acronym, a number.
_WORD_RE: Final = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|[0-9]+")
_UUID_RE: Final = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
# An image pinned by digest (``repo@sha256:<64 hex>``, lower case as OCI writes it): the hash of
# public bytes, kept so that a replay Job can run the recorded image (injector/identity.py).
_IMAGE_DIGEST_RE: Final = re.compile(r"@sha256:[0-9a-f]{64}(?![0-9A-Za-z])")


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
    if len(core) < RANDOM_MIN_CHARS or _UUID_RE.fullmatch(core):
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


def redact_value(value: str) -> str:
    """value with URL passwords replaced; ``REDACTED`` if it holds any other credential."""
    out = URL_PASSWORD_RE.sub(lambda m: f"{m['head']}{schema.REDACTED}@", value)
    checked = _IMAGE_DIGEST_RE.sub("@", out)
    header = HEADER_RE.match(checked)
    if (
        TOKEN_RE.search(checked)
        or (header is not None and secret_name(header["name"]))
        or any(looks_random(r) for r in _RUN_RE.findall(checked))
    ):
        return schema.REDACTED
    return out


# -- env and argv -----------------------------------------------------------------------------
def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """Every variable of env, with secret-looking names and values redacted."""
    out: dict[str, str] = {}
    for k, v in env.items():
        out[k] = schema.REDACTED if secret_name(k) else redact_value(v)
    return dict(sorted(out.items()))


def _takes_no_value(arg: str) -> bool:
    """After a secret flag, an argument starting with ``--`` is the next option (or the ``--``
    separator): a boolean ``--private`` must not hide it. Anything else is the flag's value, even
    ``-x``: a password may start with a dash."""
    return arg.startswith("--")


def redact_argv(argv: Iterable[str]) -> list[str]:
    """argv with secrets removed: ``--token X``, ``--api-key=X``, ``-p X``, ``PASSWORD=X``,
    ``db.password=X`` and credential-looking values anywhere."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            hide_next = False
            if not _takes_no_value(arg):
                out.append(schema.REDACTED)
                continue
        name, eq, value = arg.partition("=")
        if eq:
            # the name part is checked as a value too: "https://u:pw@host/x?a=b" has an "="
            out.append(
                f"{redact_value(name)}={schema.REDACTED if _secret_flag(name) else redact_value(value)}"
            )
        elif arg.startswith("-") and _secret_flag(arg):
            out.append(arg)
            hide_next = True
        else:
            out.append(redact_value(arg))
    return out
