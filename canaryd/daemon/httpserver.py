"""The metrics listener: ``/metrics``, ``/runbook`` (and a small index on ``/``), bounded threads and time.

``/metrics`` returns the bytes `canaryd.daemon.metrics.Metrics` rendered after the last probe pass (plus
canaryd's own few live series), never a render of every series per scrape; ``/runbook`` serves the runbook
shipped with this version (the alert rules link to it), as minimal HTML with an anchor per heading, and
``/runbook.md`` the markdown itself.

prometheus_client's ``start_http_server`` starts a thread per connection and never times an idle one out:
500 idle connections meant 505 threads, and many concurrent scrapers made scrapes fail. Here:

* a connection costs no thread until its whole request head has arrived: one watcher thread holds every
  waiting connection in a selector and reads what they send without blocking; one that has not sent a
  complete head within ``timeout_s`` (idle, or dripping bytes) is closed, and at most ``max_waiting`` wait
  at once (past that, the longest-waiting is closed to make room);
* a complete request is answered by one of at most ``max_handlers`` handler threads (started on demand,
  gone when there is nothing to answer); with all of them busy it waits in a queue of ``max_queued`` (a
  scrape takes milliseconds, so a crowd of scrapers is served in turn), and past that it gets ``503`` (with
  ``Retry-After``) at once; a response must be sent within ``timeout_s`` too, so a client that stops
  reading cannot hold a handler;
* one request per connection (HTTP/1.0 semantics, as prometheus_client's server), so no kept-alive
  connection holds anything between scrapes;
* with a web configuration (`canaryd.daemon.webconfig`: TLS, client certificates, basic auth), the
  watcher also runs each connection's TLS handshake without blocking, inside the same ``timeout_s``, and
  a handler answers ``401`` before anything else to a request without valid credentials. Each kind of
  refusal (plain HTTP to the TLS port, no client certificate, a wrong password …) is logged once.

The interface is ``http.server``'s: serve with ``serve_forever()`` (in a thread of its own), stop with
``shutdown()``, which here also closes the listening socket and every waiting connection.
"""

from __future__ import annotations

import contextlib
import gzip
import html
import io
import re
import resource
import selectors
import socket
import socketserver
import ssl
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.resources import files
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from canaryd.daemon.webconfig import Refusals, WebConfig, handshake_refusal

MAX_HANDLERS = 8  # requests answered at once; a scrape takes milliseconds
MAX_QUEUED = 256  # complete requests waiting for a handler; more get 503 at once
MAX_WAITING = 512  # connections waiting for their request head (file descriptors, not threads)
TIMEOUT_S = 10.0  # to send a request head, and to take the response
MAX_HEAD = 16 << 10  # bytes of request line and headers

INDEX = b"""<!doctype html>
<html><head><title>canaryd</title></head>
<body><h1>canaryd</h1><p>Known-answer canaries for LLM serving stacks.</p>
<p><a href="/metrics">Metrics</a> &middot; <a href="/runbook">Runbook</a></p></body></html>
"""
_END = b"Content-Length: 0\r\nConnection: close\r\n\r\n"
_BUSY = b"HTTP/1.0 503 Service Unavailable\r\nRetry-After: 1\r\n" + _END
_TOO_LARGE = b"HTTP/1.0 431 Request Header Fields Too Large\r\n" + _END
_UNAUTHORIZED = b'HTTP/1.0 401 Unauthorized\r\nWWW-Authenticate: Basic realm="canaryd"\r\n' + _END


class Exposition(Protocol):
    """What ``/metrics`` serves: a body (gzipped if asked) and its content type for an Accept header."""

    def exposition(self, accept: str = "", gzipped: bool = False) -> tuple[bytes, str]: ...


class RegistryExposition:
    """A plain registry rendered on every scrape (tools and tests; the daemon serves `Metrics`' cache)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def exposition(self, accept: str = "", gzipped: bool = False) -> tuple[bytes, str]:
        encoder, content_type = choose_encoder(accept)
        body = encoder(self.registry)
        return (gzip.compress(body) if gzipped else body), content_type


def runbook_markdown() -> bytes:
    """The runbook shipped with this version: package data ``canaryd/_shipped/docs/runbook.md`` (a symlink
    to ``docs/runbook.md`` in a checkout, the file itself in a wheel), else the checkout's ``docs/``."""
    shipped = files("canaryd") / "_shipped" / "docs" / "runbook.md"
    checkout = Path(__file__).resolve().parents[2] / "docs" / "runbook.md"
    for source in (shipped, checkout):
        try:
            return source.read_bytes()
        except OSError:
            continue
    # an install that lost it must still serve metrics (and not blame the listen address)
    return b"# canaryd runbook\n\nThis installation has no runbook: see `canaryd ops export`.\n"


def anchor(heading: str) -> str:
    """A heading's anchor as GitHub makes it (lowercase, punctuation dropped, spaces to hyphens)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def runbook_html(markdown: str) -> bytes:
    """Minimal HTML: each heading an ``<hN id=anchor>`` (the alerts' ``runbook_url`` anchors), the text
    between them preformatted, escaped (a ``#`` line inside a fenced code block stays text)."""
    out, text = (
        ["<!doctype html>\n<html><head><meta charset=utf-8><title>canaryd runbook</title></head><body>"],
        [],
    )
    fenced = False

    def flush() -> None:
        if "".join(text).strip():
            out.append(
                '<pre style="white-space: pre-wrap">' + html.escape("".join(text).strip("\n")) + "</pre>"
            )
        text.clear()

    for line in markdown.splitlines(keepends=True):
        fenced ^= line.startswith("```")
        m = None if fenced else re.match(r"(#{1,6})\s+(.+?)\s*#*\s*$", line)
        if m:
            flush()
            n, title = len(m.group(1)), m.group(2)
            out.append(f'<h{n} id="{html.escape(anchor(title))}">{html.escape(title)}</h{n}>')
        else:
            text.append(line)
    flush()
    return ("\n".join(out) + "\n</body></html>\n").encode()


@dataclass
class _Waiting:
    address: tuple
    deadline: float
    head: bytearray = field(default_factory=bytearray)
    handshaking: bool = False  # a TLS connection whose handshake has not completed


class MetricsServer(ThreadingHTTPServer):
    """Serves metrics (`Metrics`' cache, or a registry) and the runbook with bounded threads, connections
    and time (see the module docstring)."""

    daemon_threads = True
    request_queue_size = 128  # the listen backlog (socketserver's default of 5 drops bursts of scrapers)

    def __init__(
        self,
        address: tuple[str, int],
        source: Exposition | CollectorRegistry,
        *,
        max_handlers: int = MAX_HANDLERS,
        max_queued: int = MAX_QUEUED,
        max_waiting: int = MAX_WAITING,
        timeout_s: float = TIMEOUT_S,
        web: WebConfig | None = None,
    ) -> None:
        host, port = address
        # IPv6 listen addresses work too (``[::1]:9464``); raises OSError (socket.gaierror) for a bad host.
        self.address_family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0][0]
        self.source = RegistryExposition(source) if isinstance(source, CollectorRegistry) else source
        markdown = runbook_markdown()
        self.runbook_md, self.runbook_html = markdown, runbook_html(markdown.decode("utf-8", "replace"))
        self.timeout_s = timeout_s
        self.web, self.refusals = web, Refusals()
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        self.max_waiting = max(8, min(max_waiting, (soft // 2) if soft > 0 else max_waiting))
        self.max_handlers, self.max_queued = max_handlers, max_queued
        self._handlers = 0  # handler threads running (under _lock, with _ready)
        self._ready: deque[tuple[socket.socket, bytes, tuple, float]] = deque()  # (conn, head, address, due)
        self._waiting: dict[socket.socket, _Waiting] = {}
        self._incoming: list[tuple[socket.socket, tuple]] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        try:
            super().__init__(address, _Handler)  # binds and listens: OSError when the address is in use
        except BaseException:
            self._close_watcher_resources()
            raise
        for s in (self._wake_r, self._wake_w):
            s.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._watcher = threading.Thread(target=self._watch, name="metrics-waiting", daemon=True)
        self._watcher.start()

    def server_bind(self) -> None:
        """Bind without `HTTPServer`'s reverse DNS lookup of the address (``getfqdn`` can hang)."""
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), port

    # -- accepting: hand every connection to the watcher, at once ---------------------------------------
    def process_request(self, request, client_address) -> None:  # type: ignore[override]
        with self._lock:
            self._incoming.append((request, client_address))
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # a full wake-up pipe already wakes the watcher
            self._wake_w.send(b"\0")

    # -- the watcher: connections until their request head is complete ----------------------------------
    def _watch(self) -> None:
        while not self._closed.is_set():
            now = time.monotonic()
            first = min((w.deadline for w in self._waiting.values()), default=now + 1.0)
            for key, _ in self._selector.select(max(0.0, min(first - now, 1.0))):
                if key.fileobj is self._wake_r:
                    self._take_incoming()
                else:
                    self._read(key.fileobj)  # type: ignore[arg-type]
            now = time.monotonic()
            for conn in [c for c, w in self._waiting.items() if w.deadline <= now]:
                self._drop(conn)  # idle or too slow: no request head within timeout_s

    def _take_incoming(self) -> None:
        with contextlib.suppress(OSError):
            while self._wake_r.recv(4096):
                pass
        with self._lock:
            incoming, self._incoming = self._incoming, []
        for conn, address in incoming:
            if self._closed.is_set():
                self._close(conn)
                continue
            while len(self._waiting) >= self.max_waiting:  # make room: the longest-waiting goes
                self._drop(min(self._waiting, key=lambda c: self._waiting[c].deadline))
            conn.setblocking(False)
            tls = self.web is not None and self.web.tls is not None
            if tls:
                try:
                    conn = self.web.tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
                except OSError:
                    self._close(conn)
                    continue
            self._waiting[conn] = _Waiting(address, time.monotonic() + self.timeout_s, handshaking=tls)
            self._selector.register(conn, selectors.EVENT_READ)

    def _read(self, conn: socket.socket) -> None:
        waiting = self._waiting[conn]
        if waiting.handshaking and not self._shake(conn, waiting):
            return
        try:
            data = conn.recv(4096)
            while isinstance(conn, ssl.SSLSocket) and conn.pending() and len(data) <= MAX_HEAD:
                data += conn.recv(4096)  # decrypted bytes the selector cannot see
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return
        except OSError:
            data = b""
        if not data:  # the client went away
            self._drop(conn)
            return
        waiting.head += data
        end = _head_end(waiting.head)
        if end is None and len(waiting.head) <= MAX_HEAD:
            return
        self._selector.unregister(conn)
        del self._waiting[conn]
        if end is None:
            self._refuse(conn, _TOO_LARGE)
            return
        request = (conn, bytes(waiting.head[:end]), waiting.address, time.monotonic() + self.timeout_s)
        with self._lock:
            start = self._handlers < self.max_handlers
            if start:
                self._handlers += 1
            elif len(self._ready) < self.max_queued:
                self._ready.append(request)  # the next handler to finish takes it
                return
        if not start:
            self._refuse(conn, _BUSY)  # handlers busy and the queue full: say so now
            return
        try:
            threading.Thread(
                target=self._handle, args=(request,), name="metrics-request", daemon=True
            ).start()
        except BaseException:
            with self._lock:
                self._handlers -= 1
            self._close(conn)
            raise

    def _shake(self, conn: socket.socket, waiting: _Waiting) -> bool:
        """One step of a TLS handshake; True once it is done. A failed one is a refusal, logged once."""
        try:
            conn.do_handshake()  # type: ignore[attr-defined]
        except ssl.SSLWantWriteError:
            self._selector.modify(conn, selectors.EVENT_READ | selectors.EVENT_WRITE)
            return False
        except ssl.SSLWantReadError:
            self._selector.modify(conn, selectors.EVENT_READ)
            return False
        except ssl.SSLError as e:
            if not isinstance(e, ssl.SSLEOFError):  # EOF: a port check, or a client that gave up
                self.refusals.refused(handshake_refusal(e), waiting.address[0])
            self._drop(conn)
            return False
        except OSError:  # the client went away mid-handshake
            self._drop(conn)
            return False
        waiting.handshaking = False
        self._selector.modify(conn, selectors.EVENT_READ)
        return True

    def _drop(self, conn: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn)
        self._waiting.pop(conn, None)
        self._close(conn)

    def _refuse(self, conn: socket.socket, response: bytes) -> None:
        with contextlib.suppress(OSError):
            conn.send(response)  # non-blocking: a short reply fits the socket buffer, or is lost
        self._close(conn)

    @staticmethod
    def _close(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            conn.close()

    # -- a handler thread: requests, one at a time, until none is waiting ------------------------------
    def _handle(self, request: tuple[socket.socket, bytes, tuple, float]) -> None:
        while True:
            conn, head, address, due = request
            if time.monotonic() > due or self._closed.is_set():
                self._refuse(conn, _BUSY)  # queued too long: the scraper has likely given up
            else:
                self._answer(conn, head, address)
            with self._lock:
                if not self._ready:
                    self._handlers -= 1
                    return
                request = self._ready.popleft()

    def _answer(self, conn: socket.socket, head: bytes, address: tuple) -> None:
        try:
            conn.setblocking(True)
            if self.web is not None and (why := self.web.authorize(_authorization(head))) is not None:
                self.refusals.refused(why, address[0])
                conn.settimeout(self.timeout_s)
                conn.sendall(_UNAUTHORIZED)
                return
            self.finish_request((conn, head), address)  # type: ignore[arg-type]
        except Exception:
            pass  # a client that vanished or stopped reading; nothing to tell anyone
        finally:
            self._close(conn)

    # -- stopping -----------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop serving (as `socketserver.BaseServer.shutdown`) and close the listener and every waiting
        connection; requests being answered finish on their own."""
        super().shutdown()
        self.server_close()

    def server_close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        watcher = getattr(self, "_watcher", None)  # None: binding failed in __init__
        if watcher is not None:
            self._wake()
            watcher.join(timeout=5)
        super().server_close()
        for conn in list(self._waiting):
            self._drop(conn)
        with self._lock:
            incoming, self._incoming = self._incoming, []
            ready = [(conn, address) for conn, _, address, _ in self._ready]
            self._ready.clear()
        for conn, _ in incoming + ready:
            self._close(conn)
        self._close_watcher_resources()

    def _close_watcher_resources(self) -> None:
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()


def _authorization(head: bytes) -> str | None:
    """The request head's Authorization header (the last one, as http.client would read it)."""
    found = None
    for line in head.split(b"\n")[1:]:
        name, sep, value = line.partition(b":")
        if sep and name.strip().lower() == b"authorization":
            found = value.strip().decode("latin-1")
    return found


def _head_end(data: bytearray) -> int | None:
    """Where the request head ends (after its blank line), or None while it is incomplete."""
    for sep in (b"\r\n\r\n", b"\n\n"):
        i = data.find(sep)
        if i >= 0:
            return i + len(sep)
    return None


class _Writer(io.RawIOBase):
    """The handler's ``wfile``: the response must be sent within ``timeout_s`` of its first byte."""

    def __init__(self, conn: socket.socket, timeout_s: float) -> None:
        self.conn, self.timeout_s = conn, timeout_s
        self.deadline: float | None = None

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B")
        sent = 0
        if self.deadline is None:
            self.deadline = time.monotonic() + self.timeout_s
        while sent < len(view):
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the metrics client did not take the response in time")
            self.conn.settimeout(left)
            sent += self.conn.send(view[sent : sent + (1 << 16)])
        return sent


class _Handler(BaseHTTPRequestHandler):
    """One request whose head the watcher has read; answers ``/metrics``, ``/runbook`` and ``/``."""

    server: MetricsServer
    server_version = "canaryd"

    def setup(self) -> None:
        conn, head = self.request
        self.connection = conn
        self.rfile = io.BytesIO(head)
        self.wfile = _Writer(conn, self.server.timeout_s)

    def finish(self) -> None:
        self.rfile.close()

    def do_GET(self) -> None:
        self._respond(send_body=True)

    def do_HEAD(self) -> None:
        self._respond(send_body=False)

    def _respond(self, send_body: bool) -> None:
        path = urlsplit(self.path).path
        gzipped = False
        if path == "/metrics":
            # the exposition format the scraper asked for (Prometheus text or OpenMetrics)
            gzipped = "gzip" in self.headers.get("Accept-Encoding", "").lower()
            body, content_type = self.server.source.exposition(self.headers.get("Accept", ""), gzipped)
        elif path == "/runbook":
            body, content_type = self.server.runbook_html, "text/html; charset=utf-8"
        elif path == "/runbook.md":
            body, content_type = self.server.runbook_md, "text/markdown; charset=utf-8"
        elif path == "/":
            body, content_type = INDEX, "text/html; charset=utf-8"
        else:
            self.send_error(404, "Not Found: try /metrics or /runbook")
            return
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        if gzipped:
            self.send_header("Content-Encoding", "gzip")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # a scrape every few seconds is not worth a log line
