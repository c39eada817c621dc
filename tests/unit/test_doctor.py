"""``canaryd doctor`` against every replayed provider family (tests/harness/providers.py): the
facts it finds, the profile it writes, what it spends, and how it fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from canaryd.backends import discover as doctor
from canaryd.backends.openai_responses import DOCTOR as RESPONSES_API
from canaryd.backends.profile import insert_profile, to_toml
from canaryd.config import load_config
from canaryd.errors import InputError
from tests.harness.providers import KEY, Replay
from tests.harness.scripted_lab import free_port

# family → (findings that matter, the profile doctor must write)
EXPECTED: dict[str, tuple[dict, dict]] = {
    "openai-chat": (
        {"logprobs": "returned", "top_logprobs": 20, "fingerprint": "fp_b3f1157249", "reasoning_tokens": 0},
        {"logprobs": "require", "top_logprobs": 20, "token_param": "max_tokens", "completions": False},
    ),
    "openai-reasoning": (
        {"logprobs": "refused", "refused": ["temperature"], "reasoning_tokens": 8, "reasoning_effort": True},
        {
            "logprobs": "off",
            "token_param": "max_completion_tokens",
            "omit": ["temperature"],
            "extra_body": {"reasoning_effort": "low"},
            "reasoning_tokens": doctor.REASONING_BUDGET,
            "completions": False,
        },
    ),
    "anthropic-compat": (
        {"logprobs": "ignored", "refused": ["top_p"], "fingerprint": None},
        {"logprobs": "off", "token_param": "max_tokens", "omit": ["top_p"], "completions": False},
    ),
    "gemini-compat": (
        {"logprobs": "refused", "refused": []},
        {"logprobs": "off", "token_param": "max_tokens", "completions": False},
    ),
    "openrouter": (
        {"logprobs": "ignored", "completions": True},
        {"logprobs": "off", "token_param": "max_tokens", "completions": True},
    ),
    "together": (
        {"logprobs": "legacy", "top_logprobs": 0, "completions": True},
        {"logprobs": "require", "top_logprobs": 0, "token_param": "max_tokens", "completions": True},
    ),
    "groq": (
        {"logprobs": "refused", "fingerprint": "fp_179b0f92c9"},
        {"logprobs": "off", "token_param": "max_tokens", "completions": False},
    ),
    "mistral": (
        {"logprobs": "ignored", "refused": ["seed"], "seed_alias": "random_seed"},
        {
            "logprobs": "off",
            "token_param": "max_tokens",
            "omit": ["seed"],
            "extra_body": {"random_seed": 0},
            "completions": False,
        },
    ),
    "xai": (
        {"logprobs": "ignored", "refused": ["presence_penalty"], "fingerprint": "fp_3a7881249c"},
        {"logprobs": "off", "token_param": "max_tokens", "omit": ["presence_penalty"], "completions": False},
    ),
    "deepseek": (
        {"logprobs": "returned", "top_logprobs": 20, "fingerprint": "fp_8802369eaa_prod0623_fp8_kvcache"},
        {"logprobs": "require", "top_logprobs": 20, "token_param": "max_tokens", "completions": False},
    ),
}

# Comments, a second backend after the one doctor writes to, and a table after both: all kept byte for byte.
CONFIG = """\
# my canaryd config
state_dir = "state"   # kept
suites = ["s.toml"]

[[backends]]
name = "cloud"
kind = "openai"
base_url = "{base}"
model = "m"
api_key_env = "REPLAY_KEY"
timeout_s = 10  # short

[[backends]]
name = "other"
kind = "openai"
base_url = "http://127.0.0.1:9/v1"
model = "x"

[compare]
logprob_tolerance = 0.0  # kept
"""
SUITE = """\
[suite]
name = "s"
[[canary]]
id = "add"
messages = [{ role = "user", content = "What is 17 + 25?" }]
expect = { number = 42 }
"""


@pytest.fixture(scope="module")
def replay():
    with Replay() as r:
        yield r


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("REPLAY_KEY", KEY)
    (tmp_path / "s.toml").write_text(SUITE)
    return tmp_path


def config(folder: Path, base: str) -> Path:
    path = folder / "canaryd.toml"
    path.write_text(CONFIG.format(base=base))
    return path


def cli(path: Path, *args: str, key: str = KEY) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "canaryd", "-c", str(path), "doctor", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "REPLAY_KEY": key, "NO_COLOR": "1"},
        timeout=60,
    )


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_finds_the_family_facts_and_writes_its_profile(family: str, replay: Replay, folder: Path) -> None:
    path = config(folder, replay.base(family))
    before = replay.spent(family)
    found = doctor.discover(load_config(path).backend("cloud"))
    facts, want = EXPECTED[family]
    got = found.as_dict()
    assert {k: got[k] for k in facts} == facts, got["evidence"]
    assert doctor.profile(found) == want

    # Small, and never more than announced: every request a one-line prompt capped at 8 answer tokens.
    sent = replay.got(family)[-found.requests :]
    assert len(sent) == found.requests <= doctor.MAX_REQUESTS
    for g in sent:
        limit = g.body.get("max_tokens", g.body.get("max_completion_tokens"))
        assert limit == doctor.MAX_TOKENS and doctor.PROMPT in json.dumps(g.body)
    assert found.tokens == replay.spent(family) - before
    assert 0 < found.tokens <= doctor.estimate()["tokens"] <= 500

    original = path.read_text()
    block = to_toml(want, "cloud")
    insert_profile(path, "cloud", block, want)
    text = path.read_text()
    doc = tomllib.loads(text)
    assert doc["backends"][0]["request"] == want
    assert "request" not in doc["backends"][1]
    # Every line of the old file is still there, in order; the block went in the cloud backend's section.
    assert text.replace(block + "\n", "") == original
    assert text.index(block) < text.index('name = "other"')


def test_a_second_run_replaces_the_table_it_wrote(replay: Replay, folder: Path) -> None:
    path = config(folder, replay.base("mistral"))
    original = path.read_text()
    settings = load_config(path).backend("cloud")
    old = {"logprobs": "require", "top_logprobs": 5, "extra_body": {"a": {"b": 1}}}
    insert_profile(path, "cloud", to_toml(old, "cloud"), old)
    assert tomllib.loads(path.read_text())["backends"][0]["request"] == old
    want = doctor.profile(doctor.discover(settings))
    block = to_toml(want, "cloud")
    insert_profile(path, "cloud", block, want)
    text = path.read_text()
    assert tomllib.loads(text)["backends"][0]["request"] == want == EXPECTED["mistral"][1]
    assert text.count("[backends.request]") == 1
    assert text.replace(block + "\n", "") == original


def test_cli_write_puts_the_profile_in_the_file(replay: Replay, folder: Path) -> None:
    path = config(folder, replay.base("groq"))
    p = cli(path, "cloud", "--write")
    assert p.returncode == 0, p.stderr
    assert f"wrote [backends.request] of 'cloud' into {path}" in p.stdout
    assert tomllib.loads(path.read_text())["backends"][0]["request"] == EXPECTED["groq"][1]


def test_cli_prints_the_spend_first_then_findings_profile_and_what_it_spent(
    replay: Replay, folder: Path
) -> None:
    path = config(folder, replay.base("openai-reasoning"))
    before = replay.spent("openai-reasoning")
    p = cli(path, "cloud")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    estimate = doctor.estimate()
    assert out.startswith(f"doctor: asking 'cloud' at most {estimate['requests']} requests")
    assert f"at most {estimate['tokens']} tokens" in out.splitlines()[0]
    assert "max_completion_tokens" in out and "You are not allowed to request logprobs" in out
    assert 'token_param = "max_completion_tokens"' in out and 'omit = ["temperature"]' in out
    spent = replay.spent("openai-reasoning") - before
    assert out.splitlines()[-1].endswith(f"requests, {spent} tokens")
    assert "[backends.request]" not in path.read_text()  # printed, not written, without --write

    p = cli(path, "cloud", "--json")
    doc = json.loads(p.stdout)
    assert p.returncode == doc["exit_code"] == 0
    assert doc["profile"] == EXPECTED["openai-reasoning"][1] and doc["written"] is None
    assert doc["spent"]["tokens"] <= doc["estimate"]["tokens"]
    assert doc["findings"]["evidence"]["logprobs"].startswith("HTTP 403")
    assert "at most" in p.stderr  # the spend announced on stderr, stdout one JSON document


def test_preset_named_by_host() -> None:
    plain, reasoning = doctor.Findings(), doctor.Findings(reasoning_tokens=64)
    assert doctor.preset_for("https://api.groq.com/openai/v1", plain) == "groq"
    assert doctor.preset_for("https://api.openai.com/v1", plain) == "openai-chat"
    assert doctor.preset_for("https://api.openai.com/v1", reasoning) == "openai-reasoning"
    assert doctor.preset_for("https://my.openai.azure.com/openai/v1", plain) == "azure"
    assert doctor.preset_for("http://127.0.0.1:8000/v1", plain) is None
    assert 'preset = "groq"' in to_toml({"logprobs": "off"}, "b", "groq")


def test_unreachable_is_exit_3_in_one_line(folder: Path) -> None:
    path = config(folder, f"http://127.0.0.1:{free_port()}/v1")
    p = cli(path, "cloud")
    assert p.returncode == 3
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("canaryd: doctor: backend 'cloud'"), p.stderr


def test_a_refused_key_is_exit_2_naming_the_backend_and_never_shows_the_key(
    replay: Replay, folder: Path
) -> None:
    path = config(folder, replay.base("openai-chat"))
    p = cli(path, "cloud", key="sk-wrong-key-123")
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "backend 'cloud'" in lines[0] and "HTTP 401" in lines[0], p.stderr
    assert "sk-wrong-key-123" not in p.stdout + p.stderr


def test_kinds_not_spoken_over_http_are_refused(folder: Path) -> None:
    path = folder / "canaryd.toml"
    path.write_text('state_dir = "state"\nsuites = ["s.toml"]\n[[backends]]\nname = "f"\nkind = "scripted"\n')
    with pytest.raises(InputError, match="'f': kind 'scripted' is not reached over HTTP"):
        doctor.discover(load_config(path).backend("f"))
    assert cli(path, "f").returncode == 2


def test_a_table_it_cannot_place_is_refused_and_the_file_kept(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    text = 'backends = [{ name = "cloud", kind = "openai" }]\n'
    path.write_text(text)
    with pytest.raises(InputError, match="paste the block by hand"):
        insert_profile(path, "cloud", to_toml({"logprobs": "off"}, "cloud"), {"logprobs": "off"})
    assert path.read_text() == text


def test_refusals_name_the_parameter_in_each_provider_envelope() -> None:
    def reply(doc: object) -> doctor.Reply:
        return doctor.Reply(400, doc, json.dumps(doc))

    params = tuple(doctor.SAMPLING)
    assert doctor.named(reply({"error": {"param": "temperature", "message": "x"}}), params) == ["temperature"]
    mistral = {"message": {"detail": [{"type": "extra_forbidden", "loc": ["body", "seed"]}]}}
    assert doctor.named(reply(mistral), params) == ["seed"]
    xai = {"error": "Model grok-4-0709 does not support parameter presencePenalty."}
    assert doctor.named(reply(xai), params) == ["presence_penalty"]
    claude = {"error": {"message": "`temperature` and `top_p` cannot both be specified for this model."}}
    assert doctor.named(reply(claude), params) == ["temperature", "top_p"]
    assert doctor.named(reply({"error": {"message": "top_logprobs must be <= 5"}}), ("logprobs",)) == []


def test_the_responses_api_is_asked_through_responses(
    replay: Replay, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backend of the Responses kind (its settings are the HTTP kinds' own) is asked on POST /responses,
    with logprobs through ``include`` and the API's smallest ``max_output_tokens``."""
    from canaryd.backends.openai_compat import Settings

    monkeypatch.setenv("REPLAY_KEY", KEY)
    settings = Settings(
        name="r", base_url=replay.base("openai-responses"), model="m", api_key_env="REPLAY_KEY"
    )
    settings = settings.model_copy(update={"kind": "openai-responses"})  # the kind lands on another branch
    before = len(replay.got("openai-responses"))
    found = doctor.discover(settings)
    assert (found.logprobs, found.top_logprobs, found.refused) == ("returned", 20, [])
    assert doctor.profile(found) == {"logprobs": "require", "top_logprobs": 20}
    sent = replay.got("openai-responses")[before:]
    assert {g.path for g in sent} == {"/responses"} and len(sent) == found.requests == 3
    assert {g.body["max_output_tokens"] for g in sent} == {RESPONSES_API.max_tokens} == {16}
    assert sent[-1].body["include"] == ["message.output_text.logprobs"]
    assert 0 < found.tokens <= doctor.estimate("openai-responses")["tokens"]


@pytest.mark.parametrize("mode", ["503", "429", "hang", "cut"])
def test_a_failing_endpoint_is_unreachable(mode: str, folder: Path) -> None:
    from tests.harness.loopback import Loopback

    with Loopback() as server:
        path = config(folder, server.base(mode))
        path.write_text(path.read_text().replace("timeout_s = 10", "timeout_s = 1"))
        with pytest.raises(doctor.Unreachable, match=r"^backend 'cloud': http://127\.0\.0\.1:\d+/"):
            doctor.discover(load_config(path).backend("cloud"))


def test_a_body_that_is_not_json_is_read_as_nothing_returned(folder: Path) -> None:
    from tests.harness.loopback import Loopback

    with Loopback() as server:
        path = config(folder, server.base("badjson"))
        found = doctor.discover(load_config(path).backend("cloud"))
    assert (found.logprobs, found.fingerprint, found.tokens) == ("ignored", None, 0)
    assert doctor.profile(found)["logprobs"] == "off"
