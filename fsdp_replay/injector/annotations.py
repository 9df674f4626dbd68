"""The annotations and the namespace label the injector reads and writes, and what a pod's values mean.

Every name is ``<prefix>/<name>`` with the configured prefix (default ``fsdp-replay.io``).

Opt-in happens at two levels:

- **Pod**: ``<prefix>/record: "true"`` records it, ``"false"`` never does (this wins over the namespace).
- **Namespace**: the *label* ``<prefix>/record=enabled`` records every pod of the namespace unless the
  pod says ``"false"``. An AdmissionReview for a Pod carries neither the namespace's labels nor its
  annotations, and the webhook reads nothing from the API server (no RBAC, no extra latency, nothing
  to fail). Instead the MutatingWebhookConfiguration has two entries that differ by
  ``namespaceSelector``: namespaces without the label call ``/mutate`` (annotated pods only), labelled
  ones call ``/mutate/namespace-default`` (every pod not annotated ``"false"``). A namespace
  *annotation* cannot be matched by a selector, so only the label counts.

Status annotations (written by the injection, read to keep it idempotent): ``<prefix>/injected``
(the fsdp-replay version), ``<prefix>/injected-containers`` and ``<prefix>/sidecar-mode``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from fsdp_replay.injector import validate
from fsdp_replay.injector.config import InjectorConfig

# Pod annotations (names after the prefix).
RECORD = "record"
CONTAINERS = "containers"
PAYLOADS = "payloads"
SNAPSHOT_EVERY = "snapshot-every"
MODULE_FINGERPRINTS = "module-fingerprints"
CUPTI = "cupti"
RESERVE_BYTES = "reserve-bytes"
STORE = "store"
STORE_SECRET = "store-secret"
METRICS_PORT = "metrics-port"
# Status annotations, written by the injection.
INJECTED = "injected"
INJECTED_CONTAINERS = "injected-containers"
SIDECAR_MODE = "sidecar-mode"
# The namespace label <prefix>/record and the value that opts a whole namespace in.
NAMESPACE_LABEL_VALUE = "enabled"
# Prometheus' conventional pod annotations (the community Helm chart's kubernetes-pods job reads them).
PROMETHEUS_PREFIX = "prometheus.io/"
PROMETHEUS_SCRAPE = "prometheus.io/scrape"
PROMETHEUS_PORT = "prometheus.io/port"
PROMETHEUS_PATH = "prometheus.io/path"
METRICS_PATH = "/metrics"

_TRUE = ("true", "1", "yes", "on", "enabled")
_FALSE = ("false", "0", "no", "off", "disabled")

# The agent's variables (fsdp_replay/agent/config.py reads them; FSDP_REPLAY_CUPTI is the CUPTI window).
ENV_MODE = "FSDP_REPLAY_MODE"
ENV_OUT = "FSDP_REPLAY_OUT"
ENV_PAYLOADS = "FSDP_REPLAY_PAYLOADS"
ENV_SNAPSHOT_EVERY = "FSDP_REPLAY_SNAPSHOT_EVERY"
ENV_MODULE_FINGERPRINTS = "FSDP_REPLAY_MODULE_FINGERPRINTS"
ENV_CUPTI = "FSDP_REPLAY_CUPTI"
ENV_RESERVE_BYTES = "FSDP_REPLAY_RESERVE_BYTES"

# Pod annotation -> the agent variable it sets, and the check of its value (None when valid).
AGENT_ANNOTATIONS: tuple[tuple[str, str, Callable[[str], str | None]], ...] = (
    (SNAPSHOT_EVERY, ENV_SNAPSHOT_EVERY, validate.int_error),
    (MODULE_FINGERPRINTS, ENV_MODULE_FINGERPRINTS, validate.step_spec_error),
    (CUPTI, ENV_CUPTI, validate.cupti_spec_error),
    (RESERVE_BYTES, ENV_RESERVE_BYTES, validate.int_error),
)


@dataclass(frozen=True, slots=True)
class Keys:
    """The full annotation (and label) names for one prefix."""

    prefix: str

    def __call__(self, name: str) -> str:
        return f"{self.prefix}/{name}"


@dataclass(frozen=True, kw_only=True, slots=True)
class PodSettings:
    """What a pod's annotations, checked and merged over the injector's defaults, ask for."""

    containers: tuple[str, ...] | None
    """Names of the containers to record (init containers may be named too); None: every regular one."""
    agent_env: tuple[tuple[str, str], ...]
    """The ``FSDP_REPLAY_*`` variables for recorded containers, in order (the user's own values still win)."""
    store: str
    """The trace store URL for the sidecar; empty: the sidecar's default."""
    store_secret: str
    """A Secret whose keys become the sidecar's environment (store credentials); empty: none."""
    metrics_port: int
    """The sidecar's metrics and health port."""


def opt_in(annotations: Mapping[str, object], keys: Keys, namespace_default: bool) -> tuple[bool, str | None]:
    """Whether to record the pod, and a warning for a value that is neither true nor false."""
    raw = annotations.get(keys(RECORD))
    if raw is None:
        return namespace_default, None
    if validate.annotation_value_error(raw) is None:
        value = str(raw).strip().lower()
        if value in _TRUE:
            return True, None
        if value in _FALSE:
            return False, None
    shown = validate.shown(raw) if isinstance(raw, str) else f"a {type(raw).__name__}"
    return False, f"fsdp-replay: {keys(RECORD)}={shown} is neither true nor false; not recording"


def pod_settings(
    annotations: Mapping[str, object], keys: Keys, config: InjectorConfig
) -> tuple[PodSettings, list[str]]:
    """The pod's settings; a bad value is dropped with a warning (the default applies instead)."""
    warnings: list[str] = []

    def bad(name: str, why: str, fallback: str) -> None:
        warnings.append(f"fsdp-replay: annotation {keys(name)}: {why}; {fallback}")

    def text(name: str, fallback: str, max_chars: int = validate.MAX_ANNOTATION_CHARS) -> str | None:
        """The annotation's value, or None when it is absent or unsafe in a pod spec (then warned)."""
        if (raw := annotations.get(keys(name))) is None:
            return None
        if (why := validate.annotation_value_error(raw, max_chars=max_chars)) is not None:
            bad(name, why, fallback)
            return None
        return str(raw)

    containers: tuple[str, ...] | None = None
    if listed := (text(CONTAINERS, "recording every container") or "").strip():
        names = [n.strip() for n in listed.split(",") if n.strip()]
        invalid = [n for n in names if not validate.is_dns_label(n)]
        if invalid:
            bad(CONTAINERS, f"{', '.join(map(repr, invalid))} cannot be container names", "ignoring them")
        containers = tuple(dict.fromkeys(n for n in names if n not in invalid))

    payloads = config.payloads
    value: str | None
    if (value := text(PAYLOADS, f"using {config.payloads}")) is not None:
        if (why := validate.payload_spec_error(value)) is None:
            payloads = value.strip()
        else:
            bad(PAYLOADS, why, f"using {config.payloads}")
    env = [(ENV_MODE, "record"), (ENV_OUT, config.spool_path), (ENV_PAYLOADS, payloads)]
    for name, variable, check in AGENT_ANNOTATIONS:
        if (value := text(name, "using the agent's default")) is None:
            continue
        if (why := check(value)) is None:
            env.append((variable, value.strip()))
        else:
            bad(name, why, "using the agent's default")

    store = config.store
    if (value := text(STORE, "using the default store", validate.MAX_STORE_URL_CHARS)) is not None:
        if any(c.isspace() for c in value.strip()):
            bad(STORE, f"{validate.shown(value.strip())} has spaces", "using the default store")
        else:
            store = value.strip()
    secret = (text(STORE_SECRET, "no credentials mounted") or "").strip()
    if secret and not validate.is_dns_subdomain(secret):
        bad(STORE_SECRET, f"{validate.shown(secret)} is not a Secret name", "no credentials mounted")
        secret = ""
    port = config.metrics_port
    if (value := text(METRICS_PORT, f"using {config.metrics_port}")) is not None:
        if (why := validate.int_error(value, minimum=1, maximum=65535)) is None:
            port = int(value)
        else:
            bad(METRICS_PORT, why, f"using {config.metrics_port}")
    settings = PodSettings(
        containers=containers, agent_env=tuple(env), store=store, store_secret=secret, metrics_port=port
    )
    return settings, warnings
