"""``/metrics`` and ``/healthz``: a small threaded HTTP server over the sidecar's own registry.

``/metrics`` is the registry in the text exposition format, or OpenMetrics when the scraper asks
for it (``prometheus_client.exposition.choose_encoder``, what client_python's own handler does;
Prometheus asks for OpenMetrics first). ``/healthz`` answers 200 as soon as the server serves,
whatever the eBPF or collection state: the pod's readiness depends on it and a rendezvous Service
may publish only ready pods, so it must never wait for anything else (docs/injector.md).

prometheus_client's ``start_http_server`` is not used: it has no ``/healthz``. This one is a
``ThreadingHTTPServer`` on its own thread, with ``stop()``.
"""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"
HEALTH_PATH = "/healthz"


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == METRICS_PATH:
            encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
            try:
                body = encoder(self.server.registry)
            except Exception:  # a collector bug must not take the server down
                log.exception("collecting the metrics failed")
                self._reply(500, b"collecting the metrics failed\n", "text/plain; charset=utf-8")
                return
            self._reply(200, body, content_type)
        elif path == HEALTH_PATH:
            self._reply(200, b"ok\n", "text/plain; charset=utf-8")
        else:
            self._reply(404, b"not found: try /metrics or /healthz\n", "text/plain; charset=utf-8")

    def do_HEAD(self) -> None:
        self.do_GET()

    def _reply(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], registry: CollectorRegistry) -> None:
        self.registry = registry
        super().__init__(address, _Handler)


class MetricsServer:
    """Serves ``registry`` on ``address:port`` (port 0: any free one, see ``port``) from a thread."""

    def __init__(self, registry: CollectorRegistry, address: str = "0.0.0.0", port: int = 9464) -> None:
        self._server = _Server((address, port), registry)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The port actually bound."""
        return int(self._server.server_address[1])

    @property
    def address(self) -> str:
        return str(self._server.server_address[0])

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
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> MetricsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
