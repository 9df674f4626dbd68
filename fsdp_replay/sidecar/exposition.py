"""What a scrape is answered with: the registry rendered at most once per interval, per format.

Rendering is nearly all of a scrape's cost (docs/metrics.md#overhead) and holds the GIL, so N
scrapers at once used to cost N renderings, each waiting for all the others. Here one thread
renders at a time; the others are answered with the last rendering of the format they asked for
(text 0.0.4 or OpenMetrics, as ``prometheus_client.exposition.choose_encoder`` picks it), and wait
only while there is none yet. A rendering is at most ``max_age_s`` old when a scrape starts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder, generate_latest
from prometheus_client.registry import CollectorRegistry

log = logging.getLogger(__name__)

DEFAULT_MAX_AGE_S = 1.0
# Formats kept at once. choose_encoder echoes the Accept header's version and escaping into the
# content type, so a scraper making up versions must not grow the cache.
MAX_FORMATS = 8
_MAX_CONTENT_TYPE_CHARS = 200

Encoder = Callable[[CollectorRegistry], bytes]


@dataclass(frozen=True, slots=True)
class Rendering:
    """One rendering of the registry in one format."""

    content_type: str
    body: bytes | None
    """None: collecting the metrics failed (answered with 500 until the next rendering)."""
    rendered_at_s: float
    """When it was rendered, on the cache's monotonic clock."""


class RenderCache:
    """The registry's last rendering per format, renewed at most every ``max_age_s`` by one thread."""

    def __init__(
        self,
        registry: CollectorRegistry,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not max_age_s >= 0:
            raise ValueError(f"max_age_s must be >= 0, not {max_age_s}")
        self._registry = registry
        self._max_age_s = max_age_s
        self._clock = clock
        self._render_lock = threading.Lock()
        self._latest: dict[str, Rendering] = {}  # content type -> its last rendering
        self.renderings = 0
        """How many times the registry was rendered (for tests and benchmarks)."""

    def get(self, accept: str) -> Rendering:
        """A rendering for a scraper that sent ``accept``: the cached one while it is fresh, or while
        another thread renders a newer one."""
        encoder, content_type = negotiate(accept)
        cached = self._latest.get(content_type)
        if cached is not None and self._fresh(cached):
            return cached
        # Stale or missing: render, unless another thread is at it and there is something to answer.
        if not self._render_lock.acquire(blocking=cached is None):
            assert cached is not None
            return cached
        try:
            latest = self._latest.get(content_type)
            if latest is not None and self._fresh(latest):  # rendered while this thread waited
                return latest
            rendering = self._render(encoder, content_type)
            if content_type not in self._latest and len(self._latest) >= MAX_FORMATS:
                oldest = min(self._latest.values(), key=lambda r: r.rendered_at_s)
                del self._latest[oldest.content_type]
            self._latest[content_type] = rendering
            return rendering
        finally:
            self._render_lock.release()

    def _fresh(self, rendering: Rendering) -> bool:
        return self._clock() - rendering.rendered_at_s < self._max_age_s

    def _render(self, encoder: Encoder, content_type: str) -> Rendering:
        self.renderings += 1
        try:
            body: bytes | None = encoder(self._registry)
        except Exception:  # a collector bug must not take the server down; said once per interval
            log.exception("collecting the metrics failed")
            body = None
        return Rendering(content_type=content_type, body=body, rendered_at_s=self._clock())


def negotiate(accept: str) -> tuple[Encoder, str]:
    """``choose_encoder``'s answer, or the text format when it fails on a malformed Accept header
    (``version=abc`` raises TypeError in prometheus_client 0.26) or gives a content type that is
    not one short printable header value."""
    try:
        encoder, content_type = choose_encoder(accept)
    except Exception:
        return generate_latest, CONTENT_TYPE_PLAIN_0_0_4
    if (
        len(content_type) > _MAX_CONTENT_TYPE_CHARS
        or not content_type.isascii()
        or not content_type.isprintable()
    ):
        return generate_latest, CONTENT_TYPE_PLAIN_0_0_4
    return encoder, content_type
