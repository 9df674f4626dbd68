"""Injector options: one frozen dataclass, read once at start-up from ``FSDP_REPLAY_INJECTOR_*``.

``fsdp-replay webhook`` and ``fsdp-replay inject`` take every field as a flag too; the CLI turns the
flags it was given into the same environment names and calls :meth:`InjectorConfig.from_env`, so
there is one parser and flags override the environment by construction.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import dataclass

from fsdp_replay import __version__, options
from fsdp_replay.errors import ConfigError
from fsdp_replay.injector import validate

ENV_PREFIX = "FSDP_REPLAY_INJECTOR_"
SIDECAR_MODES = ("auto", "native", "container")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# Native sidecars (init containers with restartPolicy: Always) are alpha in 1.28 behind the
# SidecarContainers gate, beta and on by default from 1.29, GA in 1.33.
NATIVE_SIDECAR_SINCE = (1, 29)


def env_name(field_name: str) -> str:
    """The environment variable of a config field: ``agent_image`` -> ``FSDP_REPLAY_INJECTOR_AGENT_IMAGE``."""
    return options.env_var(field_name, ENV_PREFIX)


@dataclass(frozen=True, kw_only=True, slots=True)
class InjectorConfig:
    agent_image: str = f"fsdp-replay/agent:{__version__}"
    """The agent payload image: it holds the package at ``/fsdp-replay/lib/fsdp_replay`` and a ``cp``."""
    sidecar_image: str = f"fsdp-replay/sidecar:{__version__}"
    """The sidecar image; its container runs ``fsdp-replay sidecar``."""
    image_pull_policy: str = "IfNotPresent"
    """``imagePullPolicy`` of both injected images: Always, IfNotPresent or Never."""
    mount_path: str = "/opt/fsdp-replay"
    """Where the agent payload (an emptyDir filled by the init container) is mounted in recorded containers."""
    spool_path: str = "/var/lib/fsdp-replay"
    """The run folder (``FSDP_REPLAY_OUT``), an emptyDir mounted at this path in the trainers and the sidecar."""
    payloads: str = "auto"
    """Default payload policy (``FSDP_REPLAY_PAYLOADS``: none, all, steps:SPEC, window:N, or auto: the
    flight recorder, window:4, for a container that asks for a GPU, all for one that does not); a
    pod annotation overrides it."""
    store: str = ""
    """Default trace store URL for the sidecar (``FSDP_REPLAY_SIDECAR_STORE``); empty: the sidecar's default."""
    annotation_prefix: str = "fsdp-replay.io"
    """Prefix of every annotation and label the injector reads or writes (``<prefix>/record``)."""
    signing_key_secret: str = ""
    """A Secret in each recorded pod's namespace whose item ``key`` signs the traces its sidecar collects
    (``docs/kubernetes.md``, "Signed traces"); empty: traces are not signed."""
    sidecar_mode: str = "auto"
    """native (an init container with ``restartPolicy: Always``), container (a plain one), or auto."""
    kubernetes_version: str = ""
    """The cluster's version (``1.28``, ``v1.30.2-eks-...``), used by auto; empty: assume native sidecars work."""
    add_sys_admin: bool = False
    """Give the sidecar CAP_SYS_ADMIN as well: only for nodes whose kernels predate 5.8 (no CAP_BPF/CAP_PERFMON)."""
    metrics_port: int = 9464
    """The sidecar's Prometheus ``/metrics`` and ``/healthz`` port (in the pod's network namespace)."""
    sidecar_cpu_request: str = "100m"
    """The sidecar's CPU request (a Kubernetes quantity; empty: none)."""
    sidecar_memory_request: str = "256Mi"
    """The sidecar's memory request (empty: none)."""
    sidecar_cpu_limit: str = ""
    """The sidecar's CPU limit (empty: none, so compression may use idle CPU)."""
    sidecar_memory_limit: str = "1Gi"
    """The sidecar's memory limit (empty: none)."""
    tls_cert_file: str = ""
    """PEM certificate (chain) the webhook serves; needed by ``webhook`` only."""
    tls_key_file: str = ""
    """PEM private key of that certificate."""
    listen_address: str = "0.0.0.0"
    """Address the webhook listens on."""
    port: int = 8443
    """Port the webhook listens on (0: any free port, logged at start-up)."""
    log_level: str = "INFO"
    """Log level of the webhook process: DEBUG, INFO, WARNING or ERROR."""

    def __post_init__(self) -> None:
        for name in ("agent_image", "sidecar_image"):
            value = getattr(self, name)
            if not value or any(c.isspace() for c in value):
                raise ConfigError(f"{env_name(name)}={value!r}: give an image reference without spaces")
        _one_of("image_pull_policy", self.image_pull_policy, PULL_POLICIES)
        _one_of("sidecar_mode", self.sidecar_mode, SIDECAR_MODES)
        _one_of("log_level", self.log_level, LOG_LEVELS)
        for name in ("mount_path", "spool_path"):
            value = getattr(self, name)
            if not value.startswith("/") or value == "/" or posixpath.normpath(value) != value:
                raise ConfigError(
                    f"{env_name(name)}={value!r}: give an absolute, normalized path other than /"
                )
        a, b = self.mount_path, self.spool_path
        if a == b or a.startswith(b + "/") or b.startswith(a + "/"):
            raise ConfigError(
                f"{env_name('mount_path')}={a!r} and {env_name('spool_path')}={b!r} must not be the same "
                "folder or one inside the other (they are two volumes)"
            )
        if (why := validate.payload_spec_error(self.payloads)) is not None:
            raise ConfigError(f"{env_name('payloads')}: {why}")
        if any(c.isspace() for c in self.store):
            raise ConfigError(f"{env_name('store')}={self.store!r}: a URL has no spaces")
        if self.signing_key_secret and not validate.is_dns_subdomain(self.signing_key_secret):
            raise ConfigError(
                f"{env_name('signing_key_secret')}={self.signing_key_secret!r}: a Secret's name is a lowercase "
                "DNS subdomain"
            )
        if not validate.is_dns_subdomain(self.annotation_prefix):
            raise ConfigError(
                f"{env_name('annotation_prefix')}={self.annotation_prefix!r}: an annotation prefix is a "
                "lowercase DNS subdomain such as fsdp-replay.io"
            )
        if self.kubernetes_version and validate.kube_minor(self.kubernetes_version) is None:
            raise ConfigError(
                f"{env_name('kubernetes_version')}={self.kubernetes_version!r}: expected a version such as 1.29"
            )
        for name in ("metrics_port", "port"):
            lowest = 0 if name == "port" else 1
            if not lowest <= getattr(self, name) <= 65535:
                raise ConfigError(f"{env_name(name)}={getattr(self, name)}: a port is {lowest}..65535")
        for kind in ("cpu", "memory"):
            request, limit = getattr(self, f"sidecar_{kind}_request"), getattr(self, f"sidecar_{kind}_limit")
            for name, value in ((f"sidecar_{kind}_request", request), (f"sidecar_{kind}_limit", limit)):
                if value and validate.parse_quantity(value) is None:
                    raise ConfigError(f"{env_name(name)}={value!r} is not a Kubernetes quantity (100m, 1Gi)")
            # The API server rejects a container whose request exceeds its limit: the pod would not start.
            low, high = validate.parse_quantity(request), validate.parse_quantity(limit)
            if low is not None and high is not None and low > high:
                raise ConfigError(
                    f"{env_name(f'sidecar_{kind}_request')}={request} exceeds "
                    f"{env_name(f'sidecar_{kind}_limit')}={limit}"
                )
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError(f"{env_name('tls_cert_file')} and {env_name('tls_key_file')} go together")

    @property
    def native_sidecar(self) -> bool:
        """Whether the sidecar is injected as a native sidecar (``sidecar_mode`` resolved for ``auto``)."""
        if self.sidecar_mode != "auto":
            return self.sidecar_mode == "native"
        minor = validate.kube_minor(self.kubernetes_version) if self.kubernetes_version else None
        # Every Kubernetes release still supported upstream has native sidecars on by default.
        return minor is None or minor >= NATIVE_SIDECAR_SINCE

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> InjectorConfig:
        """The config from ``FSDP_REPLAY_INJECTOR_*`` variables; unset or empty ones keep their defaults."""
        config: InjectorConfig = options.from_env(cls, ENV_PREFIX, env)
        return config


def parse_bool(name: str, raw: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off``; anything else is a ConfigError naming the variable."""
    return options.parse_bool(env_name(name), raw)


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{env_name(name)}={value!r}: expected one of {', '.join(allowed)}")
