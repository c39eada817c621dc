"""One HTTP exchange with a whole-request deadline and a body cap: what every HTTP kind sends through.

A client's read timeout bounds each read, not the request: a server that drips a byte a second (of its
status line, its headers or its body) would hold a probe, and with it a ``check`` or the daemon's stop, for
as long as it likes. Here the deadline covers connect, send and every read, whatever the server does:

* every socket operation of the request gets at most what is left of the deadline as its timeout (a
  `NetworkBackend` wrapping the one `httpx2` uses: its pools hand each connection's I/O to it, pooled
  connections included, on the calling thread);
* at the deadline, one watchdog thread shuts down the socket an operation of the request is blocked on,
  for what a single operation could stretch (a write loop, a TLS handshake through a proxy);
* the body is read in chunks as they arrive and never beyond ``max_bytes`` (plus the chunk that crossed
  it); gzip and deflate bodies are inflated under the same cap, 64 KiB at a time (a 50 kB gzip bomb of
  50 MB costs the cap, not 50 MB). An error answer (not 2xx) is read for its message only: its first
  `ERROR_BODY_BYTES`, so that a 503 with a huge page stays a 503.

Name resolution is the one step outside it (the system resolver's own timeouts bound it).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import heapq
import itertools
import socket
import threading
import time
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpcore2
import httpx2
from httpcore2 import NetworkBackend, NetworkStream

if TYPE_CHECKING:
    import ssl
    from collections.abc import Iterable

# The encodings the body reader inflates itself (under the cap); a client must not offer others.
ACCEPT_ENCODING = "gzip, deflate"
INFLATE_STEP = 64 * 1024  # bytes inflated at a time: a bomb costs the cap plus this, never more
ERROR_BODY_BYTES = 64 * 1024  # what is read of an error answer's body (its message is in the first bytes)


class DeadlinePassed(Exception):
    """The request did not finish within its deadline (`ErrorKind.TIMEOUT`)."""


class TooLarge(Exception):
    """The response body passed the cap (`ErrorKind.TOO_LARGE`); it was not read further."""


class BadEncoding(Exception):
    """A Content-Encoding the reader does not inflate, or a body that does not inflate."""


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    headers: httpx2.Headers
    body: bytes  # inflated
    request: httpx2.Request
    encoding: str  # the text encoding the response declares (or httpx2's default)

    @property
    def text(self) -> str:
        return self.body.decode(self.encoding, errors="replace")


class Deadline:
    """One request's deadline, shared by every socket operation the request makes on this thread."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.monotonic() + seconds
        self.received = 0  # bytes read from the network so far (headers included)
        self._lock = threading.Lock()
        self._blocked: socket.socket | None = None  # the socket an operation is blocked on, if any
        self._expired = False
        self.done = False  # the request ended: the watchdog skips it

    @property
    def passed(self) -> bool:
        return self._expired or time.monotonic() >= self.at

    def describe(self) -> str:
        return f"deadline of {self.seconds:g}s passed after {self.received} bytes"

    def left(self, timeout: float | None, error: type[Exception]) -> float:
        """``timeout`` clamped to what is left; ``error`` when nothing is."""
        left = self.at - time.monotonic()
        if left <= 0 or self._expired:
            raise error(self.describe())
        return left if timeout is None else min(timeout, left)

    def block(self, sock: socket.socket | None) -> None:
        """Mark ``sock`` as the one to shut down if the deadline passes before `unblock`."""
        with self._lock:
            self._blocked = sock

    def unblock(self) -> None:
        with self._lock:
            self._blocked = None

    def _expire(self) -> None:
        with self._lock:  # under the lock: never a socket already handed back to the pool
            self._expired = True
            if self._blocked is not None:  # the TCP socket's own shutdown (a TLS one's would drop its state)
                with contextlib.suppress(OSError):
                    socket.socket.shutdown(self._blocked, socket.SHUT_RDWR)

    def __enter__(self) -> Deadline:
        self._token = _CURRENT.set(self)
        _WATCHDOG.watch(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.done = True
        with self._lock:
            self._blocked = None
        _CURRENT.reset(self._token)


class _Watchdog:
    """One thread that expires every request's deadline when it passes: a timer thread per request cost
    more CPU than the request it guarded. Deadlines wait in a heap; one that ended is dropped when its
    time comes (at most a request's ``timeout_s`` later)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._heap: list[tuple[float, int, Deadline]] = []
        self._count = itertools.count()  # ties in time are settled by arrival, never by comparing deadlines
        self._thread: threading.Thread | None = None

    def watch(self, deadline: Deadline) -> None:
        with self._cv:
            heapq.heappush(self._heap, (deadline.at, next(self._count), deadline))
            if self._thread is None or not self._thread.is_alive():  # first use, or a forked child
                self._thread = threading.Thread(target=self._run, name="canaryd-deadlines", daemon=True)
                self._thread.start()
            elif self._heap[0][2] is deadline:  # sooner than what the thread waits for
                self._cv.notify()

    def _run(self) -> None:
        with self._cv:
            while True:
                now = time.monotonic()
                while self._heap and (self._heap[0][2].done or self._heap[0][0] <= now):
                    _, _, deadline = heapq.heappop(self._heap)
                    if not deadline.done:
                        deadline._expire()
                self._cv.wait(self._heap[0][0] - now if self._heap else None)


_WATCHDOG = _Watchdog()
_CURRENT: contextvars.ContextVar[Deadline | None] = contextvars.ContextVar("canaryd_deadline", default=None)


class _Stream(NetworkStream):
    """A connection's stream: inside a request's deadline, every operation is bounded by it. (Each read
    and write marks its socket by hand, not through a context manager: a probe makes several of them.)"""

    def __init__(self, inner: NetworkStream) -> None:
        self._inner = inner
        self._sock = inner.get_extra_info("socket")  # the TCP socket the watchdog shuts down

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        d = _CURRENT.get()
        if d is None:
            return self._inner.read(max_bytes, timeout)
        timeout = d.left(timeout, httpcore2.ReadTimeout)
        d.block(self._sock)
        try:
            data = self._inner.read(max_bytes, timeout)
        finally:
            d.unblock()
        d.received += len(data)
        return data

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        d = _CURRENT.get()
        if d is None:
            return self._inner.write(buffer, timeout)
        timeout = d.left(timeout, httpcore2.WriteTimeout)
        d.block(self._sock)
        try:
            self._inner.write(buffer, timeout)
        finally:
            d.unblock()
        return None

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> NetworkStream:
        d = _CURRENT.get()
        if d is None:
            return _Stream(self._inner.start_tls(ssl_context, server_hostname, timeout))
        timeout = d.left(timeout, httpcore2.ConnectTimeout)
        d.block(self._sock)
        try:
            return _Stream(self._inner.start_tls(ssl_context, server_hostname, timeout))
        finally:
            d.unblock()

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _Backend(NetworkBackend):
    """httpx2's network backend, with connect bounded by the deadline and streams that are too."""

    def __init__(self, inner: NetworkBackend) -> None:
        self._inner = inner

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> NetworkStream:
        d = _CURRENT.get()
        if d is not None:
            timeout = d.left(timeout, httpcore2.ConnectTimeout)
        return _Stream(self._inner.connect_tcp(host, port, timeout, local_address, socket_options))

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> NetworkStream:
        d = _CURRENT.get()
        if d is not None:
            timeout = d.left(timeout, httpcore2.ConnectTimeout)
        return _Stream(self._inner.connect_unix_socket(path, timeout, socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


@functools.cache
def tls_context() -> ssl.SSLContext:
    """The default TLS context (system CAs, or ``SSL_CERT_FILE``/``SSL_CERT_DIR``), built once per process
    and shared by every client: loading the CA bundle cost about 50 ms of CPU per client, more than a
    whole ``canaryd check`` of a dozen canaries spends on everything else."""
    return httpx2.create_ssl_context()


def client(
    *, timeout_s: float, connect_timeout_s: float, connections: int, headers: dict[str, str]
) -> httpx2.Client:
    """An `httpx2.Client` (environment proxies and CA settings honoured, as before) whose connections
    obey the deadline of `exchange`. httpx2 exposes no network-backend option, so the backend of each pool
    the client built is wrapped in place; if that ever stops working, this fails loudly, not silently."""
    http = httpx2.Client(
        verify=tls_context(),
        timeout=httpx2.Timeout(timeout_s, connect=min(connect_timeout_s, timeout_s)),
        limits=httpx2.Limits(max_connections=connections),
        headers={"Accept-Encoding": ACCEPT_ENCODING, **headers},
    )
    transports = [http._transport, *(t for t in http._mounts.values() if t is not None)]
    for transport in transports:
        pool = getattr(transport, "_pool", None)
        inner = getattr(pool, "_network_backend", None)
        if not isinstance(inner, NetworkBackend):
            http.close()
            raise RuntimeError(f"cannot bound requests by a deadline with this httpx2 ({httpx2.__version__})")
        pool._network_backend = _Backend(inner)  # type: ignore[union-attr]
    return http


def exchange(
    http: httpx2.Client, method: str, url: str, *, timeout_s: float, max_bytes: int, **kwargs: Any
) -> Reply:
    """Send one request and read its body, within ``timeout_s`` and ``max_bytes``: the whole body of a 2xx
    answer, the first `ERROR_BODY_BYTES` of another.

    Raises `DeadlinePassed`, `TooLarge`, `BadEncoding`, or httpx2's `TransportError` (refused, reset, cut)."""
    with Deadline(timeout_s) as deadline:
        try:
            with http.stream(method, url, **kwargs) as r:
                ok = 200 <= r.status_code < 300
                cap = max_bytes if ok else min(max_bytes, ERROR_BODY_BYTES)
                declared = r.headers.get("content-length", "")
                if ok and declared.isdigit() and int(declared) > cap:
                    raise TooLarge(f"body of {declared} bytes announced, over the {cap}-byte cap")
                body = _Body(cap)
                try:
                    body.encoded(r.headers.get("content-encoding"))
                    for chunk in r.iter_raw():  # each as it arrives (at most 64 KiB)
                        body.add(chunk)
                        if deadline.passed:
                            raise DeadlinePassed(deadline.describe())
                except (TooLarge, BadEncoding):
                    if ok:
                        raise
                    del body[cap:]  # enough of an error answer for its message
                return Reply(r.status_code, r.headers, bytes(body), r.request, r.encoding or "utf-8")
        except httpx2.TransportError:
            if deadline.passed:  # however the blocked operation ended (timeout, or its socket shut down)
                raise DeadlinePassed(deadline.describe()) from None
            raise


class _Body(bytearray):
    """A response body as it arrives, inflated (gzip, deflate) 64 KiB at a time, never past the cap."""

    def __init__(self, cap: int) -> None:
        super().__init__()
        self.cap = cap
        self.coding = "identity"
        self._z: Any = None

    def encoded(self, encoding: str | None) -> None:
        """The response's Content-Encoding (before the first `add`)."""
        self.coding = (encoding or "identity").strip().lower()
        if self.coding in ("gzip", "x-gzip", "deflate"):
            self._z = zlib.decompressobj(zlib.MAX_WBITS | 32)  # a gzip or zlib header, detected
        elif self.coding not in ("", "identity"):
            raise BadEncoding(f"unsupported content-encoding {encoding!r}")

    def add(self, raw: bytes) -> None:
        if self._z is None:
            self.extend(raw)
        else:
            try:
                while len(self) <= self.cap:
                    piece = self._z.decompress(raw, INFLATE_STEP)
                    self.extend(piece)
                    raw = self._z.unconsumed_tail
                    if not raw and len(piece) < INFLATE_STEP:  # all in, and nothing held back
                        break
            except zlib.error as e:
                raise BadEncoding(f"{self.coding} body does not inflate ({e})") from None
        if len(self) > self.cap:
            raise TooLarge(f"body passed the {self.cap}-byte cap (not read further)")
