"""Comparison math and verdicts on hand-built observations (pure functions, no I/O)."""

from datetime import UTC, datetime

import pytest

from canaryd.judge.compare import Verdict, compare, token_delta
from canaryd.observation import ErrorKind, Observation, TokenLogprob
from canaryd.stack import diff, stack_hash


def tok(t, lp, top=()):
    return TokenLogprob(t, lp, top=tuple(top))


def obs(tokens, *, text=None, stack=None, fp="fp-1", prompt_tokens=10, request_hash="r1", error=None):
    o = Observation("b", "c", "s", datetime(2026, 1, 1, tzinfo=UTC), {}, request_hash)
    o.tokens = list(tokens)
    o.text = text if text is not None else "".join(t.token for t in tokens)
    o.stack = stack or {"vllm.version": "0.32.0"}
    o.system_fingerprint = fp
    o.prompt_tokens = prompt_tokens
    if error:
        o.error, o.error_kind = error, ErrorKind.CONNECT
    return o


BASE = [tok("4", -0.1, [("4", -0.1), ("5", -2.5)]), tok("2", -0.2, [("2", -0.2), ("3", -3.0)])]


def test_identical_when_nothing_moved():
    c = compare(obs(BASE), obs(BASE), correct=True, baseline_correct=True)
    assert c.verdict is Verdict.IDENTICAL
    assert (
        c.delta.first_divergence is None and c.delta.max_abs_dlogprob == 0.0 and c.delta.topk_overlap == 1.0
    )


def test_logprob_drift_any_change_counts_without_tolerance():
    cur = [tok("4", -0.1 + 2e-3, [("4", -0.1 + 2e-3), ("5", -2.5)]), BASE[1]]
    c = compare(obs(BASE), obs(cur), correct=True, baseline_correct=True)
    assert c.verdict is Verdict.LOGPROB_DRIFT
    assert c.delta.max_abs_dlogprob == pytest.approx(2e-3)
    assert c.delta.mean_abs_dlogprob == pytest.approx(1e-3)


def test_tolerance_absorbs_small_moves_but_not_large_ones():
    small = [tok("4", -0.1005, [("4", -0.1005), ("5", -2.5)]), BASE[1]]
    assert compare(obs(BASE), obs(small), correct=None, logprob_tolerance=1e-3).verdict is Verdict.IDENTICAL
    large = [tok("4", -0.2, [("4", -0.2), ("5", -2.5)]), BASE[1]]
    assert (
        compare(obs(BASE), obs(large), correct=None, logprob_tolerance=1e-3).verdict is Verdict.LOGPROB_DRIFT
    )


def test_alternative_logprob_move_is_drift_even_if_chosen_token_is_stable():
    cur = [tok("4", -0.1, [("4", -0.1), ("5", -2.4)]), BASE[1]]
    c = compare(obs(BASE), obs(cur), correct=None)
    assert c.verdict is Verdict.LOGPROB_DRIFT and c.delta.max_abs_dtop == pytest.approx(0.1)


def test_topk_set_change_counts_only_without_tolerance():
    cur = [tok("4", -0.1, [("4", -0.1), ("9", -2.5)]), BASE[1]]
    assert compare(obs(BASE), obs(cur), correct=None).verdict is Verdict.LOGPROB_DRIFT
    assert compare(obs(BASE), obs(cur), correct=None, logprob_tolerance=0.5).verdict is Verdict.IDENTICAL


def test_answer_drift_reports_first_divergence():
    cur = [BASE[0], tok("3", -0.9)]
    c = compare(obs(BASE), obs(cur), correct=None)
    assert c.verdict is Verdict.ANSWER_DRIFT
    assert c.delta.first_divergence == 1 and c.delta.common_prefix == 1


def test_longer_answer_diverges_at_end_of_common_prefix():
    d = token_delta(BASE, [*BASE, tok("!", -1.0)])
    assert d.first_divergence == 2 and d.common_prefix == 2


def test_divergence_at_first_token_has_no_logprob_stats():
    d = token_delta(BASE, [tok("7", -0.1)])
    assert d.first_divergence == 0 and d.max_abs_dlogprob is None


def test_token_id_difference_is_divergence_even_with_same_string():
    a = [TokenLogprob("a", -1.0, token_id=1)]
    b = [TokenLogprob("a", -1.0, token_id=2)]
    assert token_delta(a, b).first_divergence == 0


def test_regression_beats_answer_drift():
    c = compare(obs(BASE), obs([tok("5", -0.1)]), correct=False, baseline_correct=True)
    assert c.verdict is Verdict.REGRESSION and c.verdict.is_drift


def test_wrong_before_and_after_is_drift_not_regression():
    c = compare(obs(BASE), obs([tok("5", -0.1)]), correct=False, baseline_correct=False)
    assert c.verdict is Verdict.ANSWER_DRIFT


def test_stack_change_alone_and_its_diff():
    c = compare(obs(BASE), obs(BASE, stack={"vllm.version": "0.33.0"}), correct=True)
    assert c.verdict is Verdict.STACK_CHANGE
    assert [(x.field, x.before, x.after) for x in c.stack_changes] == [("vllm.version", "0.32.0", "0.33.0")]


def test_drift_verdict_still_carries_stack_diff_and_fingerprint_flag():
    cur = [tok("4", -0.11, [("4", -0.11), ("5", -2.5)]), BASE[1]]
    c = compare(
        obs(BASE),
        obs(cur, fp="fp-2", stack={"vllm.version": "0.32.0", "metrics.x.dtype": "bf16"}),
        correct=None,
    )
    assert c.verdict is Verdict.LOGPROB_DRIFT and c.fingerprint_changed
    assert c.stack_changes[0].field == "metrics.x.dtype" and c.stack_changes[0].before is None


def test_prompt_token_count_change_is_a_stack_change():
    c = compare(obs(BASE), obs(BASE, prompt_tokens=42), correct=None)
    assert c.verdict is Verdict.STACK_CHANGE and c.prompt_tokens_changed


def test_error_is_never_drift():
    c = compare(obs(BASE), obs([], error="connection refused"), correct=None)
    assert c.verdict is Verdict.ERROR and not c.verdict.is_drift


def test_first_observation_and_changed_request_become_baseline():
    assert compare(None, obs(BASE), correct=True).verdict is Verdict.BASELINE
    assert compare(obs(BASE), obs(BASE, request_hash="r2"), correct=True).verdict is Verdict.BASELINE


def test_stack_helpers():
    assert stack_hash({"x": "1", "y": "2"}) == stack_hash({"y": "2", "x": "1"})
    assert stack_hash({"x": "1"}) != stack_hash({"x": "2"})
    assert [c.field for c in diff({"a": "1", "b": "2"}, {"b": "3", "c": "4"})] == ["a", "b", "c"]
