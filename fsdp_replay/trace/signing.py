"""Signed traces: who collected a trace, checked without trusting the trace.

The digests a trace carries (each rank's array list, blobs named by the digest of their bytes)
find damage, not forgery: whoever edits a trace can recompute them. With a key (a file of at least
16 random bytes; in Kubernetes a Secret, see docs/kubernetes.md) the collector signs the root's
attributes and each rank's attributes: an HMAC-SHA256 over their canonical JSON, the signature
itself left out. A rank's attributes hold its command line, snapshots and the list of its arrays
with their digests, and its payload rows name its blobs by digest, so the signature covers every
byte a replay reads. ``inspect`` says whether a trace is signed and by which key;
``inspect --verify`` and ``replay`` given the key check it, and refuse a trace whose signature does
not match (or that is not signed at all).

A key is named by its id (``k-`` and 16 hex digits of a hash of the key): the id tells which key
signed a trace, never the key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from fsdp_replay.errors import ConfigError

SIGNATURE_ATTR: Final = "signature"
ALGORITHM: Final = "hmac-sha256"
KEY_FILE_ENV: Final = "FSDP_REPLAY_SIGNING_KEY"
MIN_KEY_BYTES: Final = 16
MAX_KEY_BYTES: Final = 4096


@dataclass(frozen=True, slots=True)
class SigningKey:
    secret: bytes
    key_id: str

    def __repr__(self) -> str:  # never the secret
        return f"SigningKey({self.key_id})"


def key_id(secret: bytes) -> str:
    return "k-" + hashlib.sha256(b"fsdp-replay key id\x00" + secret).hexdigest()[:16]


def load_key(path: str | os.PathLike[str]) -> SigningKey:
    """The key in the file at ``path`` (its bytes, less a trailing newline)."""
    where = os.fspath(path)
    try:
        fd = os.open(where, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ConfigError(f"signing key {where}: {e.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"signing key {where}: not a regular file")
        secret = os.read(fd, MAX_KEY_BYTES + 1).rstrip(b"\r\n")
    finally:
        os.close(fd)
    if len(secret) > MAX_KEY_BYTES:
        raise ConfigError(f"signing key {where}: more than {MAX_KEY_BYTES} bytes")
    if len(secret) < MIN_KEY_BYTES:
        raise ConfigError(
            f"signing key {where}: {len(secret)} bytes; a key has at least {MIN_KEY_BYTES} "
            "(make one with: head -c 32 /dev/urandom | base64 > KEYFILE)"
        )
    return SigningKey(secret, key_id(secret))


def key_from_env(env: Mapping[str, str] | None = None) -> SigningKey | None:
    """The key in the file ``FSDP_REPLAY_SIGNING_KEY`` names, if set."""
    path = (os.environ if env is None else env).get(KEY_FILE_ENV, "")
    return load_key(path) if path else None


def canonical(doc: Mapping[str, Any]) -> bytes:
    """The bytes a signature covers: the document as JSON with sorted keys and no spaces, less the
    signature. Read back from the store, a document gives the same bytes it was signed with."""
    body = {k: v for k, v in doc.items() if k != SIGNATURE_ATTR}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True, default=str).encode()


def sign(key: SigningKey, doc: Mapping[str, Any]) -> dict[str, str]:
    mac = hmac.new(key.secret, canonical(doc), hashlib.sha256).hexdigest()
    return {"alg": ALGORITHM, "key_id": key.key_id, "mac": mac}


@dataclass(frozen=True, slots=True)
class Check:
    """A document's signature: ``state`` one of ``unsigned``, ``unchecked`` (signed; no key given
    to check it), ``other-key`` (signed by another key than the one given), ``valid``, ``invalid``."""

    state: str
    key_id: str = ""

    @property
    def bad(self) -> bool:
        return self.state in ("invalid", "other-key")


def check(doc: Mapping[str, Any], key: SigningKey | None) -> Check:
    sig = doc.get(SIGNATURE_ATTR)
    if sig is None:
        return Check("unsigned")
    if not isinstance(sig, dict) or sig.get("alg") != ALGORITHM or not isinstance(sig.get("mac"), str):
        return Check("invalid", str(sig.get("key_id", ""))[:40] if isinstance(sig, dict) else "")
    kid = str(sig.get("key_id", ""))[:40]
    if key is None:
        return Check("unchecked", kid)
    if kid != key.key_id:
        return Check("other-key", kid)
    ok = hmac.compare_digest(sign(key, doc)["mac"], sig["mac"])
    return Check("valid" if ok else "invalid", kid)


def describe(checks: Mapping[str, Check], key: SigningKey | None) -> tuple[str, bool]:
    """One line for a trace's documents (``"root"``, ``"rank 3"``, ...), and whether it is bad:
    a signature that does not match, another key's, or, with a key given, no signature."""
    states = {c.state for c in checks.values()}
    ids = sorted({c.key_id for c in checks.values() if c.key_id})
    by = f"key {', '.join(ids)}" if ids else "no key"
    invalid = [w for w, c in checks.items() if c.state == "invalid"]
    if invalid:
        return (
            f"signature DOES NOT MATCH for {', '.join(invalid[:8])}: the trace was changed after it was signed",
            True,
        )
    if "other-key" in states:
        return f"signed by {by}, not by the key given ({key.key_id if key else ''})", True
    unsigned = [w for w, c in checks.items() if c.state == "unsigned"]
    if unsigned and len(unsigned) < len(checks):
        return f"partly signed ({by}): {', '.join(unsigned[:8])} not signed", True
    if unsigned:
        if key is not None:
            return (
                f"not signed, and a key was given ({key.key_id}): the trace cannot be shown to be yours",
                True,
            )
        return "not signed (its digests find damage, not changes made on purpose)", False
    if states == {"valid"}:
        return f"signed by {by}: the signature matches", False
    return f"signed by {by} (give its key with --signing-key or {KEY_FILE_ENV} to check it)", False


def key_of_option(path: str | None) -> SigningKey | None:
    """The key of a command's ``--signing-key FILE`` (``FSDP_REPLAY_SIGNING_KEY``), if given."""
    return load_key(path) if path else None
