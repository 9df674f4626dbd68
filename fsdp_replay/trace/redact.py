"""Keep credentials out of traces: traces travel to object stores and to colleagues.

Environment variables are recorded by allow-list (schema.ENV_ALLOW / ENV_ALLOW_PREFIXES), and
anything that looks like a credential is replaced by ``schema.REDACTED``, in env values and argv.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from fsdp_replay.trace import schema


def secret_name(name: str) -> bool:
    return bool(schema.SECRET_NAME_RE.search(name))


def redact_value(value: str) -> str:
    return schema.REDACTED if schema.SECRET_VALUE_RE.search(value) else value


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """The allowed subset of env, with secret-looking names and values redacted."""
    out: dict[str, str] = {}
    for k, v in env.items():
        if k not in schema.ENV_ALLOW and not k.startswith(schema.ENV_ALLOW_PREFIXES):
            continue
        out[k] = schema.REDACTED if secret_name(k) else redact_value(v)
    return dict(sorted(out.items()))


def redact_argv(argv: Iterable[str]) -> list[str]:
    """argv with secret values removed: ``--token X``, ``--api-key=X``, ``PASSWORD=X``, bare keys."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(schema.REDACTED)
            hide_next = False
            continue
        if "=" in arg:
            name, _, value = arg.partition("=")
            if secret_name(name):
                out.append(f"{name}={schema.REDACTED}")
                continue
            out.append(f"{name}={redact_value(value)}" if redact_value(value) != value else arg)
            continue
        if arg.startswith("-") and secret_name(arg):
            out.append(arg)
            hide_next = True
            continue
        out.append(redact_value(arg))
    return out
