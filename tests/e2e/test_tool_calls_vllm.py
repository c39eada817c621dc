"""Tool-call and parameter-conformance canaries against the real vLLM CPU server, one start for the module.

The tiny model is taught (as the demo teaches its answers) to answer "What is the weather in Paris?" with
the Hermes tool-call text ``<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>``
and "Count to twenty." with a 50-character count. vLLM runs with ``--enable-auto-tool-choice
--tool-call-parser hermes`` (the parser reads the tags from the text, so a byte-level tokenizer without
special tokens serves), and turns that text into OpenAI ``tool_calls``.

Two backends share the server: ``direct`` (the vllm kind) and ``gateway``, an OpenAI-compatible proxy in
front of it that drops ``max_tokens`` from every request, as a gateway that filters parameters does. The good
call passes; a canary expecting another tool name and one whose schema the call breaks are each wrong with
their reason; the max_tokens pair passes direct and is ``nonconformant`` through the gateway.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx2
import pytest

from canaryd.lab.tinymodel import build_tiny_model
from canaryd.lab.vllm_process import free_port
from tests.e2e.conftest import CACHE
from tests.harness.lab import Lab

pytestmark = pytest.mark.vllm

WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
COUNT = [{"role": "user", "content": "Count to twenty."}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
COUNTING = "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20"
WORDS = ("<tool_call>", "</tool_call>", '"get_weather"', '"arguments"', '"name"', '"city"', '"Paris"')

WEATHER_TOOL = (
    '{ type = "function", function = { name = "get_weather", description = "Weather in a city", parameters = '
    '{ type = "object", properties = { city = { type = "string" } }, required = ["city"] } } }'
)
TOOLS = f'[{WEATHER_TOOL}, {{ type = "function", function = {{ name = "get_time" }} }}]'
SCHEMA = (
    '{ type = "object", properties = { city = { enum = ["Paris"] } }, required = ["city"], '
    "additionalProperties = false }"
)
SUITE = f"""
[suite]
name = "conformance"
[defaults]
max_tokens = 64
top_logprobs = 2
[[canary]]
id = "weather"
messages = [{{ role = "user", content = "What is the weather in Paris?" }}]
tools = {TOOLS}
expect = {{ tool_call = {{ name = "get_weather", arguments = {SCHEMA} }} }}
[[canary]]
id = "weather-wrong-name"
messages = [{{ role = "user", content = "What is the weather in Paris?" }}]
tools = {TOOLS}
expect = {{ tool_call = {{ name = "get_time" }} }}
[[canary]]
id = "weather-broken-schema"
messages = [{{ role = "user", content = "What is the weather in Paris?" }}]
tools = {TOOLS}
expect = {{ tool_call = {{ name = "get_weather", arguments = {{ required = ["city", "country"] }} }} }}
[[canary]]
id = "count"
messages = [{{ role = "user", content = "Count to twenty." }}]
conform = {{ param = "max_tokens", low = 8, high = 32 }}
"""
CONFIG = """
state_dir = "state"
suites = ["suite.toml"]
[[backends]]
name = "direct"
kind = "vllm"
base_url = "http://127.0.0.1:{port}/v1"
model = "tiny"
timeout_s = 60
[[backends]]
name = "gateway"
kind = "openai"
base_url = "http://127.0.0.1:%d/v1"
model = "tiny"
timeout_s = 60
"""


class DroppingGateway:
    """Forwards to vLLM, minus ``max_tokens`` in every JSON request body: a parameter silently dropped."""

    def __init__(self, upstream: str, port: int) -> None:
        client = httpx2.Client(timeout=60)

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                body.pop("max_tokens", None)
                reply = client.post(upstream + self.path, json=body)
                self.send_response(reply.status_code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply.content)))
                self.end_headers()
                self.wfile.write(reply.content)

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.client = client

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.client.close()


@pytest.fixture(scope="module")
def model() -> Path:
    train = [(WEATHER, CALL), (COUNT, COUNTING)]
    return build_tiny_model(CACHE / "toolcall-hermes", seed=0, train=train, steps=400, words=WORDS)


@pytest.fixture(scope="module")
def lab(tmp_path_factory, model) -> Iterator[Lab]:
    gateway_port = free_port()
    lab = Lab(tmp_path_factory.mktemp("toolcalls"), SUITE, CONFIG % gateway_port)
    gateway = DroppingGateway(f"http://127.0.0.1:{lab.port}", gateway_port)
    try:
        with lab.serve(model, extra_args=["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]):
            yield lab
    finally:
        gateway.stop()


def results(report: dict) -> dict[tuple[str, str], dict]:
    return {(r["backend"], r["canary"]): r for r in report["results"]}


def test_tool_calls_and_max_tokens_conformance_against_real_vllm(lab):
    code, report = lab.json("check")
    got = results(report)
    for backend in ("direct", "gateway"):
        good = got[(backend, "weather")]
        assert good["verdict"] == "baseline" and good["correct"] is True, good
        call = json.loads(good["text"].removeprefix("[tool_call] "))  # the call, as the store keeps it
        assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}

        wrong = got[(backend, "weather-wrong-name")]
        assert wrong["correct"] is False
        assert wrong["reasons"][0] == "wrong tool name: called 'get_weather', expected 'get_time'"
        broken = got[(backend, "weather-broken-schema")]
        assert broken["correct"] is False
        assert broken["reasons"][0] == (
            "tool call 'get_weather': arguments break the schema at $: required property 'country' is missing"
        )

    low, high = got[("direct", "count:low")], got[("direct", "count:high")]
    assert (low["verdict"], high["verdict"]) == ("baseline", "baseline"), (low, high)
    assert (low["completion_tokens"], low["text"]) == (8, COUNTING[:8])
    assert high["completion_tokens"] == 32 and high["text"] == COUNTING[:32]

    # the gateway dropped max_tokens: vLLM generated the whole count both times
    for side, limit in (("low", 8), ("high", 32)):
        r = got[("gateway", f"count:{side}")]
        assert r["verdict"] == "error" and r["error_kind"] == "nonconformant", r
        assert r["error"] == f"max_tokens ignored: 51 completion tokens > the {limit} asked for"
    assert code == 3, report  # a probe that failed (the conformance error) is the exit code's first

    # the calls are answers compared with their baselines: unchanged, identical
    code, again = lab.json("check")
    direct = {c: r for (b, c), r in results(again).items() if b == "direct"}
    assert {c: r["verdict"] for c, r in direct.items()} == dict.fromkeys(direct, "identical"), direct
