"""The grammar of every value that ends up in a pod spec, checked before it gets there.

The webhook fails open, but a patch that makes the pod invalid does not: the API server would reject
the pod, and the user's job would not start. So every value that comes from an annotation or from
the injector's configuration is checked here first, and a bad one is dropped with a warning.

The step grammar (``none | all | steps:0-3,10,20-``, and ``window:N`` for payloads) is the agent's
(``fsdp_replay.agent.config.StepSet``); the injector must not import the agent, so it is restated
here, and the tests check that both accept the same specs.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

# Our annotation values are short (a URL, a few names, a step spec): a longer one is a mistake or an
# attack, and dropped. Kubernetes only caps a pod's annotations together (256 KiB), not one value.
MAX_ANNOTATION_CHARS = 1024
MAX_STORE_URL_CHARS = 2048
# Characters no value of ours may carry into a pod spec: control characters (NUL, newline, ESC, the
# C1 range), line and paragraph separators, and lone surrogates (not encodable as UTF-8).
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cs", "Zl", "Zp"})
_SHOWN_CHARS = 40

_STEP_PART = re.compile(r"\s*(\d+)\s*(?:(-)\s*(\d*)\s*)?")
# RFC 1123 subdomain (Secret names, annotation prefixes) and label (container, port names).
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_KUBE_VERSION = re.compile(r"v?(\d+)\.(\d+)(?:\.\d+)?(?:[-+].*)?")
# Kubernetes resource.Quantity: a decimal number and a binary (Ki..Ei), decimal (m, k..E) or exponent suffix.
_QUANTITY = re.compile(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+))(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E|[eE][+-]?\d+)?")
_SUFFIX_FACTORS = {
    "": Decimal(1),
    "m": Decimal("0.001"),
    **{s: Decimal(1000) ** (i + 1) for i, s in enumerate("kMGTPE")},
    **{s + "i": Decimal(1024) ** (i + 1) for i, s in enumerate("KMGTPE")},
}


def step_spec_error(spec: str, forms: str = "none, all, or steps:0-3,10,20-") -> str | None:
    """Why ``spec`` is not ``none``, ``all`` or ``steps:SPEC`` (or a bare SPEC), or None when it is;
    ``forms``: what the option takes, said when ``spec`` is none of them."""
    spec = spec.strip()
    if spec in ("", "none", "all"):
        return None
    body = spec.removeprefix("steps:")
    for part in body.split(","):
        m = _STEP_PART.fullmatch(part)
        if not m:
            return f"{spec!r} is not {forms}"
        if m.group(2) is not None and m.group(3) and int(m.group(3)) < int(m.group(1)):
            return f"step range {part.strip()!r} in {spec!r} ends before it starts"
    return None


AUTO_PAYLOADS = "auto"
AUTO_GPU_POLICY = "window:4"  # agent/config.py's, restated (tests/injector check they agree)


def pod_payloads(spec: str, container: Mapping[str, Any]) -> str:
    """The policy a container records with: ``auto`` is the flight recorder for a container that
    asks for a GPU (a ``*/gpu`` resource, as ``nvidia.com/gpu``), every step's payloads otherwise;
    any other policy as it is."""
    if spec.strip() != AUTO_PAYLOADS:
        return spec
    resources = container.get("resources")
    asked: dict[str, Any] = {}
    if isinstance(resources, Mapping):
        for part in ("limits", "requests"):
            if isinstance(resources.get(part), Mapping):
                asked.update(resources[part])
    gpu = any(str(k).endswith("/gpu") and str(v).strip() not in ("0", "") for k, v in asked.items())
    return AUTO_GPU_POLICY if gpu else "all"


def payload_spec_error(spec: str) -> str | None:
    """Why ``spec`` is not a payload policy (a step spec, ``window:N`` with N >= 1: the agent's
    flight recorder, or ``auto``), or None when it is."""
    spec = spec.strip()
    if spec == AUTO_PAYLOADS:
        return None
    if spec.startswith("window:"):
        m = re.fullmatch(r"window:\s*(\d+)\s*", spec)
        return None if m and int(m.group(1)) >= 1 else f"{spec!r} is not window:N with N >= 1 steps"
    return step_spec_error(spec, "none, all, steps:0-3,10,20- or window:N")


def cupti_spec_error(spec: str) -> str | None:
    """Why ``spec`` is not a CUPTI window (``off``, ``always`` or ``steps:SPEC``), or None when it is."""
    spec = spec.strip()
    if spec in ("off", "always"):
        return None
    if not spec.startswith("steps:"):
        return f"{spec!r} is not off, always, or steps:SPEC"
    return step_spec_error(spec)


def annotation_value_error(value: object, *, max_chars: int = MAX_ANNOTATION_CHARS) -> str | None:
    """Why ``value`` cannot be one of our annotation values (not text, too long, a control
    character), or None when it can. Numbers and booleans are accepted as their text: YAML written
    by hand for ``inject -f`` says ``record: true``."""
    if not isinstance(value, str | int | float):  # bool is an int
        return f"a {type(value).__name__} is not a string"
    text = str(value)
    if len(text) > max_chars:
        return f"{shown(text)} is longer than {max_chars} characters"
    for i, c in enumerate(text):
        if unicodedata.category(c) in _UNSAFE_CATEGORIES:
            return f"{shown(text)} has a control character (U+{ord(c):04X} at {i})"
    return None


def shown(text: str) -> str:
    """``text`` quoted for a message (``repr`` escapes what is not printable), cut to a few dozen characters."""
    if len(text) <= _SHOWN_CHARS:
        return repr(text)
    return f"{text[:_SHOWN_CHARS]!r}... ({len(text)} characters)"


def is_dns_subdomain(name: str) -> bool:
    """A valid Secret name or annotation prefix (RFC 1123 subdomain, at most 253 characters)."""
    return len(name) <= 253 and _DNS_SUBDOMAIN.fullmatch(name) is not None


def is_dns_label(name: str) -> bool:
    """A valid container name (RFC 1123 label, at most 63 characters)."""
    return len(name) <= 63 and _DNS_LABEL.fullmatch(name) is not None


def kube_minor(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a version such as ``1.29``, ``v1.30.2`` or ``v1.28.5-eks-1234``; None if unparsable."""
    m = _KUBE_VERSION.fullmatch(version.strip())
    return (int(m.group(1)), int(m.group(2))) if m else None


def parse_quantity(text: object) -> Decimal | None:
    """The value of a Kubernetes quantity (``100m`` -> 0.1, ``1Gi`` -> 1073741824), or None if it is not one.

    YAML written by hand often says ``cpu: 2``, so numbers are accepted as well as strings.
    """
    if isinstance(text, bool) or not isinstance(text, str | int | float):
        return None
    m = _QUANTITY.fullmatch(str(text).strip())
    if not m:
        return None
    suffix = m.group(2) or ""
    try:
        number = Decimal(m.group(1))
        if suffix[:1] in ("e", "E"):
            return number * Decimal(10) ** int(suffix[1:])
        return number * _SUFFIX_FACTORS[suffix]
    except (InvalidOperation, KeyError):
        return None


def int_error(text: str, *, minimum: int = 0, maximum: int | None = None) -> str | None:
    """Why ``text`` is not an integer in ``[minimum, maximum]``, or None when it is."""
    try:
        value = int(text.strip())
    except ValueError:
        return f"{text!r} is not an integer"
    if value < minimum or (maximum is not None and value > maximum):
        upper = "" if maximum is None else f" and <= {maximum}"
        return f"{value} must be >= {minimum}{upper}"
    return None
