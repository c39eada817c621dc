"""A real vLLM (CPU) server behind the ``openai`` kind with each logprob mode of the request profile.

``logprobs = "off"`` never asks for logprobs: its answers are judged on text and usage (basis ``text``);
``prefer`` asks and is judged on logprobs when they come, on text when they do not (here: the profile
omits the parameters, as a provider that drops them would). In order, on one history: baselines, an
unchanged restart (identical on every basis), and a differently seeded model under a chat template with a
hidden system prompt (its answers change and its prompts grow: both caught on text, with their reasons).
Three server starts, about 40 s each.
"""

import json
import sqlite3
from pathlib import Path

import pytest

from canaryd.lab.tinymodel import CHAT_TEMPLATE, build_tiny_model
from tests.e2e.conftest import CACHE
from tests.harness.lab import Lab

pytestmark = pytest.mark.vllm

SUITE = """
[suite]
name = "text"
[defaults]
max_tokens = 8
[[canary]]
id = "add"
messages = [{ role = "user", content = "What is 17 + 25?" }]
[[canary]]
id = "capital"
messages = [{ role = "user", content = "Capital of France?" }]
"""

CONFIG = """
state_dir = "state"
suites = ["suite.toml"]
[[backends]]
name = "off"
kind = "openai"
base_url = "http://127.0.0.1:{port}/v1"
model = "tiny"
timeout_s = 60
[backends.request]
logprobs = "off"
[[backends]]
name = "prefer"
kind = "openai"
base_url = "http://127.0.0.1:{port}/v1"
model = "tiny"
timeout_s = 60
[backends.request]
logprobs = "prefer"
[[backends]]
name = "dropped"
kind = "openai"
base_url = "http://127.0.0.1:{port}/v1"
model = "tiny"
timeout_s = 60
[backends.request]
logprobs = "prefer"
omit = ["logprobs", "top_logprobs"]
"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> Lab:
    return Lab(tmp_path_factory.mktemp("text-basis"), SUITE, CONFIG)


def results(report: dict, backend: str) -> list[dict]:
    return [r for r in report["results"] if r["backend"] == backend]


def basis(r: dict) -> str:
    return r["basis"]


def test_each_mode_forms_its_baseline_and_an_unchanged_restart_is_identical(lab, tiny_model):
    with lab.serve(tiny_model):
        code, report = lab.json("probe")
        assert code == 0, report
        assert {r["verdict"] for r in report["results"]} == {"baseline"}
        code, report = lab.json("check")
    assert code == 0, report
    assert {r["verdict"] for r in report["results"]} == {"identical"}
    assert {basis(r) for r in results(report, "off")} == {"text"}
    assert {basis(r) for r in results(report, "dropped")} == {"text"}
    assert {basis(r) for r in results(report, "prefer")} == {"logprobs"}

    db = sqlite3.connect(lab.root / "state" / "canaryd.db")
    rows = db.execute("select backend, request, has_logprobs, payload_hash from observation").fetchall()
    for backend, request, has_logprobs, payload in rows:
        sent = json.loads(request)
        if backend == "prefer":
            assert sent["logprobs"] is True and has_logprobs and payload
        else:  # nothing asked, nothing stored; the text and usage are
            assert "logprobs" not in sent and "top_logprobs" not in sent
            assert not has_logprobs and payload is None
    texts = db.execute("select text, prompt_tokens from observation where backend = 'off'").fetchall()
    assert all(t and p for t, p in texts)

    with lab.serve(tiny_model):
        code, report = lab.json("check")
    assert code == 0 and {r["verdict"] for r in report["results"]} == {"identical"}, report


def test_a_changed_model_behind_a_hidden_system_prompt_is_caught_on_text_and_prompt_tokens(lab):
    """A differently seeded model (its answers change) under a chat template with a hidden system prompt
    (more prompt tokens): both are caught on the text basis, each named."""
    other = build_tiny_model(CACHE / "random-seed1", seed=1)
    template = Path(lab.root / "hidden.jinja")
    template.write_text(CHAT_TEMPLATE.replace("{{ bos_token }}", "{{ bos_token }}<|system|>Be terse.\n"))
    with lab.serve(other, extra_args=["--chat-template", str(template)]):
        code, report = lab.json("check")
    assert code == 1, report
    for backend in ("off", "dropped"):
        rs = results(report, backend)
        assert {basis(r) for r in rs} == {"text"}
        for r in rs:
            assert r["verdict"] != "identical" and r["text_identical"] is False, r
            assert r["prompt_tokens_changed"] and any("prompt tokens" in why for why in r["reasons"]), r
