"""The sidecar's /metrics server under load and against bad scrapers: 200 at once share a few
renderings and all get their answer, /healthz never waits for a rendering, scrapers that go away
mid-answer or trickle their request leave one log line and no traceback."""

from __future__ import annotations

import http.client
import logging
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry

from fsdp_replay.sidecar.exposition import RenderCache
from fsdp_replay.sidecar.server import MetricsServer, ServerLimits

OPENMETRICS = "application/openmetrics-text; version=1.0.0"
WORKER = "process_request_thread"  # in the name of every connection thread of socketserver


@dataclass(eq=False)  # hashable: the registry keeps collectors in a dict
class Collector:
    """``series`` samples of one gauge, the value the number of collections so far; waits on ``gate``."""

    series: int = 10
    help_text: str = "a test gauge"
    gate: threading.Event = field(default_factory=threading.Event)
    calls: int = 0

    def __post_init__(self) -> None:
        self.gate.set()

    def collect(self) -> Iterator[Metric]:
        self.calls += 1
        self.gate.wait(timeout=5)
        family = GaugeMetricFamily("fsdp_replay_test_value", self.help_text, labels=["i"])
        for i in range(self.series):
            family.add_metric([str(i)], float(self.calls))
        yield family


def serve(
    collector: Collector, cache_max_age_s: float = 1.0, limits: ServerLimits | None = None
) -> MetricsServer:
    registry = CollectorRegistry()
    registry.register(collector)
    return MetricsServer(registry, "127.0.0.1", 0, cache_max_age_s=cache_max_age_s, limits=limits).start()


def get(port: int, path: str = "/metrics", accept: str = "", timeout: float = 10) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path, headers={"Accept": accept} if accept else {})
        response = conn.getresponse()
        return response.status, response.getheader("Content-Type") or "", response.read()
    finally:
        conn.close()


def value_of(body: bytes) -> float:
    (family,) = list(text_string_to_metric_families(body.decode()))
    return float(family.samples[0].value)


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger="fsdp_replay.sidecar")
    return caplog


def assert_no_traceback(logs: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]) -> None:
    assert not [r for r in logs.records if r.exc_info], "a traceback was logged"
    assert "Traceback" not in capfd.readouterr().err


def test_200_concurrent_scrapers_share_a_few_renderings(
    logs: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    collector = Collector(series=3000)
    limits = ServerLimits(max_connections=32)
    scrapers = 200
    results: list[tuple[int, str, bytes, float]] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(scrapers + 1, timeout=30)
    done = threading.Event()
    most_workers = 0
    health_s: list[float] = []

    def scrape(i: int) -> None:
        try:
            barrier.wait()
            start = time.monotonic()
            status, content_type, body = get(server.port, accept=OPENMETRICS if i % 2 else "")
            results.append((status, content_type, body, time.monotonic() - start))
        except BaseException as e:
            errors.append(e)

    def watch() -> None:  # the connection threads, and /healthz, while the scrapers run
        nonlocal most_workers
        for _ in range(400):
            if done.is_set():
                return
            most_workers = max(most_workers, sum(WORKER in t.name for t in threading.enumerate()))
            start = time.monotonic()
            assert get(server.port, "/healthz")[0] == 200
            health_s.append(time.monotonic() - start)
            time.sleep(0.01)

    with serve(collector, limits=limits) as server:
        threads = [threading.Thread(target=scrape, args=(i,)) for i in range(scrapers)]
        for t in threads:
            t.start()
        watcher = threading.Thread(target=watch)
        watcher.start()
        start = time.monotonic()
        barrier.wait()
        for t in threads:
            t.join(timeout=30)
        wall_s = time.monotonic() - start
        done.set()
        watcher.join(timeout=10)
    assert not errors and len(results) == scrapers
    assert {status for status, *_ in results} == {200}
    assert max(elapsed for *_, elapsed in results) < 5.0 and wall_s < 8.0
    bodies = {content_type: body for _, content_type, body, _ in results}
    assert len(bodies) == 2  # text and OpenMetrics
    for content_type, body in bodies.items():
        if content_type.startswith("application/openmetrics-text"):
            assert body.endswith(b"# EOF\n") and body.count(b"fsdp_replay_test_value{") == 3000
        else:
            assert len(next(iter(text_string_to_metric_families(body.decode()))).samples) == 3000
    for _, _, body, _ in results:  # whole answers (the renderings of one format may differ)
        assert body.count(b"fsdp_replay_test_value{") == 3000
    # One rendering per format per second at most (two formats), where each scrape used to render.
    assert collector.calls <= 2 * (int(wall_s) + 2), (collector.calls, wall_s)
    assert 0 < most_workers <= limits.max_connections
    assert health_s and max(health_s) < 2.0
    assert_no_traceback(logs, capfd)


def test_a_rendering_is_at_most_the_interval_old_per_format() -> None:
    collector = Collector()
    with serve(collector, cache_max_age_s=0.3) as server:
        first = get(server.port)[2]
        assert get(server.port)[2] == first and collector.calls == 1
        status, content_type, body = get(server.port, accept=OPENMETRICS)
        assert status == 200 and content_type.startswith("application/openmetrics-text")
        assert body.endswith(b"# EOF\n") and collector.calls == 2
        time.sleep(0.35)
        assert value_of(get(server.port)[2]) == 3.0 and collector.calls == 3


def test_healthz_and_other_scrapers_do_not_wait_for_a_rendering() -> None:
    collector = Collector()
    with serve(collector, cache_max_age_s=0.2) as server:
        stale = get(server.port)[2]
        time.sleep(0.25)
        collector.gate.clear()  # the next rendering blocks until the gate opens
        slow: list[bytes] = []
        renderer = threading.Thread(target=lambda: slow.append(get(server.port)[2]))
        renderer.start()
        deadline = time.monotonic() + 5
        while collector.calls < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert collector.calls == 2
        start = time.monotonic()
        assert get(server.port, "/healthz")[0] == 200
        assert get(server.port)[2] == stale  # the last rendering, while another thread renders
        assert time.monotonic() - start < 1.0
        collector.gate.set()
        renderer.join(timeout=10)
        assert value_of(slow[0]) == 2.0 and collector.calls == 2


def test_malformed_accept_header_gets_the_text_format() -> None:
    with serve(Collector()) as server:
        for accept in (
            "application/openmetrics-text;version=abc",
            "application/openmetrics-text;version=1.x",
        ):
            status, content_type, body = get(server.port, accept=accept)
            assert status == 200 and content_type.startswith("text/plain; version=0.0.4")
            assert value_of(body) == 1.0


def test_made_up_formats_do_not_grow_the_cache() -> None:
    cache = RenderCache(CollectorRegistry(), max_age_s=60)
    for i in range(50):
        cache.get(f"application/openmetrics-text; version=1.0.{i}")
    assert len(cache._latest) <= 8 and cache.renderings == 50


def test_scrapers_that_go_away_mid_answer_leave_one_line_each(
    logs: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    # An 8 MB answer, more than the socket buffers hold, to a scraper that reads 1 kB and resets.
    with serve(Collector(help_text="x" * (8 << 20))) as server:
        get(server.port)  # rendered once, served from the cache from now on
        clients = 5
        for _ in range(clients):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.settimeout(5)
            sock.connect(("127.0.0.1", server.port))
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(1024).startswith(b"HTTP/1.1 200")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            gone = [r for r in logs.records if "went away" in r.getMessage()]
            if len(gone) >= clients:
                break
            time.sleep(0.05)
        assert len(gone) == clients, [r.getMessage() for r in logs.records]
        assert get(server.port, "/healthz")[0] == 200
    assert_no_traceback(logs, capfd)


def test_trickling_scrapers_are_cut_off_and_others_served(
    logs: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    limits = ServerLimits(request_timeout_s=0.5)
    request = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: */*\r\n\r\n"
    cut_after: list[float] = []

    def trickle() -> None:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            start = time.monotonic()
            for byte in request:  # 5 s for the whole request: never finished in time
                sock.sendall(bytes([byte]))
                sock.settimeout(0.1)
                try:
                    if sock.recv(100) == b"":
                        cut_after.append(time.monotonic() - start)
                        return
                except TimeoutError:
                    continue
                except OSError:
                    cut_after.append(time.monotonic() - start)
                    return

    with serve(Collector(), limits=limits) as server:
        threads = [threading.Thread(target=trickle) for _ in range(4)]
        for t in threads:
            t.start()
        for _ in range(5):
            start = time.monotonic()
            assert get(server.port)[0] == 200 and time.monotonic() - start < 0.5
            time.sleep(0.1)
        for t in threads:
            t.join(timeout=10)
    assert len(cut_after) == 4 and max(cut_after) < 0.5 + 1.5
    timeouts = [r for r in logs.records if "did not arrive within 0.5 s" in r.getMessage()]
    assert len(timeouts) == 4
    assert_no_traceback(logs, capfd)
