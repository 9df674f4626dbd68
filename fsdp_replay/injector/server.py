"""The webhook: HTTPS (stdlib ``http.server`` + ``ssl``, one thread per connection), no third-party code.

Routes: ``POST /mutate`` (pods annotated ``<prefix>/record: "true"``), ``POST /mutate/namespace-default``
(pods of a namespace labelled ``<prefix>/record=enabled``: recorded unless annotated ``"false"``),
``GET /healthz`` and ``GET /readyz``. The namespace default is a path, not a query string, because the
API server allows neither a query in ``clientConfig.url`` nor anything but DNS-label segments in
``clientConfig.service.path``.

Two kinds of failure are kept apart (kopf's habit): a request that is not an AdmissionReview v1 gets
HTTP 400 with the reason; anything that goes wrong while mutating a well-formed request admits the
pod unchanged, with a warning saying why, and is logged. The webhook fails open: recording is never
a reason for a training job not to start.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import ssl
import threading
from collections.abc import Mapping
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from fsdp_replay.errors import ConfigError
from fsdp_replay.injector.config import InjectorConfig, env_name
from fsdp_replay.injector.errors import BadReviewError, InjectionError
from fsdp_replay.injector.mutate import mutate
from fsdp_replay.injector.review import Request, ResponseReview, build_response, parse_review

logger = logging.getLogger(__name__)

MUTATE_PATH = "/mutate"
NAMESPACE_DEFAULT_PATH = "/mutate/namespace-default"
ROUTES = {MUTATE_PATH: False, NAMESPACE_DEFAULT_PATH: True}  # path -> namespace_default
HEALTH_PATHS = ("/healthz", "/readyz")
# The API server caps a request body at 3 MiB of object; a review holds the object (and oldObject).
MAX_BODY_BYTES = 16 << 20
HANDSHAKE_TIMEOUT_S = 10.0
# Longer than the API server's webhook timeout (at most 30 s), so a kept-alive connection is reused.
IDLE_TIMEOUT_S = 60.0


def review_request(request: Request, config: InjectorConfig, *, namespace_default: bool) -> ResponseReview:
    """The answer to a well-formed request: always allowed; a patch when the pod is to be recorded."""
    uid = request["uid"]
    if request.get("operation", "CREATE") != "CREATE":
        return build_response(uid, [], [])  # a pod's spec cannot change after creation
    kind: Mapping[str, Any] = request.get("kind") or {}
    if (kind.get("group"), kind.get("kind")) != ("", "Pod"):
        logger.warning("uid %s: asked about %s, not a Pod: check the webhook's rules", uid, kind)
        return build_response(uid, [], [f"fsdp-replay: only Pods are injected, not {kind.get('kind')!r}"])
    pod: Mapping[str, Any] = request.get("object") or {}
    raw_metadata = pod.get("metadata")
    metadata: Mapping[str, Any] = raw_metadata if isinstance(raw_metadata, Mapping) else {}
    namespace = str(request.get("namespace") or metadata.get("namespace") or "")
    name = metadata.get("name") or metadata.get("generateName", "") + "*"
    try:
        ops, warnings = mutate(pod, namespace, config, namespace_default=namespace_default)
        response = build_response(uid, ops, warnings)
    except InjectionError as e:
        logger.warning("pod %s/%s (uid %s) admitted unchanged: %s", namespace, name, uid, e)
        return build_response(uid, [], [f"fsdp-replay: not injected: {e}"])
    except Exception as e:  # a bug must not stop the pod: fail open, loudly
        logger.exception(
            "pod %s/%s (uid %s) admitted unchanged after an internal error", namespace, name, uid
        )
        return build_response(
            uid,
            [],
            [f"fsdp-replay: not injected: internal error ({type(e).__name__}: {e}); pod admitted unchanged"],
        )
    if ops:
        logger.info("pod %s/%s (uid %s): injected (%d operations)", namespace, name, uid, len(ops))
    else:
        logger.debug("pod %s/%s (uid %s): not recorded", namespace, name, uid)
    for warning in warnings:
        logger.info("pod %s/%s (uid %s): %s", namespace, name, uid, warning)
    return response


def admit(body: bytes, config: InjectorConfig, *, namespace_default: bool) -> tuple[int, bytes, str]:
    """(HTTP status, body, content type) for a POSTed AdmissionReview."""
    try:
        request = parse_review(body)
    except BadReviewError as e:
        logger.warning("bad AdmissionReview: %s", e)
        return HTTPStatus.BAD_REQUEST, f"bad AdmissionReview: {e}\n".encode(), "text/plain; charset=utf-8"
    response = review_request(request, config, namespace_default=namespace_default)
    return HTTPStatus.OK, json.dumps(response).encode(), "application/json"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the API server reuses its connections
    timeout = IDLE_TIMEOUT_S
    server: WebhookServer

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if path in HEALTH_PATHS:
            self._send(HTTPStatus.OK, b"ok\n", "text/plain; charset=utf-8")
        elif path in ROUTES:
            self._send(
                HTTPStatus.METHOD_NOT_ALLOWED, b"POST an AdmissionReview here\n", "text/plain", allow="POST"
            )
        else:
            self._send(HTTPStatus.NOT_FOUND, f"no route {path}\n".encode(), "text/plain; charset=utf-8")

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        if path not in ROUTES:
            self.close_connection = True  # the body was not read
            self._send(HTTPStatus.NOT_FOUND, f"no route {path}\n".encode(), "text/plain; charset=utf-8")
            return
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            self._send(HTTPStatus.LENGTH_REQUIRED, b"a Content-Length is required\n", "text/plain")
            return
        if int(length) > MAX_BODY_BYTES:
            self.close_connection = True
            self._send(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, b"the review is too large\n", "text/plain")
            return
        body = self.rfile.read(int(length))
        status, payload, content_type = admit(body, self.server.config, namespace_default=ROUTES[path])
        self._send(status, payload, content_type)

    def _send(self, status: int, body: bytes, content_type: str, **headers: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name.title(), value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)


class WebhookServer(ThreadingHTTPServer):
    """The threaded HTTPS server; the TLS handshake runs in each connection's thread, not in accept()."""

    daemon_threads = True

    def __init__(self, config: InjectorConfig, context: ssl.SSLContext) -> None:
        self.config = config
        self.context = context
        if ":" in config.listen_address:
            self.address_family = socket.AF_INET6
        super().__init__((config.listen_address, config.port), _Handler)

    def finish_request(self, request: Any, client_address: Any) -> None:
        request.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            tls = self.context.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError) as e:
            logger.info("TLS handshake with %s failed: %s", client_address[0], e)
            return
        try:
            super().finish_request(tls, client_address)
        finally:
            self.shutdown_request(tls)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A bug in the handler itself: the connection is dropped (the API server then applies
        # failurePolicy: Ignore), and the traceback goes to our log rather than bare stderr.
        logger.exception("error while serving %s", client_address[0])

    @property
    def port(self) -> int:
        return int(self.server_address[1])


def tls_context(config: InjectorConfig) -> ssl.SSLContext:
    if not (config.tls_cert_file and config.tls_key_file):
        raise ConfigError(
            f"the webhook serves HTTPS only: give --tls-cert-file and --tls-key-file "
            f"({env_name('tls_cert_file')}, {env_name('tls_key_file')})"
        )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(config.tls_cert_file, config.tls_key_file)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(
            f"cannot load the TLS certificate {config.tls_cert_file} and key {config.tls_key_file}: {e}"
        ) from None
    return context


def make_server(config: InjectorConfig) -> WebhookServer:
    """A bound, not yet serving, webhook server (``port`` 0 picks a free port: see ``.port``)."""
    return WebhookServer(config, tls_context(config))


def serve(config: InjectorConfig) -> int:
    """Serve until SIGTERM or SIGINT; requests in flight are finished first."""
    server = make_server(config)
    host = config.listen_address
    logger.info("fsdp-replay webhook listening on https://%s:%d", host, server.port)

    def stop(signum: int, _frame: Any) -> None:
        logger.info("signal %d: stopping", signum)
        threading.Thread(target=server.shutdown, daemon=True).start()  # shutdown() waits for serve_forever

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0
