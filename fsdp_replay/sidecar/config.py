"""Sidecar options: one frozen dataclass, read once at start-up from ``FSDP_REPLAY_SIDECAR_*``.

The names are the contract with the injector (``injector/containers.py`` sets ``FSDP_REPLAY_OUT``,
``FSDP_REPLAY_SIDECAR_STORE``, ``_METRICS_PORT``, ``_MODE``, ``_CONTAINERS``, ``_POD_NAME``,
``_POD_NAMESPACE``, ``_POD_UID`` and ``_NODE_NAME`` on the sidecar container). The run folder is the
agents' own ``FSDP_REPLAY_OUT``, not a sidecar-prefixed name: the sidecar reads what they write.

``fsdp-replay sidecar`` takes every field as a flag too; the CLI writes the flags it was given over
the environment and calls :meth:`SidecarConfig.from_env`, so there is one parser and flags win.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from fsdp_replay import options
from fsdp_replay.errors import ConfigError

ENV_PREFIX = "FSDP_REPLAY_SIDECAR_"
ENV_OUT = "FSDP_REPLAY_OUT"
"""The run folder the agents spool into (``OUT/spool/rank-NNNNN``); the injector sets it on both."""
MODE_NATIVE = "native"
"""A native sidecar (init container, ``restartPolicy: Always``): the kubelet stops it (SIGTERM)."""
MODE_CONTAINER = "container"
"""A plain container: nothing stops it, so it exits by itself once the trainers have ended."""
MODES = (MODE_NATIVE, MODE_CONTAINER)
PROBE_SCOPES = ("file", "process")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DEFAULT_OUT = "/var/lib/fsdp-replay"
"""The injector's default ``spool_path``."""
DEFAULT_METRICS_PORT = 9464
ENV_NAMES = {"out": ENV_OUT}  # fields whose variable is not prefixed
# A Kubernetes container name (RFC 1123 label).
_CONTAINER_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def env_name(field_name: str) -> str:
    """The environment variable of a config field: ``metrics_port`` -> ``FSDP_REPLAY_SIDECAR_METRICS_PORT``
    (``out`` -> ``FSDP_REPLAY_OUT``, shared with the agents)."""
    return ENV_NAMES.get(field_name) or options.env_var(field_name, ENV_PREFIX)


@dataclass(frozen=True, kw_only=True, slots=True)
class SidecarConfig:
    out: str = DEFAULT_OUT
    """The run folder: the agents spool into ``OUT/spool/rank-NNNNN/seg-*.fsrs``."""
    store: str = ""
    """Trace store URL (``s3://bucket/prefix``) the collector uploads to; empty: ``OUT/trace.zarr``."""
    collect_interval_s: float = 0.0
    """Seconds between two collections of the trace into the store while trainers run (0: once, when they end)."""
    signing_key: str = ""
    """A file holding the key that signs the traces collected (``trace/signing.py``; the injector mounts
    its Secret); empty: traces are not signed."""
    keep_spools: bool = False
    """Keep the spools after the store holds the trace whole (default: delete each rank's once it reads back whole)."""
    proc_root: str = "/proc"
    """Where the training processes' /proc entries are (another mount of the pod's or host's procfs)."""
    metrics_address: str = "0.0.0.0"
    """Address ``/metrics`` and ``/healthz`` listen on."""
    metrics_port: int = DEFAULT_METRICS_PORT
    """Port of ``/metrics`` and ``/healthz`` (0: any free port, logged at start-up)."""
    ebpf: bool = True
    """Probe the trainers' libnccl with eBPF uprobes; without root or bcc the sidecar runs without them."""
    probe_scope: str = "file"
    """file: attach each library file once (every process mapping it takes the breakpoint); process: per trainer."""
    poll_interval_s: float = 1.0
    """Seconds between two looks at the processes and the spools."""
    mode: str = MODE_NATIVE
    """native (stopped by the kubelet) or container (a plain sidecar container, which must exit by itself)."""
    containers: tuple[str, ...] = ()
    """The recorded containers, comma-separated (exported in fsdp_replay_sidecar_info)."""
    exit_when_trainers_end: bool | None = None
    """Exit 0 once the training processes seen have ended and their spools are quiet; unset: in container mode only."""
    exit_quiet_s: float = 10.0
    """How long no trainer may run and no spool grow before that exit (a restarted worker within it keeps the sidecar)."""
    hang_dump_wait_s: float = 10.0
    """At a hang (ranks newly stuck): how long to wait for every live rank's state (a dump request's answers) before collecting (0: collect at once, no request)."""
    cost_skip_steps: int = 0
    """Steps left out of the recording-cost medians, as summary.recording_cost's skip_steps (inspect uses 0)."""
    max_comm_labels: int = 64
    """Distinct NCCL communicator labels exported at most; the calls on any further ones go to comm="other"."""
    pod_name: str = ""
    """The pod's name (downward API), exported in fsdp_replay_sidecar_info."""
    pod_namespace: str = ""
    """The pod's namespace (downward API)."""
    pod_uid: str = ""
    """The pod's UID (downward API)."""
    node_name: str = ""
    """The node the pod runs on (downward API)."""
    log_level: str = "INFO"
    """Log level of the sidecar: DEBUG, INFO, WARNING or ERROR."""

    def __post_init__(self) -> None:
        for name in ("out", "proc_root"):
            value = getattr(self, name)
            if not value.strip():
                raise ConfigError(f"{env_name(name)}={value!r}: give a folder")
        if any(c.isspace() for c in self.store):
            raise ConfigError(f"{env_name('store')}={self.store!r}: a URL has no spaces")
        if not self.metrics_address or any(c.isspace() for c in self.metrics_address):
            raise ConfigError(
                f"{env_name('metrics_address')}={self.metrics_address!r}: give an address such as 0.0.0.0"
            )
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"{env_name('metrics_port')}={self.metrics_port}: a port is 0..65535")
        _one_of("probe_scope", self.probe_scope, PROBE_SCOPES)
        _one_of("mode", self.mode, MODES)
        _one_of("log_level", self.log_level, LOG_LEVELS)
        if not (math.isfinite(self.poll_interval_s) and 0.01 <= self.poll_interval_s <= 3600):
            raise ConfigError(
                f"{env_name('poll_interval_s')}={self.poll_interval_s}: give 0.01..3600 seconds"
            )
        if not (math.isfinite(self.collect_interval_s) and 0 <= self.collect_interval_s <= 86400):
            raise ConfigError(
                f"{env_name('collect_interval_s')}={self.collect_interval_s}: give 0..86400 seconds"
            )
        if not (math.isfinite(self.exit_quiet_s) and 0 <= self.exit_quiet_s <= 86400):
            raise ConfigError(f"{env_name('exit_quiet_s')}={self.exit_quiet_s}: give 0..86400 seconds")
        if not (math.isfinite(self.hang_dump_wait_s) and 0 <= self.hang_dump_wait_s <= 3600):
            raise ConfigError(f"{env_name('hang_dump_wait_s')}={self.hang_dump_wait_s}: give 0..3600 seconds")
        if self.cost_skip_steps < 0:
            raise ConfigError(f"{env_name('cost_skip_steps')}={self.cost_skip_steps}: a step count is >= 0")
        if self.max_comm_labels < 1:
            raise ConfigError(f"{env_name('max_comm_labels')}={self.max_comm_labels}: at least 1")
        for c in self.containers:
            if not _CONTAINER_NAME.match(c):
                raise ConfigError(
                    f"{env_name('containers')}: {c!r} is not a container name (lowercase letters, digits, -)"
                )

    @property
    def exits_when_trainers_end(self) -> bool:
        """``exit_when_trainers_end`` resolved: unset means "in container mode"."""
        if self.exit_when_trainers_end is None:
            return self.mode == MODE_CONTAINER
        return self.exit_when_trainers_end

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SidecarConfig:
        """The config from its environment variables; unset ones (and empty non-text ones) keep their defaults."""
        config: SidecarConfig = options.from_env(cls, ENV_PREFIX, env, names=ENV_NAMES)
        return config


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{env_name(name)}={value!r}: expected one of {', '.join(allowed)}")
