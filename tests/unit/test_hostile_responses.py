"""Hostile answers cost exactly one observation: the parsers name the field, the probe pass vets every
answer, the judge never compares an unusable logprob (nor trusts a stored baseline holding one), and the
rest of the pass, the store and every other backend's series are untouched.

The whole-pass cases run the scripted kind through the real registry, probe pass, store and judge, with
each answer round-tripped through the OpenAI wire format (`openai_wire.parse_json` and the chat / legacy
completion parsers) the way the HTTP kinds read a body, and one canary's body made hostile.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest
from prometheus_client import generate_latest

from canaryd.backends import openai_headers
from canaryd.backends import openai_wire as wire
from canaryd.backends.vllm_offline import token_logprobs
from canaryd.daemon.metrics import Metrics, bounded
from canaryd.judge.compare import Comparison, Verdict, compare
from canaryd.judge.sampled import compare_samples
from canaryd.judge.stats import CalibrationError, NoiseModel, Point, fit
from canaryd.observation import ErrorKind, Observation, TokenLogprob, utcnow
from canaryd.probe import vet
from canaryd.probe.run import BackendRun, Result
from tests.harness.scripted_lab import ScriptedLab, by_id, change, scripted, verdicts

IDS = ["add", "capital", "colors"]
NAN, INF = float("nan"), float("inf")
T0 = datetime(2026, 1, 1, tzinfo=UTC)


# -- the parsers ----------------------------------------------------------------------------------------
def chat_doc(lps=(-0.1, -0.2), top=(-1.0, -2.0), **fields) -> dict:
    content = [
        {
            "token": str(i),
            "logprob": lp,
            "bytes": [48 + i],
            "top_logprobs": [{"token": f"t{j}", "logprob": v} for j, v in enumerate(top)],
        }
        for i, lp in enumerate(lps)
    ]
    doc = {
        "model": "m",
        "system_fingerprint": "fp",
        "choices": [
            {"message": {"content": "01"}, "finish_reason": "stop", "logprobs": {"content": content}}
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": len(lps)},
    }
    doc.update(fields)
    return doc


def completion_doc(lps=(-0.1, -0.2), top=-1.0) -> dict:
    return {
        "choices": [
            {
                "text": "01",
                "logprobs": {
                    "tokens": ["0", "1"],
                    "token_logprobs": list(lps),
                    "top_logprobs": [{"0": top}, {"1": -1.0}],
                },
            }
        ]
    }


def chat_with(path: tuple, value: object) -> dict:
    doc = chat_doc()
    *parents, last = path
    node = doc
    for p in parents:
        node = node[p]
    node[last] = value
    return doc


PARSER_CASES = [
    # (name, parser, body, error message fragment or None: accepted)
    ("nan chosen", wire.parse_chat, chat_doc(lps=(-0.1, NAN)), "choices.0.logprobs.content.1.logprob: nan"),
    ("+inf chosen", wire.parse_chat, chat_doc(lps=(INF, -0.1)), "choices.0.logprobs.content.0.logprob: inf"),
    ("-inf chosen", wire.parse_chat, chat_doc(lps=(-INF, -0.1)), "content.0.logprob: -inf"),
    ("positive", wire.parse_chat, chat_doc(lps=(0.5, -0.1)), "content.0.logprob: 0.5 > 0"),
    ("-1e308", wire.parse_chat, chat_doc(lps=(-1e308, -0.1)), "content.0.logprob: -1e+308 < -100000"),
    ("huge int", wire.parse_chat, chat_doc(lps=(-(10**400), -0.1)), "content.0.logprob: -huge < -100000"),
    ("string logprob", wire.parse_chat, chat_doc(lps=("-0.1", -0.1)), "content.0.logprob: has type str"),
    ("nan top-k", wire.parse_chat, chat_doc(top=(-1.0, NAN)), "content.0.top_logprobs.1.logprob: nan"),
    ("positive top-k", wire.parse_chat, chat_doc(top=(3.0,)), "content.0.top_logprobs.0.logprob: 3 > 0"),
    ("rounding above 0", wire.parse_chat, chat_doc(lps=(5e-5, -0.1)), None),
    ("vLLM's -9999 floor", wire.parse_chat, chat_doc(lps=(-9999.0, -0.1)), None),
    (
        "surrogate content",
        wire.parse_chat,
        chat_with(("choices", 0, "message", "content"), "4\ud800"),
        "choices.0.message.content: not valid UTF-8 (lone surrogate at index 1)",
    ),
    (
        "surrogate fingerprint",
        wire.parse_chat,
        chat_doc(system_fingerprint="\udfff"),
        "system_fingerprint: not",
    ),
    ("surrogate model", wire.parse_chat, chat_doc(model="m\ud800"), "model: not valid UTF-8"),
    (
        "surrogate token",
        wire.parse_chat,
        chat_with(("choices", 0, "logprobs", "content", 1, "token"), "\ud800"),
        "choices.0.logprobs.content.1.token: not valid UTF-8",
    ),
    (
        "token not a string",
        wire.parse_chat,
        chat_with(("choices", 0, "logprobs", "content", 0, "token"), [1]),
        "content.0.token has type list",
    ),
    (
        "byte out of range",
        wire.parse_chat,
        chat_with(("choices", 0, "logprobs", "content", 0, "bytes"), [300]),
        "content.0.bytes.0: not a byte",
    ),
    (
        "legacy nan",
        wire.parse_completion,
        completion_doc(lps=(-0.1, NAN)),
        "choices.0.logprobs.token_logprobs.1: nan",
    ),
    (
        "legacy inf top-k",
        wire.parse_completion,
        completion_doc(top=INF),
        "choices.0.logprobs.top_logprobs.0.'0': inf",
    ),
    ("legacy positive", wire.parse_completion, completion_doc(lps=(2.0, -0.1)), "token_logprobs.0: 2 > 0"),
    ("legacy ok", wire.parse_completion, completion_doc(), None),
]


@pytest.mark.parametrize(("name", "parse", "body", "message"), PARSER_CASES, ids=[c[0] for c in PARSER_CASES])
def test_parsers_refuse_unusable_values_naming_the_field(name, parse, body, message):
    # through the bytes a transport reads, too (NaN and Infinity are what Python's JSON writes for them)
    raw = json.dumps(body, ensure_ascii=True).encode()
    for doc in (body, wire.parse_json(raw)):
        if message is None:
            r = parse(doc)
            assert all(-1e5 <= t.logprob <= 1e-4 for t in r.tokens)
        else:
            with pytest.raises(wire.InvalidResponse) as err:
                parse(doc)
            assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"choices": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested too deep"),
        (b'{"choices": [{"text": "\xed\xa0\x80"}]}', "body is not UTF-8 (byte 23)"),  # an encoded surrogate
        (b"\xff{}", "body is not UTF-8 (byte 0)"),
        (b'{"a": 1', "body is not JSON"),
        (b"", "body is not JSON"),
        (b"1" * 5000, "body is not JSON"),  # past Python's int-digits limit: ValueError, not a crash
    ],
)
def test_parse_json_turns_every_failure_into_an_invalid_response(raw, message):
    with pytest.raises(wire.InvalidResponse) as err:
        wire.parse_json(raw)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_parse_json_reads_strict_utf8_and_ignores_a_bom():
    assert wire.parse_json(b'\xef\xbb\xbf{"a": "\xc3\xa9"}') == {"a": "\u00e9"}
    assert (
        wire.parse_json('{"a": NaN}')["a"] != wire.parse_json('{"a": NaN}')["a"]
    )  # a value: the parsers judge it


@pytest.mark.parametrize(
    "raw",
    [
        json.dumps(chat_doc(lps=(-1.2e-05, -0.0, -3.5), top=(-1e-300, -99999.5))).encode(),
        b'\xef\xbb\xbf{"a": [1, 2.5, "\xc3\xa9"]}',  # a BOM: refused by the fast reader, read by the full one
        b'{"a": NaN, "b": -Infinity, "c": 1e400}',  # only the full reader takes these
        b'{"a": "\\ud800", "b": "\\ud83d\\ude00"}',  # an escaped lone surrogate, and a pair
        b'{"a": 1, "a": 2, "n": -9223372036854775808, "u": 18446744073709551615}',
    ],
)
def test_parse_json_reads_bytes_as_the_standard_library_does(raw):
    got, want = wire.parse_json(raw), json.loads(raw.decode("utf-8-sig"))
    assert repr(got) == repr(want)  # repr: NaN is equal to nothing, and -0.0 must stay -0.0


@pytest.mark.parametrize(
    ("second", "kind"),
    [(None, "NoneType"), (True, "bool"), ("2", "str"), (2.0, "float"), (18446744073709551616, "float")],
)
def test_a_token_id_that_is_no_integer_is_refused_naming_it(second, kind):
    # an integer beyond 64 bits arrives as a float (the fast reader's), which the field refuses
    doc = chat_doc()
    doc["choices"][0]["token_ids"] = [7, second]
    with pytest.raises(wire.InvalidResponse, match=rf"choices\.0\.token_ids\.1 has type {kind}$"):
        wire.parse_chat(wire.parse_json(json.dumps(doc).encode()))
    doc["choices"][0]["token_ids"] = [7]  # fewer ids than tokens: the rest have none
    assert [t.token_id for t in wire.parse_chat(doc).tokens] == [7, None]


def test_kept_headers_are_an_allow_list_of_exact_names_with_bounded_values():
    sent = {f"x-ratelimit-custom-{i}": "1" for i in range(300)}
    sent |= {
        "X-RateLimit-Remaining-Tokens": "7" * 1000,
        "x-ratelimit-reset-requests": "1s",
        "Set-Cookie": "s",
    }
    sent |= {"Server": "vllm", "X-Request-Id": "r1", "Authorization": "Bearer k", "openai-processing-ms": "3"}
    kept = openai_headers.kept_headers(sent.items())
    assert kept == {
        "x-ratelimit-remaining-tokens": "7" * openai_headers.MAX_HEADER_VALUE,
        "x-ratelimit-reset-requests": "1s",
        "server": "vllm",
        "x-request-id": "r1",
        "openai-processing-ms": "3",
    }
    assert openai_headers.kept_headers(sent) == kept  # a mapping works as well as its items
    assert not openai_headers.keep_header("x-ratelimit-anything-else") and openai_headers.keep_header(
        "retry-after"
    )


def lp(logprob: float, rank: int) -> SimpleNamespace:
    return SimpleNamespace(logprob=logprob, rank=rank, decoded_token="")


@pytest.mark.parametrize(
    ("steps", "message"),
    [
        ([{7: lp(NAN, 1)}], "outputs.0.logprobs.0.logprob: nan"),
        ([{7: lp(-0.1, 1), 9: lp(NAN, 2)}], "outputs.0.logprobs.0.top.1.logprob: nan"),
        ([{7: lp(0.5, 1)}], "outputs.0.logprobs.0.logprob: 0.5 > 0"),
        ([{7: lp(INF, 1)}], "outputs.0.logprobs.0.logprob: inf"),
    ],
)
def test_vllm_offline_logprobs_refuse_nan_and_positive_values(steps, message):
    with pytest.raises(wire.InvalidResponse, match=message.replace(".", r"\.").replace("+", r"\+")):
        token_logprobs([7], steps, k=2)


def test_vllm_offline_clamps_minus_inf_like_the_server():
    (t,) = token_logprobs([7], [{7: lp(-INF, 1), 9: lp(-1e300, 2)}], k=2)
    assert t.logprob == -9999.0 and t.top == (("token_id:7", -9999.0), ("token_id:9", -9999.0))


# -- the judge ------------------------------------------------------------------------------------------
def observation(*lps: float, text: str = "42", top: tuple = ()) -> Observation:
    o = Observation("b", "c", "s", T0, {}, "r", text=text)
    o.tokens = [TokenLogprob(str(i), v, top=top) for i, v in enumerate(lps)]
    return o


@pytest.mark.parametrize("bad", [NAN, INF, -INF, 0.5, -1e308])
def test_compare_never_calls_an_unusable_logprob_identical(bad):
    good = observation(-0.5, -0.25)
    # the old comparison: abs(nan - x) > tol is False, so a NaN looked identical (and hid every change)
    now = compare(good, observation(bad, -0.25), correct=True, baseline_correct=True)
    assert now.verdict is Verdict.ERROR and "invalid_response: tokens.0.logprob" in now.reasons[0]
    refused = compare(observation(-0.5, bad), good, correct=True, baseline_correct=True)
    assert refused.verdict is Verdict.BASELINE
    assert refused.reasons[0].startswith("stored baseline refused (tokens.1.logprob: ")
    in_top = compare(observation(-0.5, top=(("x", bad),)), good, correct=None)
    assert in_top.verdict is Verdict.BASELINE and "tokens.0.top.0.logprob" in in_top.reasons[0]


def test_a_sampled_baseline_set_with_an_unusable_logprob_is_refused():
    base = [observation(-0.5), observation(NAN)]
    c = compare_samples(base, [observation(-0.5), observation(-0.5)], expect=None, alpha=0.05)
    assert c.verdict is Verdict.BASELINE and "sample 1: tokens.0.logprob: nan" in c.reasons[0]


def test_calibration_refuses_unusable_logprobs():
    probes = [observation(-0.5), observation(-0.5), observation(NAN)]
    with pytest.raises(CalibrationError, match=r"calibration probe 2: tokens\.0\.logprob: nan"):
        fit(probes)
    doc = fit(probes[:2]).as_dict()
    for broken in (
        {**doc, "refs": [Point(("0",), {(0, "0"): NAN}).as_list(), *doc["refs"][1:]]},
        {**doc, "refs": [Point(("0",), {(0, "0"): 7.0}).as_list(), *doc["refs"][1:]]},
        {**doc, "default_spread": INF},
        {**doc, "loo": [NAN, 0.0]},
        {**doc, "spread": [[0, "0", -1.0]]},
    ):
        with pytest.raises(CalibrationError):
            NoiseModel.from_dict(json.loads(json.dumps(broken)))  # as stored (JSON keeps NaN)
    assert NoiseModel.from_dict(doc).k == 2


# -- the probe pass -------------------------------------------------------------------------------------
def chat_body(o: Observation) -> dict:
    content = [
        {
            "token": t.token,
            "logprob": t.logprob,
            "bytes": list(t.bytes or ()),
            "top_logprobs": [{"token": a, "logprob": v} for a, v in t.top],
        }
        for t in o.tokens
    ]
    choice = {
        "message": {"content": o.text},
        "finish_reason": o.finish_reason,
        "logprobs": {"content": content},
    }
    choice["token_ids"] = [t.token_id for t in o.tokens]
    usage = {"prompt_tokens": o.prompt_tokens, "completion_tokens": o.completion_tokens}
    return {
        "model": o.response_model,
        "system_fingerprint": o.system_fingerprint,
        "choices": [choice],
        "usage": usage,
    }


def completion_body(o: Observation) -> dict:
    logprobs = {
        "tokens": [t.token for t in o.tokens],
        "token_logprobs": [t.logprob for t in o.tokens],
        "top_logprobs": [dict(t.top) for t in o.tokens],
    }
    choice = {"text": o.text, "finish_reason": o.finish_reason, "logprobs": logprobs}
    choice["token_ids"] = [t.token_id for t in o.tokens]
    usage = {"prompt_tokens": o.prompt_tokens, "completion_tokens": o.completion_tokens}
    return {
        "model": o.response_model,
        "system_fingerprint": o.system_fingerprint,
        "choices": [choice],
        "usage": usage,
    }


@dataclass(frozen=True)
class Unparsed:
    """A hostile observation straight from a kind, past no parser: only the probe pass's vetting sees it."""

    change: Callable[[Observation], None]


Hostile = Callable[[dict], dict | bytes] | Unparsed


class Wire:
    """Wraps a scripted backend's prober: every answer becomes an OpenAI body and is read back by the wire
    parsers, as an HTTP kind reads it; ``hostile[canary]`` rewrites that canary's body first."""

    def __init__(self, lab: ScriptedLab, name: str) -> None:
        self.prober = lab.backend(name).prober
        self.attempt = self.prober.attempt
        self.hostile: dict[str, Hostile] = {}
        self.prober.attempt = self.send

    def send(self, canary) -> Observation:
        o = self.attempt(canary)
        if not o.ok:
            return o
        mutate = self.hostile.get(canary.id)
        if isinstance(mutate, Unparsed):  # a kind that builds its observation without these parsers
            mutate.change(o)
            return o
        chat = canary.messages is not None
        doc = chat_body(o) if chat else completion_body(o)
        out = mutate(doc) if mutate else doc
        raw = out if isinstance(out, bytes) else json.dumps(out).encode()
        fresh = Observation(o.backend, o.canary_id, o.suite, o.started_at, o.request, o.request_hash)
        try:
            r = (wire.parse_chat if chat else wire.parse_completion)(wire.parse_json(raw))
        except wire.InvalidResponse as e:
            fresh.error_kind, fresh.error = ErrorKind.INVALID_RESPONSE, str(e)
            return fresh
        fresh.text, fresh.finish_reason, fresh.system_fingerprint = (
            r.text,
            r.finish_reason,
            r.system_fingerprint,
        )
        fresh.response_model, fresh.prompt_tokens, fresh.completion_tokens = (
            r.model,
            r.prompt_tokens,
            r.completion_tokens,
        )
        fresh.stack = {
            "response.model": str(r.model),
            "response.system_fingerprint": str(r.system_fingerprint),
        }
        if r.tokens is None:
            fresh.error_kind, fresh.error = ErrorKind.NO_LOGPROBS, "response carries no logprobs"
        else:
            fresh.tokens = r.tokens
        return fresh


def at(path: tuple, value: object) -> Hostile:
    def mutate(doc: dict) -> dict:
        *parents, last = path
        node = doc
        for p in parents:
            node = node[p]
        node[last] = value
        return doc

    return mutate


def too_many_tokens(doc: dict) -> dict:
    content = doc["choices"][0]["logprobs"]["content"]
    doc["choices"][0]["logprobs"]["content"] = content * 4  # "Paris": 20 tokens for max_tokens 16
    doc["choices"][0]["token_ids"] *= 4
    doc["choices"][0]["message"]["content"] *= 4
    return doc


def no_logprobs_but_long(doc: dict) -> dict:
    del doc["choices"][0]["logprobs"]
    doc["usage"]["completion_tokens"] = 999
    return doc


CONTENT0 = ("choices", 0, "logprobs", "content", 0)
LEGACY = ("choices", 0, "logprobs")
PASS_CASES = [
    # (name, canary, hostile body, error kind, message fragment)
    ("nan", "capital", at((*CONTENT0, "logprob"), NAN), "invalid_response", "content.0.logprob: nan"),
    ("+inf", "capital", at((*CONTENT0, "logprob"), INF), "invalid_response", "content.0.logprob: inf"),
    ("-inf", "capital", at((*CONTENT0, "logprob"), -INF), "invalid_response", "content.0.logprob: -inf"),
    (
        "positive",
        "capital",
        at((*CONTENT0, "logprob"), 2.5),
        "invalid_response",
        "content.0.logprob: 2.5 > 0",
    ),
    ("-1e308", "capital", at((*CONTENT0, "logprob"), -1e308), "invalid_response", "-1e+308 < -100000"),
    (
        "nan top-k",
        "capital",
        at((*CONTENT0, "top_logprobs", 1, "logprob"), NAN),
        "invalid_response",
        "content.0.top_logprobs.1.logprob: nan",
    ),
    (
        "legacy nan",
        "colors",
        at((*LEGACY, "token_logprobs", 2), NAN),
        "invalid_response",
        "token_logprobs.2: nan",
    ),
    (
        "surrogate content",
        "capital",
        at(("choices", 0, "message", "content"), "Par\ud800"),
        "invalid_response",
        "choices.0.message.content: not valid UTF-8",
    ),
    (
        "surrogate fingerprint",
        "capital",
        at(("system_fingerprint",), "fp\udbff"),
        "invalid_response",
        "system_fingerprint: not valid UTF-8",
    ),
    (
        "deep nesting",
        "capital",
        lambda doc: b'{"choices": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "invalid_response",
        "nested too deep",
    ),
    ("more tokens than max_tokens", "capital", too_many_tokens, "too_large", "20 tokens > max_tokens 16"),
    ("usage past max_tokens", "capital", no_logprobs_but_long, "too_large", "999 tokens > max_tokens 16"),
    (
        "unparsed nan",
        "capital",
        Unparsed(lambda o: o.tokens.__setitem__(2, replace(o.tokens[2], logprob=NAN))),
        "invalid_response",
        "tokens.2.logprob: nan",
    ),
    (
        "unparsed top-k above 0",
        "capital",
        Unparsed(lambda o: o.tokens.__setitem__(1, replace(o.tokens[1], top=(("x", 0.25),)))),
        "invalid_response",
        "tokens.1.top.0.logprob: 0.25 > 0",
    ),
    (
        "unparsed surrogate text",
        "capital",
        Unparsed(lambda o: setattr(o, "text", "Par\udc00is")),
        "invalid_response",
        "text: not valid UTF-8 (lone surrogate at index 3)",
    ),
    (
        "unparsed surrogate stack",
        "capital",
        Unparsed(lambda o: o.stack.update({"response.model": "\ud800"})),
        "invalid_response",
        "stack.response.model: not valid UTF-8",
    ),
    (
        "unparsed too many tokens",
        "colors",
        Unparsed(lambda o: setattr(o, "tokens", o.tokens * 3)),
        "too_large",
        "15 tokens > max_tokens 5",
    ),
]

TABLES = ("run", "event", "outcome", "payload", "stack", "request", "baseline")


def rows(lab: ScriptedLab) -> dict[str, set]:
    path = lab.config.storage_url.removeprefix("sqlite:///")
    with sqlite3.connect(path) as db:
        return {t: set(db.execute(f"select * from {t}").fetchall()) for t in TABLES}


@pytest.fixture
def lab(tmp_path):
    lab = ScriptedLab(tmp_path, scripted("good") + scripted("fake"))
    yield lab
    lab.close()


def exposition(*runs: BackendRun) -> str:
    m = Metrics()
    for r in runs:
        m.record(r)
    return generate_latest(m.registry).decode()


def healthy_series(text: str, backend: str, canaries: list[str]) -> None:
    for c in canaries:
        labels = f'backend="{backend}",canary="{c}"'
        assert f"canaryd_canary_probe_success{{{labels}}} 1.0" in text
        assert f'canaryd_canary_verdict{{{labels},verdict="identical"}} 1.0' in text
    assert f'canaryd_backend_reachable{{backend="{backend}"}} 1.0' in text
    assert f'canaryd_backend_stack_info{{backend="{backend}"' in text


@pytest.mark.parametrize(
    ("name", "canary", "hostile", "kind", "message"), PASS_CASES, ids=[c[0] for c in PASS_CASES]
)
def test_one_hostile_answer_costs_one_observation(lab, name, canary, hostile, kind, message):
    fake = Wire(lab, "fake")
    Wire(lab, "good")
    assert verdicts(lab.cycle("good")) == verdicts(lab.cycle("fake")) == dict.fromkeys(IDS, "baseline")
    before = rows(lab)

    fake.hostile[canary] = hostile
    good_run, fake_run = lab.cycle("good"), lab.cycle("fake")
    bad = by_id(fake_run)[canary]
    assert bad.observation.error_kind.value == kind and message in bad.observation.error
    assert bad.comparison.verdict is Verdict.ERROR and bad.observation.tokens == []
    others = [c for c in IDS if c != canary]
    assert {c: verdicts(fake_run)[c] for c in others} == dict.fromkeys(others, "identical")
    assert verdicts(good_run) == dict.fromkeys(IDS, "identical")

    # every earlier row (runs, observations, payloads, stacks, baselines) byte for byte as it was
    after = rows(lab)
    for t in TABLES:
        assert before[t] <= after[t], t
    assert after["baseline"] == before["baseline"]

    # the series: the healthy backend complete, the hostile canary a failure by its reason, nothing lost
    text = exposition(good_run, fake_run)
    healthy_series(text, "good", IDS)
    healthy_series(text, "fake", others)
    labels = f'backend="fake",canary="{canary}"'
    assert f"canaryd_canary_probe_success{{{labels}}} 0.0" in text
    assert f'canaryd_canary_verdict{{{labels},verdict="error"}} 1.0' in text
    assert f'canaryd_backend_probe_failures_total{{backend="fake",reason="{kind}"}} 1.0' in text

    # the server behaves again: identical to the untouched baseline
    fake.hostile.clear()
    assert verdicts(lab.cycle("fake")) == dict.fromkeys(IDS, "identical")


def test_a_judging_bug_is_that_canarys_internal_error(lab, monkeypatch):
    from canaryd.probe import shapes

    assert verdicts(lab.cycle("fake")) == dict.fromkeys(IDS, "baseline")
    before = rows(lab)
    real = shapes.compare

    def buggy(baseline, current, **kw):
        if current.canary_id == "capital":
            raise ZeroDivisionError("a judging bug")
        return real(baseline, current, **kw)

    monkeypatch.setattr(shapes, "compare", buggy)
    run = lab.cycle("fake")
    capital = by_id(run)["capital"]
    assert capital.observation.error_kind is ErrorKind.INTERNAL
    assert capital.observation.error == "judging failed: ZeroDivisionError: a judging bug"
    assert capital.comparison.verdict is Verdict.ERROR
    assert {c: verdicts(run)[c] for c in ("add", "colors")} == {"add": "identical", "colors": "identical"}
    assert rows(lab)["baseline"] == before["baseline"]
    text = exposition(run)
    healthy_series(text, "fake", ["add", "colors"])
    assert 'canaryd_canary_verdict{backend="fake",canary="capital",verdict="error"} 1.0' in text
    assert 'canaryd_backend_probe_failures_total{backend="fake",reason="internal"} 1.0' in text


def test_a_sending_bug_is_that_canarys_internal_error(lab, monkeypatch):
    from canaryd.probe import shapes

    real = shapes.Plain.send

    def buggy(self, backend, canary):
        if canary.id == "add":
            raise RuntimeError("a sending bug")
        return real(self, backend, canary)

    monkeypatch.setattr(shapes.Plain, "send", buggy)
    run = by_id(lab.cycle("fake"))
    assert run["add"].observation.error == "sending failed: RuntimeError: a sending bug"
    assert run["capital"].comparison.verdict is Verdict.BASELINE


def test_a_storing_failure_stores_that_canary_as_an_internal_error(lab):
    # a usage count past 64 bits: SQLite refuses it, and with it the pass's one transaction
    lab.write(scripted("fake", body=change(at=1, canaries=["capital"], prompt_tokens_delta=2**63 - 1)))
    run = by_id(lab.cycle("fake"))
    capital = run["capital"].observation
    assert capital.error_kind is ErrorKind.INTERNAL and capital.text is None
    assert capital.error.startswith("storing failed: OverflowError")
    assert {run[c].comparison.verdict for c in ("add", "colors")} == {Verdict.BASELINE}
    assert lab.store.observation(run["capital"].observation_id).error == capital.error
    assert lab.store.baseline("fake", "capital") is None  # an error never becomes the baseline
    assert lab.store.baseline("fake", "add").observation_id == run["add"].observation_id


def test_a_stored_baseline_with_a_nan_is_refused_and_replaced(lab):
    backend = lab.backend("fake")
    canary = next(c for c in lab.canaries("fake") if c.id == "add")
    # a baseline an older version stored: NaN logprobs, for the very request the canary sends
    old = Observation(
        "fake", "add", canary.suite, utcnow(), backend.request(canary), backend.request_hash(canary)
    )
    old.text, old.tokens = "42", [TokenLogprob("4", NAN, 52), TokenLogprob("2", -0.1, 50)]
    run_id = lab.store.start_run("fake")
    old_id = lab.store.add_observation(run_id, old, Comparison(Verdict.BASELINE, True), None)
    stored = lab.store.baseline("fake", "add")
    assert stored.observation_id == old_id and math.isnan(stored.observation.tokens[0].logprob)

    first = by_id(lab.cycle("fake"))
    add = first["add"]
    assert add.comparison.verdict is Verdict.BASELINE and add.observation.ok
    assert add.comparison.reasons == (
        "stored baseline refused (tokens.0.logprob: nan): this observation replaces it",
    )
    assert add.comparison.delta is None  # nothing was compared with it
    assert lab.store.baseline("fake", "add").observation_id == add.observation_id != old_id
    # the new baseline is used from now on: an unchanged answer is identical, not compared with the NaN
    assert verdicts(lab.cycle("fake")) == dict.fromkeys(IDS, "identical")


def test_a_stored_calibration_with_a_nan_is_refused_with_a_reason(lab):
    # without learning, whose first contact would replace the refused model before the pass is judged
    lab.write(scripted("good") + scripted("fake"), tail="[compare]\nlearn = false\n")
    assert verdicts(lab.cycle("fake")) == dict.fromkeys(IDS, "baseline")
    base = lab.store.baseline("fake", "add").observation
    good = fit([base, base])
    broken = NoiseModel(
        good.request_hash, (Point(("x",), {(0, "x"): NAN}), *good.refs), good.spread, 1e-6, (0.0, 0.0, 0.0)
    )
    lab.store.save_calibration("fake", "add", broken)
    add = by_id(lab.cycle("fake"))["add"]
    assert add.comparison.verdict is Verdict.IDENTICAL and add.comparison.evidence is None
    assert "stored calibration refused (refs.0: logprob at 0 'x': nan)" in add.comparison.reasons[-1]


# -- the daemon -----------------------------------------------------------------------------------------
def test_one_backends_failure_leaves_every_other_backends_series(tmp_path, monkeypatch):
    from canaryd.config import load_config
    from canaryd.daemon import service

    lab = ScriptedLab(
        tmp_path,
        scripted("good") + scripted("broken") + scripted("unrecordable"),
        tail='[[schedules]]\nname = "fast"\nevery = "1s"\n',
    )
    lab.close()
    d = service.Daemon(lab.path, load_config(lab.path))
    real_probe, real_record = service.run_pass, d.metrics.record

    def probe(config, backends, work, store):
        if "broken" in work:
            raise OSError("database is locked")
        return real_probe(config, backends, work, store)

    def record(run, now=None):
        if run.backend == "unrecordable":
            raise ValueError("a metrics bug")
        return real_record(run, now)

    monkeypatch.setattr(service, "run_pass", probe)
    monkeypatch.setattr(d.metrics, "record", record)
    try:
        d._pass("fast")
        d._pass("fast")
    finally:
        d.gen.close()
        d.store.close()
    text = generate_latest(d.metrics.registry).decode()
    healthy_series(text, "good", IDS)
    for b in ("broken", "unrecordable"):
        for c in IDS:
            labels = f'backend="{b}",canary="{c}"'
            assert f"canaryd_canary_probe_success{{{labels}}} 0.0" in text
            assert f'canaryd_canary_verdict{{{labels},verdict="error"}} 1.0' in text
        # two passes of every canary, each a failure by its reason
        assert (
            f'canaryd_backend_probe_failures_total{{backend="{b}",reason="internal"}} {2.0 * len(IDS)}'
            in text
        )
        # CanarydProbesFailing: probe_success == 0 unless the backend is unreachable; nothing says it is
        assert f'canaryd_backend_reachable{{backend="{b}"}} 0.0' not in text
    assert 'canaryd_schedule_last_run_timestamp_seconds{schedule="fast"}' in text


# -- labels and the vetting itself ---------------------------------------------------------------------
def stack_run(backend: str, fingerprint: str, model: str) -> BackendRun:
    o = Observation(backend, "c", "s", T0, {}, "r", text="42", system_fingerprint=fingerprint)
    o.tokens = [TokenLogprob("42", -0.5)]
    cmp = compare(None, o, correct=None)
    stack = {
        "scripted.version": "9" * 1000,
        "response.system_fingerprint": fingerprint,
        "response.model": model,
    }
    return BackendRun(backend, "scripted", 1, [Result(1, 1, o, cmp)], stack)


def info_labels(text: str, backend: str) -> dict[str, str]:
    import re

    (line,) = [
        x for x in text.splitlines() if x.startswith(f'canaryd_backend_stack_info{{backend="{backend}"')
    ]
    return dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', line))


def test_long_label_values_are_cut_and_marked_and_stay_distinct():
    m = Metrics(label_length=128)
    long_a, long_b = "a" * 1_000_000, "a" * 999_999 + "b"  # a 1 MB fingerprint, and one differing at the end
    m.record(stack_run("one", long_a, "m" * 5000))
    m.record(stack_run("two", long_b, "model"))
    text = generate_latest(m.registry).decode()
    one, two = info_labels(text, "one"), info_labels(text, "two")
    for labels in (one, two):
        assert all(len(v) <= 128 for v in labels.values())
    assert one["fingerprint"].startswith("a" * 96 + "…") and one["fingerprint"] != two["fingerprint"]
    assert one["engine_version"] == "9" * 96 + "…" + one["engine_version"][-10:]
    assert one["model"] == "m" * 96 + "…" + one["model"][-10:] and two["model"] == "model"
    assert m.registry.get_sample_value("canaryd_backend_fingerprints", {"backend": "one"}) == 1
    assert len(bounded("x" * 100, 16)) == 16 and bounded("short", 16) == "short"
    assert bounded("m\ud800odel", 16) == "m\\ud800odel"  # escaped: one odd value never breaks the exposition
    assert bounded("x" * 100, 16) != bounded("x" * 99 + "y", 16)


def test_vet_bounds_headers_and_makes_every_string_storable():
    o = Observation("b", "c", "s", T0, {}, "r", text="ok")
    o.headers = {f"h{i}": "v" * 1000 for i in range(100)}
    o.error_kind, o.error = ErrorKind.INTERNAL, "KeyError: '\ud800'"  # a kind's exception echoing the body
    o.stack = {"response.model": "m\udc00"}
    vet.vet(o, max_tokens=4)
    assert len(o.headers) == vet.MAX_HEADERS and all(
        len(v) == vet.MAX_HEADER_VALUE for v in o.headers.values()
    )
    assert o.error == "KeyError: '\\ud800'" and o.stack == {"response.model": "m\\udc00"}
    ok = Observation("b", "c", "s", T0, {}, "r", text="ok", completion_tokens=5)
    assert (
        vet.vet(ok, max_tokens=4).error == "5 tokens > max_tokens 4" and ok.error_kind is ErrorKind.TOO_LARGE
    )
    fine = Observation("b", "c", "s", T0, {}, "r", text="ok", completion_tokens=4)
    assert vet.vet(fine, max_tokens=4).ok
