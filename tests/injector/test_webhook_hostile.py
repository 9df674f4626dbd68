"""The webhook against hostile and broken clients: every malformed request gets an HTTP answer and
no traceback, slow clients are cut off at one deadline per request, connections are bounded, and
annotation values that could not go into a pod spec are dropped with a warning.

The header and review cases run against the real ``fsdp-replay webhook`` processes of conftest.py;
the timing cases against a ``WebhookServer`` in this process with short limits, over the same TLS.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import ssl
import struct
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from email.message import Message
from typing import Any

import pytest
from injector_support import Tls, Webhook, admission_review, load, make_config, patched, validate_pod

from fsdp_replay.injector import server
from fsdp_replay.injector.server import BadHeaderError, ServerLimits, body_length

REQUEST_TIMEOUT_S = 1.0
LIMITS = ServerLimits(
    request_timeout_s=REQUEST_TIMEOUT_S, handshake_timeout_s=1.0, idle_timeout_s=3.0, max_connections=8
)
SLACK_S = 1.5  # scheduling on a loaded machine


def review_body(pod: Any) -> bytes:
    return json.dumps(admission_review(pod, str(uuid.uuid4()))).encode()


def tls_socket(port: int, context: ssl.SSLContext, timeout: float = 5.0) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    return context.wrap_socket(raw, server_hostname="127.0.0.1")


def exchange(port: int, context: ssl.SSLContext, data: bytes) -> tuple[int, bytes]:
    """Send ``data`` as it is over one TLS connection and read the one answer."""
    with tls_socket(port, context) as sock:
        sock.sendall(data)
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, response.read()


def post(headers: list[tuple[str, bytes]], body: bytes, path: str = "/mutate") -> bytes:
    lines = [f"POST {path} HTTP/1.1".encode(), b"Host: 127.0.0.1"]
    lines += [name.encode() + b": " + value for name, value in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


@pytest.fixture
def webhook(webhooks: dict[str, Webhook]) -> Iterator[Webhook]:
    """The 1.33 webhook process only (conftest's ``webhook`` is both); its log must hold no traceback
    from this test on."""
    hook = webhooks["1.33"]
    start = len(hook.log_text())
    yield hook
    text = hook.log_text()[start:]
    assert "Traceback" not in text, text[-3000:]


# -- headers, request lines and reviews, against the real process ---------------------------------
BODY = review_body(load("plain-pod"))


@pytest.mark.parametrize(
    ("headers", "status", "reason"),
    [
        ([("Content-Length", "²".encode("latin-1"))], 400, "is not a number of bytes"),
        ([("Content-Length", "²".encode())], 400, "is not a number of bytes"),
        ([("Content-Length", "٣".encode())], 400, "is not a number of bytes"),
        ([("Content-Length", b"-1")], 400, "is not a number of bytes"),
        ([("Content-Length", b"12abc")], 400, "is not a number of bytes"),
        ([("Content-Length", b"")], 400, "is not a number of bytes"),
        ([("Content-Length", b"9" * 5000)], 413, "too large"),
        ([("Content-Length", b"17000000")], 413, "too large"),
        ([], 411, "a Content-Length is required"),
        ([("Content-Length", b"5"), ("Content-Length", b"6")], 400, "different Content-Length"),
        ([("Transfer-Encoding", b"chunked")], 411, "not chunked"),
    ],
    ids=["superscript-latin1", "superscript-utf8", "arabic-digit", "negative", "non-numeric", "empty",
         "5000-digits", "over-the-bound", "missing", "two-lengths", "chunked"],
)  # fmt: skip
def test_bad_content_length_is_answered(
    webhook: Webhook, headers: list[tuple[str, bytes]], status: int, reason: str
) -> None:
    # No body: one the server does not read could turn its close into a reset before the answer is read.
    got, text = exchange(webhook.port, webhook.context, post(headers, b""))
    assert (got, reason in text.decode()) == (status, True), text
    assert webhook.request("GET", "/healthz")[0] == 200


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET http://[::1/mutate HTTP/1.1\r\nHost: x\r\n\r\n", 400),
        (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", 414),
        (b"GET /healthz HTTP/1.1\r\n" + b"X-A: b\r\n" * 120 + b"\r\n", 431),
        (b"GET /healthz HTTP/1.1\r\nX-Long: " + b"b" * 70000 + b"\r\n\r\n", 431),
        (b"GET /healthz HTTP/7.0\r\n\r\n", 505),
        (b"BREW /mutate HTTP/1.1\r\nHost: x\r\n\r\n", 501),
    ],
    ids=["garbage", "bad-target", "long-line", "many-headers", "long-header", "http-7", "unknown-method"],
)
def test_malformed_request_line_and_headers_are_answered(
    webhook: Webhook, request_bytes: bytes, status: int
) -> None:
    assert exchange(webhook.port, webhook.context, request_bytes)[0] == status


@pytest.mark.parametrize(
    "metadata",
    [
        {"generateName": 5, "annotations": {"fsdp-replay.io/record": "true"}},
        {"generateName": ["a"], "namespace": {"x": 1}, "annotations": {"fsdp-replay.io/record": "true"}},
        {"name": "a\nINFO forged log line", "annotations": {"fsdp-replay.io/record": "true"}},
        {"name": 7, "annotations": "not a map"},
        {"annotations": {"fsdp-replay.io/record": ["true"]}},
        {"annotations": {"fsdp-replay.io/record": "true", "fsdp-replay.io/store": {"a": 1}}},
    ],
    ids=[
        "numeric-generateName",
        "list-generateName",
        "newline-name",
        "numeric-name",
        "list-record",
        "map-store",
    ],
)
def test_weird_pod_in_a_well_formed_review_is_allowed(webhook: Webhook, metadata: Any) -> None:
    pod = load("plain-pod")
    pod["metadata"] = metadata
    start = len(webhook.log_text())
    response = webhook.review(pod)  # HTTP 200, the uid echoed
    assert response["allowed"] is True
    assert "\nINFO forged" not in webhook.log_text()[start:]  # the name's newline is escaped


@pytest.mark.parametrize(
    ("annotation", "value", "why"),
    [
        ("store", "s3://bucket/x\x00y", "control character (U+0000"),
        ("store", "s3://bucket/x\ny", "control character (U+000A"),
        ("store", "s3://bucket/" + "x" * 3000, "longer than 2048 characters"),
        ("snapshot-every", "1" * 100_000, "longer than 1024 characters"),
        ("payloads", "all\x00", "control character"),
        ("cupti", "always\x1b[31m", "control character (U+001B"),
        ("containers", "trainer\x00", "control character"),
        ("store-secret", "creds\u2028", "control character (U+2028"),
        ("metrics-port", "9465\x00", "control character"),
        ("reserve-bytes", "1\x85", "control character (U+0085"),
    ],
)
def test_hostile_annotation_values_are_dropped_with_a_warning(
    webhook: Webhook, annotation: str, value: str, why: str
) -> None:
    pod = load("plain-pod")
    pod["metadata"]["annotations"][f"fsdp-replay.io/{annotation}"] = value
    response = webhook.review(pod)
    out = patched(pod, response)
    validate_pod(out, "1.33")
    (warning,) = [w for w in response["warnings"] if f"fsdp-replay.io/{annotation}" in w]
    assert why in warning and len(warning) < 300
    # Nothing of the value reached a container: the default applies (the pod's own annotation stays).
    containers = out["spec"]["containers"] + out["spec"].get("initContainers", [])
    spec_text = json.dumps(containers)
    assert "\\u0000" not in spec_text and "\\n" not in spec_text and "x" * 1025 not in spec_text
    assert "\\u2028" not in spec_text and "\\u0085" not in spec_text and "\\u001b" not in spec_text
    sidecar = next(c for c in containers if c["name"] == "fsdp-replay-sidecar")
    assert sidecar["ports"][0]["containerPort"] == 9464


def test_hostile_record_value_is_not_recorded(webhook: Webhook) -> None:
    for value in ("true\x00", "t" * 100_000):
        pod = load("plain-pod")
        pod["metadata"]["annotations"]["fsdp-replay.io/record"] = value
        response = webhook.review(pod, server.NAMESPACE_DEFAULT_PATH)
        assert "patch" not in response
        (warning,) = response["warnings"]
        assert "neither true nor false" in warning and len(warning) < 300


def test_body_length_is_strict() -> None:
    def headers(*pairs: tuple[str, str]) -> Message:
        message = Message()
        for name, value in pairs:
            message[name] = value
        return message

    assert body_length(headers(("Content-Length", "0042")), 100) == 42
    assert body_length(headers(("Content-Length", "7"), ("Content-Length", " 7")), 100) == 7
    for value in ("²", "٣", "+1", "1_0", "0x10", " ", "1 2"):
        with pytest.raises(BadHeaderError) as e:
            body_length(headers(("Content-Length", value)), 100)
        assert e.value.status == 400
    with pytest.raises(BadHeaderError) as e:
        body_length(headers(("Content-Length", "101")), 100)
    assert e.value.status == 413


# -- time and connections, against a server in this process with short limits ---------------------
@dataclass
class LocalWebhook:
    server: server.WebhookServer
    context: ssl.SSLContext

    @property
    def port(self) -> int:
        return self.server.port

    def review(self, timeout: float = 5.0) -> float:
        """Seconds a well-formed review of plain-pod took (it must succeed)."""
        start = time.monotonic()
        conn = http.client.HTTPSConnection("127.0.0.1", self.port, context=self.context, timeout=timeout)
        try:
            conn.request("POST", "/mutate", BODY, {"Content-Type": "application/json"})
            response = conn.getresponse()
            assert response.status == 200 and json.loads(response.read())["response"]["allowed"] is True
        finally:
            conn.close()
        return time.monotonic() - start


@pytest.fixture
def local(tls: Tls, caplog: pytest.LogCaptureFixture) -> Iterator[LocalWebhook]:
    caplog.set_level(logging.DEBUG, logger="fsdp_replay.injector")
    config = make_config(
        tls_cert_file=str(tls.cert), tls_key_file=str(tls.key), listen_address="127.0.0.1", port=0
    )
    webhook = server.make_server(config, LIMITS)
    thread = threading.Thread(target=webhook.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield LocalWebhook(webhook, ssl.create_default_context(cafile=str(tls.ca)))
    finally:
        webhook.shutdown()
        webhook.server_close()
        thread.join(timeout=5)
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"


def healthz(sock: ssl.SSLSocket) -> None:
    """One request and its answer on a kept-alive connection."""
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    response = http.client.HTTPResponse(sock)
    response.begin()
    assert (response.status, response.read()) == (200, b"ok\n")


def trickle(sock: ssl.SSLSocket, data: bytes, every_s: float, give_up_s: float) -> tuple[float, bytes]:
    """Send ``data`` a byte at a time until the server answers or closes; (seconds, what it said)."""
    start = time.monotonic()
    for byte in data:
        if time.monotonic() - start > give_up_s:
            break
        try:
            sock.sendall(bytes([byte]))
            sock.settimeout(every_s)
            answer = sock.recv(4096)
        except TimeoutError:
            continue
        except OSError:  # reset: cut off without an answer
            return time.monotonic() - start, b""
        return time.monotonic() - start, answer
    raise AssertionError(f"still not cut off after {time.monotonic() - start:.1f} s")


@pytest.mark.parametrize("part", ["headers", "body"])
def test_slow_clients_are_cut_off_and_others_still_served(
    local: LocalWebhook, caplog: pytest.LogCaptureFixture, part: str
) -> None:
    head = post([("Content-Length", str(len(BODY)).encode())], b"")
    results: list[tuple[float, bytes]] = []
    errors: list[BaseException] = []

    def slow_client() -> None:
        try:
            with tls_socket(local.port, local.context) as sock:
                if part == "body":
                    sock.sendall(head)
                results.append(trickle(sock, head if part == "headers" else BODY, 0.2, give_up_s=6.0))
        except BaseException as e:
            errors.append(e)

    clients = [threading.Thread(target=slow_client) for _ in range(4)]
    for t in clients:
        t.start()
    times: list[float] = []
    deadline = time.monotonic() + REQUEST_TIMEOUT_S + 0.5
    while time.monotonic() < deadline and len(times) < 20:  # meanwhile, reviews are answered at once
        times.append(local.review())
        time.sleep(0.05)
    for t in clients:
        t.join(timeout=10)
    assert not errors and len(results) == 4
    for elapsed, answer in results:
        assert elapsed < REQUEST_TIMEOUT_S + SLACK_S
        assert answer == b"" or answer.startswith(b"HTTP/1.1 408 ")
    assert max(times) < 1.0
    lines = [r.getMessage() for r in caplog.records if "did not arrive within 1 s" in r.getMessage()]
    assert len(lines) == 4


def test_silent_and_vanishing_clients_are_logged_in_one_line(
    local: LocalWebhook, caplog: pytest.LogCaptureFixture
) -> None:
    # No TLS hello at all: the handshake times out.
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", local.port), timeout=5) as raw:
        assert raw.recv(100) == b""
    assert time.monotonic() - start < LIMITS.handshake_timeout_s + SLACK_S
    # After a first request (the TLS handshake is long done), half a body, then the client is gone...
    with tls_socket(local.port, local.context) as sock:
        healthz(sock)
        sock.sendall(post([("Content-Length", b"1000")], b"{" * 10))
    # ... or resets the connection in the middle of the headers.
    sock = tls_socket(local.port, local.context)
    healthz(sock)
    sock.sendall(b"POST /mutate HTTP/1.1\r\nContent-")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        gone = [r.getMessage() for r in caplog.records if "went away" in r.getMessage()]
        if len(gone) >= 2:
            break
        time.sleep(0.05)
    handshakes = [r.getMessage() for r in caplog.records if "TLS handshake" in r.getMessage()]
    assert len(handshakes) == 1 and "timed out" in handshakes[0]
    assert len(gone) == 2 and "went away after 10 of 1000 bytes" in gone[0], gone
    assert local.review() < 1.0


def test_connections_beyond_the_bound_are_refused_without_a_thread(
    local: LocalWebhook, caplog: pytest.LogCaptureFixture
) -> None:
    held = [tls_socket(local.port, local.context) for _ in range(LIMITS.max_connections)]
    try:
        for _ in range(5):
            start = time.monotonic()
            with pytest.raises((ssl.SSLError, OSError)):
                tls_socket(local.port, local.context).close()
            assert time.monotonic() - start < 1.0
        workers = [t for t in threading.enumerate() if "process_request_thread" in t.name]
        assert len(workers) <= LIMITS.max_connections
    finally:
        for sock in held:
            sock.close()
    refused = [r for r in caplog.records if "refused" in r.getMessage()]
    assert 1 <= len(refused) <= 2 and "refused 1 connection(s)" in refused[0].getMessage()
    deadline = time.monotonic() + 5
    while True:  # the held connections' threads end as their sockets close
        try:
            assert local.review() < 1.0
            break
        except (ssl.SSLError, OSError):
            assert time.monotonic() < deadline, "no slot came free"
            time.sleep(0.05)
