"""The response shapes of the cloud APIs, served from recorded bodies (tests/fixtures/shapes/, each naming its
source) by a replay server on loopback: legacy logprob lists inside chat responses, the Responses API kind,
answers without logprobs under each ``request.logprobs`` mode, reasoning tokens, OpenRouter's ``provider``
field and Azure's identity headers."""

from __future__ import annotations

import json
from typing import Any

import pytest

from canaryd.backends import openai_compat as compat
from canaryd.backends import openai_headers
from canaryd.backends import openai_responses as responses
from canaryd.backends import openai_wire as wire
from canaryd.canaries import Canary
from canaryd.observation import ErrorKind
from canaryd.probe import vet
from tests.harness.fixtures import every, load, read
from tests.harness.replay import Server

CANARY = Canary(id="add", messages=[{"role": "user", "content": "What is 17 + 25? Answer with the number."}])


def fixture(name: str) -> dict:
    return load(f"shapes/{name}")


class Replay(Server):
    """Answers ``POST /<fixture>/v1/...`` with the fixture's status, headers and body; records requests."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict]] = []
        super().__init__()

    def base(self, name: str) -> str:
        return f"{self.url}/{name}/v1"

    def _answer(self, method: str, url: str, headers: Any, raw: bytes) -> tuple[int, dict[str, str], Any]:
        self.requests.append((url, json.loads(raw)))
        doc = fixture(url.split("/")[1])
        return doc["status"], doc["headers"], doc["body"]


@pytest.fixture(scope="module")
def replay():
    with Replay() as r:
        yield r


def probe(replay: Replay, name: str, kind=compat, preset: str | None = None, **request: object):
    settings = kind.Settings(
        name="cloud",
        model="m",
        base_url=replay.base(name),
        preset=preset,
        **({"request": request} if request else {}),
    )
    p = kind.Prober(settings)
    try:
        obs = vet.vet(p.attempt(CANARY), CANARY.decoding.max_tokens)
    finally:
        p.close()
    return obs, replay.requests[-1]


def test_every_fixture_names_its_source():
    for path in every("shapes"):
        assert read(path)["_source"].strip(), path.name


def test_legacy_logprob_lists_inside_a_chat_response_are_parsed(replay):
    obs, (path, sent) = probe(replay, "together-legacy-logprobs", preset="together")
    assert obs.ok and obs.has_logprobs, obs.error
    assert [t.token for t in obs.tokens][:3] == ["1", ".", " Define"]
    assert obs.tokens[2].logprob == -2.1367188 and len(obs.tokens) == 10
    assert path.endswith("/chat/completions") and sent["logprobs"] == 5 and "top_logprobs" not in sent


def test_legacy_lists_of_different_lengths_are_a_named_error():
    body = fixture("together-legacy-logprobs")["body"]
    body["choices"][0]["logprobs"]["token_logprobs"].pop()
    with pytest.raises(wire.InvalidResponse, match=r"choices\.0\.logprobs: tokens, token_logprobs"):
        wire.parse_chat(body)


@pytest.mark.parametrize("preset", [None, "openai-reasoning"])
def test_an_answer_without_logprobs_is_an_observation_judged_on_text(replay, preset):
    obs, (_, sent) = probe(replay, "openai-reasoning-chat", preset=preset)
    assert obs.ok and not obs.has_logprobs and obs.tokens == [], obs.error
    assert obs.text == "42" and obs.prompt_tokens == 19 and obs.completion_tokens == 203
    assert obs.reasoning_tokens == 192  # usage.completion_tokens_details.reasoning_tokens
    assert obs.stack["response.service_tier"] == "default"
    # 203 completion tokens for max_tokens 32 is not "too large": 192 of them were hidden reasoning
    assert ("logprobs" in sent) is (preset is None)
    assert sent.get("max_completion_tokens") == (32 + 2048 if preset else None)


def test_logprobs_required_but_missing_is_an_error(replay):
    obs, _ = probe(replay, "openai-reasoning-chat", logprobs="require")
    assert obs.error_kind is ErrorKind.NO_LOGPROBS and obs.text == "42" and obs.reasoning_tokens == 192


def test_logprobs_off_are_not_asked_for_and_not_used(replay):
    obs, (_, sent) = probe(replay, "azure-chat", logprobs="off")  # this server sends them anyway
    assert obs.ok and not obs.has_logprobs and obs.tokens == []
    assert "logprobs" not in sent and "top_logprobs" not in sent
    obs, _ = probe(replay, "azure-chat")
    assert obs.ok and obs.has_logprobs and obs.tokens[0].token == "42"


def test_anthropic_compat_answers_without_logprobs(replay):
    obs, (_, sent) = probe(replay, "anthropic-compat", preset="anthropic-compat")
    assert obs.ok and not obs.has_logprobs and obs.text == "42" and obs.reasoning_tokens is None
    assert {"top_p", "logprobs", "top_logprobs", "seed"}.isdisjoint(sent) and sent["temperature"] == 0.0


def test_the_responses_api_with_logprobs(replay):
    obs, (path, sent) = probe(replay, "responses-logprobs", kind=responses)
    assert path.endswith("/v1/responses") and sent["include"] == ["message.output_text.logprobs"]
    assert obs.ok and obs.has_logprobs and obs.text == "42" and obs.finish_reason == "stop"
    assert [(t.token, t.logprob, t.bytes) for t in obs.tokens] == [("42", -0.0009, (52, 50))]
    assert obs.tokens[0].top == (("42", -0.0009), ("The", -7.2))
    assert (obs.prompt_tokens, obs.completion_tokens, obs.reasoning_tokens) == (14, 1, 0)
    assert obs.response_model == "gpt-4.1-2025-04-14" and obs.stack["response.service_tier"] == "default"


@pytest.mark.parametrize("logprobs", ["prefer", "off"])
def test_the_responses_api_of_a_reasoning_model(replay, logprobs):
    obs, (_, sent) = probe(
        replay, "responses-reasoning", kind=responses, logprobs=logprobs, reasoning_tokens=512
    )
    assert obs.ok and not obs.has_logprobs and obs.text == "42", obs.error
    assert (obs.completion_tokens, obs.reasoning_tokens) == (138, 128)
    assert sent["max_output_tokens"] == 32 + 512 and ("include" in sent) is (logprobs == "prefer")


def test_a_responses_body_with_a_bad_logprob_is_a_named_error():
    body = fixture("responses-logprobs")["body"]
    body["output"][0]["content"][0]["logprobs"][0]["logprob"] = 3.0
    with pytest.raises(wire.InvalidResponse, match=r"output\.0\.content\.0\.logprobs\.0\.logprob: 3 > 0"):
        wire.parse_responses(body)
    body["output"] = "no"
    with pytest.raises(wire.InvalidResponse, match="response field output has type str"):
        wire.parse_responses(body)


def test_an_incomplete_response_says_why_as_its_finish_reason():
    body = fixture("responses-reasoning")["body"]
    body |= {"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"}}
    body["output"] = body["output"][:1]  # reasoning spent the budget: no message at all
    r = wire.parse_responses(body)
    assert (r.finish_reason, r.text, r.tokens, r.reasoning_tokens) == ("length", None, None, 128)


def test_openrouters_provider_is_a_stack_field(replay):
    obs, _ = probe(replay, "openrouter-provider", preset="openrouter")
    assert obs.ok and not obs.has_logprobs
    assert (
        obs.stack["response.provider"] == "Anthropic"
        and obs.stack["header.x-openrouter-provider"] == "Anthropic"
    )


def test_azures_identity_headers_are_stack_fields_and_recorded_headers_stay_bounded(replay):
    obs, _ = probe(replay, "azure-chat", preset="azure")
    assert obs.ok and obs.has_logprobs
    assert obs.stack["header.openai-model"] == "gpt-4.1-mini-2025-04-14"
    assert obs.stack["header.azureml-model-session"] == "d156-20250422145713"
    assert obs.stack["header.x-ms-region"] == "Sweden Central"
    assert "header.apim-request-id" not in obs.stack  # per request: recorded, never a stack field
    assert obs.headers["apim-request-id"] == "8a6b2f4e-0c1d-4c55-9b7a-2f9d8e1c0a11"
    assert set(obs.headers) <= openai_headers.RECORDED_HEADERS and "content-length" not in obs.headers
    assert len(openai_headers.RECORDED_HEADERS) < 32  # exact names only, no pattern
