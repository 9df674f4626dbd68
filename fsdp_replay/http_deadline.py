"""Reading an HTTP request with one deadline, for the project's two small servers (the webhook and
the sidecar's ``/metrics``), which the layering keeps apart.

A timeout per ``recv`` does not stop a client that trickles a byte every few seconds; a deadline
per request does. The clock starts with a request's first byte (before it, the idle timeout of a
kept-alive connection applies) and covers its line, headers and body; ``next_request()`` restarts
it. ``http.server``'s handlers read through it as their ``rfile`` (wrapped in a BufferedReader).
"""

from __future__ import annotations

import io
import logging
import socket
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any


class ClientTimeout(Exception):
    """The client took too long: ``idle`` between requests, else inside one."""

    def __init__(self, message: str, *, idle: bool) -> None:
        super().__init__(message)
        self.idle = idle


class RequestReader(io.RawIOBase):
    """The connection's bytes, with one deadline per request rather than a timeout per read."""

    def __init__(self, sock: socket.socket, *, idle_timeout_s: float, request_timeout_s: float) -> None:
        super().__init__()
        self._sock = sock
        self._idle_s = idle_timeout_s
        self._request_s = request_timeout_s
        self._deadline: float | None = None
        self.eof = False
        """The client closed its side: what was read since it wanted more is all there is."""

    def next_request(self) -> None:
        self._deadline = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if self._deadline is None:
            self._sock.settimeout(self._idle_s)
        else:
            remaining = self._deadline - time.monotonic()
            if remaining <= 0:
                raise self._timeout()
            self._sock.settimeout(remaining)
        try:
            n = self._sock.recv_into(buffer)
        except TimeoutError:
            raise self._timeout() from None
        if n and self._deadline is None:
            self._deadline = time.monotonic() + self._request_s
        self.eof = n == 0
        return n

    def _timeout(self) -> ClientTimeout:
        if self._deadline is None:
            return ClientTimeout(f"idle for {self._idle_s:g} s", idle=True)
        return ClientTimeout(f"the request did not arrive within {self._request_s:g} s", idle=False)


class DeadlineRequestHandler(BaseHTTPRequestHandler):
    """``BaseHTTPRequestHandler`` reading through a :class:`RequestReader` (the server has
    ``limits.idle_timeout_s`` and ``limits.request_timeout_s``), with every way a client can fail
    answered or logged in one line, never a traceback."""

    protocol_version = "HTTP/1.1"  # keep-alive: clients reuse their connections
    # What an unparsable request line is answered as: with a status line (HTTP/0.9 has none).
    default_request_version = "HTTP/1.1"
    max_request_line_bytes = 8192
    log: logging.Logger = logging.getLogger(__name__)
    client_noun = ""  # how the log names a client ("scraper "), before its address

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # the plain makefile() reader, replaced by one with a deadline
        limits = self.server.limits  # type: ignore[attr-defined]
        self._reader = RequestReader(
            self.connection, idle_timeout_s=limits.idle_timeout_s, request_timeout_s=limits.request_timeout_s
        )
        self.rfile = io.BufferedReader(self._reader)

    def timed_out(self, e: ClientTimeout) -> None:
        """A request that did not arrive in time (the connection is closing): answer it if wanted."""

    def handle_one_request(self) -> None:
        self._reader.next_request()
        who = f"{self.client_noun}{self.client_address[0]}"
        try:
            self.raw_requestline = self.rfile.readline(self.max_request_line_bytes + 1)
            if not self.raw_requestline:
                self.close_connection = True
                return
            if len(self.raw_requestline) > self.max_request_line_bytes:
                self.requestline = self.request_version = self.command = ""
                self.send_error(HTTPStatus.REQUEST_URI_TOO_LONG)
                return
            if not self.parse_request():
                return  # parse_request answered it (400, 431, 505)
            if self._reader.eof:  # parse_headers takes an end of file for the end of the headers
                self.close_connection = True
                self.log.info("%s went away in the middle of its request's headers", who)
                return
            method = getattr(self, f"do_{self.command}", None)
            if method is None:
                self.send_error(HTTPStatus.NOT_IMPLEMENTED, f"unsupported method {self.command!r}")
                return
            method()
            self.wfile.flush()
        except ClientTimeout as e:
            self.close_connection = True
            if e.idle:
                self.log.debug("%s: %s: connection closed", who, e)
                return
            self.log.info("%s: %s: connection closed", who, e)
            self.timed_out(e)
        except OSError as e:  # reset, broken pipe, a TLS error, a write timeout: the client went away
            self.close_connection = True
            self.log.info("%s went away: %s: %s", who, type(e).__name__, e)
