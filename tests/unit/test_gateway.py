"""What a gateway says about the upstream that served each answer, from bodies and headers recorded from a
real LiteLLM proxy (tests/fixtures/shapes/litellm-*.json) and OpenRouter's documented shape: the
``gateway.*`` stack fields, the deployments of a model group and the parameters they drop, and a gateway
that dropped the logprobs asked for, reported once, as a stack change, never as ``identical``. The real
proxy in front of a real vLLM is tests/e2e/test_litellm_gateway.py."""

from __future__ import annotations

from canaryd.backends import litellm, openai_headers
from canaryd.judge.compare import Verdict, compare
from tests.unit.test_response_shapes import fixture, probe, replay  # noqa: F401  (replay: a fixture)

INFO = fixture("litellm-model-info")["body"]


def test_the_proxys_headers_name_the_deployment_not_the_per_request_values():
    fields = openai_headers.gateway_fields(fixture("litellm-chat")["headers"])
    assert fields == {
        "gateway.model_group": "tiny",
        "gateway.model_id": "501a33cb0df68f348576bc45810a6b4d9a27a20a0f39585dafa5b45552ed1656",
        "gateway.model_name": "hosted_vllm/tiny",
        "gateway.api_base": "http://127.0.0.1:18411/v1",
        "gateway.version": "1.110.2",
        "gateway.upstream_server": "BaseHTTP/0.6 Python/3.11.7",
    }  # no call id, duration, retries: they change every request
    assert openai_headers.gateway_fields({"x-litellm-model-api-base": "https://u:pw@h/v1"}) == {
        "gateway.api_base": "https://<redacted>@h/v1"
    }
    assert openai_headers.gateway_fields({"server": "uvicorn"}) == {}


def test_deployments_and_what_they_drop_come_from_model_info():
    passing = litellm.deployment_fields(INFO, "tiny")
    assert passing == {
        "gateway.deployments": "501a33cb0df68f34",
        "gateway.deployment.501a33cb0df68f34.model": "hosted_vllm/tiny",
        "gateway.deployment.501a33cb0df68f34.api_base": "http://127.0.0.1:18411/v1",
        "gateway.deployment.501a33cb0df68f34.provider": "hosted_vllm",
    }
    dropping = litellm.deployment_fields(INFO, "tiny-dropping")
    assert dropping["gateway.deployment.57f8e131e721967f.drops"] == "logprobs,top_logprobs"
    assert dropping["gateway.deployment.57f8e131e721967f.drop_params"] == "True"
    assert litellm.deployment_fields(INFO, "nope") == {
        "gateway.error": "the proxy serves no model group 'nope'"
    }


def test_drop_params_drops_what_the_provider_does_not_support():
    supported = ["temperature", "max_tokens", "seed"]
    assert litellm.dropped_params({"drop_params": True}, supported) == [
        "logprobs",
        "n",
        "stop",
        "top_logprobs",
        "top_p",
    ]
    assert (
        litellm.dropped_params({"drop_params": False}, supported) == []
    )  # LiteLLM refuses instead (HTTP 400)
    assert litellm.dropped_params({"additional_drop_params": ["seed"]}, None) == ["seed"]


def test_an_answer_through_the_proxy_carries_the_upstreams_identity_and_its_logprobs(replay):  # noqa: F811
    obs, (_, sent) = probe(replay, "litellm-chat", kind=litellm)
    assert obs.ok and obs.has_logprobs and sent["logprobs"] is True
    assert obs.stack["gateway.model_name"] == "hosted_vllm/tiny" and obs.stack["gateway.logprobs"] == "passed"
    assert obs.stack["response.model"] == "tiny"  # the proxy renames it: the answer alone hides the upstream


def test_dropped_logprobs_are_judged_as_a_stack_change_not_identical(replay):  # noqa: F811
    good, _ = probe(replay, "litellm-chat", kind=litellm)
    dropped, _ = probe(replay, "litellm-dropped", kind=litellm)
    assert dropped.ok and not dropped.has_logprobs and dropped.stack["gateway.logprobs"] == "dropped"
    assert good.text == dropped.text  # the same answer: only the missing logprobs tell them apart
    c = compare(good, dropped, correct=None)
    assert c.verdict is not Verdict.IDENTICAL
    assert ("gateway.logprobs", "passed", "dropped") in {
        (s.field, s.before, s.after) for s in c.stack_changes
    }


def test_the_warning_is_logged_once_per_backend(replay, capsys):  # noqa: F811
    p = litellm.Prober(litellm.Settings(name="gw", model="m", base_url=replay.base("litellm-dropped")))
    from canaryd.canaries import Canary

    canary = Canary(id="a", messages=[{"role": "user", "content": "hi"}])
    try:
        for _ in range(3):
            assert p.attempt(canary).stack["gateway.logprobs"] == "dropped"
    finally:
        p.close()
    said = capsys.readouterr()
    assert (said.out + said.err).count("gateway_dropped_logprobs") == 1


def test_openrouter_names_its_upstream_and_the_logprobs_it_dropped(replay):  # noqa: F811
    obs, (_, sent) = probe(replay, "openrouter-provider", preset="openrouter")
    assert sent.get("logprobs") is True
    assert obs.stack["response.provider"] == "Anthropic" and obs.stack["gateway.logprobs"] == "dropped"


def test_no_logprobs_asked_no_claim_made(replay):  # noqa: F811
    obs, (_, sent) = probe(replay, "litellm-chat", kind=litellm, logprobs="off")
    assert "logprobs" not in sent and "gateway.logprobs" not in obs.stack
