"""Parameter-conformance canaries: the ``conform`` table's errors, the pair's judgement for each way a server
can fail to honour a parameter, and the scripted kind's probe pass with the failure on the metrics' path.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from canaryd.canaries import load_suite
from canaryd.conform import Conform
from canaryd.daemon.metrics import Metrics
from canaryd.errors import InputError
from canaryd.judge.conformance import judge_pair
from canaryd.observation import ErrorKind, Observation, TokenLogprob
from canaryd.probe.shapes import shape_of
from tests.harness.scripted_lab import ScriptedLab, by_id, change, scripted, verdicts

MAX = Conform(param="max_tokens", low=8, high=32)
EFFORT = Conform(param="reasoning_effort", low="low", high="high")


def obs(
    limit: int | None = None,
    n: int | None = None,
    finish: str = "length",
    reasoning: int | None = None,
    effort: str | None = None,
    logprobs: bool = False,
) -> Observation:
    request: dict = {"model": "m"}
    if limit is not None:
        request["max_tokens"] = limit
    if effort is not None:
        request["reasoning_effort"] = effort
    o = Observation("b", "c", "s", datetime(2026, 1, 1, tzinfo=UTC), request, "r")
    o.text, o.finish_reason, o.reasoning_tokens = "x" * (n or 0), finish, reasoning
    if logprobs:
        o.tokens = [TokenLogprob("x", -0.1)] * (n or 0)
    else:
        o.completion_tokens, o.has_logprobs = n, False
    return o


# -- the conform table --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("table", "wanted"),
    [
        ('{ param = "max_tokens", low = 32, high = 8 }', "max_tokens: low (32) must be below high (8)"),
        ('{ param = "max_tokens", low = "a", high = 8 }', "max_tokens: low and high must be integers"),
        (
            '{ param = "max_tokens", low = 8, high = 16, expect = "more" }',
            'max_tokens: expect is "length" or "limit"',
        ),
        (
            '{ param = "reasoning_effort", low = "low", high = "max" }',
            "reasoning_effort: high 'max' is not one of",
        ),
        (
            '{ param = "reasoning_effort", low = "high", high = "low" }',
            "low ('high') must be below high ('low')",
        ),
        ('{ param = "temperature", low = 0, high = 1 }', "conform.param: Input should be 'max_tokens' or"),
        (
            '{ param = "max_tokens", low = 8, high = 16, ratio = 2 }',
            "conform.ratio: Extra inputs are not permitted",
        ),
    ],
)
def test_a_bad_conform_table_is_one_line_naming_file_canary_and_field(tmp_path, table, wanted):
    path = tmp_path / "c.toml"
    path.write_text(
        f'[suite]\nname = "c"\n[[canary]]\nid = "lim"\nmessages = [{{ role = "user", content = "q" }}]\n'
        f"conform = {table}\n"
    )
    with pytest.raises(InputError) as e:
        load_suite(path)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{path}: canary[0] (id 'lim')"), message
    assert wanted in message, message


def test_a_conform_canary_is_a_pair_of_its_own_shape(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(
        '[suite]\nname = "c"\n[[canary]]\nid = "lim"\nprompt = "Count:"\n'
        'conform = { param = "max_tokens", low = 4, high = 12 }\n'
    )
    (canary,) = load_suite(path).canaries
    assert canary.observed_ids() == ("lim:low", "lim:high") and shape_of(canary).name == "conformance"
    assert MAX.wants == "length" and EFFORT.wants == "more"


# -- max_tokens ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("logprobs", [False, True])
def test_max_tokens_honoured_is_no_finding(logprobs):
    assert judge_pair(MAX, obs(8, 8, logprobs=logprobs), obs(32, 20, "stop", logprobs=logprobs)) == {}


@pytest.mark.parametrize(
    ("low", "high", "wanted"),
    [
        (
            obs(8, 51, "stop"),
            obs(32, 51, "stop"),
            {
                "low": "max_tokens ignored: 51 completion tokens > the 8 asked for",
                "high": "max_tokens ignored: 51 completion tokens > the 32 asked for",
            },
        ),
        (
            obs(8, 8, "stop"),
            obs(32, 20, "stop"),
            {"low": "cut at max_tokens 8 but finish_reason is 'stop', not 'length'"},
        ),
        (obs(8, 8), obs(32, 8), {"high": "max_tokens had no effect: 8 tokens at max_tokens 32, 8 at 8"}),
        (
            obs(8, 3, "stop"),
            obs(32, 3, "stop"),
            {"low": "cannot judge max_tokens: the answer ended after 3 tokens"},
        ),
        (
            obs(None, 8),
            obs(None, 20),
            dict.fromkeys(("low", "high"), "cannot judge max_tokens: the request carried no token limit"),
        ),
        (obs(8, None), obs(32, 20), {"low": "cannot judge max_tokens: the answer reports no token count"}),
    ],
)
def test_each_way_max_tokens_is_not_honoured_has_its_reason(low, high, wanted):
    got = judge_pair(MAX, low, high)
    assert set(got) == set(wanted), got
    for side, why in wanted.items():
        assert got[side].startswith(why), got


def test_expect_limit_checks_only_the_limits():
    limit = Conform(param="max_tokens", low=8, high=32, expect="limit")
    assert judge_pair(limit, obs(8, 3, "stop"), obs(32, 3, "stop")) == {}
    assert "ignored" in judge_pair(limit, obs(8, 9, "stop"), obs(32, 3, "stop"))["low"]


def test_a_failed_side_is_left_to_its_own_error():
    failed = obs(8, 51, "stop")
    failed.error, failed.error_kind = "boom", ErrorKind.HTTP_5XX
    assert judge_pair(MAX, failed, obs(32, 51, "stop")) == {}


def test_the_limit_sent_is_what_counts_a_reasoning_budget_included():
    low = obs(None, 300)
    low.request["max_completion_tokens"] = 8 + 2048
    high = obs(None, 900)
    high.request["max_completion_tokens"] = 32 + 2048
    assert judge_pair(MAX, low, high)["low"].startswith(
        "cannot judge max_tokens: the answer ended"
    )  # 300 of 2056 tokens


# -- reasoning_effort ---------------------------------------------------------------------------------


def test_reasoning_effort_honoured_is_no_finding():
    assert (
        judge_pair(
            EFFORT, obs(64, 70, reasoning=60, effort="low"), obs(64, 400, reasoning=380, effort="high")
        )
        == {}
    )


@pytest.mark.parametrize(
    ("low", "high", "spec", "wanted"),
    [
        (
            obs(reasoning=120, effort="low"),
            obs(reasoning=120, effort="high"),
            EFFORT,
            {"high": "reasoning_effort had no effect: 120 reasoning tokens at 'high', 120 at 'low'"},
        ),
        (
            obs(reasoning=100, effort="low"),
            obs(reasoning=150, effort="high"),
            Conform(param="reasoning_effort", low="low", high="high", min_ratio=2),
            {
                "high": "reasoning_effort had no effect: 150 reasoning tokens at 'high', 100 at 'low' "
                "(expected more than 2 ×"
            },
        ),
        (
            obs(effort="low"),
            obs(reasoning=300, effort="high"),
            EFFORT,
            {"low": "cannot judge reasoning_effort: the answer reports no reasoning tokens"},
        ),
        (
            obs(reasoning=100, effort="low"),
            obs(reasoning=100, effort="low"),  # a profile's extra_body pinned the effort
            EFFORT,
            {"high": "cannot judge reasoning_effort: the request carried 'low', not 'high'"},
        ),
    ],
)
def test_each_way_reasoning_effort_is_not_honoured_has_its_reason(low, high, spec, wanted):
    got = judge_pair(spec, low, high)
    assert set(got) == set(wanted), got
    for side, why in wanted.items():
        assert got[side].startswith(why), got


def test_the_responses_api_effort_is_read_from_its_reasoning_table():
    low, high = obs(reasoning=10), obs(reasoning=90)
    low.request["reasoning"], high.request["reasoning"] = {"effort": "low"}, {"effort": "high"}
    assert judge_pair(EFFORT, low, high) == {}


# -- the scripted kind through the probe pass ---------------------------------------------------------

SUITE = """
[suite]
name = "conform"
[[canary]]
id = "lim"
messages = [{ role = "user", content = "Count to twenty." }]
conform = { param = "max_tokens", low = 8, high = 32 }
[[canary]]
id = "effort"
messages = [{ role = "user", content = "How many primes are below 100?" }]
decoding = { max_tokens = 4 }
conform = { param = "reasoning_effort", low = "low", high = "high" }
"""
COUNTING = "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20"
PAIRS = ["lim:low", "lim:high", "effort:low", "effort:high"]


@pytest.fixture
def lab(tmp_path):
    body = change(at=3, until=4, ignore=["max_tokens"]) + change(at=4, until=5, ignore=["reasoning_effort"])
    settings = {"answers": {"lim": COUNTING, "effort": "25"}, "reasoning_tokens": {"effort": 150}}
    settings["reasoning_effort"] = {"low": 100, "high": 400}  # an ignored effort: the default, 150
    lab = ScriptedLab(tmp_path, scripted(body=body, **settings), {"conform.toml": SUITE})
    yield lab
    lab.close()


def test_an_honouring_server_passes_and_one_that_ignores_a_parameter_is_caught(lab):
    first = lab.cycle()
    assert verdicts(first) == dict.fromkeys(PAIRS, "baseline")
    sides = by_id(first)
    assert sides["lim:low"].observation.request["max_tokens"] == 8
    assert sides["lim:high"].observation.request["max_tokens"] == 32
    assert [sides[i].observation.finish_reason for i in ("lim:low", "lim:high")] == ["length", "length"]
    assert sides["effort:high"].observation.request["reasoning_effort"] == "high"
    assert [sides[i].observation.reasoning_tokens for i in ("effort:low", "effort:high")] == [100, 400]
    assert verdicts(lab.cycle()) == dict.fromkeys(PAIRS, "identical")

    ignored = by_id(lab.cycle())  # the server stops honouring max_tokens
    low = ignored["lim:low"]
    assert low.comparison.verdict.value == "error" and low.observation.error_kind is ErrorKind.NONCONFORMANT
    assert low.observation.error == f"max_tokens ignored: {len(COUNTING)} completion tokens > the 8 asked for"
    assert ignored["lim:high"].observation.error_kind is ErrorKind.NONCONFORMANT  # 51 > 32 too

    flat = by_id(lab.cycle())  # ... then reasoning_effort
    assert flat["effort:high"].observation.error_kind is ErrorKind.NONCONFORMANT
    assert flat["effort:high"].observation.error.startswith("reasoning_effort had no effect")
    assert flat["effort:low"].comparison.verdict.value == "answer-drift"  # its reasoning tokens moved too

    m = Metrics()
    m.record(lab.cycle(), now=1.0)  # honoured again
    assert (
        m.registry.get_sample_value(
            "canaryd_backend_probe_failures_total", {"backend": "fake", "reason": "nonconformant"}
        )
        is None
    )
    lab.write(
        scripted(ignore=["max_tokens"], answers={"lim": COUNTING}, reasoning_effort={"low": 1, "high": 9})
    )
    m.record(lab.cycle(), now=2.0)
    labels = {"backend": "fake", "reason": "nonconformant"}
    assert m.registry.get_sample_value("canaryd_backend_probe_failures_total", labels) == 2
    pair = {"backend": "fake", "canary": "lim:low"}
    assert m.registry.get_sample_value("canaryd_canary_verdict", {**pair, "verdict": "error"}) == 1


def test_the_census_refuses_a_pair_by_its_shapes_name(lab):
    p = lab.cli("census", "--canary", "lim")
    assert p.returncode == 2
    assert "'lim' is a conformance canary; the census takes single-request ones" in p.stderr
