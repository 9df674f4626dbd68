"""``fsdp-replay job`` options: one frozen dataclass, read from ``FSDP_REPLAY_JOB_*`` (flags win).

The same pattern as :class:`~fsdp_replay.injector.config.InjectorConfig`: the command writes the
flags it was given over the environment and calls :meth:`JobConfig.from_env`. The docstrings
under the fields are the flags' help texts.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping
from dataclasses import dataclass

from fsdp_replay import __version__, options
from fsdp_replay.errors import ConfigError
from fsdp_replay.injector import validate
from fsdp_replay.injector.config import PULL_POLICIES

ENV_PREFIX = "FSDP_REPLAY_JOB_"
DEVICES = ("cuda", "cpu")
DEFAULT_PAYLOAD_IMAGE = f"fsdp-replay/replay:{__version__}"
# A Job's name is a label value (63); an Indexed Job's pods are named <job>-<index>-<5 random>
# and their hostnames <job>-<index>: 52 leaves room for both, as a CronJob's limit does.
MAX_NAME_CHARS = 52


def env_name(field_name: str) -> str:
    """``payload_image`` -> ``FSDP_REPLAY_JOB_PAYLOAD_IMAGE``."""
    return options.env_var(field_name, ENV_PREFIX)


@dataclass(frozen=True, kw_only=True, slots=True)
class JobConfig:
    trace: str = ""
    """The trace to replay: a store URL (s3://...) or a path the Job's pod sees (--volume-claims)."""
    rank: int | None = None
    """The rank to replay (a Job of one pod); give this or --all-ranks."""
    all_ranks: bool = False
    """An Indexed Job: one pod per rank, each replaying its rank alone from the trace's payloads."""
    from_step: int = 0
    """Verify from this step (the replay restores the latest snapshot at or before it)."""
    to_step: int = -1
    """Stop after this step (-1: run the program to its end)."""
    device: str = "cuda"
    """cuda (one GPU per pod, the replay on cuda:0) or cpu (no GPU asked for)."""
    gpu_resource: str = "nvidia.com/gpu"
    """The extended resource a GPU is asked for by (amd.com/gpu, ...)."""
    report: str = ""
    """Where the report goes (a store URL or a path the pod sees); default: replays/NAME beside the trace."""
    namespace: str = ""
    """The Job's namespace; default: the recorded pod's (its Secrets are there)."""
    name: str = ""
    """The Job's name; default: replay-<recorded pod>-rank-<R>[-from-<S>][-to-<E>]."""
    image: str = ""
    """The image to replay in; default: the recorded container's (the trace holds it)."""
    payload_image: str = DEFAULT_PAYLOAD_IMAGE
    """The replay payload image (Dockerfile target replay-payload): the package and its readers per Python."""
    image_pull_policy: str = "IfNotPresent"
    """imagePullPolicy of both images: Always, IfNotPresent or Never."""
    service_account: str = ""
    """The pod's service account; default: the recorded pod's (its access to the store)."""
    store_secret: str = ""
    """A Secret whose keys become the replay's environment (store credentials); default: the recorded pod's store-secret."""
    signing_key_secret: str = ""
    """A Secret whose item ``key`` signed the trace (the injector's signing-key Secret): the replay refuses
    the trace unless its signature matches; empty: the signature is not checked."""
    volume_claims: tuple[str, ...] = ()
    """PersistentVolumeClaims to mount, CLAIM:/path, comma-separated (a trace or report on shared storage)."""
    cpu: str = ""
    """The replay container's CPU request (a Kubernetes quantity; empty: none)."""
    memory: str = ""
    """The replay container's memory request (empty: none)."""
    parallelism: int = 0
    """With --all-ranks: how many ranks replay at once (0: all)."""
    kubernetes_version: str = ""
    """The cluster's version (1.28, v1.30.2-...): per-rank failure of an Indexed Job needs 1.29; empty: assume it."""
    mount_path: str = "/opt/fsdp-replay"
    """Where the replay payload is mounted in the replay container."""
    work_path: str = "/var/lib/fsdp-replay"
    """A scratch emptyDir for the replay's report before it is stored."""
    annotation_prefix: str = "fsdp-replay.io"
    """Prefix of the Job's annotations, as the injector's (the pod opts out of recording with <prefix>/record)."""
    force: bool = False
    """Replay even if the script or torch version differ from the recorded ones (replay --force)."""
    trust_trace: bool = False
    """Only for a trace you made yourself: run its recorded command as it is (replay --trust-trace)."""
    dry_run: bool = False
    """Print the Job as YAML (for kubectl apply -f -) instead of creating it with kubectl."""

    def __post_init__(self) -> None:
        if self.rank is not None and self.rank < 0:
            raise ConfigError(f"{env_name('rank')}={self.rank} must be >= 0")
        if self.rank is not None and self.all_ranks:
            raise ConfigError("--rank and --all-ranks exclude each other: one rank, or an Indexed Job of all")
        if self.from_step < 0:
            raise ConfigError(f"{env_name('from_step')}={self.from_step} must be >= 0")
        if self.to_step < -1:
            raise ConfigError(f"{env_name('to_step')}={self.to_step} must be >= -1")
        if self.to_step != -1 and self.to_step < self.from_step:
            raise ConfigError(f"--to-step {self.to_step} comes before --from-step {self.from_step}")
        if self.device not in DEVICES:
            raise ConfigError(f"{env_name('device')}={self.device!r}: expected one of {', '.join(DEVICES)}")
        for name in ("trace", "report", "image", "payload_image", "gpu_resource"):
            if any(c.isspace() for c in getattr(self, name)):
                raise ConfigError(f"{env_name(name)}={getattr(self, name)!r} has spaces")
        if not self.payload_image:
            raise ConfigError(f"{env_name('payload_image')} is empty: name the replay payload image")
        if self.image_pull_policy not in PULL_POLICIES:
            raise ConfigError(
                f"{env_name('image_pull_policy')}={self.image_pull_policy!r}: expected one of "
                + ", ".join(PULL_POLICIES)
            )
        for name, check in (
            ("namespace", validate.is_dns_label),
            ("name", validate.is_dns_label),
            ("service_account", validate.is_dns_subdomain),
            ("store_secret", validate.is_dns_subdomain),
            ("signing_key_secret", validate.is_dns_subdomain),
            ("annotation_prefix", validate.is_dns_subdomain),
        ):
            value = getattr(self, name)
            if value and not check(value):
                raise ConfigError(f"{env_name(name)}={value!r} is not a valid Kubernetes name")
        if len(self.name) > MAX_NAME_CHARS:
            raise ConfigError(
                f"{env_name('name')}={self.name!r}: at most {MAX_NAME_CHARS} characters (the pods' "
                "names and hostnames add to it)"
            )
        for name in ("cpu", "memory"):
            value = getattr(self, name)
            if value and validate.parse_quantity(value) is None:
                raise ConfigError(f"{env_name(name)}={value!r} is not a Kubernetes quantity (100m, 16Gi)")
        if self.parallelism < 0:
            raise ConfigError(f"{env_name('parallelism')}={self.parallelism} must be >= 0")
        if self.kubernetes_version and validate.kube_minor(self.kubernetes_version) is None:
            raise ConfigError(f"{env_name('kubernetes_version')}={self.kubernetes_version!r}: expected 1.29")
        paths = [("mount_path", self.mount_path), ("work_path", self.work_path)]
        for claim in self.volume_claims:
            name, _, path = claim.partition(":")
            if not validate.is_dns_subdomain(name) or not path:
                raise ConfigError(f"{env_name('volume_claims')}: {claim!r} is not CLAIM:/path")
            paths.append(("volume_claims", path))
        for field, path in paths:
            if not path.startswith("/") or path == "/" or posixpath.normpath(path) != path:
                raise ConfigError(
                    f"{env_name(field)}: {path!r} is not an absolute, normalized path other than /"
                )
        for i, (_, a) in enumerate(paths):
            for _, b in paths[i + 1 :]:
                if a == b or a.startswith(b + "/") or b.startswith(a + "/"):
                    raise ConfigError(f"the mounts {a} and {b} overlap: give them separate folders")

    @property
    def per_index_failure(self) -> bool:
        """Whether an Indexed Job fails per rank (backoffLimitPerIndex, beta and on from 1.29)."""
        minor = validate.kube_minor(self.kubernetes_version) if self.kubernetes_version else None
        return minor is None or minor >= (1, 29)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> JobConfig:
        """The config from ``FSDP_REPLAY_JOB_*`` variables; unset or empty ones keep their defaults."""
        config: JobConfig = options.from_env(cls, ENV_PREFIX, env)
        return config
