"""Metrics folded from synthetic probe passes: values, bounded labels, stack-change counting."""

from datetime import UTC, datetime

from prometheus_client import generate_latest

from canaryd.daemon.metrics import Metrics
from canaryd.judge.compare import compare
from canaryd.observation import ErrorKind, Observation, TokenLogprob
from canaryd.probe.run import BackendRun, Result


def run(stack_fp="fp-1", lp=-0.5, error=False, unavailable=None):
    o = Observation("b", "c", "s", datetime(2026, 1, 1, tzinfo=UTC), {}, "r")
    if error:
        o.error, o.error_kind = "boom", ErrorKind.HTTP_5XX
    else:
        o.text, o.system_fingerprint, o.latency_s = "42", stack_fp, 0.2
        o.tokens = [TokenLogprob("42", lp)]
    base = Observation("b", "c", "s", datetime(2026, 1, 1, tzinfo=UTC), {}, "r")
    base.text, base.tokens, base.system_fingerprint = "42", [TokenLogprob("42", -0.5)], "fp-1"
    cmp = compare(base, o, correct=True if not error else None, baseline_correct=True)
    stack = (
        {} if error or unavailable else {"vllm.version": "0.32.0", "response.system_fingerprint": stack_fp}
    )
    return BackendRun("b", "vllm", 1, [Result(1, 1, o, cmp)], stack, unavailable)


def value(m: Metrics, name: str, labels: dict) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_identical_then_drift_then_error():
    m = Metrics()
    m.record(run(), now=100.0)
    bc = {"backend": "b", "canary": "c"}
    assert value(m, "canaryd_canary_verdict", {**bc, "verdict": "identical"}) == 1
    assert value(m, "canaryd_canary_verdict", {**bc, "verdict": "logprob-drift"}) == 0
    assert value(m, "canaryd_canary_first_divergence_index", bc) == -1
    assert value(m, "canaryd_backend_stack_changes_total", {"backend": "b"}) == 0
    assert value(m, "canaryd_backend_fingerprints", {"backend": "b"}) == 1

    m.record(run(stack_fp="fp-2", lp=-0.51), now=200.0)
    assert value(m, "canaryd_canary_verdict", {**bc, "verdict": "logprob-drift"}) == 1
    assert abs(value(m, "canaryd_canary_logprob_delta_max", bc) - 0.01) < 1e-9
    assert value(m, "canaryd_backend_stack_changes_total", {"backend": "b"}) == 1
    assert value(m, "canaryd_backend_fingerprints", {"backend": "b"}) == 2
    info = {"backend": "b", "kind": "vllm", "engine_version": "0.32.0", "model": ""}
    assert (
        value(
            m,
            "canaryd_backend_stack_info",
            {**info, "fingerprint": "fp-2", "stack_hash": run(stack_fp="fp-2").stack_hash},
        )
        == 1
    )
    assert (
        "fp-1"
        not in generate_latest(m.registry).decode().split("canaryd_backend_stack_info{")[1].split("\n")[0]
    )

    m.record(run(error=True), now=300.0)
    assert value(m, "canaryd_canary_probe_success", bc) == 0
    assert value(m, "canaryd_canary_probe_failures_total", {**bc, "reason": "http_5xx"}) == 1
    assert value(m, "canaryd_canary_verdict", {**bc, "verdict": "error"}) == 1
    assert value(m, "canaryd_canary_last_probe_timestamp_seconds", bc) == 300.0


def test_fingerprints_age_out_of_the_window():
    m = Metrics(fingerprint_window_s=60)
    m.record(run(stack_fp="a"), now=0.0)
    m.record(run(stack_fp="b"), now=30.0)
    assert value(m, "canaryd_backend_fingerprints", {"backend": "b"}) == 2
    m.record(run(stack_fp="b"), now=100.0)
    assert value(m, "canaryd_backend_fingerprints", {"backend": "b"}) == 1


def test_no_free_text_in_labels():
    m = Metrics()
    m.record(run(error=True))
    text = generate_latest(m.registry).decode()
    assert "boom" not in text and "canaryd_build_info{" in text and "_created" not in text


def test_series_of_canaries_dropped_by_a_reload_disappear():
    m = Metrics()
    m.set_intervals([("b", "c", 300.0), ("b", "gone", 300.0), ("old", "c", 60.0)])
    m.record(run())
    m.set_intervals([("b", "c", 300.0)])
    text = generate_latest(m.registry).decode()
    assert 'canary="gone"' not in text and 'backend="old"' not in text
    assert 'canaryd_canary_verdict{backend="b",canary="c",verdict="identical"} 1.0' in text
