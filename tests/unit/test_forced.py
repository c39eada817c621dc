"""Forced canaries (a fixed ``continuation`` scored by teacher forcing) through the scripted kind.

The scripted kind scores a continuation character by character (`scripted.Prober._scored`); everything
else is the real registry, resilience, vetting, probe pass, store and judge. A forced canary's tokens are
its continuation's every cycle, so only logprobs can move; a kind that cannot score is refused before
anything is sent (exit 2, naming backend and canary). The vLLM scoring body is parsed from a response the
real server sent (tests/fixtures/scoring/).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from sqlalchemy import text

from canaryd.backends import openai_wire as wire
from canaryd.backends import scoring
from canaryd.canaries import Canary
from canaryd.errors import InputError
from canaryd.probe.shapes import FORCED, shape_of
from tests.harness.fixtures import load
from tests.harness.replay import Server
from tests.harness.scripted_lab import PLAIN, ScriptedLab, by_id, change, scripted, verdicts

FORCED_SUITE = """
[suite]
name = "forced"
[[canary]]
id = "forced-chat"
messages = [{ role = "user", content = "What is the capital of France? Answer with one word." }]
continuation = "Paris"
[[canary]]
id = "forced-raw"
prompt = "The three primary colors of light are red, green and"
continuation = " blue"
"""
ANSWERS = {"forced-chat": "Paris", "forced-raw": " blue"}  # what the scripted model would say


@pytest.fixture
def make(tmp_path):
    labs = []

    def build(backends: str, suites: dict[str, str] | None = None, **kwargs) -> ScriptedLab:
        lab = ScriptedLab(tmp_path, backends, suites or {"forced.toml": FORCED_SUITE}, **kwargs)
        labs.append(lab)
        return lab

    yield build
    for lab in labs:
        lab.close()


def test_a_forced_canary_is_the_forced_shape_and_scores_its_continuation_token_by_token(make):
    lab = make(scripted(answers=ANSWERS))
    run = lab.cycle()
    assert verdicts(run) == {"forced-chat": "baseline", "forced-raw": "baseline"}
    obs = by_id(run)["forced-chat"].observation
    assert shape_of(lab.canaries()[0]) is FORCED
    assert [t.token for t in obs.tokens] == list("Paris") and obs.text == "Paris"
    assert obs.finish_reason == "forced" and obs.request["continuation"] == "Paris"
    assert all(t.top and t.top[0][0] == t.token for t in obs.tokens)  # the model's own answer: top-1


def test_forced_canaries_are_identical_across_passes_and_a_logprob_shift_is_logprob_drift(make):
    lab = make(scripted(answers=ANSWERS, body=change(at=3, logprob_shift=-0.25)))
    lab.cycle()
    assert set(verdicts(lab.cycle()).values()) == {"identical"}
    run = lab.cycle()
    assert set(verdicts(run).values()) == {"logprob-drift"}
    delta = by_id(run)["forced-raw"].comparison.delta
    assert delta.first_divergence is None and delta.max_abs_dlogprob == pytest.approx(0.25)


def test_a_forced_canary_scores_the_same_tokens_even_when_the_model_would_answer_otherwise(make):
    """No sampling: a model that now says something else still scores the same tokens (lower), which is
    a logprob drift, never an answer drift that an argmax flip could fake."""
    lab = make(scripted(answers=ANSWERS, body=change(at=2, text="Lyon")))
    lab.cycle()
    run = lab.cycle()
    comparison = by_id(run)["forced-chat"].comparison
    assert comparison.verdict.value == "logprob-drift"
    assert comparison.delta.first_divergence is None and comparison.delta.max_abs_dlogprob >= 1.0
    assert [t.token for t in by_id(run)["forced-chat"].observation.tokens] == list("Paris")


def test_forced_canaries_are_calibrated_like_plain_ones_and_noise_is_within_noise(make):
    from canaryd.probe.calibrate import calibrate

    lab = make(scripted(answers=ANSWERS, noise=0.01, seed=0))
    lab.cycle()
    saved = calibrate(lab.backend(), lab.canaries(), lab.store, k=8, batch_sizes=[1, 2])
    assert [(c.canary_id, c.problem, c.errors) for c in saved] == [
        ("forced-chat", None, 0),
        ("forced-raw", None, 0),
    ]
    assert {c.model.regime.value for c in saved} == {"continuous"}
    assert set(verdicts(lab.cycle()).values()) <= {"within-noise", "identical"}


def test_a_failed_scoring_is_an_error_never_identical(make):
    lab = make(scripted(retries=0, body=change(at=2, error="http_5xx")))
    lab.cycle()
    run = lab.cycle()
    assert set(verdicts(run).values()) == {"error"}


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ('expect = { exact = "Paris" }', "expect"),
        ("decoding = { samples = 4, temperature = 1.0 }", "decoding.samples"),
        ('conform = { param = "max_tokens", low = 1, high = 8 }', "conform"),
        ("decoding = { top_logprobs = 0 }", "top_logprobs"),
    ],
)
def test_a_forced_canary_refuses_what_it_cannot_judge(make, tmp_path, extra, field):
    suite = FORCED_SUITE.replace('continuation = "Paris"', f'continuation = "Paris"\n{extra}')
    with pytest.raises(InputError, match=rf"forced-chat.*continuation.*{field}"):
        make(scripted(), {"forced.toml": suite}).canaries()


def test_a_forced_canary_on_a_kind_that_cannot_score_is_refused_naming_backend_and_canary(make):
    backends = (
        scripted() + '[[backends]]\nname = "api"\nkind = "openai"\nbase_url = "http://127.0.0.1:9/v1"\n'
    )
    backends += 'model = "m"\n'
    lab = make(backends, {"plain.toml": PLAIN, "forced.toml": FORCED_SUITE})
    with pytest.raises(InputError, match=r"canary 'forced-chat'.*backend 'api' \(kind openai\) cannot score"):
        lab.canaries("api")
    assert len(lab.canaries("fake")) == 5  # the scripted kind scores
    p = lab.cli("validate")
    assert p.returncode == 2 and "backend 'api' (kind openai) cannot score" in p.stderr


def test_a_suite_kept_off_a_kind_that_cannot_score_is_accepted(make, tmp_path):
    backends = (
        scripted() + '[[backends]]\nname = "api"\nkind = "openai"\nbase_url = "http://127.0.0.1:9/v1"\n'
    )
    backends += 'model = "m"\n'
    lab = make(backends, {"plain.toml": PLAIN, "forced.toml": FORCED_SUITE})
    text = lab.path.read_text().replace(
        'suites = ["plain.toml", "forced.toml"]',
        'suites = ["plain.toml", { path = "forced.toml", backends = ["fake"] }]',
    )
    lab.path.write_text(text)
    assert lab.cli("validate").returncode == 0


# -- vLLM's prompt_logprobs, as the real server answers ------------------------------------------------


def _recorded() -> dict:
    return load("scoring/vllm-prompt-logprobs")


def test_the_recorded_vllm_scoring_body_parses_into_the_continuations_tokens():
    rec = _recorded()
    ids, start, k = rec["ids"], rec["continuation_start"], rec["request"]["prompt_logprobs"]
    tokens = scoring.scored_tokens(rec["response"], ids, start, k)
    assert [t.token_id for t in tokens] == ids[start:]
    assert all(t.token == f"token_id:{t.token_id}" and len(t.top) == k for t in tokens)
    for t in tokens:  # the top-k is ranked, and the scored token's logprob is at most the best one's
        lps = [lp for _, lp in t.top]
        assert lps == sorted(lps, reverse=True) and t.logprob <= lps[0] + 1e-9


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r["choices"][0].update(prompt_logprobs=None), "expected .* positions, got NoneType"),
        (lambda r: r["choices"][0]["prompt_logprobs"].pop(), "expected .* positions"),
        (lambda r: r.update(choices=[]), "no choices"),
        (lambda r: r["choices"][0]["prompt_logprobs"][-1].clear(), "is missing"),
        (
            lambda r: [
                v.update(logprob=float("nan")) for v in r["choices"][0]["prompt_logprobs"][-1].values()
            ],
            "usable logprob",
        ),
    ],
)
def test_an_unreadable_scoring_body_is_an_invalid_response(mutate, message):
    rec = _recorded()
    mutate(rec["response"])
    with pytest.raises(wire.InvalidResponse, match=message):
        scoring.scored_tokens(rec["response"], rec["ids"], rec["continuation_start"], 5)


def test_the_scoring_request_names_continuation_and_prompt_logprobs_and_hashes_stably():
    c = Canary(id="x", prompt="Say", continuation=" ok", decoding={"top_logprobs": 3})
    body = scoring.score_request("m", c)
    assert body["continuation"] == " ok" and body["prompt_logprobs"] == 3 and body["max_tokens"] == 1
    assert scoring.score_hash("m", c) == scoring.score_hash("m", c.model_copy())
    assert scoring.score_hash("m", c) != scoring.score_hash("m", c.model_copy(update={"continuation": "!"}))
    assert scoring.tokenize_continuation("m", c)["add_special_tokens"] is False


class ScoringReplay(Server):
    """vLLM's scoring endpoints, answered from the recorded scoring (tests/fixtures/scoring/): ``/tokenize``
    gives the recorded prompt's ids for messages and the continuation's for text, ``/v1/completions`` the
    recorded ``prompt_logprobs`` when asked for those ids, ``/version`` vLLM's recorded answer; the rest is
    404, as for an endpoint vLLM lacks. Every completion body is kept (`sent`)."""

    def __init__(self) -> None:
        self.rec = _recorded()
        self.sent: list[dict] = []
        super().__init__()

    def _answer(self, method: str, url: str, headers, raw: bytes) -> tuple[int, dict[str, str], object]:
        ids, start = self.rec["ids"], self.rec["continuation_start"]
        if (method, url) == ("GET", "/version"):
            return 200, {}, load("engines/vllm-detect/version")["body"]
        if (method, url) == ("POST", "/tokenize"):
            tokens = ids[:start] if "messages" in json.loads(raw) else ids[start:]
            return 200, {}, {"count": len(tokens), "max_model_len": 256, "tokens": tokens}
        if (method, url) == ("POST", "/v1/completions"):
            asked = json.loads(raw)
            self.sent.append(asked)
            if asked.get("prompt") != ids or asked.get("prompt_logprobs") != 5:
                return 400, {}, {"error": {"message": "not the recorded scoring request"}}
            return 200, {}, self.rec["response"]
        return 404, {}, {"detail": "Not Found"}


def test_vllm_scoring_requests_carry_a_fresh_cache_salt_that_stays_out_of_hash_ref_and_store(make):
    """Each scoring request gets its own ``cache_salt`` on the wire (it never reads a cached prefix), the
    stack says so, and the canary keeps its baseline: the recorded request, its hash and its stored body
    are the same every pass, so the ``request`` table holds one row for any number of probes."""
    rec = _recorded()
    suite = FORCED_SUITE.split('[[canary]]\nid = "forced-raw"')[0]
    assert rec["continuation"] == "Paris" and rec["messages"][0]["content"] in suite  # what was recorded
    with ScoringReplay() as server:
        backend = f'name = "local"\nkind = "vllm"\nbase_url = "{server.url}/v1"\nmodel = "tiny"\n'
        lab = make(f"[[backends]]\n{backend}retry_backoff = 0\n", {"forced.toml": suite})
        runs = [lab.cycle("local") for _ in range(3)]
    assert [verdicts(r) for r in runs] == [
        {"forced-chat": "baseline"},
        {"forced-chat": "identical"},
        {"forced-chat": "identical"},
    ]
    # three passes, and first contact's probes (learning finds the replay exact): one salt each
    salts = [body["cache_salt"] for body in server.sent]
    assert len(salts) >= 3 and len(set(salts)) == len(salts)
    assert all(re.fullmatch("[0-9a-f]{32}", s) for s in salts)
    observations = [by_id(r)["forced-chat"].observation for r in runs]
    assert all(o.stack["request.scoring_cache_salt"] == "per-request" for o in observations)
    assert all("cache_salt" not in o.request for o in observations)
    assert len({(o.request_hash, o.request_ref) for o in observations}) == 1
    assert lab.store.baseline("local", "forced-chat").observation.request_hash == observations[0].request_hash
    with lab.store.engine.connect() as db:
        stored = db.execute(text("select hash, body from request")).all()
    assert [h for h, _ in stored] == [observations[0].request_ref]
    assert "cache_salt" not in json.loads(stored[0][1])


def test_the_vllm_kind_scores_within_the_profile_top_k_and_keeps_the_baseline_key():
    """A server started with ``--max-logprobs 2`` refuses ``prompt_logprobs`` above 2 as it refuses
    ``top_logprobs``: ``request.top_logprobs = 2`` caps both, and the canary keeps its baseline."""
    from canaryd.backends import vllm_server

    c = Canary(id="x", prompt="Say", continuation=" ok", decoding={"top_logprobs": 5})
    plain = vllm_server.Prober(vllm_server.Settings(name="v", base_url="http://127.0.0.1:9/v1", model="m"))
    capped = vllm_server.Prober(
        vllm_server.Settings(
            name="v", base_url="http://127.0.0.1:9/v1", model="m", request={"top_logprobs": 2}
        )
    )
    try:
        assert plain.request(c)["prompt_logprobs"] == 5 and capped.request(c)["prompt_logprobs"] == 2
        assert capped.request_hash(c) == plain.request_hash(c)
    finally:
        plain.close()
        capped.close()


def test_the_shipped_forced_suite_loads_and_is_all_forced():
    from canaryd.canaries import load_suite

    suite = load_suite(Path(__file__).parent.parent.parent / "canaries" / "forced.toml")
    assert suite.canaries and all(shape_of(c) is FORCED for c in suite.canaries)
