"""The injector's two kinds of failure, kept apart as kopf keeps them (``WebhookError`` vs ``AdmissionError``).

A bad *request* (not JSON, not an AdmissionReview v1, no uid) is the caller's fault and gets HTTP 400.
A pod the injector cannot handle is not: the webhook fails open, so an :class:`InjectionError` (or any
other exception raised while mutating) admits the pod unchanged, with a warning saying why.
"""

from __future__ import annotations

from fsdp_replay.errors import FsdpReplayError


class BadReviewError(FsdpReplayError, ValueError):
    """The HTTP body is not a usable AdmissionReview v1 request (answered with HTTP 400)."""


class InjectionError(FsdpReplayError, ValueError):
    """A pod (or a manifest's pod template) has a shape the injector cannot patch safely."""
