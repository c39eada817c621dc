"""A random load balancer on loopback: each request goes to one upstream, picked at random (seeded) by
weight, the way a naive L7 balancer spreads an OpenAI-compatible endpoint over servers. Tests change the
pool while it runs (``set_pool``) to add, drop or favour a server; the detection bench puts one in front of
two servers whose numerics differ (its heterogeneous fleet)."""

from __future__ import annotations

import http.client
import random
import threading
from http.server import ThreadingHTTPServer

from canaryd.lab.vllm_process import free_port
from tests.harness.replay import KeepAliveHandler

_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding"}


class Balancer:
    """``with Balancer({port: weight, ...}) as lb:`` serves at ``lb.base_url``; ``lb.served`` counts the
    requests each upstream port answered."""

    def __init__(self, pool: dict[int, float], *, port: int | None = None, seed: int = 0) -> None:
        self.port = port or free_port()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.served: dict[int, int] = {}
        self.set_pool(pool)
        balancer = self

        class Handler(KeepAliveHandler):
            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                port = balancer.pick()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                    conn.request(self.command, self.path, body=body or None, headers=headers)
                    reply = conn.getresponse()
                    data = reply.read()
                    self.send_response(reply.status)
                    for k, v in reply.getheaders():
                        if k.lower() not in _HOP:
                            self.send_header(k, v)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                finally:
                    conn.close()

            do_GET = do_POST = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def set_pool(self, pool: dict[int, float]) -> None:
        with self._lock:
            self._pool = dict(pool)

    def pick(self) -> int:
        """The upstream of the next request. Equal weights draw a uniform index (``randrange``: the
        detection bench's seeded split of its fleet depends on that draw)."""
        with self._lock:
            ports, weights = list(self._pool), list(self._pool.values())
            if len(set(weights)) == 1:
                port = ports[self._rng.randrange(len(ports))]
            else:
                port = self._rng.choices(ports, weights=weights)[0]
            self.served[port] = self.served.get(port, 0) + 1
            return port

    def __enter__(self) -> Balancer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
