"""Plain canaries through the scripted kind: the real registry, config loading, probe pass, store (SQLite in
tmp_path) and judgement, with the backend's ``[[backends.changes]]`` scripting what moves and when.

Each scripted change stands for something a real stack does (a numerical shift, a new engine setting, a
hidden system prompt, a 5xx, an outage, a server dropping logprobs); the assertions are on what canaryd
makes of it: the verdict, its reasons and evidence, what is stored, and what is never done (an error
never becomes a baseline, an open circuit sends nothing).
"""

from __future__ import annotations

import pytest

from canaryd.daemon.metrics import Metrics
from canaryd.observation import ErrorKind
from tests.harness.scripted_lab import by_id, change, scripted, verdicts

IDS = ["add", "capital", "colors"]

NO_LEARNING = "[compare]\nlearn = false\n"  # for tests whose subject is judging without a model


def test_first_pass_is_the_baseline_and_an_unchanged_pass_is_identical(make):
    lab = make(scripted())
    first = lab.cycle()
    assert first.kind == "scripted" and first.unavailable is None
    assert verdicts(first) == dict.fromkeys(IDS, "baseline")
    assert all(r.comparison.correct for r in first.results)  # the reference answers, as scripted
    assert {r.observation.text for r in first.results} == {"42", "Paris", " blue"}
    # the stored baselines are exactly the first pass's observations, read back losslessly
    for r in first.results:
        base = lab.store.baseline("fake", r.observation.canary_id)
        assert base.observation_id == r.observation_id and base.correct is True
        assert base.observation.tokens == r.observation.tokens
        assert base.observation.text == r.observation.text
    assert first.stack["backend.kind"] == "scripted" and first.stack["scripted.version"] == "1"
    assert first.stack["response.system_fingerprint"] == "fp_scripted"

    second = lab.cycle()
    assert verdicts(second) == dict.fromkeys(IDS, "identical")
    for r in second.results:
        c = r.comparison
        assert c.text_identical and c.delta.max_abs_dlogprob == 0 and c.delta.first_divergence is None
        assert not c.stack_changes and c.reasons == ()
    assert second.stack_hash == first.stack_hash and second.run_id == first.run_id + 1
    # the baselines did not move
    assert lab.baselines(IDS) == [r.observation_id for r in first.results]


def test_check_exits_0_while_unchanged_and_1_once_logprobs_shift_at_cycle_3(make, tmp_path):
    """``canaryd check`` as an operator runs it, one process per pass: ``cycle_file`` carries the count."""
    cycles = tmp_path / "cycles"
    # without learning: its subject is the exit codes and the tolerance's reason (tests/unit/test_learning.py)
    lab = make(scripted(cycle_file=cycles, body=change(at=3, logprob_shift=-0.25)), tail=NO_LEARNING)

    code, first = lab.check_json()
    assert code == 0 and first["exit_code"] == 0
    assert {r["canary"]: r["verdict"] for r in first["results"]} == dict.fromkeys(IDS, "baseline")
    code, second = lab.check_json()
    assert code == 0 and {r["verdict"] for r in second["results"]} == {"identical"}
    assert cycles.read_text() == "2"

    code, third = lab.check_json()
    assert code == 1 and third["exit_code"] == 1
    for r in third["results"]:
        assert r["verdict"] == "logprob-drift" and r["text_identical"] and r["correct"]
        assert r["delta"]["max_abs_dlogprob"] == pytest.approx(0.25)
        assert r["delta"]["first_divergence"] is None
        assert r["reasons"] == ["max |Δ logprob| 0.25 > tolerance 0"]
        assert r["stack_changes"] == []


def test_a_stack_change_alone_is_a_stack_change_naming_the_fields(make):
    moved = {"stack": {"engine.dtype": "bfloat16", "engine.kv_cache_dtype": "fp8"}}
    lab = make(scripted(stack={"engine.dtype": "float32"}, body=change(at=2, **moved)))
    expected = [("engine.dtype", "float32", "bfloat16"), ("engine.kv_cache_dtype", None, "fp8")]
    first = lab.cycle()
    second = lab.cycle()
    assert verdicts(second) == dict.fromkeys(IDS, "stack-change")
    for r in second.results:
        c = r.comparison
        assert [(f.field, f.before, f.after) for f in c.stack_changes] == expected
        assert c.text_identical and c.delta.max_abs_dlogprob == 0  # nothing the model said moved
        assert c.reasons == ("stack changed (2 fields)",) and not c.fingerprint_changed
    assert second.stack_hash != first.stack_hash
    assert verdicts(lab.cycle()) == dict.fromkeys(IDS, "stack-change")  # still unlike the baseline


def test_a_fingerprint_swap_of_the_whole_backend_is_a_replacement_and_a_stack_change(make):
    """Every answer from a configuration the backend never had baselines under (its one server restarted
    in another configuration): judged as one configuration, so the move is a stack-change naming the
    fingerprint, with the reason; compare test_text_basis.py, where one canary's swap is a newcomer."""
    from canaryd.probe.run import REPLACED

    lab = make(scripted(body=change(at=2, fingerprint="fp_other")))
    lab.cycle()
    second = lab.cycle()
    assert verdicts(second) == dict.fromkeys(IDS, "stack-change")
    for r in second.results:
        c = r.comparison
        assert [(f.field, f.before, f.after) for f in c.stack_changes] == [
            ("response.system_fingerprint", "fp_scripted", "fp_other")
        ]
        assert c.fingerprint_changed and c.reasons == (REPLACED, "stack changed (1 field)")
    assert verdicts(lab.cycle()) == dict.fromkeys(IDS, "stack-change")  # until accepted, as before


def test_a_hidden_prompt_shows_as_a_stack_change_with_the_prompt_token_reason(make):
    lab = make(scripted(body=change(at=2, prompt_tokens_delta=7, canaries=["add"])))
    first = by_id(lab.cycle())
    second = by_id(lab.cycle())
    c = second["add"].comparison
    assert c.verdict.value == "stack-change" and c.prompt_tokens_changed and not c.stack_changes
    before = first["add"].observation.prompt_tokens
    assert second["add"].observation.prompt_tokens == before + 7
    assert c.reasons == (f"prompt tokens {before} -> {before + 7}",)
    assert {i: second[i].comparison.verdict.value for i in ("capital", "colors")} == dict.fromkeys(
        ("capital", "colors"), "identical"
    )  # a change scoped to one canary leaves the rest alone


def test_a_text_change_is_answer_drift_and_a_wrong_answer_after_a_correct_baseline_a_regression(make):
    body = change(at=2, canaries=["add"], text="43") + change(at=2, canaries=["capital"], text="Paris.")
    lab = make(scripted(body=body))
    lab.cycle()
    second = by_id(lab.cycle())

    add = second["add"].comparison  # "42" → "43": was correct, now wrong
    assert add.verdict.value == "regression" and add.correct is False and add.baseline_correct is True
    assert add.reasons[0] == "was correct, now wrong" and not add.text_identical
    assert add.delta.first_divergence == 1 and add.delta.common_prefix == 1

    capital = second["capital"].comparison  # "Paris" → "Paris.": other tokens, still correct
    assert capital.verdict.value == "answer-drift" and capital.correct is True
    assert capital.delta.first_divergence == 5 and capital.reasons[0] == "tokens differ from index 5"
    assert second["capital"].observation.text == "Paris."

    assert second["colors"].comparison.verdict.value == "identical"


@pytest.mark.parametrize("kind", [ErrorKind.HTTP_5XX, ErrorKind.RATE_LIMITED, ErrorKind.TIMEOUT])
def test_a_transient_failure_is_retried_into_an_answer_with_its_attempts_recorded(make, kind):
    lab = make(scripted(retries=1, body=change(at=1, error=kind.value, fail_attempts=1)))
    run = lab.cycle()
    assert verdicts(run) == dict.fromkeys(IDS, "baseline")  # answered: an ordinary first observation
    for r in run.results:
        assert r.observation.ok and r.observation.attempts == 2
    metrics = Metrics()
    metrics.record(run)
    get = metrics.registry.get_sample_value
    # the retries are counted where an operator sees them: one per canary, on the backend's series
    assert get("canaryd_backend_probe_retries_total", {"backend": "fake"}) == len(IDS)
    for canary in IDS:
        assert get("canaryd_canary_probe_success", {"backend": "fake", "canary": canary}) == 1
    again = lab.cycle()  # the next cycle's probes fail once each too, and are retried into answers
    assert verdicts(again) == dict.fromkeys(IDS, "identical")
    assert [r.observation.attempts for r in again.results] == [2] * len(IDS)


def test_without_retries_the_same_failure_is_an_error_and_a_bad_answer_is_never_retried(make):
    body = change(at=1, canaries=["add"], error="http_5xx", fail_attempts=1)
    body += change(at=1, canaries=["capital"], error="invalid_response")
    lab = make(scripted(retries=0, body=body) + scripted("patient", retries=3, body=body))
    for name in ("fake", "patient"):
        run = by_id(lab.cycle(name))
        add, capital = run["add"].observation, run["capital"].observation
        assert capital.error_kind is ErrorKind.INVALID_RESPONSE and capital.attempts == 1  # not retryable
        if name == "fake":
            assert add.error_kind is ErrorKind.HTTP_5XX and add.attempts == 1
        else:
            assert add.ok and add.attempts == 2


def test_persistent_errors_are_error_verdicts_never_a_baseline_and_open_the_circuit(make):
    lab = make(
        scripted(
            retries=1,
            breaker_failures=3,
            breaker_cooldown="1h",
            concurrency=1,
            body=change(at=1, error="http_5xx"),
        )
    )
    first = lab.cycle()
    assert verdicts(first) == dict.fromkeys(IDS, "error")
    for r in first.results:
        obs = r.observation
        assert obs.error_kind is ErrorKind.HTTP_5XX and obs.attempts == 2
        assert obs.error == "scripted http_5xx (after 2 attempts)"
        assert r.comparison.reasons == (f"http_5xx: {obs.error}",)
        assert lab.store.baseline("fake", obs.canary_id) is None
    assert first.stack == {}  # no probe answered: the run has no stack (a half-stack would be a change)
    assert lab.backend().breaker.state == "open"  # three failed probes in a row

    sent = lab.count_requests()
    second = lab.cycle()
    assert verdicts(second) == dict.fromkeys(IDS, "error")
    for r in second.results:
        obs = r.observation
        assert obs.error_kind is ErrorKind.CIRCUIT_OPEN and obs.attempts == 0
        assert obs.error.startswith("not sent: 3+ failed probes in a row")
        assert lab.store.baseline("fake", obs.canary_id) is None
    assert sent == []  # nothing reached the backend


def test_an_error_after_the_baseline_is_judged_as_an_error_and_leaves_the_baseline_alone(make):
    lab = make(scripted(retries=0, body=change(at=2, until=3, error="http_5xx")))
    first = lab.cycle()
    assert verdicts(lab.cycle()) == dict.fromkeys(IDS, "error")
    third = lab.cycle()  # the server recovered: compared with the first pass, not with the errors
    assert verdicts(third) == dict.fromkeys(IDS, "identical")
    assert lab.baselines(IDS) == [r.observation_id for r in first.results]


def test_a_backend_that_is_down_is_a_connect_error_for_every_canary_and_a_pass_without_stack(make):
    lab = make(scripted(body=change(at=2, until=3, down=True)))
    first = lab.cycle()
    sent = lab.count_requests()
    down = lab.cycle()
    assert down.unavailable is not None and down.unavailable.kind is ErrorKind.CONNECT
    assert down.stack == {} and down.stack_hash == ""
    assert verdicts(down) == dict.fromkeys(IDS, "error")
    for r in down.results:
        assert r.observation.error_kind is ErrorKind.CONNECT
        assert r.observation.error == "scripted backend 'fake' is down"
        assert r.observation.request == {}  # never sent
    assert sent == []  # the snapshot failed: no canary was sent to a backend that is down
    assert lab.baselines(IDS) == [r.observation_id for r in first.results]
    back = lab.cycle()
    assert sorted(sent) == sorted(IDS)  # it is back: each canary sent once
    assert back.unavailable is None and verdicts(back) == dict.fromkeys(IDS, "identical")
    assert back.stack_hash == first.stack_hash


def test_an_answer_without_logprobs_is_a_no_logprobs_error_when_they_are_required(make):
    """``request.logprobs = "require"``: a response without logprobs is an error (else it is judged on
    text: tests/unit/test_text_basis.py)."""
    lab = make(scripted(require_logprobs=True, body=change(at=2, logprobs=False)))
    lab.cycle()
    second = lab.cycle()
    assert verdicts(second) == dict.fromkeys(IDS, "error")
    for r in second.results:
        assert r.observation.error_kind is ErrorKind.NO_LOGPROBS and r.observation.tokens == []
        assert r.observation.attempts == 1  # not a transient failure: not retried
    assert second.stack == {}


def test_logprob_tolerance_absorbs_noise_below_it_and_not_a_shift_above_it(make):
    lab = make(
        scripted(noise=1e-4, body=change(at=3, canaries=["add"], logprob_shift=-0.05)),
        tail="[compare]\nlogprob_tolerance = 0.01\nlearn = false\n",  # the tolerance, not learning
    )
    lab.cycle()
    second = lab.cycle()
    assert verdicts(second) == dict.fromkeys(IDS, "identical")
    assert all(0 < r.comparison.delta.max_abs_dlogprob < 0.01 for r in second.results)  # noise: it moved
    third = by_id(lab.cycle())
    assert third["add"].comparison.verdict.value == "logprob-drift"
    assert third["add"].comparison.reasons[0].endswith("> tolerance 0.01")
    assert third["capital"].comparison.verdict.value == "identical"
