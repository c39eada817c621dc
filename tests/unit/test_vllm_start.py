"""`VLLMServer.start` when another process takes the free port it chose before the server binds it (tests
on parallel workers start servers at once): it starts again on a new one; a port the caller named is never
changed. Its compute thread is one, unbound, and the model runs in vLLM's engine process, unless the
environment or the caller says otherwise. The server here is a stand-in that binds and answers ``/health``
as vLLM does, and fails to bind with the same error."""

from __future__ import annotations

import socket
import sys

import httpx2
import pytest

from canaryd.lab.vllm_process import DEFAULTS, VLLMServer, VLLMServerError

SERVER = f"""
import http.server, os, sys
print(*(os.environ.get(name) for name in {tuple(DEFAULTS)!r}), flush=True)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


class StandIn(VLLMServer):
    def command(self) -> list[str]:
        return [sys.executable, "-c", SERVER, str(self.port)]


@pytest.fixture
def taken():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, not listening: a bind fails, a connection is refused at once
        yield s.getsockname()[1]


def test_a_chosen_port_taken_before_the_server_binds_it_is_chosen_again(tmp_path, taken):
    server = StandIn(tmp_path, log_path=tmp_path / "server.log", startup_timeout=30)
    server.port = taken  # what the race does: another process binds it after `free_port`
    with server:
        assert server.port != taken
        assert httpx2.get(f"{server.root_url}/health", timeout=5).status_code == 200


def test_a_port_the_caller_named_is_never_changed(tmp_path, taken):
    server = StandIn(tmp_path, port=taken, log_path=tmp_path / "server.log", startup_timeout=30)
    with pytest.raises(VLLMServerError, match="during start-up"):
        server.start()
    assert server.port == taken and server.proc is None


@pytest.mark.parametrize(
    ("outside", "given", "seen"),
    [
        # vLLM's default would bind every server's thread to one core, and start a third process
        ({}, {}, "nobind 1 0"),
        ({"OMP_NUM_THREADS": "2"}, {}, "nobind 2 0"),  # the environment wins
        (
            {},
            {"VLLM_CPU_OMP_THREADS_BIND": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"},
            "1 1 1",
        ),  # and the caller's env
    ],
)
def test_a_server_has_one_unbound_compute_thread_and_two_processes_unless_told_otherwise(
    tmp_path, monkeypatch, outside, given, seen
):
    for name in DEFAULTS:
        monkeypatch.delenv(name, raising=False)
    for name, value in outside.items():
        monkeypatch.setenv(name, value)
    with StandIn(tmp_path, env=given, log_path=tmp_path / "server.log", startup_timeout=30) as server:
        assert server.log_tail(1) == seen
