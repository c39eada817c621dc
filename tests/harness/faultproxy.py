"""A fault-injecting HTTP proxy on loopback, in front of a real vLLM server.

Introspection calls always pass through; the probes themselves (POST …/completions) get the fault named by
``mode``. Every fault is something a real deployment produces: a hung upstream, 429 with Retry-After,
5xx, a 200 whose body is not JSON, a body cut mid-way, a response without logprobs. Every POST is kept
(`posted`: path and body), as the proxy received it.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import ThreadingHTTPServer

import httpx2

from canaryd.lab.vllm_process import free_port
from tests.harness.replay import KeepAliveHandler

MODES = ("pass", "hang", "429", "503", "badjson", "truncate", "nologprobs")


class FaultProxy:
    def __init__(self, upstream: str, hang_s: float = 6.0) -> None:
        self.upstream = upstream.rstrip("/")
        self.mode = "pass"
        self.fail_first = 0  # with mode "pass": fail this many probes with 503 first (retry tests)
        self.probe_hits = 0
        self.posted: list[tuple[str, bytes]] = []
        self.hang_s = hang_s
        self.lock = threading.Lock()
        self.client = httpx2.Client(timeout=30)
        proxy = self

        class Handler(KeepAliveHandler):
            def _forward(self, body: bytes | None) -> httpx2.Response:
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")
                }
                return proxy.client.request(
                    self.command, proxy.upstream + self.path, headers=headers, content=body
                )

            def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
                self.send_response(status)
                for k, v in {"Content-Type": "application/json", **(headers or {})}.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                r = self._forward(None)
                self._send(r.status_code, r.content, {"Content-Type": r.headers.get("content-type", "")})

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                proxy.posted.append((self.path, body))
                if not self.path.endswith("completions"):
                    r = self._forward(body)
                    return self._send(r.status_code, r.content)
                with proxy.lock:
                    proxy.probe_hits += 1
                    hit = proxy.probe_hits
                mode = proxy.mode
                if mode == "pass" and hit <= proxy.fail_first:
                    mode = "503"
                if mode == "hang":
                    time.sleep(proxy.hang_s)  # bounded: longer than the client's timeout, then give up
                    self.close_connection = True
                    return None
                if mode == "429":
                    return self._send(429, b'{"error": {"message": "slow down"}}', {"Retry-After": "0"})
                if mode == "503":
                    return self._send(503, b'{"error": {"message": "overloaded"}}')
                if mode == "badjson":
                    return self._send(200, b'{"choices": [{"message": ')
                r = self._forward(body)
                if mode == "nologprobs":
                    doc = r.json()
                    for choice in doc.get("choices", []):
                        choice.pop("logprobs", None)
                    return self._send(r.status_code, json.dumps(doc).encode())
                if mode == "truncate":
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(r.content)))
                    self.end_headers()
                    self.wfile.write(r.content[: len(r.content) // 2])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return None
                return self._send(r.status_code, r.content)

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.client.close()
