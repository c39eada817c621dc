"""The census statistics on synthetic observations with known answers, and `collect`'s batching."""

import json
import math
import threading
import time
from datetime import UTC, datetime

import pytest

from canaryd.canaries import Canary, Decoding, Message, Step
from canaryd.errors import InputError
from canaryd.judge.census import Census, summarize
from canaryd.observation import ErrorKind, Observation, TokenLogprob
from canaryd.probe.batching import BUILTIN_FILLERS, collect
from canaryd.probe.census import parse_batch_sizes
from canaryd.probe.shapes import fillers_for

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def obs(ids=(), logprobs=None, *, text=None, with_ids=True, error=False) -> Observation:
    lps = logprobs if logprobs is not None else [-0.25] * len(ids)
    tokens = [
        TokenLogprob(token=f"t{i}", logprob=lp, token_id=i if with_ids else None)
        for i, lp in zip(ids, lps, strict=True)
    ]
    o = Observation("b", "c", "s", T0, {}, "", text=text if text is not None else " ".join(map(str, ids)))
    o.tokens = tokens
    if error:
        o.text, o.tokens, o.error, o.error_kind = None, [], "boom", ErrorKind.TIMEOUT
    return o


def test_thousand_greedy_requests_with_eighty_distinct_completions():
    modal = list(range(200))
    observations = [obs(modal) for _ in range(842)]
    for k in range(79):  # 79 variants, each twice; variant k leaves the mode at token 100 + k // 8
        at = 100 + k // 8
        variant = [*modal[:at], 1000 + k, *modal[at + 1 :]]
        observations += [obs(variant), obs(variant)]
    assert len(observations) == 1000

    g = summarize(observations)

    assert (g.n, g.errors, g.ok) == (1000, 0, 1000)
    assert g.distinct_completions == 80 and g.distinct_signatures == 80
    assert g.modal_count == 842
    assert g.first_divergence == {**{i: 16 for i in range(100, 109)}, 109: 14}
    assert g.spread == (0.0,) * 200 and g.max_spread == 0.0
    assert g.modal_text == " ".join(map(str, modal))


def test_one_ulp_of_logprob_is_a_new_signature_but_not_a_new_completion():
    lp = [-0.5, -1.25, -2.0]
    nudged = [-0.5, math.nextafter(-1.25, 0.0), -2.0]
    g = summarize([obs([7, 8, 9], lp), obs([7, 8, 9], lp), obs([7, 8, 9], nudged)])
    assert g.distinct_completions == 1 and g.distinct_signatures == 2 and g.modal_count == 3
    assert g.first_divergence == {}
    assert g.spread == (0.0, math.ulp(1.25), 0.0) and g.max_spread == math.ulp(1.25)


def test_a_changed_top_k_alternative_is_a_new_signature():
    a, b = obs([1, 2]), obs([1, 2])
    a.tokens[0] = TokenLogprob("t1", -0.25, 1, top=(("t1", -0.25), ("x", -3.0)))
    b.tokens[0] = TokenLogprob("t1", -0.25, 1, top=(("t1", -0.25), ("x", -3.5)))
    g = summarize([a, b])
    assert g.distinct_completions == 1 and g.distinct_signatures == 2 and g.max_spread == 0.0


def test_spread_counts_only_probes_on_the_modal_path_up_to_that_position():
    observations = [
        obs([1, 2, 3], [-0.1, -0.2, -0.3]),
        obs([1, 2, 3], [-0.1, -0.25, -0.3]),
        obs([1, 2, 3], [-0.1, -0.2, -0.3]),
        obs([1, 5, 3], [-0.6, -9.0, -9.0]),  # leaves the mode at token 1: counts at position 0 only
        obs([1, 2], [-0.1, -0.2]),  # stops early: a prefix of the mode, diverges at 2
    ]
    g = summarize(observations)
    assert g.distinct_completions == 3 and g.modal_count == 3
    assert g.first_divergence == {1: 1, 2: 1}
    assert g.spread == pytest.approx((0.5, 0.05, 0.0), abs=1e-12)
    assert g.max_spread == pytest.approx(0.5)


def test_errors_are_counted_but_kept_out_of_the_statistics():
    g = summarize([obs([1, 2]), obs(error=True), obs([1, 2]), obs(error=True)])
    assert (g.n, g.errors, g.ok) == (4, 2, 2)
    assert g.distinct_completions == 1 and g.distinct_signatures == 1 and g.modal_count == 2
    empty = summarize([obs(error=True)])
    assert (empty.n, empty.errors, empty.distinct_signatures, empty.modal_signature) == (1, 1, 0, None)


def test_without_token_ids_completions_are_told_apart_by_text():
    same_tokens_no_ids = [obs([1, 2], with_ids=False, text="ab"), obs([1, 2], with_ids=False, text="ab")]
    assert summarize(same_tokens_no_ids).distinct_completions == 1
    # no tokens at all (a server without logprobs): the text decides, divergence is a character index
    a, b = obs(text="hello"), obs(text="help!")
    g = summarize([a, a, b])
    assert g.distinct_completions == 2 and g.first_divergence == {3: 1} and g.spread == ()


def census(**groups) -> Census:
    return Census("b", "c", {int(k.removeprefix("b")): summarize(v) for k, v in groups.items()})


def test_census_is_deterministic_and_batch_invariant_only_with_one_shared_signature():
    same = [obs([1, 2], [-0.5, -0.5]) for _ in range(4)]
    shifted = [obs([1, 2], [-0.5, -0.5000001]) for _ in range(4)]
    mixed = same[:2] + shifted[:2]

    c = census(b1=same, b4=same, b16=same)
    assert c.deterministic is True and c.batch_invariant is True and c.complete
    assert c.verdict() == "deterministic, batch-invariant"

    c = census(b1=same, b4=same, b16=shifted)  # each group is self-consistent, but 16 moved the logprobs
    assert c.deterministic is True and c.batch_invariant is False
    assert c.verdict() == "deterministic, NOT batch-invariant (the signature changes with batch size)"

    c = census(b1=same, b4=mixed)
    assert c.batch_invariant is False
    assert "NOT batch-invariant (several signatures at batch size 4)" in c.verdict()

    c = census(b1=mixed, b4=same)
    assert c.deterministic is False and c.verdict().startswith("NOT deterministic (2 signatures alone)")

    assert census(b4=same, b8=same).deterministic is None  # never measured alone
    assert census(b1=same).batch_invariant is None  # nothing to compare with
    assert census(b1=same, b4=[obs(error=True)]).complete is False


def test_census_as_dict_is_json():
    doc = json.loads(json.dumps(census(b1=[obs([1, 2]), obs([1, 3])], b8=[obs([1, 2])]).as_dict()))
    assert doc["deterministic"] is False and doc["batch_invariant"] is False
    g1 = doc["groups"][0]
    assert g1["batch_size"] == 1 and g1["distinct_completions"] == 2 and g1["first_divergence"] == {"1": 1}
    assert g1["spread"] == [0.0, 0.0] and doc["groups"][1]["batch_size"] == 8


@pytest.mark.parametrize("bad", ["0", "a", "", "1,,8", "-1", "1.5", "257"])
def test_bad_batch_sizes_are_input_errors(bad):
    with pytest.raises(InputError, match="--batch-sizes"):
        parse_batch_sizes(bad)


def test_batch_sizes_parse_in_order_without_duplicates():
    assert parse_batch_sizes("1, 8,32,8") == (1, 8, 32)


CANARY = Canary(id="main", messages=(Message(role="user", content="hi"),), decoding=Decoding(max_tokens=9))


def test_fillers_are_the_other_canaries_then_built_in_prompts_with_the_canarys_decoding():
    other = Canary(id="other", prompt="x", decoding=Decoding(max_tokens=1, temperature=1.0))
    chain = Canary(id="chain", steps=(Step(id="s", prompt="y"),))  # several requests: never a filler
    pool = fillers_for(CANARY, [CANARY, other, chain])
    assert [c.id for c in pool] == ["other", *(f.id for f in BUILTIN_FILLERS)]
    assert {c.decoding for c in pool} == {CANARY.decoding}


class Recorder:
    """A backend stand-in that records when each request was in flight (collect's timing contract)."""

    name, kind, concurrency = "rec", "test", 64

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[str, float, float]] = []  # canary id, start, end

    def probe(self, canary: Canary) -> Observation:
        start = time.monotonic()
        time.sleep(0.05)
        with self.lock:
            self.calls.append((canary.id, start, time.monotonic()))
        return obs([1], text=canary.id)

    def companions(self) -> list[list[str]]:
        """For each canary probe in order, the fillers in flight during it."""
        mains = sorted((c for c in self.calls if c[0] == "main"), key=lambda c: c[1])
        return [
            sorted(f for f, s, e in self.calls if f != "main" and s < m_end and e > m_start)
            for _, m_start, m_end in mains
        ]


def test_collect_sends_each_probe_with_its_fillers_in_flight_and_keeps_only_the_canary():
    rec = Recorder()
    fillers = [Canary(id=f"f{i}", prompt=str(i)) for i in range(3)]
    got = collect(rec, CANARY, n=2, batch_sizes=[1, 3], fillers=fillers)
    assert list(got) == [1, 3] and all(len(v) == 2 for v in got.values())
    assert {o.text for v in got.values() for o in v} == {"main"}  # filler observations are discarded
    assert len(rec.calls) == 4 + 2 * 2
    # alone: nothing else in flight; crowded: two fillers each, cycling through the pool round by round
    assert rec.companions() == [[], [], ["f0", "f1"], ["f0", "f2"]]
