"""The Kubernetes mutating admission webhook: a pod annotation injects the agent and the sidecar.
Never imports torch.

The webhook (``fsdp-replay webhook``, ``server.py``) needs the standard library only; ``inject -f``
(``cli.py``) also needs PyYAML. ``mutate.py`` is pure: a pod (or a manifest's pod templates) in, a JSON
Patch and warnings out, injecting

- an init container that copies the agent payload image's ``/fsdp-replay`` into an emptyDir,
- into each recorded container: the mounts, ``PYTHONPATH`` by ``fsdp_replay.boot.pythonpath`` (the
  user's value kept after ours) and the ``FSDP_REPLAY_*`` variables the user has not set,
- the sidecar (native or plain, least privilege), the spool emptyDir, ``shareProcessNamespace``,
- the Prometheus and status annotations.

It is idempotent and fails open: every error admits the pod unchanged, with a warning.
``docs/injector.md`` describes the annotations, the precedence rules and the registration.
"""
