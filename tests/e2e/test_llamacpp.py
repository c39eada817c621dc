"""End to end against a real llama.cpp server (``llama-server``) serving the tiny model as GGUF.

The weights are the tiny Llama vLLM serves elsewhere, trained on this suite's answers and converted by
`canaryd.lab.gguf_model`, served through one path (a symlink) so that only the file behind it changes.
In order, on one history: baseline; an unchanged restart (identical); the same weights re-quantised F32
→ Q8_0 (detected, the stack diff naming ``model.ftype``); the F32 weights again under an edited chat
template that renders the same prompts (a stack change named by ``template.sha256``, no answer moved).
Four server starts, about a second each; the binary comes from tests/engines/build_llama_server.sh.
"""

from __future__ import annotations

import fcntl
import math
import os
import re
import time
from contextlib import contextmanager
from pathlib import Path

import httpx2
import pytest

from canaryd.lab.gguf_model import write_gguf
from canaryd.lab.tinymodel import CHAT_TEMPLATE, build_tiny_model
from tests.e2e.conftest import CACHE, REPO
from tests.harness.lab import Lab
from tests.harness.services import Service, wait_for

BUILT = REPO / ".cache/engines/llama.cpp"
SERVER = Path(os.environ.get("CANARYD_LLAMA_SERVER", BUILT / "bin/llama-server"))
BUILD_WAIT_S = 3600
ADD = [{"role": "user", "content": "What is 17 + 25? Answer with the number only."}]
CAPITAL = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
# The same rendering unless the request has tools: what a template update for tool calls looks like.
TOOLS_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{ bos_token }}", "{{ bos_token }}{% if tools %}<|system|>{{ tools | length }} tools\n{% endif %}"
)

SUITE = """
[suite]
name = "llamacpp"
[defaults]
max_tokens = 8
[[canary]]
id = "add"
messages = [{ role = "user", content = "What is 17 + 25? Answer with the number only." }]
expect = { number = 42 }
[[canary]]
id = "capital"
messages = [{ role = "system", content = "Be brief." }, { role = "user", content = "Capital of France?" }]
expect = { exact = "Paris" }
"""

CONFIG = """
state_dir = "state"
suites = ["suite.toml"]
[[backends]]
name = "llama"
kind = "llamacpp"
base_url = "http://127.0.0.1:{port}/v1"
model = "tiny"
timeout_s = 30
"""


def wait_for_build() -> None:
    """Wait while tests/engines/build_llama_server.sh holds its lock: test.sh builds the server in the
    background, and this module is collected last (tests/conftest.py) so that the build overlaps the rest."""
    lock_path = BUILT.with_name(BUILT.name + ".lock")
    if not lock_path.exists():
        return
    deadline = time.monotonic() + BUILD_WAIT_S
    with open(lock_path) as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                assert time.monotonic() < deadline, f"llama-server still building after {BUILD_WAIT_S}s"
                time.sleep(2)


class LlamaLab(Lab):
    @contextmanager
    def serve(self, gguf: Path):
        """llama-server on the lab's port serving ``gguf`` through the ``serving`` symlink."""
        assert SERVER.is_file(), f"{SERVER} missing: run ./test.sh (or tests/engines/build_llama_server.sh)"
        self.serving.unlink(missing_ok=True)
        self.serving.symlink_to(gguf)
        argv = [str(SERVER), "-m", str(self.serving), "--alias", "tiny", "--host", "127.0.0.1"]
        argv += ["--port", str(self.port), "--jinja", "--metrics", "-c", "512", "-np", "1", "-t", "1"]
        argv += ["--no-ui", "--no-warmup"]
        server = Service(argv, self.root / f"llama-{gguf.stem}.log")
        url = f"http://127.0.0.1:{self.port}/health"
        try:
            try:
                wait_for(
                    "llama-server", lambda: server.proc.poll() is None and httpx2.get(url).is_success, 60
                )
            except AssertionError:
                raise AssertionError(f"llama-server did not come up:\n{server.tail()}") from None
            yield server
        finally:
            server.stop()


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> LlamaLab:
    wait_for_build()
    return LlamaLab(tmp_path_factory.mktemp("llamacpp"), SUITE, CONFIG)


@pytest.fixture(scope="module")
def ggufs() -> dict[str, Path]:
    """The trained tiny model as F32, Q8_0, and F32 under the tools-aware template."""
    model = build_tiny_model(CACHE / "llamacpp-add-capital", seed=0, train=[(ADD, "42"), (CAPITAL, "Paris")])
    out = CACHE / "llamacpp-gguf"
    out.mkdir(parents=True, exist_ok=True)
    return {
        "f32": write_gguf(model, out / "tiny-f32.gguf"),
        "q8": write_gguf(model, out / "tiny-q8_0.gguf", file_type="Q8_0"),
        "tools": write_gguf(model, out / "tiny-f32-tools.gguf", chat_template=TOOLS_TEMPLATE),
    }


def verdicts(report: dict) -> dict[str, str]:
    return {r["canary"]: r["verdict"] for r in report["results"]}


def changed(report: dict) -> dict[str, tuple[str, str]]:
    return {c["field"]: (c["before"], c["after"]) for r in report["results"] for c in r["stack_changes"]}


def assert_logprobs_ignore_the_samplers(port: int) -> None:
    """tools/server/README.md (`n_probs`): probabilities are "a simple softmax of the logits without
    considering any other sampler settings". So a top-k of 1 and a min-p of 0.5 change neither the
    logprobs nor the number of alternatives (pre-sampling probabilities, the default)."""

    def ask(**samplers) -> list[dict]:
        body = {"messages": ADD, "temperature": 0, "max_tokens": 4, "logprobs": True, "top_logprobs": 3}
        r = httpx2.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={**body, **samplers}, timeout=30)
        return r.json()["choices"][0]["logprobs"]["content"]

    pinned, truncated = ask(top_k=0, min_p=0.0), ask(top_k=1, min_p=0.5)
    assert pinned == truncated
    assert all(len(t["top_logprobs"]) == 3 for t in pinned), pinned
    assert all(sum(math.exp(a["logprob"]) for a in t["top_logprobs"]) <= 1 + 1e-6 for t in pinned)


def test_baseline_answers_and_snapshot(lab, ggufs):
    with lab.serve(ggufs["f32"]):
        code, report = lab.json("probe")
        assert code == 0, report
        assert verdicts(report) == {"add": "baseline", "capital": "baseline"}
        assert {r["correct"] for r in report["results"]} == {True}, report
        code, report = lab.json("check")
        assert code == 0 and set(verdicts(report).values()) == {"identical"}, report
        assert_logprobs_ignore_the_samplers(lab.port)
    code, stack = lab.json("stack", "--backend", "llama")
    assert code == 0 and len(stack["stacks"]) == 1, stack
    fields = stack["stacks"][0]["fields"]
    assert fields["model.ftype"] == "all F32" and fields["model.path"] == str(lab.serving)
    assert re.fullmatch("[0-9a-f]{7,}", fields["llamacpp.commit"]) and fields["llamacpp.build"].isdigit()
    assert fields["engine.n_ctx"] == "512" and fields["engine.top_k"] == "40"
    assert len(fields["template.sha256"]) == 16 and fields["metrics.series"].startswith("llamacpp:")


def test_unchanged_restart_is_identical(lab, ggufs):
    with lab.serve(ggufs["f32"]):
        code, report = lab.json("check")
    assert code == 0 and set(verdicts(report).values()) == {"identical"}, report


def flipped(lab: LlamaLab) -> list[dict]:
    code, doc = lab.json("explain", "llama")
    assert code == 0, doc
    return doc["flips"]


def test_requantised_weights_are_detected_and_named(lab, ggufs):
    with lab.serve(ggufs["q8"]):  # same path, alias, flags: only the file's tensor types changed
        code, report = lab.json("check")
    assert code == 1, report
    assert set(verdicts(report).values()) <= {"logprob-drift", "answer-drift"}, report
    diff = changed(report)
    assert diff["model.ftype"] == ("all F32", "Q8_0"), diff
    assert {f.split(".")[0] for f in diff} == {"model"} and "model.size" in diff, diff
    for flip in flipped(lab):
        assert flip["suggestion"].split("1. ")[1].startswith("model.ftype (all F32 -> Q8_0)"), flip


def test_reverting_the_file_type_confirms_the_cause(lab, ggufs):
    with lab.serve(ggufs["f32"]):
        code, report = lab.json("check")
    assert code == 0 and set(verdicts(report).values()) == {"identical"}, report


def test_changed_chat_template_is_a_stack_change_before_any_answer_moves(lab, ggufs):
    with lab.serve(ggufs["tools"]):
        code, report = lab.json("check")
    assert code == 1, report
    assert set(verdicts(report).values()) == {"stack-change"}, report
    diff = changed(report)
    assert "template.sha256" in diff and "template.prompt_sha256" not in diff, diff
    assert {f.split(".")[0] for f in diff} == {"template"}, diff
    flips = flipped(lab)
    assert flips and all("template.sha256" in f["suggestion"] for f in flips), flips
