"""`refusals.classify` on recorded provider error bodies (``tests/fixtures/refusals/``, each naming its
source): a refused parameter or value is a ``config`` error naming the backend, the parameter and the fix;
so is an engine's top-k cap (vLLM, TGI, SGLang), with the cap read from its message; everything else keeps
its kind by status. Then through the ``openai`` kind against a local HTTP server."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from canaryd.backends import openai_compat
from canaryd.backends.refusals import classify, top_k_limit
from canaryd.canaries import load_suites
from canaryd.observation import ErrorKind
from tests.harness.fixtures import every, load, read

CASES = every("refusals")


def test_every_family_the_issue_names_has_a_recorded_body():
    names = {p.stem for p in CASES}
    families = ("openai", "azure", "groq", "mistral", "xai", "anthropic", "gemini", "vllm", "tgi", "sglang")
    for family in families:
        assert any(n.startswith(family) for n in names), family
    assert sum(read(p)["expect"]["kind"] == "config" for p in CASES) >= 12


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_a_recorded_body_is_classified_as_its_fixture_says(path):
    doc = read(path)
    expect = doc["expect"]
    kind, message = classify(doc["status"], json.dumps(doc["body"]), "o4")
    assert kind is ErrorKind(expect["kind"]), message
    assert "\n" not in message
    if kind is ErrorKind.CONFIG:
        assert message.startswith(f"backend 'o4': HTTP {doc['status']}"), message
        assert f"refuses {expect['parameter']}" in message or f"of {expect['parameter']}" in message
        assert expect["fix"] in message, message
        if "preset" in expect:
            assert f'preset = "{expect["preset"]}"' in message, message
        assert top_k_limit(doc["status"], json.dumps(doc["body"])) == expect.get("limit")
    else:
        assert message.startswith(f"HTTP {doc['status']}: "), message
        assert "the server refuses" not in message  # no fix offered for what no profile key fixes


@pytest.mark.parametrize("name", ["vllm-max-logprobs-chat", "vllm-max-logprobs-completions"])
def test_a_vllm_started_with_max_logprobs_2_names_the_profile_key_and_its_cap(name):
    doc = load(f"refusals/{name}")
    assert classify(400, json.dumps(doc["body"]), "v") == (
        ErrorKind.CONFIG,
        "backend 'v': HTTP 400: the server refuses top_logprobs above 2; set request.top_logprobs = 2",
    )


def test_the_prompt_logprobs_cap_names_the_scoring_it_stops_and_the_same_key():
    doc = load("refusals/vllm-max-logprobs-prompt")
    kind, message = classify(400, json.dumps(doc["body"]), "v")
    assert kind is ErrorKind.CONFIG
    assert "refuses prompt_logprobs above 2 (the scoring of forced canaries" in message
    assert message.endswith("set request.top_logprobs = 2")


def test_a_cap_above_what_a_profile_can_ask_gives_a_valid_fix():
    doc = load("refusals/sglang-pd-top-logprobs")
    assert top_k_limit(400, json.dumps(doc["body"])) == 128
    assert classify(400, json.dumps(doc["body"]), "s")[1].endswith("above 128; set request.top_logprobs = 20")


@pytest.mark.parametrize(
    ("status", "body"),
    [
        (500, '{"error": "Requested sample logprobs of 5, which is greater than max allowed: 2"}'),
        (401, '{"error": "`top_n_tokens` must be >= 0 and <= 5. Given: 20"}'),
        (400, '{"error": {"message": "max_tokens must be >= 0 and <= 5"}}'),  # no top-k field named
    ],
)
def test_a_cap_is_only_read_from_a_4xx_that_names_top_k(status, body):
    assert top_k_limit(status, body) is None
    assert classify(status, body, "b")[0] is not ErrorKind.CONFIG


def test_the_message_of_the_issue():
    doc = load("refusals/openai-max-tokens")
    assert classify(400, json.dumps(doc["body"]), "o4") == (
        ErrorKind.CONFIG,
        "backend 'o4': HTTP 400 unsupported_parameter: the server refuses max_tokens; "
        'set request.token_param = "max_completion_tokens" (or preset = "openai-reasoning")',
    )


@pytest.mark.parametrize(
    ("status", "body", "kind"),
    [
        (400, "", ErrorKind.HTTP_4XX),  # no body at all
        (400, "<html>Bad Request</html>", ErrorKind.HTTP_4XX),
        (403, '{"error": {"message": "Project does not have access to model o3"}}', ErrorKind.AUTH),
        (401, '{"error": "not allowed to request logprobs"}', ErrorKind.AUTH),  # a 401 is never config
        (400, '{"error": {"message": "temperature must be at most 2"}}', ErrorKind.HTTP_4XX),  # no refusal
        (502, '{"error": {"message": "logprobs not supported"}}', ErrorKind.HTTP_5XX),
        (400, "[1, 2]", ErrorKind.HTTP_4XX),
        (400, '{"error": {"message": {"nested": true}}}', ErrorKind.HTTP_4XX),
    ],
)
def test_what_is_no_refusal_keeps_its_kind_by_status(status, body, kind):
    got, message = classify(status, body, "b")
    assert got is kind and message.startswith(f"HTTP {status}: ")


def test_a_long_server_message_is_cut_and_a_parameter_in_it_is_only_named_when_known():
    kind, message = classify(500, json.dumps({"error": {"message": "x" * 1000}}), "b")
    assert kind is ErrorKind.HTTP_5XX and len(message) == len("HTTP 500: ") + 300
    kind, message = classify(400, '{"error": {"message": "Unsupported parameter: \'frobnicate\'"}}', "b")
    assert kind is ErrorKind.HTTP_4XX and "frobnicate" in message and "the server refuses" not in message


class _Refusing(BaseHTTPRequestHandler):
    body = b""
    status = 400

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *_: object) -> None:
        pass


def test_the_openai_kind_stores_a_refusal_as_a_config_error(tmp_path):
    doc = load("refusals/openai-max-tokens")
    handler = type("H", (_Refusing,), {"body": json.dumps(doc["body"]).encode(), "status": 400})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    (tmp_path / "s.toml").write_text(
        '[suite]\nname = "s"\n[[canary]]\nid = "add"\n'
        'messages = [{ role = "user", content = "1+1?" }]\nexpect = { number = 2 }\n'
    )
    (canary,) = load_suites([tmp_path / "s.toml"])[0].canaries
    cfg = openai_compat.Settings(
        name="o4", model="o4-mini", base_url=f"http://127.0.0.1:{server.server_address[1]}/v1"
    )
    prober = openai_compat.Prober(cfg)
    try:
        obs = prober.attempt(canary)
    finally:
        prober.close()
        server.shutdown()
    assert obs.error_kind is ErrorKind.CONFIG and not obs.error_kind.retryable
    assert obs.error == classify(400, json.dumps(doc["body"]), "o4")[1]
