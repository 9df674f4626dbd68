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
import re
import signal
import socket
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from email.message import Message
from http import HTTPStatus
from http.server import ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from fsdp_replay.errors import ConfigError
from fsdp_replay.http_deadline import ClientTimeout, DeadlineRequestHandler
from fsdp_replay.injector import validate
from fsdp_replay.injector.config import InjectorConfig, env_name
from fsdp_replay.injector.errors import BadReviewError, InjectionError
from fsdp_replay.injector.mutate import mutate
from fsdp_replay.injector.review import Request, ResponseReview, build_response, parse_review

logger = logging.getLogger(__name__)

MUTATE_PATH = "/mutate"
NAMESPACE_DEFAULT_PATH = "/mutate/namespace-default"
ROUTES = {MUTATE_PATH: False, NAMESPACE_DEFAULT_PATH: True}  # path -> namespace_default
HEALTH_PATHS = ("/healthz", "/readyz")
MAX_REQUEST_LINE_BYTES = 8192
# ASCII digits only: int() and str.isdigit() also take "²" or "٣", which no HTTP client sends.
_CONTENT_LENGTH = re.compile(r"[0-9]+", re.ASCII)
_TEXT = "text/plain; charset=utf-8"


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerLimits:
    """What one client may hold of the server: time, bytes, and one of a bounded number of threads."""

    max_body_bytes: int = 16 << 20
    """The largest review read; the API server caps an object at 3 MiB, and a review holds two."""
    handshake_timeout_s: float = 10.0
    """The TLS handshake, in the connection's own thread."""
    request_timeout_s: float = 10.0
    """Headers and body of one request, from its first byte: a client trickling a byte every few
    seconds never trips a per-read timeout, so the whole request has one deadline."""
    idle_timeout_s: float = 60.0
    """Waiting for the next request on a kept-alive connection; longer than the API server's webhook
    timeout (at most 30 s), so its connections are reused."""
    write_timeout_s: float = 10.0
    """Sending one response to a client that does not read it."""
    max_connections: int = 128
    """Connections served at once, one thread each; one more is closed at once (the API server then
    applies ``failurePolicy: Ignore``: the pod is admitted unchanged)."""
    refusal_log_interval_s: float = 1.0
    """At most one log line per interval for refused connections, with their count."""

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, not {getattr(self, name)}")
        for name in ("handshake_timeout_s", "request_timeout_s", "idle_timeout_s", "write_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, not {getattr(self, name)}")


def review_request(request: Request, config: InjectorConfig, *, namespace_default: bool) -> ResponseReview:
    """The answer to a well-formed request: always allowed; a patch when the pod is to be recorded."""
    uid = request["uid"]
    try:
        return _review(request, config, namespace_default=namespace_default)
    except Exception as e:  # a bug must not stop the pod: fail open, loudly
        logger.exception("uid %s admitted unchanged after an internal error", _one_line(uid))
        return build_response(
            uid,
            [],
            [f"fsdp-replay: not injected: internal error ({type(e).__name__}: {e}); pod admitted unchanged"],
        )


def _review(request: Request, config: InjectorConfig, *, namespace_default: bool) -> ResponseReview:
    uid = request["uid"]
    if request.get("operation", "CREATE") != "CREATE":
        return build_response(uid, [], [])  # a pod's spec cannot change after creation
    kind: Mapping[str, Any] = request.get("kind") or {}
    if (kind.get("group"), kind.get("kind")) != ("", "Pod"):
        logger.warning(
            "uid %s: asked about %s, not a Pod: check the webhook's rules",
            _one_line(f"{uid}"),
            _one_line(f"{kind}"),
        )
        return build_response(uid, [], [f"fsdp-replay: only Pods are injected, not {kind.get('kind')!r}"])
    pod: Mapping[str, Any] = request.get("object") or {}
    raw_metadata = pod.get("metadata")
    metadata: Mapping[str, Any] = raw_metadata if isinstance(raw_metadata, Mapping) else {}
    namespace = str(request.get("namespace") or metadata.get("namespace") or "")
    # The API server has not validated the object yet: its name may be of any type, or hold a newline.
    name = str(metadata.get("name") or f"{metadata.get('generateName') or ''}*")
    name = name if len(name) <= 253 else validate.shown(name)
    who = _one_line(f"pod {namespace}/{name} (uid {uid})")
    try:
        ops, warnings = mutate(pod, namespace, config, namespace_default=namespace_default)
        response = build_response(uid, ops, warnings)
    except InjectionError as e:
        logger.warning("%s admitted unchanged: %s", who, _one_line(str(e)))
        return build_response(uid, [], [f"fsdp-replay: not injected: {e}"])
    if ops:
        logger.info("%s: injected (%d operations)", who, len(ops))
    else:
        logger.debug("%s: not recorded", who)
    for warning in warnings:
        logger.info("%s: %s", who, _one_line(warning))
    return response


def _one_line(text: str) -> str:
    """``text`` for one log line: a newline in a pod's name must not forge another line."""
    return text if text.isprintable() else repr(text)[1:-1]


def admit(body: bytes, config: InjectorConfig, *, namespace_default: bool) -> tuple[int, bytes, str]:
    """(HTTP status, body, content type) for a POSTed AdmissionReview."""
    try:
        request = parse_review(body)
    except BadReviewError as e:
        logger.warning("bad AdmissionReview: %s", e)
        return HTTPStatus.BAD_REQUEST, f"bad AdmissionReview: {e}\n".encode(), _TEXT
    response = review_request(request, config, namespace_default=namespace_default)
    return HTTPStatus.OK, json.dumps(response).encode(), "application/json"


class BadHeaderError(ValueError):
    """A request whose headers say nothing usable about its body; answered with ``status``."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


def body_length(headers: Message, max_body_bytes: int) -> int:
    """The body's length from ``Content-Length``, which the API server always sends; raises
    :class:`BadHeaderError` for a missing, malformed, ambiguous or too large one, or a chunked body."""
    if "Transfer-Encoding" in headers:
        raise BadHeaderError(HTTPStatus.LENGTH_REQUIRED, "send the review with a Content-Length, not chunked")
    values = headers.get_all("Content-Length") or []
    if not values:
        raise BadHeaderError(HTTPStatus.LENGTH_REQUIRED, "a Content-Length is required")
    lengths = {v.strip() for v in values}
    if len(lengths) > 1:
        raise BadHeaderError(HTTPStatus.BAD_REQUEST, f"{len(values)} different Content-Length headers")
    (text,) = lengths
    if not _CONTENT_LENGTH.fullmatch(text):
        raise BadHeaderError(
            HTTPStatus.BAD_REQUEST, f"Content-Length {validate.shown(text)} is not a number of bytes"
        )
    digits = text.lstrip("0") or "0"
    if len(digits) > len(str(max_body_bytes)) or int(digits) > max_body_bytes:
        raise BadHeaderError(
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            f"the review is too large ({validate.shown(digits)} bytes, at most {max_body_bytes})",
        )
    return int(digits)


class _Handler(DeadlineRequestHandler):
    server: WebhookServer
    max_request_line_bytes = MAX_REQUEST_LINE_BYTES
    log = logger
    client_noun = ""

    def timed_out(self, e: ClientTimeout) -> None:
        self._send_raw(HTTPStatus.REQUEST_TIMEOUT, f"{e}\n".encode())

    def do_GET(self) -> None:
        if "Transfer-Encoding" in self.headers or self.headers.get("Content-Length", "0").strip() != "0":
            self.close_connection = True  # a body we do not read
        path = self._route()
        if path is None:
            return
        if path in HEALTH_PATHS:
            self._send(HTTPStatus.OK, b"ok\n", _TEXT)
        elif path in ROUTES:
            self._send(HTTPStatus.METHOD_NOT_ALLOWED, b"POST an AdmissionReview here\n", _TEXT, allow="POST")
        else:
            self._send(HTTPStatus.NOT_FOUND, f"no route {validate.shown(path)}\n".encode(), _TEXT)

    def do_POST(self) -> None:
        path = self._route()
        if path is None:
            return
        if path not in ROUTES:
            self.close_connection = True  # the body was not read
            self._send(HTTPStatus.NOT_FOUND, f"no route {validate.shown(path)}\n".encode(), _TEXT)
            return
        try:
            length = body_length(self.headers, self.server.limits.max_body_bytes)
        except BadHeaderError as e:
            logger.warning("%s: %s", self.client_address[0], e)
            self.close_connection = True
            self._send(e.status, f"{e}\n".encode(), _TEXT)
            return
        body = self.rfile.read(length)
        if len(body) < length:
            logger.info(
                "%s went away after %d of %d bytes of its body", self.client_address[0], len(body), length
            )
            self.close_connection = True
            return
        status, payload, content_type = admit(body, self.server.config, namespace_default=ROUTES[path])
        self._send(status, payload, content_type)

    def _route(self) -> str | None:
        """The request's path, or None once a malformed target has been answered with 400."""
        try:
            return urlsplit(self.path).path
        except ValueError as e:  # e.g. an unclosed IPv6 bracket
            self.close_connection = True
            self._send(HTTPStatus.BAD_REQUEST, f"bad request target: {e}\n".encode(), _TEXT)
            return None

    def _send(self, status: int, body: bytes, content_type: str, **headers: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name.title(), value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _send_raw(self, status: HTTPStatus, body: bytes) -> None:
        """An answer after the request could not be read whole (the request line may be missing)."""
        head = (
            f"HTTP/1.1 {status.value} {status.phrase}\r\nContent-Type: {_TEXT}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        try:
            self.connection.settimeout(min(1.0, self.server.limits.write_timeout_s))
            self.wfile.write(head.encode() + body)
        except OSError:
            pass  # it did not wait for the answer: the log line above says enough

    def flush_headers(self) -> None:
        # Every answer starts here, error pages included: from now on the socket's timeout is for
        # writing, not what was left of the request's deadline.
        self.connection.settimeout(self.server.limits.write_timeout_s)
        super().flush_headers()

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.client_address[0], format % args)


class WebhookServer(ThreadingHTTPServer):
    """The threaded HTTPS server: a bounded number of connection threads, the TLS handshake in each
    connection's thread, not in accept()."""

    daemon_threads = True
    request_queue_size = 128  # the listen backlog: a burst of reviews waits here, not refused by the kernel

    def __init__(
        self, config: InjectorConfig, context: ssl.SSLContext, limits: ServerLimits | None = None
    ) -> None:
        self.config = config
        self.context = context
        self.limits = limits or ServerLimits()
        self._slots = threading.BoundedSemaphore(self.limits.max_connections)
        self._refused = 0
        self._refusal_logged_at = -float("inf")
        if ":" in config.listen_address:
            self.address_family = socket.AF_INET6
        super().__init__((config.listen_address, config.port), _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        # In the accept loop: a connection beyond the bound is closed here, and no thread is started.
        if not self._slots.acquire(blocking=False):
            self._log_refusal(client_address)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread could be started: the slot is not taken
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _log_refusal(self, client_address: Any) -> None:
        self._refused += 1
        now = time.monotonic()
        if now - self._refusal_logged_at >= self.limits.refusal_log_interval_s:
            logger.warning(
                "refused %d connection(s), the latest from %s: %d are being served already",
                self._refused,
                client_address[0],
                self.limits.max_connections,
            )
            self._refused, self._refusal_logged_at = 0, now

    def finish_request(self, request: Any, client_address: Any) -> None:
        request.settimeout(self.limits.handshake_timeout_s)
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
        # A bug in the handler itself (clients that fail are handled there): the connection is dropped
        # (the API server then applies failurePolicy: Ignore), and the traceback goes to our log.
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


def make_server(config: InjectorConfig, limits: ServerLimits | None = None) -> WebhookServer:
    """A bound, not yet serving, webhook server (``port`` 0 picks a free port: see ``.port``)."""
    return WebhookServer(config, tls_context(config), limits)


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
