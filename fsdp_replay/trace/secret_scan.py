"""detect-secrets' detectors over a line of text: the maintained detector behind ``redact.py``.

Its keyword, basic-auth, high-entropy and provider plugins (AWS, Azure storage, private keys,
Slack, Stripe, GitHub, GitLab, JWT, OpenAI, PyPI, npm, Twilio, ...) find what ``secret_shapes.py``
may miss; ``redact.py`` replaces what either finds. Used as a library, never through its global
settings: each plugin is made here and asked with ``analyze_string`` (``analyze_line`` reads the
global settings, and with a verification filter there would call the provider over the network).
The high-entropy plugins' unquoted strings are cut out here and kept when their entropy passes the
plugin's limit; every finding then goes through detect-secrets' heuristic filters (sequential
strings, UUIDs, id strings, templates such as ``<redacted>``).

Its public IPv4 plugin is left out (an address is not a credential: ``MASTER_ADDR``), and two
guards of the project's own keep paths and host names: a hex run counts from 16 digits (a
Kubernetes pod-template hash has 9 or 10), a base64 run only when its words are short
(``secret_shapes.mean_word_chars``, as ``looks_random`` does).

It is imported once per process, lazily, the first time something is redacted (at a rank's start,
at an exception, when a command writes its output): about 0.15 s, with ``requests`` (its plugins
import it). At import its logger module turns ``logging.captureWarnings`` on; that is undone here,
so a training process's warnings still go where they went. Where it cannot be imported (an image
without it), ``scanner()`` is None after one log line, and the project's own rules act alone.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from fsdp_replay.trace.secret_shapes import UUID_RE, masked, mean_word_chars, random_pieces

log = logging.getLogger(__name__)

Span = tuple[int, int]
SKIPPED_PLUGINS: Final = frozenset({"IPPublicDetector"})
BASE64_LIMIT_BITS: Final = 4.5  # detect-secrets' default limits
HEX_LIMIT_BITS: Final = 3.0
HEX_MIN_CHARS: Final = 16
BASE64_MAX_MEAN_WORD_CHARS: Final = 3.0
# A run of base64 characters ("=" only as padding, so ``name=value`` is two runs), of hex digits.
_BASE64_RUN_RE: Final = re.compile(r"[A-Za-z0-9+/_-]+=*")
_HEX_RUN_RE: Final = re.compile(rf"(?<![A-Za-z0-9])[0-9A-Fa-f]{{{HEX_MIN_CHARS},}}(?![A-Za-z0-9])")
# The heuristic filters applied to each finding (detect_secrets.filters.heuristic), by name: one
# a release lacks is skipped.
_FILTERS: Final = (
    "is_sequential_string",
    "is_potential_uuid",
    "is_likely_id_string",
    "is_templated_secret",
    "is_prefixed_with_dollar_sign",
    "is_not_alphanumeric_string",
)
_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True)
class Scanner:
    """detect-secrets' plugins, made once; ``spans`` finds credentials in one line of text."""

    version: str
    keyword: Any
    keyword_regexes: Any
    keyword_quoted_regexes: Any
    plugins: tuple[Any, ...]
    private_key: type
    base64: Any
    hex: Any
    filters: tuple[tuple[str, Callable[..., bool]], ...]

    def spans(self, line: str, *, free: bool = False) -> list[Span]:
        """Where ``line`` holds a credential, by every plugin (a private key: to the end of its
        block, or of the line). ``free``: free text (a message, a line of source), where the
        keyword plugin wants the value quoted, as detect-secrets does for source files."""
        text = UUID_RE.sub(lambda m: " " * len(m[0]), masked(line))
        out: list[Span] = []
        for plugin in self.plugins:
            for found in set(plugin.analyze_string(text)):
                if isinstance(plugin, self.private_key):
                    out += [(_pem_start(text, s), _pem_end(text, s)) for s, _e in _locate(text, found)]
                elif self._kept(found, line, plugin):
                    out += _locate(text, found)
        out += self.assigned(text, free=free)
        for plugin, runs in ((self.base64, _BASE64_RUN_RE), (self.hex, _HEX_RUN_RE)):
            for m in runs.finditer(text):
                found = m[0]
                if plugin is self.base64 and mean_word_chars(found) >= BASE64_MAX_MEAN_WORD_CHARS:
                    continue
                if plugin.calculate_shannon_entropy(found) > plugin.entropy_limit and self._kept(
                    found, line, plugin
                ):
                    if free and "/" in found:  # a URL or a path in a message: its random pieces
                        out += [(f.start, f.end) for f in random_pieces(m.start(), found)]
                    else:
                        out.append(m.span())
        return out

    def assigned(self, line: str, *, free: bool = False) -> list[Span]:
        """The keyword plugin alone (``password = x``, ``api_key: x``; ``free``: quoted values only)."""
        out: list[Span] = []
        regexes = self.keyword_quoted_regexes if free else self.keyword_regexes
        for found in set(self.keyword.analyze_string(line, regexes)):
            if self._kept(found, line, self.keyword):
                out += _locate(line, found.rstrip())
        return out

    def _kept(self, secret: str, line: str, plugin: Any) -> bool:
        for name, check in self.filters:
            try:
                hit = check(secret, line, plugin) if name == "is_likely_id_string" else check(secret)
            except Exception:  # a filter of another release with another signature: not applied
                continue
            if hit:
                return False
        return True


def _locate(text: str, found: str) -> list[Span]:
    out: list[Span] = []
    if not found:
        return out
    at = text.find(found)
    while at >= 0:
        out.append((at, at + len(found)))
        at = text.find(found, at + len(found))
    return out


def _pem_start(text: str, at: int) -> int:
    dashes = text.rfind("-----", 0, at)
    return dashes if dashes >= 0 and text[dashes + 5 : at].strip() == "" else at


def _pem_end(text: str, at: int) -> int:
    end = text.find("-----END", at)
    if end < 0:
        return len(text)
    close = text.find("-----", end + 8)
    return close + 5 if close >= 0 else len(text)


def _load() -> Scanner:
    import logging as logging_module

    shown = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # requests warns about its dependencies' versions at import
        import detect_secrets.plugins
        from detect_secrets import __version__ as version_module
        from detect_secrets.filters import heuristic
        from detect_secrets.plugins.base import BasePlugin
        from detect_secrets.plugins.high_entropy_strings import (
            Base64HighEntropyString,
            HexHighEntropyString,
        )
        from detect_secrets.plugins.keyword import (
            CONFIG_DENYLIST_REGEX_TO_GROUP,
            QUOTES_REQUIRED_DENYLIST_REGEX_TO_GROUP,
            KeywordDetector,
        )
        from detect_secrets.plugins.private_key import PrivateKeyDetector
        from detect_secrets.util.importlib import import_types_from_package

        if warnings.showwarning is not shown:
            # detect_secrets.core.log called logging.captureWarnings(True): give them back
            logging_module.captureWarnings(False)

    def regex_plugin(x: Any) -> bool:
        return (
            isinstance(x, type)
            and issubclass(x, BasePlugin)
            and isinstance(getattr(x, "secret_type", None), str)
            and x.__name__ not in SKIPPED_PLUGINS
            and not issubclass(x, (KeywordDetector, Base64HighEntropyString, HexHighEntropyString))
        )

    kinds = import_types_from_package(detect_secrets.plugins, filter=lambda x: not regex_plugin(x))
    plugins = tuple(kind() for kind in sorted(set(kinds), key=lambda k: k.__name__))
    return Scanner(
        version=str(getattr(version_module, "VERSION", "?")),
        keyword=KeywordDetector(),
        keyword_regexes=CONFIG_DENYLIST_REGEX_TO_GROUP,
        keyword_quoted_regexes=QUOTES_REQUIRED_DENYLIST_REGEX_TO_GROUP,
        plugins=plugins,
        private_key=PrivateKeyDetector,
        base64=Base64HighEntropyString(limit=BASE64_LIMIT_BITS),
        hex=HexHighEntropyString(limit=HEX_LIMIT_BITS),
        filters=tuple((n, getattr(heuristic, n)) for n in _FILTERS if callable(getattr(heuristic, n, None))),
    )


@functools.cache
def scanner() -> Scanner | None:
    """detect-secrets' plugins, imported the first time; None (after one log line) where it cannot
    be imported or made."""
    with _LOCK:
        try:
            return _load()
        except Exception as e:  # ImportError on an image without it; anything from a release we do not know
            log.warning(
                "fsdp-replay: detect-secrets is not available (%s): credentials are found by fsdp-replay's "
                "own rules alone",
                e,
            )
            return None
