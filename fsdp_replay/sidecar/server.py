"""``/metrics`` and ``/healthz``: a small threaded HTTP server over the sidecar's own registry.

``/metrics`` is the registry in the text exposition format, or OpenMetrics when the scraper asks
for it (``prometheus_client.exposition.choose_encoder``, what client_python's own handler does;
Prometheus asks for OpenMetrics first), from a rendering at most a second old that one thread
renews while the others are answered with the last one (``exposition.py``). ``/healthz`` answers
200 as soon as the server serves, whatever the eBPF or collection state: the pod's readiness
depends on it and a rendezvous Service may publish only ready pods, so it must never wait for
anything else, a rendering least of all (docs/injector.md).

prometheus_client's ``start_http_server`` is not used: it has no ``/healthz``. This one is a
``ThreadingHTTPServer`` on its own thread, with ``stop()``, at most ``max_connections`` connection
threads (more wait in the listen backlog), one deadline for each request's headers, and one log
line, never a traceback, for a client that goes away or is too slow.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from typing import Any

from prometheus_client.registry import CollectorRegistry

from fsdp_replay.http_deadline import DeadlineRequestHandler
from fsdp_replay.sidecar.exposition import DEFAULT_MAX_AGE_S, RenderCache

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"
HEALTH_PATH = "/healthz"
MAX_REQUEST_LINE_BYTES = 8192
_TEXT = "text/plain; charset=utf-8"
_SLOT_POLL_S = 0.2  # how often the accept loop, waiting for a free thread, checks for stop()


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerLimits:
    """What one scraper may hold of the server."""

    max_connections: int = 64
    """Connections served at once, one thread each; further ones wait in the listen backlog. Past
    half of them, a connection is closed after its answer rather than kept alive."""
    request_timeout_s: float = 10.0
    """A request's line and headers, from its first byte (one deadline, not one per read: a client
    trickling a byte every few seconds is cut off too)."""
    idle_timeout_s: float = 30.0
    """Waiting for the next request on a kept-alive connection (Prometheus scrapes every 15-60 s)."""
    write_timeout_s: float = 10.0
    """Sending one answer to a scraper that does not read it."""

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, not {self.max_connections}")
        for name in ("request_timeout_s", "idle_timeout_s", "write_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, not {getattr(self, name)}")


class _Handler(DeadlineRequestHandler):
    server: _Server
    max_request_line_bytes = MAX_REQUEST_LINE_BYTES
    log = log
    client_noun = "scraper "

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == HEALTH_PATH:
            self._reply(200, b"ok\n", _TEXT)
        elif path == METRICS_PATH:
            rendering = self.server.cache.get(self.headers.get("Accept", ""))
            if rendering.body is None:
                self._reply(500, b"collecting the metrics failed\n", _TEXT)
            else:
                self._reply(200, rendering.body, rendering.content_type)
        else:
            self._reply(404, b"not found: try /metrics or /healthz\n", _TEXT)

    def do_HEAD(self) -> None:
        self.do_GET()

    def _reply(self, code: int, body: bytes, content_type: str) -> None:
        if "Transfer-Encoding" in self.headers or self.headers.get("Content-Length", "0").strip() != "0":
            self.close_connection = True  # a body we do not read
        if self.server.busy():
            self.close_connection = True  # its thread is better spent on the scrapers waiting
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def flush_headers(self) -> None:
        # Every answer starts here, error pages included: from now on the socket's timeout is for
        # writing, not what was left of the request's deadline.
        self.connection.settimeout(self.server.limits.write_timeout_s)
        super().flush_headers()

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.client_address[0], *args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256  # the listen backlog: scrapers beyond max_connections wait here

    def __init__(
        self,
        address: tuple[str, int],
        registry: CollectorRegistry,
        cache_max_age_s: float,
        limits: ServerLimits,
    ) -> None:
        self.registry = registry
        self.cache = RenderCache(registry, cache_max_age_s)
        self.limits = limits
        self._slots = threading.BoundedSemaphore(limits.max_connections)
        self._active = 0
        self._active_lock = threading.Lock()
        self.closing = threading.Event()
        super().__init__(address, _Handler)

    def busy(self) -> bool:
        return self._active * 2 >= self.limits.max_connections

    def process_request(self, request: Any, client_address: Any) -> None:
        # In the accept loop: no thread is started until one of max_connections is free.
        while not self._slots.acquire(timeout=_SLOT_POLL_S):
            if self.closing.is_set():
                self.shutdown_request(request)
                return
        with self._active_lock:
            self._active += 1
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread could be started: the slot is not taken
            self._release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release()

    def _release(self) -> None:
        with self._active_lock:
            self._active -= 1
        self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A bug in the handler (scrapers that fail are handled there): the traceback goes to our log.
        log.exception("error while serving %s", client_address[0])


class MetricsServer:
    """Serves ``registry`` on ``address:port`` (port 0: any free one, see ``port``) from a thread."""

    def __init__(
        self,
        registry: CollectorRegistry,
        address: str = "0.0.0.0",
        port: int = 9464,
        *,
        cache_max_age_s: float = DEFAULT_MAX_AGE_S,
        limits: ServerLimits | None = None,
    ) -> None:
        self._server = _Server((address, port), registry, cache_max_age_s, limits or ServerLimits())
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The port actually bound."""
        return int(self._server.server_address[1])

    @property
    def address(self) -> str:
        return str(self._server.server_address[0])

    @property
    def cache(self) -> RenderCache:
        return self._server.cache

    def start(self) -> MetricsServer:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._server.serve_forever,
                kwargs={"poll_interval": 0.2},
                name="fsdp-replay-metrics",
                daemon=True,
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and release the port (idempotent)."""
        if self._thread is not None:
            self._server.closing.set()
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> MetricsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
