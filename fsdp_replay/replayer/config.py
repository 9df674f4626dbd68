"""The replayer's options, read once from ``FSDP_REPLAY_*`` at start-up (``fsdp-replay replay`` writes them)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fsdp_replay import options
from fsdp_replay.errors import ConfigError

ENV_PREFIX = options.ENV_PREFIX


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplayConfig:
    mode: str = "replay"
    """Always ``replay`` (``FSDP_REPLAY_MODE`` chooses the config: ``boot/attach.py``)."""
    trace: str = ""
    """The trace to replay from (a folder or an fsspec URL)."""
    rank: int = 0
    """The recorded rank this process replays."""
    from_step: int = 0
    """Verify from this step on (restoring the latest snapshot at or before it)."""
    to_step: int = -1
    """Stop after this step (-1: run the program to its end)."""
    report: str = ""
    """The folder for report.json."""
    live: bool = False
    """All-rank replay: collectives run for real (torchrun) and are compared with the record."""
    force: bool = False
    """Replay although the trace was recorded with another torch (kernels, so bits, may differ)."""
    data: str = "auto"
    """Where batches come from: ``recorded`` (the trace, without the dataset), ``live`` (the
    program's DataLoader, compared with the record), ``auto`` (the trace where it holds a loader's
    batches for the verified steps, else live)."""
    path_map: str = ""
    """JSON ``[[recorded folder, its place here], ...]``: the recorded run's paths (its file
    ledger) as they are where the replay runs (``replay --cwd/--map``)."""
    fast_forward_warmup: int = 2
    """Replaying from a snapshot at S: the first this many steps compute (frameworks' one-time
    set-up), the rest up to S run without kernels (``replayer/fastforward.py``). S or more: every
    step before S computes."""
    trust_trace: bool = False
    """The user vouches for the trace (``replay --trust-trace``): an older agent's pickled snapshot
    loads as the pickle it is. Never the default: a trace is untrusted input."""
    signing_key: str = ""
    """A file holding the key the trace was signed with: the replay refuses a trace whose signature
    does not match it (``trace/signing.py``); empty: the signature is not checked."""
    redacted_env: str = ""
    """Comma-separated: the variables the recording redacted, watched from interpreter start
    (``replayer/env_watch.py``) so the report can name one the program looked up."""

    def __post_init__(self) -> None:
        if self.mode != "replay":
            raise ConfigError(f"{ENV_PREFIX}MODE={self.mode!r}: a ReplayConfig replays")
        if not (self.trace and self.report):
            raise ConfigError(
                f"{ENV_PREFIX}TRACE and {ENV_PREFIX}REPORT are needed when {ENV_PREFIX}MODE=replay"
            )
        if self.data not in ("auto", "recorded", "live"):
            raise ConfigError(f"{ENV_PREFIX}DATA={self.data!r}: use auto, recorded or live")
        for name in ("rank", "from_step", "fast_forward_warmup"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{ENV_PREFIX}{name.upper()}={getattr(self, name)} must be >= 0")
        if self.to_step < -1:
            raise ConfigError(f"{ENV_PREFIX}TO_STEP={self.to_step} must be >= -1")
        if 0 <= self.to_step < self.from_step:
            raise ConfigError(
                f"{ENV_PREFIX}TO_STEP={self.to_step} is before {ENV_PREFIX}FROM_STEP={self.from_step}: "
                "nothing would be verified"
            )

    @property
    def enabled(self) -> bool:
        return True

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ReplayConfig:
        config: ReplayConfig = options.from_env(cls, ENV_PREFIX, env)
        return config

    def to_env(self) -> dict[str, str]:
        """The environment that makes a child process's agent replay with this config."""
        return {
            ENV_PREFIX + "MODE": self.mode,
            ENV_PREFIX + "TRACE": self.trace,
            ENV_PREFIX + "RANK": str(self.rank),
            ENV_PREFIX + "FROM_STEP": str(self.from_step),
            ENV_PREFIX + "TO_STEP": str(self.to_step),
            ENV_PREFIX + "REPORT": self.report,
            ENV_PREFIX + "LIVE": "1" if self.live else "0",
            ENV_PREFIX + "FORCE": "1" if self.force else "0",
            ENV_PREFIX + "TRUST_TRACE": "1" if self.trust_trace else "0",
            ENV_PREFIX + "SIGNING_KEY": self.signing_key,
            ENV_PREFIX + "DATA": self.data,
            ENV_PREFIX + "PATH_MAP": self.path_map,
            ENV_PREFIX + "FAST_FORWARD_WARMUP": str(self.fast_forward_warmup),
            ENV_PREFIX + "REDACTED_ENV": self.redacted_env,
        }
