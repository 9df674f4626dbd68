"""What a recorded container must carry into its trace so that a replay Job can be made from the trace.

A replay Job (``fsdp-replay job``, ``job.py``) runs the recorded command again in the recorded
image, with the recorded pod's credentials. The agent records the process's whole environment
(redacted: ``trace/redact.py``), but not the image, nor where a variable's value came from. So the
injection adds, to every recorded container, variables that only say where things are:

- ``FSDP_REPLAY_POD_IMAGE`` and ``FSDP_REPLAY_POD_CONTAINER``: the container's image and name,
  literals known at admission;
- ``FSDP_REPLAY_POD_NAME``, ``_NAMESPACE``, ``_SERVICE_ACCOUNT``: from the downward API, because an
  AdmissionReview of a pod made from ``generateName`` does not hold its final name yet;
- ``FSDP_REPLAY_POD_REFS``: one JSON object with the container's ``valueFrom`` variables
  (Secret and ConfigMap keys, downward API fields), its ``envFrom`` sources, the pod's
  ``imagePullSecrets`` and the store's credentials Secret (the ``store-secret`` annotation). Names
  of Secrets and keys only: never a value.

Both sides of that contract are here: ``identity_env`` writes it (the injection), ``recorded_pod``
reads it back from a rank's recorded environment (the Job renderer). ``docs/injector.md`` lists
the variables, ``docs/kubernetes.md`` what a Job makes of them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fsdp_replay.errors import TraceFormatError
from fsdp_replay.trace.schema import has_redacted, is_redacted

ENV_POD_IMAGE = "FSDP_REPLAY_POD_IMAGE"
ENV_POD_CONTAINER = "FSDP_REPLAY_POD_CONTAINER"
ENV_POD_NAME = "FSDP_REPLAY_POD_NAME"
ENV_POD_NAMESPACE = "FSDP_REPLAY_POD_NAMESPACE"
ENV_POD_SERVICE_ACCOUNT = "FSDP_REPLAY_POD_SERVICE_ACCOUNT"
ENV_POD_REFS = "FSDP_REPLAY_POD_REFS"
# (variable, downward API field): resolved by the kubelet when the container starts.
FIELD_ENV = (
    (ENV_POD_NAME, "metadata.name"),
    (ENV_POD_NAMESPACE, "metadata.namespace"),
    (ENV_POD_SERVICE_ACCOUNT, "spec.serviceAccountName"),
)
IDENTITY_ENV = (ENV_POD_IMAGE, ENV_POD_CONTAINER, *(n for n, _ in FIELD_ENV), ENV_POD_REFS)
# The keys of FSDP_REPLAY_POD_REFS.
REFS_ENV = "env"
REFS_ENV_FROM = "envFrom"
REFS_PULL_SECRETS = "imagePullSecrets"
REFS_STORE_SECRET = "storeSecret"


def identity_env(
    spec: Mapping[str, Any], container: Mapping[str, Any], store_secret: str
) -> list[dict[str, Any]]:
    """The identity variables for one recorded ``container`` of a pod with ``spec``."""
    env: list[dict[str, Any]] = []
    if isinstance(container.get("image"), str) and container["image"]:
        env.append({"name": ENV_POD_IMAGE, "value": container["image"]})
    env.append({"name": ENV_POD_CONTAINER, "value": str(container["name"])})
    env += [{"name": n, "valueFrom": {"fieldRef": {"fieldPath": p}}} for n, p in FIELD_ENV]
    refs: dict[str, Any] = {
        REFS_ENV: [
            {"name": e["name"], "valueFrom": e["valueFrom"]}
            for e in container.get("env") or []
            if isinstance(e, Mapping) and isinstance(e.get("valueFrom"), Mapping)
        ],
        REFS_ENV_FROM: [dict(s) for s in container.get("envFrom") or [] if isinstance(s, Mapping)],
        REFS_PULL_SECRETS: [
            str(s["name"])
            for s in spec.get("imagePullSecrets") or []
            if isinstance(s, Mapping) and s.get("name")
        ],
    }
    if store_secret:
        refs[REFS_STORE_SECRET] = store_secret
    # Kubernetes expands $(VAR) in a value; $$ keeps a literal "$" (no name of ours holds "$(" but a
    # fieldPath could in principle, and a changed value would not read back as JSON).
    text = json.dumps(refs, sort_keys=True, separators=(",", ":")).replace("$(", "$$(")
    env.append({"name": ENV_POD_REFS, "value": text})
    return env


@dataclass(frozen=True, kw_only=True, slots=True)
class RecordedPod:
    """Where a recorded rank ran, read back from its recorded environment."""

    image: str | None
    """The container's image; None when the trace does not hold it (or it was redacted)."""
    container: str | None
    name: str | None
    namespace: str | None
    service_account: str | None
    env_refs: dict[str, dict[str, Any]]
    """Variable name -> its ``valueFrom`` in the recorded container."""
    env_from: tuple[dict[str, Any], ...]
    """The recorded container's ``envFrom`` sources, in order."""
    pull_secrets: tuple[str, ...]
    store_secret: str | None

    @property
    def known(self) -> bool:
        """Whether the trace came from a pod the injector recorded (its identity is there)."""
        return self.namespace is not None and self.image is not None


def recorded_pod(env: Mapping[str, str]) -> RecordedPod:
    """The identity in a rank's recorded (redacted) environment; fields are None where absent.

    Raises :class:`TraceFormatError` when ``FSDP_REPLAY_POD_REFS`` is there but unreadable.
    """

    def plain(name: str) -> str | None:
        value = env.get(name)
        return value if value and not has_redacted(value) else None

    raw = env.get(ENV_POD_REFS)
    refs: dict[str, Any] = {}
    if is_redacted(raw):
        raise TraceFormatError(
            f"the recording redacted {ENV_POD_REFS} (a Secret's name looked like a credential): "
            "the Secrets the recorded pod used are unknown"
        )
    if raw:
        try:
            parsed = json.loads(raw.replace("$$(", "$("))
        except ValueError as e:
            raise TraceFormatError(f"{ENV_POD_REFS} is not JSON: {e}") from None
        if not isinstance(parsed, dict):
            raise TraceFormatError(f"{ENV_POD_REFS} is not a JSON object")
        refs = parsed
    env_refs = {
        str(e["name"]): dict(e["valueFrom"])
        for e in _list(refs, REFS_ENV)
        if isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("valueFrom"), dict)
    }
    secret = refs.get(REFS_STORE_SECRET)
    return RecordedPod(
        image=plain(ENV_POD_IMAGE),
        container=plain(ENV_POD_CONTAINER),
        name=plain(ENV_POD_NAME),
        namespace=plain(ENV_POD_NAMESPACE),
        service_account=plain(ENV_POD_SERVICE_ACCOUNT),
        env_refs=env_refs,
        env_from=tuple(dict(s) for s in _list(refs, REFS_ENV_FROM) if isinstance(s, dict)),
        pull_secrets=tuple(str(s) for s in _list(refs, REFS_PULL_SECRETS) if isinstance(s, str)),
        store_secret=secret if isinstance(secret, str) and secret else None,
    )


def _list(refs: Mapping[str, Any], key: str) -> Sequence[Any]:
    value = refs.get(key)
    return value if isinstance(value, list) else []
