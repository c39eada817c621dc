"""Request profiles against a real vLLM (CPU) server: every body a profile shapes is one the server accepts,
logprobs "off" gives observations judged on text (the same answer as with logprobs), "prefer" keeps the
logprobs a server sends, and the stored request is what was sent."""

from pathlib import Path

import pytest

from canaryd.backends import make_backend
from canaryd.canaries import Canary
from canaryd.config import load_config
from canaryd.lab.vllm_process import VLLMServer

pytestmark = pytest.mark.vllm

CHAT = Canary(id="add", messages=[{"role": "user", "content": "17 + 25 ="}], decoding={"max_tokens": 6})
RAW = Canary(id="sky", prompt="The three primary colors of light are", decoding={"max_tokens": 6})
BACKENDS = {
    "plain": "",
    "off": "[backends.request]\nlogprobs = 'off'\n",
    "prefer": "[backends.request]\nlogprobs = 'prefer'\ntop_logprobs = 2\n",
    "reasoning": "preset = 'openai-reasoning'\n[backends.request]\nreasoning_tokens = 4\n",
    "trimmed": (
        "[backends.request]\ntoken_param = 'max_completion_tokens'\n"
        "omit = ['presence_penalty', 'n', 'seed']\nextra_body = { top_k = 1 }\n"
    ),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model):
    root: Path = tmp_path_factory.mktemp("profiles")
    with VLLMServer(tiny_model, extra_args=["--enforce-eager"], log_path=root / "vllm.log") as server:
        (root / "s.toml").write_text('[suite]\nname = "s"\n[[canary]]\nid = "x"\nprompt = "x"\n')
        blocks = "".join(
            f"[[backends]]\nname = '{name}'\nkind = '{'vllm' if name == 'off' else 'openai'}'\n"
            f"base_url = '{server.root_url}/v1'\nmodel = 'tiny'\n{extra}"
            for name, extra in BACKENDS.items()
        )
        (root / "canaryd.toml").write_text(f"state_dir = 'state'\nsuites = ['s.toml']\n{blocks}")
        config = load_config(root / "canaryd.toml")
        backends = {name: make_backend(config.backend(name)) for name in BACKENDS}
        try:
            yield backends
        finally:
            for b in backends.values():
                b.close()


def test_every_profiled_body_is_accepted_and_answers_the_same(served):
    answers = {}
    for name, backend in served.items():
        obs = backend.probe(CHAT)
        assert obs.ok, (name, obs.error)
        assert obs.request is backend.request(CHAT)  # the stored request is the body sent
        answers[name] = obs.text
        assert obs.has_logprobs is (name in ("plain", "prefer", "trimmed")), name
        assert bool(obs.tokens) is obs.has_logprobs, name
        assert obs.reasoning_tokens is None  # vLLM reports none for this model
    del answers["reasoning"]  # it sends no temperature: the model's own default decides
    assert len(set(answers.values())) == 1, answers  # greedy: the profile changes the request, not the answer
    assert all(len(t.top) <= 2 for t in served["prefer"].probe(CHAT).tokens)
    assert served["reasoning"].request(CHAT)["max_completion_tokens"] == 10


def test_logprobs_off_on_the_legacy_endpoint_and_a_profile_in_the_stack(served):
    obs = served["off"].probe(RAW)
    assert obs.ok and not obs.has_logprobs and obs.text and "logprobs" not in obs.request
    plain = served["plain"].probe(RAW)
    assert plain.ok and plain.has_logprobs and plain.text == obs.text
    assert "request.profile" not in served["plain"].snapshot()
    assert served["off"].snapshot()["request.profile"] != served["prefer"].snapshot()["request.profile"]
