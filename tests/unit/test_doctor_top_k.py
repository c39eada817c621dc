"""``canaryd doctor`` against engines that cap top-k logprobs: it keeps the logprobs and finds the largest
top-k the server accepts (the cap a refusal names, else bisection), instead of proposing logprobs "off".

The server here answers with recorded bodies: vLLM's refusal and answer (``--max-logprobs 2``) and TGI's
refusal (`tests/fixtures/refusals/`, `tests/fixtures/engines/vllm-max-logprobs/`), the asked top-k put in
the message and the answer's alternatives cut or repeated to it."""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from canaryd.backends import discover as doctor
from canaryd.backends.openai_compat import Settings
from tests.harness.fixtures import load

ANSWER = load("engines/vllm-max-logprobs/chat-top2")["body"]
# engine → (status, body of a refusal of ``asked``)
VLLM, TGI = load("refusals/vllm-max-logprobs-chat")["body"], load("refusals/tgi-max-top-n-tokens-422")["body"]
# A refusal of the value that names the parameter but no cap: what bisection is for.
SILENT = {"error": {"message": "top_logprobs is too large", "param": "top_logprobs"}}
REFUSALS = {
    "vllm": lambda asked: (400, _asked(VLLM, "of 5,", f"of {asked},")),
    "tgi": lambda asked: (422, _asked(TGI, "Given: 20", f"Given: {asked}")),
    "silent": lambda asked: (400, SILENT),
}


def _asked(body: dict, old: str, new: str) -> dict:
    return json.loads(json.dumps(body).replace(old, new))


def _answer(k: int) -> dict:
    doc = copy.deepcopy(ANSWER)
    for entry in doc["choices"][0]["logprobs"]["content"]:
        tops = entry["top_logprobs"]
        entry["top_logprobs"] = [tops[i % len(tops)] for i in range(k)]
    return doc


class Capped:
    """A chat endpoint that refuses more than ``cap`` top logprobs as ``engine`` does, and returns at most
    ``clamp`` of those it accepts; records the top-k of every logprob request."""

    def __init__(self, engine: str, cap: int, clamp: int = doctor.TOP_K_MAX) -> None:
        self.asked: list[int] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, doc = 200, _answer(0)
                if body.get("logprobs") is True:
                    k = body.get("top_logprobs", 0)
                    outer.asked.append(k)
                    status, doc = REFUSALS[engine](k) if k > cap else (200, _answer(min(k, clamp)))
                raw = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *_: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def settings(self) -> Settings:
        return Settings(
            name="e", model="tiny", base_url=f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        )


@pytest.fixture
def capped() -> Iterator:
    servers: list[Capped] = []

    def start(engine: str, cap: int, clamp: int = doctor.TOP_K_MAX) -> Capped:
        servers.append(Capped(engine, cap, clamp))
        return servers[-1]

    yield start
    for s in servers:
        s.server.shutdown()


@pytest.mark.parametrize(("engine", "cap"), [("vllm", 2), ("tgi", 5)])
def test_the_cap_a_refusal_names_is_asked_next_and_goes_in_the_profile(capped, engine: str, cap: int) -> None:
    server = capped(engine, cap)
    found = doctor.discover(server.settings)
    assert server.asked == [doctor.TOP_K_MAX, cap]  # one more request, not a search
    assert (found.logprobs, found.top_logprobs) == ("returned", cap), found.evidence
    assert doctor.profile(found)["logprobs"] == "require"
    assert doctor.profile(found)["top_logprobs"] == cap
    assert f"top {cap}, the cap it names: accepted" in found.evidence["logprobs"]
    assert found.requests <= doctor.MAX_REQUESTS


@pytest.mark.parametrize("cap", [3, 7])
def test_a_refusal_naming_no_cap_is_bisected_within_the_request_cap(capped, cap: int) -> None:
    server = capped("silent", cap)
    found = doctor.discover(server.settings)
    assert (found.logprobs, found.top_logprobs) == ("returned", cap), found.evidence
    assert server.asked[:2] == [doctor.TOP_K_MAX, 1] and max(k for k in server.asked if k <= cap) == cap
    assert f"bisected: top {cap} accepted" in found.evidence["logprobs"]
    assert found.completions and found.requests <= doctor.MAX_REQUESTS  # room kept for what comes after


def test_a_server_that_refuses_even_top_1_gets_logprobs_off(capped) -> None:
    server = capped("silent", 0)
    found = doctor.discover(server.settings)
    assert server.asked == [doctor.TOP_K_MAX, 1]
    assert found.logprobs == "refused" and doctor.profile(found)["logprobs"] == "off"


def test_a_server_that_clamps_silently_shows_in_the_top_k_it_returns(capped) -> None:
    """An engine that clamps instead of refusing (llama.cpp returns no more alternatives than the candidates
    left after sampling): the profile asks for the top-k that came back."""
    server = capped("vllm", doctor.TOP_K_MAX, clamp=4)
    found = doctor.discover(server.settings)
    assert server.asked == [doctor.TOP_K_MAX]
    assert (found.logprobs, found.top_logprobs, doctor.profile(found)["top_logprobs"]) == ("returned", 4, 4)
