"""The cheap probe path of the HTTP kinds: a canary's request built once, and the quick check of common
chat logprob entries, which must accept and refuse exactly what the full checks do."""

from __future__ import annotations

import json
import math

import pytest

from canaryd.backends import make_backend, openai_request
from canaryd.backends import openai_compat as compat
from canaryd.backends import openai_wire as wire
from canaryd.canaries import load_suites
from canaryd.config import load_config
from canaryd.observation import canonical_digest
from tests.harness.loopback import Loopback, chat_body

SUITE = """
[suite]
name = "s"
[[canary]]
id = "chat"
messages = [{ role = "user", content = "Say 42." }]
[[canary]]
id = "legacy"
prompt = "The sky is"
[[canary]]
id = "seeded"
messages = [{ role = "user", content = "Pick a number." }]
decoding = { temperature = 1.0, seed = 7, samples = 3 }
"""


@pytest.fixture
def setup(tmp_path):
    with Loopback() as server:
        (tmp_path / "s.toml").write_text(SUITE)
        (tmp_path / "canaryd.toml").write_text(
            'state_dir = "state"\nsuites = ["s.toml"]\n[[backends]]\nname = "v"\nkind = "vllm"\n'
            f'base_url = "{server.base("ok")}"\nmodel = "m"\n'
        )
        config = load_config(tmp_path / "canaryd.toml")
        backend = make_backend(config.backend("v"))
        yield server, backend, load_suites([s.path for s in config.suites])[0].canaries
        backend.close()


def test_a_canarys_request_is_built_once_and_sent_as_it_always_was(setup):
    server, backend, canaries = setup
    for canary in canaries:
        body = backend.request(canary)
        assert backend.request(canary) is body  # built once: the same object, every cycle
        fresh = {**openai_request.request_body("m", canary), **backend.prober.extra_params(canary)}
        assert body == fresh and backend.request_hash(canary) == openai_request.request_hash(fresh)
        obs = backend.probe(canary)
        assert obs.ok and obs.request is body and obs.request_hash == openai_request.request_hash(fresh)
        assert server.requests[-1].body == compat.wire_body(fresh)  # the bytes the SDK sent
        path = "chat/completions" if canary.messages is not None else "completions"
        assert server.requests[-1].path.endswith(path)


def test_both_digests_of_a_request_are_computed_once_and_carried_on_each_observation(setup, monkeypatch):
    """The baseline key and the stored body's key are made when the request is prepared, not per probe
    (and not by the store, which takes the observation's)."""
    _, backend, canaries = setup
    digested = []

    def counted(doc: object) -> str:
        digested.append(doc)
        return canonical_digest(doc)

    monkeypatch.setattr(compat, "canonical_digest", counted)
    monkeypatch.setattr("canaryd.observation.canonical_digest", counted)
    canary = canaries[0]
    first, second = backend.probe(canary), backend.probe(canary)
    assert digested == [first.request]  # once, for both probes
    assert first.request_ref == second.request_ref == canonical_digest(backend.request(canary))
    assert first.request_hash == second.request_hash == backend.request_hash(canary)


def test_each_seed_of_a_sampled_canary_has_its_own_request(setup):
    _, backend, canaries = setup
    seeded = next(c for c in canaries if c.id == "seeded")
    draws = [
        seeded.model_copy(update={"decoding": seeded.decoding.model_copy(update={"seed": 7 + i})})
        for i in range(3)
    ]
    assert [backend.request(d)["seed"] for d in draws] == [7, 8, 9]
    assert len({backend.request_hash(d) for d in draws}) == 3
    again = seeded.model_copy(update={"decoding": seeded.decoding.model_copy(update={"seed": 8})})
    assert backend.request(again) is backend.request(draws[1])  # an equal canary is the same request


class Nested(dict):
    """A JSON object the quick check does not take (it wants exact dicts): the full checks alone judge it."""


def full_checks(doc):
    if isinstance(doc, dict):
        return Nested({k: full_checks(v) for k, v in doc.items()})
    if isinstance(doc, list):
        return [full_checks(v) for v in doc]
    return doc


def entry(**changes) -> dict:
    body = chat_body("42")
    body["choices"][0]["logprobs"]["content"][0].update(changes)
    return body


VARIANTS = [
    entry(),
    entry(logprob=math.nan),
    entry(logprob=math.inf),
    entry(logprob=0.5),
    entry(logprob=-1e9),
    entry(logprob=0),  # an integer logprob: accepted, as a float
    entry(logprob=True),
    entry(logprob="-0.1"),
    entry(token="\ud800"),
    entry(token="ü"),
    entry(token=7),
    entry(bytes=[256]),
    entry(bytes=[True]),
    entry(bytes="x"),
    entry(bytes=None),
    entry(top_logprobs=None),
    entry(top_logprobs={"a": -1.0}),
    entry(top_logprobs=[["a", -1.0]]),
    entry(top_logprobs=[{"token": "a", "logprob": math.nan}]),
    entry(top_logprobs=[{"token": "\udfff", "logprob": -1.0}]),
    entry(top_logprobs=[{"token": "a"}]),
]


@pytest.mark.parametrize("body", VARIANTS, ids=range(len(VARIANTS)))
def test_the_quick_check_accepts_and_refuses_what_the_full_checks_do(body):
    def outcome(doc):
        try:
            return wire.parse_chat(doc)
        except wire.InvalidResponse as e:
            return str(e)

    quick, full = outcome(json.loads(json.dumps(body))), outcome(full_checks(json.loads(json.dumps(body))))
    if isinstance(quick, wire.Parsed) and isinstance(full, wire.Parsed):
        assert [repr(t) for t in quick.tokens] == [repr(t) for t in full.tokens]  # NaN-safe, types included
        assert [type(t.logprob) for t in quick.tokens] == [float]
    assert repr(quick) == repr(full).replace("type Nested", "type dict")  # the wrapper's name aside
