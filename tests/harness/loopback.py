"""A misbehaving OpenAI-compatible server on loopback, for the HTTP kinds' unit tests (no vLLM needed).

Raw sockets, one thread per connection, HTTP/1.1 keep-alive: the first path segment names what the server
does with a request (``{server.base("drip-body")}/chat/completions``), so one server serves every mode and a
client's pooled connection can meet several. Every request is recorded (method, path, headers, body).

Modes: ``ok`` (a chat or legacy completion body with logprobs; ``GET …/models``, ``…/version``, ``…/metrics``
and ``POST …/tokenize`` answer too), ``slow`` (the same, completions after ``delay_s``: a server's time per
probe; ``peak`` counts the most requests it held at once), ``gzip`` (the same, gzip-encoded), ``drip-body`` /
``drip-headers`` (one byte per ``drip_s``, forever), ``hang`` (reads the request, never answers), ``big`` (a
50 MB chunked body), ``big-declared`` (a 50 MB body announced by Content-Length), ``gzip-bomb`` (50 MB of
zeros, gzip-encoded: about 50 kB on the wire), ``429`` (Retry-After: 7), ``503``, ``503-big`` (with a 50 MB
page), ``401`` (echoes the Authorization header back), ``cut`` (half the announced body, then the connection
closes), ``badjson``.
"""

from __future__ import annotations

import functools
import gzip
import json
import socket
import threading
import time
import zlib
from dataclasses import dataclass

BIG = 50_000_000  # bytes a big body has (generated as it is sent, never held)
CHUNK = 64 * 1024


def chat_body(text: str = "42") -> dict:
    """A chat completion with logprobs, in the shape vLLM and OpenAI send."""
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "m",
        "system_fingerprint": "fp_loopback",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
                "logprobs": {
                    "content": [
                        {
                            "token": text,
                            "logprob": -0.01,
                            "bytes": list(text.encode()),
                            "top_logprobs": [
                                {"token": text, "logprob": -0.01},
                                {"token": "4", "logprob": -5.0},
                            ],
                        }
                    ]
                },
            }
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10},
    }


def completion_body(text: str = " blue") -> dict:
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "model": "m",
        "choices": [
            {
                "index": 0,
                "text": text,
                "finish_reason": "length",
                "logprobs": {"tokens": [text], "token_logprobs": [-0.1], "top_logprobs": [{text: -0.1}]},
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1},
    }


@functools.cache
def _bomb() -> bytes:
    z = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    return b"".join(z.compress(bytes(CHUNK)) for _ in range(BIG // CHUNK)) + z.flush()


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]  # lower-case names
    body: bytes
    at: float  # time.monotonic() when it had arrived whole


class Loopback:
    def __init__(self, drip_s: float = 1.0, delay_s: float = 0.2) -> None:
        self.drip_s = drip_s
        self.delay_s = delay_s
        self.in_flight = self.peak = 0
        self._counting = threading.Lock()
        self.requests: list[Request] = []
        self.stopping = threading.Event()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def base(self, mode: str) -> str:
        """A ``base_url`` whose requests get ``mode``."""
        return f"{self.url}/{mode}/v1"

    def close(self) -> None:
        self.stopping.set()
        self._thread.join(5)
        self._sock.close()

    def __enter__(self) -> Loopback:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing -----------------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(0.5)
        buf = b""
        try:
            while not self.stopping.is_set():
                while b"\r\n\r\n" not in buf:
                    try:
                        data = conn.recv(CHUNK)
                    except TimeoutError:
                        if self.stopping.is_set():
                            return
                        continue
                    if not data:
                        return
                    buf += data
                head, buf = buf.split(b"\r\n\r\n", 1)
                line, *fields = head.decode("latin-1").split("\r\n")
                method, path, _ = line.split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, v in (f.split(":", 1) for f in fields)}
                length = int(headers.get("content-length", 0))
                while len(buf) < length:
                    data = conn.recv(CHUNK)
                    if not data:
                        return
                    buf += data
                body, buf = buf[:length], buf[length:]
                self.requests.append(Request(method, path, headers, body, time.monotonic()))
                if not self._answer(conn, path, headers):
                    return
        except OSError:  # the client went away (it gave up on a drip, or took what it wanted)
            return
        finally:
            conn.close()

    def _wait(self, seconds: float) -> bool:
        """Sleep; False when the server is stopping."""
        return not self.stopping.wait(seconds)

    @staticmethod
    def _head(status: str, headers: dict[str, str]) -> bytes:
        lines = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in headers.items())]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def _send(self, conn: socket.socket, status: str, body: bytes, **headers: str) -> bool:
        h = {"Content-Type": "application/json", "Content-Length": str(len(body)), **headers}
        conn.sendall(self._head(status, {k.replace("_", "-"): v for k, v in h.items()}) + body)
        return True

    # -- the modes ----------------------------------------------------------------------------------
    def _answer(self, conn: socket.socket, path: str, headers: dict[str, str]) -> bool:
        """Answer one request; False closes the connection."""
        mode = path.split("/")[1]
        if mode == "slow" and path.endswith("completions"):
            with self._counting:
                self.in_flight += 1
                self.peak = max(self.peak, self.in_flight)
            try:
                self._wait(self.delay_s)
            finally:
                with self._counting:
                    self.in_flight -= 1
            return self._send(conn, "200 OK", json.dumps(self._document(path)).encode())
        if mode in ("ok", "gzip", "slow"):
            doc = self._document(path)
            if mode == "gzip":
                return self._send(
                    conn, "200 OK", gzip.compress(json.dumps(doc).encode()), Content_Encoding="gzip"
                )
            return self._send(conn, "200 OK", json.dumps(doc).encode())
        if mode == "drip-body":
            conn.sendall(
                self._head("200 OK", {"Content-Type": "application/json", "Content-Length": "100000"})
            )
            while self._wait(self.drip_s):
                conn.sendall(b" ")
            return False
        if mode == "drip-headers":
            conn.sendall(b"H")
            for byte in b"TTP/1.1 200 OK\r\n" + b"X-Pad: a\r\n" * 100_000:
                if not self._wait(self.drip_s):
                    return False
                conn.sendall(bytes([byte]))
            return False
        if mode == "hang":
            self.stopping.wait()
            return False
        if mode == "big":
            conn.sendall(
                self._head("200 OK", {"Content-Type": "application/json", "Transfer-Encoding": "chunked"})
            )
            chunk = b"%x\r\n" % CHUNK + b"x" * CHUNK + b"\r\n"
            conn.sendall(b'5\r\n{"a":\r\n')
            for _ in range(BIG // CHUNK):
                conn.sendall(chunk)
            conn.sendall(b"0\r\n\r\n")
            return False
        if mode == "big-declared":
            conn.sendall(
                self._head("200 OK", {"Content-Type": "application/json", "Content-Length": str(BIG)})
            )
            for _ in range(BIG // CHUNK):
                conn.sendall(b"x" * CHUNK)
            return False
        if mode == "gzip-bomb":
            return self._send(conn, "200 OK", _bomb(), Content_Encoding="gzip")
        if mode == "429":
            return self._send(
                conn, "429 Too Many Requests", b'{"error": {"message": "slow down"}}', Retry_After="7"
            )
        if mode == "503-big":  # a proxy's error page of 50 MB
            head = {"Content-Type": "text/html", "Content-Length": str(BIG)}
            conn.sendall(self._head("503 Service Unavailable", head) + b"<html>overloaded")
            for _ in range(BIG // CHUNK):
                conn.sendall(b"x" * CHUNK)
            return False
        if mode == "503":
            return self._send(conn, "503 Service Unavailable", b'{"error": {"message": "overloaded"}}')
        if mode == "401":
            echo = json.dumps({"error": {"message": f"bad key in {headers.get('authorization')}"}})
            return self._send(conn, "401 Unauthorized", echo.encode())
        if mode == "cut":
            body = json.dumps(self._document(path)).encode()
            head = {"Content-Type": "application/json", "Content-Length": str(len(body))}
            conn.sendall(self._head("200 OK", head) + body[: len(body) // 2])
            conn.shutdown(socket.SHUT_RDWR)
            return False
        if mode == "badjson":
            return self._send(conn, "200 OK", b'{"choices": [{"message": ')
        return self._send(conn, "404 Not Found", b'{"error": "no such mode"}')

    @staticmethod
    def _document(path: str) -> dict:
        if path.endswith("/chat/completions"):
            return chat_body()
        if path.endswith("/completions"):
            return completion_body()
        if path.endswith("/models"):
            return {"data": [{"id": "m", "root": "/models/m", "max_model_len": 64, "owned_by": "vllm"}]}
        if path.endswith("/version"):
            return {"version": "0.0.test"}
        if path.endswith("/tokenize"):
            return {"tokens": [1, 2, 3]}
        return {}
