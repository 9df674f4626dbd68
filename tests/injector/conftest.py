"""Fixtures for the injector: fixture pods, a test CA, the real webhook over HTTPS, and a strict validator.

No API server can run here, so the webhook is exercised the way the API server calls it: a real
``fsdp-replay webhook`` process serving TLS on 127.0.0.1 with a certificate from a throwaway CA, sent
AdmissionReview v1 requests and verified against that CA. Patched pods are checked with
``kubernetes-validate --strict`` against the schemas of two Kubernetes versions: 1.28 (native sidecars
off by default there, so the sidecar is a plain container) and 1.33 (native sidecars).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from injector_support import (
    NATIVE_VERSION,
    PLAIN_VERSION,
    Tls,
    Webhook,
    make_tls,
    start_webhook,
    stop_webhook,
)


@pytest.fixture(scope="session")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Tls:
    """A throwaway CA and a server certificate it signed for 127.0.0.1 (and the in-cluster service name)."""
    return make_tls(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="session")
def webhooks(tls: Tls, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Webhook]]:
    """Two real webhook processes: one told the cluster is 1.28, one 1.33."""
    folder = tmp_path_factory.mktemp("webhook")
    started: dict[str, Webhook] = {}
    try:
        for version in (PLAIN_VERSION, NATIVE_VERSION):
            started[version] = start_webhook(tls, version, folder)
        yield started
    finally:
        for webhook in started.values():
            stop_webhook(webhook)


@pytest.fixture(params=[PLAIN_VERSION, NATIVE_VERSION], ids=["k8s-1.28-plain", "k8s-1.33-native"])
def webhook(request: pytest.FixtureRequest, webhooks: dict[str, Webhook]) -> Webhook:
    return webhooks[request.param]
