"""Which names hold a secret: flags, ``NAME=value`` arguments, env vars, query parameters.

A name is split into word parts at non-alphanumerics, camel-case and letter/digit boundaries; one
secret-naming part makes its value a secret. Parts, not substrings, so that ``--keep``,
``--monkey-patch`` and ``--author`` stay. docs/trace-format.md ("What is redacted") states the
rules for users; ``redact.py`` applies them.
"""

from __future__ import annotations

import re
from typing import Final

# Word parts that name a secret on their own. Plurals "tokens" and "keys" are left out on purpose:
# in training scripts they count things (--max-tokens, --num-keys). Short ones: pw (REDIS_PW,
# --pw), dsn (SENTRY_DSN: a URL whose user is a key), sas (an Azure shared access signature).
SECRET_WORDS: Final = frozenset({"key", "pass", "pwd", "pw", "private", "creds", "dsn", "sas"})
# Distinctive enough to name a secret inside a compound part too (dbpassword, clientsecret, DB_PASSCODE).
SECRET_INFIXES: Final = (
    "secret",
    "passw",
    "passphrase",
    "passcode",
    "credential",
    "cookie",
    "session",
    "signature",
)
# Compound parts ending so (authtoken, hftoken, wandbapikey, oauth). A bare "key" suffix is not
# one of them: monkey, hockey.
SECRET_SUFFIXES: Final = (
    "token",
    "apikey",
    "accesskey",
    "privatekey",
    "privkey",
    "authkey",
    "sshkey",
    "auth",
)
# A secret word directly followed by one of these names something about the secret, not the
# secret: --pad-token-id 0, --key-frames 8, --auth-type basic, --hub-private-repo true. Their
# values still go through the value rules.
NOT_SECRET_AFTER: Final = frozenset(
    {"id", "ids", "type", "types", "len", "length", "size", "count", "num", "dim", "frames", "repo"}
)
# Short flags whose value is a secret: -p is a password by mysql convention. Case-sensitive:
# `python -P` is the safe-path flag.
SECRET_SHORT_FLAGS: Final = frozenset({"-p"})
# Query and connection-string parameters that hold a secret though their name is not a secret
# name above: an Azure SAS or signed URL's `sig`.
SECRET_PARAMS: Final = frozenset({"sig"})
# Parts of a name whose value may be ``user:password`` (--login, curl's -u, DB_LOGIN): the part
# after the first ":" is a secret, the user is kept.
LOGIN_WORDS: Final = frozenset({"login", "user", "userpass", "basicauth", "u"})
# Clients whose attached ``-pPASSWORD`` is a password (``mysql -uroot -phunter2``).
MYSQL_CLIENTS: Final = frozenset(
    {"mysql", "mysqldump", "mysqladmin", "mysqlimport", "mysqlcheck", "mysqlsh", "mariadb", "mariadb-dump"}
)

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


# In free text (a message, a line of source a stack dump shows) "key", "token", "session" and
# "private" mostly name something else (``key: str``, ``token = None``, ``sorted(x, key=...)``):
# there a name is a secret name only through one of these words, infixes and compound endings,
# read over each part and each pair of adjacent parts (``api_key``, ``AccessToken``).
TEXT_SECRET_WORDS: Final = frozenset({"pwd", "pw", "creds", "dsn", "authorization"})
TEXT_SECRET_INFIXES: Final = ("secret", "passw", "passphrase", "passcode", "credential")
TEXT_SECRET_SUFFIXES: Final = (
    "apikey",
    "accesskey",
    "privatekey",
    "authkey",
    "sshkey",
    "authtoken",
    "accesstoken",
    "refreshtoken",
    "sessiontoken",
    "bearertoken",
    "apitoken",
    "hftoken",
    "idtoken",
)


def text_secret_name(name: str) -> bool:
    """Whether ``name`` names a secret where it stands in free text (stricter than ``secret_name``)."""
    parts = name_parts(name)
    for i, p in enumerate(parts):
        if i + 1 < len(parts) and parts[i + 1] in NOT_SECRET_AFTER:
            continue
        pair = parts[i - 1] + p if i else p
        if (
            p in TEXT_SECRET_WORDS
            or any(w in p for w in TEXT_SECRET_INFIXES)
            or p.endswith(TEXT_SECRET_SUFFIXES)
            or pair.endswith(TEXT_SECRET_SUFFIXES)
        ):
            return True
    return False


def secret_flag(flag: str) -> bool:
    """Whether a command-line flag's value is a secret (a secret name, or ``-p``)."""
    return flag in SECRET_SHORT_FLAGS or secret_name(flag)


def secret_param(name: str) -> bool:
    """Whether a query or connection-string parameter (``?token=``, ``;Password=``) is a secret."""
    return name.lower() in SECRET_PARAMS or secret_name(name)


def login_name(name: str) -> bool:
    """Whether ``name`` (a flag, an env var) may hold ``user:password``."""
    return any(p in LOGIN_WORDS for p in name_parts(name))


def mysql_client(arg: str) -> bool:
    """Whether a command-line argument starts a mysql-like client (by its file name)."""
    return arg.replace("\\", "/").rsplit("/", 1)[-1] in MYSQL_CLIENTS
