"""Request profiles: what each preset sends for a chat canary, explicit keys over presets, the body a backend
without a profile sends (unchanged, byte for byte), config errors naming the field, raw-prompt canaries
refused for backends without a completions endpoint, and a profile change as a stack change."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from canaryd.backends import openai_compat as compat
from canaryd.backends import openai_responses as responses
from canaryd.backends.profile import PRESETS, RequestProfile
from canaryd.canaries import Canary
from canaryd.config import load_config
from canaryd.errors import InputError

CHAT = Canary(id="c", messages=[{"role": "user", "content": "What is 17 + 25?"}], decoding={"stop": ["\n"]})
RAW = Canary(id="r", prompt="The sky is")
# What canaryd sent before profiles existed (from main at 99642cd): a backend without a preset or a
# [backends.request] table must keep sending exactly these bytes.
CHAT_BYTES = (
    b'{"model":"m","messages":[{"role":"user","content":"What is 17 + 25?"}],"frequency_penalty":0.0,'
    b'"logprobs":true,"max_tokens":32,"n":1,"presence_penalty":0.0,"seed":0,"stop":["\\n"],'
    b'"temperature":0.0,"top_logprobs":5,"top_p":1.0}'
)
RAW_BYTES = (
    b'{"model":"m","prompt":"The sky is","frequency_penalty":0.0,"logprobs":5,"max_tokens":32,"n":1,'
    b'"presence_penalty":0.0,"seed":0,"temperature":0.0,"top_p":1.0}'
)
MESSAGES = [{"role": "user", "content": "What is 17 + 25?"}]
SAMPLING = {"temperature": 0.0, "top_p": 1.0, "n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0}
BASE = {"model": "m", "messages": MESSAGES, **SAMPLING, "seed": 0, "stop": ["\n"]}
LOGPROBS = {"logprobs": True, "top_logprobs": 5}


def drop(body: dict, *keys: str) -> dict:
    return {k: v for k, v in body.items() if k not in keys}


# Each preset's whole body for CHAT: what it sends, and what it leaves out.
PRESET_BODIES = {
    "openai-chat": {**BASE, "max_completion_tokens": 32, **LOGPROBS},
    "openai-reasoning": {
        **drop(BASE, "temperature", "top_p", "presence_penalty", "frequency_penalty"),
        "max_completion_tokens": 32 + 2048,
        "reasoning_effort": "low",
    },
    "azure": {**BASE, "max_completion_tokens": 32, **LOGPROBS},
    "anthropic-compat": {
        **drop(BASE, "top_p", "seed", "presence_penalty", "frequency_penalty"),
        "max_tokens": 32,
    },
    "gemini-compat": {**drop(BASE, "presence_penalty", "frequency_penalty"), "max_tokens": 32},
    "openrouter": {**BASE, "max_tokens": 32, **LOGPROBS},
    "groq": {**BASE, "max_tokens": 32},
    "together": {**BASE, "max_tokens": 32, "logprobs": 5},
    "fireworks": {**drop(BASE, "presence_penalty", "frequency_penalty"), "max_tokens": 32, **LOGPROBS},
    "deepseek": {**BASE, "max_tokens": 32, **LOGPROBS},
    "mistral": {**drop(BASE, "seed"), "max_tokens": 32, "random_seed": 0},
    "xai": {
        **drop(BASE, "presence_penalty", "frequency_penalty", "stop"),
        "max_tokens": 32 + 1024,
        **LOGPROBS,
    },
}


def prober(preset: str | None = None, kind: type = compat, **request: object) -> compat.Prober:
    block = {"name": "b", "model": "m", "base_url": "http://127.0.0.1:9/v1", "preset": preset}
    return kind.Prober(kind.Settings(**block, **({"request": request} if request else {})))


def test_a_backend_without_a_profile_sends_what_it_always_sent():
    p = prober()
    assert p._prepared(CHAT).content == CHAT_BYTES
    assert p._prepared(RAW).content == RAW_BYTES
    assert "request.profile" not in p.snapshot()  # stacks recorded before profiles still match


def test_every_preset_has_its_body():
    assert set(PRESET_BODIES) == set(PRESETS)
    for name, expected in PRESET_BODIES.items():
        body = prober(name).request(CHAT)
        assert body == expected, name
        assert json.loads(compat.wire_body(body)) == expected  # every parameter sent is the stored request


def test_explicit_keys_override_the_preset_and_extra_body_tables_merge():
    p = prober(
        "openai-reasoning",
        logprobs="prefer",
        top_logprobs=3,
        reasoning_tokens=100,
        extra_body={"reasoning_effort": "high", "service_tier": "flex"},
    )
    body = p.request(CHAT)
    assert body["logprobs"] is True and body["top_logprobs"] == 3  # min(canary's 5, cap 3)
    assert body["max_completion_tokens"] == 132 and "temperature" not in body  # the rest is the preset's
    assert body["reasoning_effort"] == "high" and body["service_tier"] == "flex"
    assert p.profile.omit == PRESETS["openai-reasoning"].omit


def test_omit_token_param_extra_body_and_the_reasoning_budget():
    body = prober(
        omit=["seed", "stop", "n"], token_param="none", extra_body={"provider": {"order": ["x"]}}
    ).request(CHAT)
    assert {"seed", "stop", "n", "max_tokens", "max_completion_tokens"}.isdisjoint(body)
    assert body["provider"] == {"order": ["x"]} and body["temperature"] == 0.0
    raw = prober(token_param="max_completion_tokens", reasoning_tokens=500, logprobs="off").request(RAW)
    assert raw["max_tokens"] == 532 and "logprobs" not in raw  # legacy completions know only max_tokens
    assert prober(top_logprobs=2).request(RAW)["logprobs"] == 2


def test_the_responses_kind_builds_its_own_body():
    body = prober(kind=responses).request(CHAT)
    assert body == {
        "model": "m",
        "input": MESSAGES,
        "max_output_tokens": 32,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_logprobs": 5,
        "include": ["message.output_text.logprobs"],
    }
    short = Canary(id="s", messages=MESSAGES, decoding={"max_tokens": 2})
    off = prober(
        kind=responses, logprobs="off", omit=["temperature"], extra_body={"reasoning": {"effort": "low"}}
    )
    assert off.request(short) == {
        "model": "m",
        "input": MESSAGES,
        "max_output_tokens": 16,  # OpenAI's minimum
        "top_p": 1.0,
        "reasoning": {"effort": "low"},
    }
    assert compat.wire_body(off.request(short)).startswith(b'{"model":"m","input":')


def test_a_profile_change_is_a_stack_change_not_a_new_canary():
    plain, reasoning, tuned = prober(), prober("openai-reasoning"), prober("openai-reasoning", top_logprobs=1)
    digests = {p.snapshot().get("request.profile") for p in (plain, reasoning, tuned)}
    assert len(digests) == 3 and None in digests
    assert plain.request_hash(CHAT) == reasoning.request_hash(CHAT) == tuned.request_hash(CHAT)
    assert prober("openai-reasoning").snapshot() == reasoning.snapshot()  # stable across processes
    # the same effective profile by a preset or by explicit keys is the same stack
    spelled = prober(**PRESETS["groq"].model_dump())
    assert spelled.snapshot()["request.profile"] == prober("groq").snapshot()["request.profile"]


def config(tmp_path: Path, block: str, suite: str = "", refs: str = "['s.toml']") -> Path:
    (tmp_path / "s.toml").write_text(
        suite or '[suite]\nname = "s"\n[[canary]]\nid = "c"\nmessages = [{ role = "user", content = "hi" }]\n'
    )
    path = tmp_path / "canaryd.toml"
    path.write_text(
        f"state_dir = 'state'\nsuites = {refs}\n[[backends]]\nname = 'cloud'\nkind = 'openai'\nbase_url = 'http://h/v1'\n"
        f"model = 'm'\n{block}"
    )
    return path


@pytest.mark.parametrize(
    ("block", "message"),
    [
        (
            "preset = 'openai'\n",
            "backends[0].preset: unknown preset 'openai' (known: openai-chat, openai-reasoning",
        ),
        (
            "[backends.request]\nlogprob = 'off'\n",
            "backends[0].request.logprob: Extra inputs are not permitted",
        ),
        (
            "[backends.request]\nlogprobs = 'maybe'\n",
            "backends[0].request.logprobs: Input should be 'require'",
        ),
        ("[backends.request]\ntop_logprobs = 21\n", "backends[0].request.top_logprobs: Input should be less"),
        (
            "[backends.request]\nomit = ['model']\n",
            "backends[0].request.omit[0]: Input should be 'temperature'",
        ),
        (
            "[backends.request]\ntoken_param = 'max_output'\n",
            "backends[0].request.token_param: Input should be",
        ),
        (
            "[backends.request]\nreasoning_tokens = -1\n",
            "backends[0].request.reasoning_tokens: Input should be",
        ),
        (
            "[backends.request]\nextra_body = { messages = [] }\n",
            "backends[0].request.extra_body: 'messages' is the canary's own",
        ),
        (
            "[backends.request]\nextra_body = { at = 1979-05-27 }\n",
            "backends[0].request.extra_body: not JSON",
        ),
    ],
)
def test_a_bad_profile_is_one_line_naming_the_field(tmp_path, block, message):
    with pytest.raises(InputError) as e:
        load_config(config(tmp_path, block))
    assert message in str(e.value) and "\n" not in str(e.value)


RAW_SUITE = '[suite]\nname = "raw"\n[[canary]]\nid = "sky"\nprompt = "The sky is"\n'


def validate(path: Path, command: str = "validate") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "canaryd", "-c", str(path), command],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("block", "why"),
    [
        ("preset = 'openai-chat'\n", "(preset = 'openai-chat')"),
        ("[backends.request]\ncompletions = false\n", "(request.completions = false)"),
        ("", None),
    ],
)
def test_raw_prompt_canaries_are_refused_up_front_where_there_is_no_completions_endpoint(
    tmp_path, block, why
):
    p = validate(config(tmp_path, block, RAW_SUITE))
    if why is None:
        assert p.returncode == 0, p.stderr
        return
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert (
        "canary 'sky' (suite 'raw') is a raw prompt, but backend 'cloud' has no completions endpoint"
        in p.stderr
    )
    assert why in p.stderr
    check = validate(config(tmp_path, block, RAW_SUITE), "check")  # refused before anything is sent
    assert check.returncode == 2 and check.stderr == p.stderr


def test_the_responses_kind_refuses_raw_prompts_and_a_suite_can_leave_it_out(tmp_path):
    from canaryd.canaries import load_suites
    from canaryd.probe.run import plan

    path = config(
        tmp_path,
        "[[backends]]\nname = 'resp'\nkind = 'openai-responses'\nbase_url = 'http://h/v1'\nmodel = 'm'\n",
        RAW_SUITE,
    )
    cfg = load_config(path)
    suites = load_suites([s.path for s in cfg.suites])
    with pytest.raises(
        InputError, match=r"backend 'resp' has no completions endpoint \(kind openai-responses\)"
    ):
        plan(cfg, suites)
    assert [c.id for c in plan(cfg, suites, only="cloud")["cloud"]] == ["sky"]  # the other backend takes it
    path.write_text(
        path.read_text().replace(
            "suites = ['s.toml']", "suites = [{ path = 's.toml', backends = ['cloud'] }]"
        )
    )
    assert validate(path).returncode == 0


def test_a_profile_validates_as_a_model():
    assert RequestProfile().logprobs == "prefer" and RequestProfile().top_logprobs == 20
    assert RequestProfile(completions=False).digest() != RequestProfile().digest()
