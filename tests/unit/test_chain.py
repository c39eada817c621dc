"""Chained canaries: the plan format, its validation errors, sending step by step, per-step baselines, and
which step diverged first.

Sending is exercised through the real ``openai`` backend against a scripted OpenAI-compatible server on
loopback (each step's answer is set by the test), so that upstream answers can be changed at will; the
same path against a real vLLM is tests/e2e/test_chain_e2e.py.
"""

from __future__ import annotations

import json
import random
import threading
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from canaryd.backends import make_backend
from canaryd.canaries import load_suite, load_suites
from canaryd.config import load_config
from canaryd.errors import InputError
from canaryd.judge.compare import Comparison, Verdict
from canaryd.judge.stats import DetectorState
from canaryd.observation import ErrorKind, Observation
from canaryd.probe.calibrate import calibrate
from canaryd.probe.chain import first_divergence, mark_divergence, render, run_chain, step_canary
from canaryd.probe.run import one_pass, plan, run_pass
from canaryd.probe.shapes import shape_of
from canaryd.store import Store

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())

PLAN = """
[suite]
name = "s"
[defaults]
max_tokens = 8
[[canary]]
id = "plan"
expect = { choices = ["yes"] }
[[canary.steps]]
id = "extract"
messages = [{ role = "user", content = "STEP1 terms?" }]
[[canary.steps]]
id = "map"
messages = [
  { role = "system", content = "Be brief." },
  { role = "user", content = "STEP2 {{extract}} facts?" },
]
decoding = { max_tokens = 16 }
[[canary.steps]]
id = "answer"
prompt = "STEP3 {{ map }} / {{  extract}} covered?"
decoding = { max_tokens = 2 }
[[canary]]
id = "plain"
messages = [{ role = "user", content = "PLAIN 2+2?" }]
expect = { number = 4 }
"""


def suite_file(tmp_path: Path, text: str = PLAN) -> Path:
    p = tmp_path / "s.toml"
    p.write_text(text)
    return p


def test_plan_loads_with_per_step_decoding_and_step_ids(tmp_path):
    plan, plain = load_suite(suite_file(tmp_path)).canaries
    assert [s.id for s in plan.steps] == ["extract", "map", "answer"] and plain.steps is None
    assert plan.observed_ids() == ("plan:extract", "plan:map", "plan:answer")
    assert plain.observed_ids() == ("plain",)
    # the suite default (8), then each step's own keys; keys a step does not set come from the canary
    assert [plan.step_decoding(s).max_tokens for s in plan.steps] == [8, 16, 2]
    assert {plan.step_decoding(s).top_logprobs for s in plan.steps} == {5}
    assert plan.steps[2].references() == ["map", "extract"]


def test_templates_render_earlier_outputs_with_whitespace_in_braces(tmp_path):
    plan = load_suite(suite_file(tmp_path)).canaries[0]
    out = {"extract": "T1 {{ not a ref }}", "map": "M"}
    assert render("x {{map}} {{ map }} {{  extract}}", out) == "x M M T1 {{ not a ref }}"
    rendered = step_canary(plan, plan.steps[1], out)
    assert rendered.messages[1].content == "STEP2 T1 {{ not a ref }} facts?"
    assert rendered.decoding.max_tokens == 16 and rendered.steps is None
    assert step_canary(plan, plan.steps[2]).prompt == "STEP3 {{ map }} / {{  extract}} covered?"  # template


def test_shipped_example_plans_are_valid_next_to_the_default_suite():
    _, chained = load_suites([REPO / "canaries/default.toml", REPO / "canaries/chained.toml"])
    assert len(chained.canaries) == 2 and all(c.steps and len(c.steps) == 3 for c in chained.canaries)
    for c in chained.canaries:
        assert c.expect is not None and c.expect.answer is not None
        assert [s.references() for s in c.steps] == [[], ["extract"], ["map"]]


STEPS = '[[canary]]\nid = "p"\n{}\n'


@pytest.mark.parametrize(
    ("canary", "message"),
    [
        (
            "[[canary.steps]]\nid='a'\nprompt='{{b}}'\n[[canary.steps]]\nid='b'\nprompt='x'",
            "canary[0] (id 'p').steps: steps[0] (id 'a'): {{b}} names a later step (earlier steps: none)",
        ),
        (
            "[[canary.steps]]\nid='a'\nprompt='x'\n[[canary.steps]]\nid='b'\nprompt='{{ nope }}'",
            "canary[0] (id 'p').steps: steps[1] (id 'b'): {{nope}} names no step (earlier steps: a)",
        ),
        (
            "[[canary.steps]]\nid='a'\nprompt='x'\n[[canary.steps]]\nid='a'\nprompt='{{a}}'",
            "canary[0] (id 'p').steps: duplicate step id 'a' (steps[0] and steps[1])",
        ),
        (
            "[[canary.steps]]\nid='a'\nprompt='{{a}}'",
            "steps[0] (id 'a'): {{a}} names a later step",  # itself: not an earlier step
        ),
        ("steps = []", "canary[0] (id 'p').steps: steps must not be empty"),
        (
            "prompt = 'top'\n[[canary.steps]]\nid='a'\nprompt='x'",
            "takes no top-level messages or prompt",
        ),
        ("[[canary.steps]]\nid='a'", "canary[0] (id 'p').steps[0]: give exactly one of messages"),
        ("[[canary.steps]]\nid='a:b'\nprompt='x'", "canary[0] (id 'p').steps[0].id"),
        ("[[canary.steps]]\nid='a'\nprompt='x'\ntemperature=1", "steps[0].temperature: Extra inputs"),
        (
            "decoding = { temperature = 1.0, samples = 4 }\n[[canary.steps]]\nid='a'\nprompt='x'",
            "decoding.samples: a chained canary is not sampled",
        ),
        (
            "[[canary.steps]]\nid='a'\nprompt='x'\ndecoding={samples=2, temperature=0.7}",
            "decoding.samples: a chained canary is not sampled",
        ),
    ],
)
def test_bad_plans_are_one_line_errors_naming_file_canary_and_field(tmp_path, canary, message):
    path = suite_file(tmp_path, "[suite]\nname='x'\n" + STEPS.format(canary))
    with pytest.raises(InputError) as e:
        load_suite(path)
    assert str(e.value).startswith(f"{path}: canary[0] (id 'p')") and "\n" not in str(e.value)
    assert message in str(e.value)


def cmp(verdict: Verdict) -> Comparison:
    return Comparison(verdict, None)


@pytest.mark.parametrize(
    ("verdicts", "expected"),
    [
        (["identical", "identical", "identical"], None),
        (["baseline", "baseline", "baseline"], None),
        (["stack-change", "stack-change", "stack-change"], None),  # the stack moved, no output did
        (["identical", "within-noise", "identical"], None),
        (["logprob-drift", "answer-drift", "identical"], ("extract", 1)),
        (["stack-change", "answer-drift", "answer-drift"], ("map", 2)),
        (["identical", "identical", "regression"], ("answer", 3)),
        (["error", "error", "error"], None),
        (["baseline", "answer-drift", "identical"], ("map", 2)),  # a re-baselined step cannot say
    ],
)
def test_first_diverging_step(verdicts, expected):
    steps = [(sid, cmp(Verdict(v))) for sid, v in zip(("extract", "map", "answer"), verdicts, strict=True)]
    found = first_divergence(steps)
    assert (found and (found.step, found.position)) == (expected or None)
    if found:
        assert (
            found.steps == 3 and found.reason == f"step {found.step!r} ({found.position} of 3) diverged first"
        )


def test_mark_divergence_annotates_only_the_final_step(tmp_path):
    plan = load_suite(suite_file(tmp_path)).canaries[0]
    obs = [Observation("b", i, "s", datetime(2026, 1, 1, tzinfo=UTC), {}, "h") for i in plan.observed_ids()]
    judged = [
        (o, cmp(v), None)
        for o, v in zip(obs, [Verdict.IDENTICAL, Verdict.ANSWER_DRIFT, Verdict.IDENTICAL], strict=True)
    ]
    marked = mark_divergence(plan, judged)
    assert [c.first_diverged_step for _, c, _ in marked] == [None, None, "map"]
    assert marked[-1][1].reasons == ("step 'map' (2 of 3) diverged first",)
    assert marked[-1][1].as_dict()["first_diverged_step"] == "map"
    unchanged = [(o, cmp(Verdict.IDENTICAL), None) for o in obs]
    assert mark_divergence(plan, unchanged) == unchanged


class Scripted:
    """An OpenAI-compatible chat/completions server whose answer to each step the test sets.

    A request's step is the first ``STEPn``/``PLAIN`` marker in its text; ``answers`` maps it to a reply
    text or an HTTP status. A request with no marker (a calibration filler crowding the batch) is answered
    ``FILLER``'s reply: a dropped filler would count towards the circuit breaker. Every request body is
    recorded.
    """

    def __init__(self) -> None:
        self.answers: dict[str, str | int] = {
            "STEP1": "alpha",
            "STEP2": "beta",
            "STEP3": "yes",
            "PLAIN": "4",
            "FILLER": "ok",
        }
        self.bodies: list[dict] = []
        self.jitter = 0.0  # σ of gaussian noise on every logprob (a noisy engine)
        self.shift: dict[str, float] = {}  # marker → logprob offset (a silent change under one step)
        rng = random.Random(3)
        scripted = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                scripted.bodies.append(body)
                text = body.get("prompt") or " ".join(m["content"] for m in body.get("messages", []))
                marker = next((m for m in scripted.answers if m in text), "FILLER")
                answer = scripted.answers[marker]
                if isinstance(answer, int):
                    self._send(answer, {"error": {"message": "scripted failure"}})
                    return
                # one token per character, as many as max_tokens allows (the last one takes the rest)
                n = min(len(answer), body.get("max_tokens") or len(answer))
                pieces = [answer[len(answer) * i // n : len(answer) * (i + 1) // n] for i in range(n)]
                lps = [
                    -0.25 + scripted.shift.get(marker, 0.0) + rng.gauss(0, scripted.jitter) for _ in pieces
                ]
                toks = [
                    {"token": ch, "logprob": lp, "bytes": list(ch.encode()), "top_logprobs": []}
                    for ch, lp in zip(pieces, lps, strict=True)
                ]
                choice: dict = {"index": 0, "finish_reason": "stop"}
                if "messages" in body:
                    choice |= {
                        "message": {"role": "assistant", "content": answer},
                        "logprobs": {"content": toks},
                    }
                else:
                    choice |= {
                        "text": answer,
                        "logprobs": {
                            "tokens": pieces,
                            "token_logprobs": lps,
                            "top_logprobs": [{}] * len(pieces),
                        },
                    }
                usage = {"prompt_tokens": len(text), "completion_tokens": len(pieces)}
                self._send(
                    200, {"model": "m", "system_fingerprint": "fp", "choices": [choice], "usage": usage}
                )

            def _send(self, status: int, doc: dict) -> None:
                data = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = Scripted()
    yield s
    s.close()


@pytest.fixture
def config(tmp_path, server):
    suite_file(tmp_path)
    (tmp_path / "canaryd.toml").write_text(
        f'state_dir = "state"\nsuites = ["s.toml"]\n[[backends]]\nname = "api"\nkind = "openai"\n'
        f'base_url = "{server.base_url}"\nmodel = "m"\nretries = 0\nconcurrency = 1\n'
    )
    return load_config(tmp_path / "canaryd.toml")


def passed(config) -> list:
    """The results of one pass as a command makes it (`one_pass`), every backend's."""
    return [r for run in one_pass(config) for r in run.results]


def by_id(results) -> dict:
    return {r.observation.canary_id: r for r in results}


def test_steps_are_sent_in_order_each_rendered_from_the_outputs_before_it(config, server):
    results = by_id(passed(config))
    assert list(results) == ["plan:extract", "plan:map", "plan:answer", "plain"]
    sent = [json.dumps(b) for b in server.bodies[:3]]
    assert (
        "STEP1 terms?" in sent[0]
        and "STEP2 alpha facts?" in sent[1]
        and "STEP3 beta / alpha covered?" in sent[2]
    )
    assert [b["max_tokens"] for b in server.bodies[:3]] == [8, 16, 2]
    assert {r.comparison.verdict for r in results.values()} == {Verdict.BASELINE}
    # only the final step is judged against expect
    assert [results[i].comparison.correct for i in ("plan:extract", "plan:map", "plan:answer", "plain")] == [
        None,
        None,
        True,
        True,
    ]
    assert results["plan:answer"].observation.request["prompt"] == "STEP3 beta / alpha covered?"


def test_an_upstream_change_is_a_change_of_each_later_step_never_a_new_baseline(config, server):
    first = by_id(passed(config))
    again = by_id(passed(config))
    assert {r.comparison.verdict for r in again.values()} == {Verdict.IDENTICAL}
    assert all(r.comparison.first_diverged_step is None for r in again.values())

    server.answers["STEP1"] = "gamma-ray"  # the first step now extracts something else (longer, too)
    moved = by_id(passed(config))
    verdicts = {i: r.comparison.verdict for i, r in moved.items()}
    assert verdicts == {
        "plan:extract": Verdict.ANSWER_DRIFT,
        # same answers, but the prompts they were given changed: measured against their own baselines
        "plan:map": Verdict.STACK_CHANGE,
        "plan:answer": Verdict.STACK_CHANGE,
        "plain": Verdict.IDENTICAL,
    }
    for i in ("plan:map", "plan:answer"):
        assert moved[i].observation.request != first[i].observation.request  # the exact rendered request
        assert moved[i].observation.request_hash == first[i].observation.request_hash  # the template's
    final = moved["plan:answer"].comparison
    assert (
        final.first_diverged_step == "extract" and "step 'extract' (1 of 3) diverged first" in final.reasons
    )

    server.answers["STEP1"], server.answers["STEP2"] = "alpha", "delta"  # now the middle step moves
    final = by_id(passed(config))["plan:answer"].comparison
    assert final.first_diverged_step == "map" and "step 'map' (2 of 3) diverged first" in final.reasons

    server.answers["STEP2"], server.answers["STEP3"] = "beta", "no"  # and now only the answer, wrongly
    final = by_id(passed(config))["plan:answer"].comparison
    assert final.verdict is Verdict.REGRESSION and final.first_diverged_step == "answer"


def test_a_failed_step_stops_the_plan_and_the_rest_are_errors_not_sent(config, server):
    passed(config)
    server.bodies.clear()
    server.answers["STEP2"] = 400
    results = by_id(passed(config))
    assert len([b for b in server.bodies if "PLAIN" not in json.dumps(b)]) == 2  # extract and map only
    extract, mapped, answer = (results[f"plan:{s}"] for s in ("extract", "map", "answer"))
    assert extract.comparison.verdict is Verdict.IDENTICAL
    assert mapped.observation.error_kind is answer.observation.error_kind is ErrorKind.HTTP_4XX
    assert answer.observation.error == "not sent: step 'plan:map' failed (http_4xx)"
    assert answer.observation.attempts == 0 and answer.comparison.verdict is Verdict.ERROR
    assert results["plain"].comparison.verdict is Verdict.IDENTICAL


def test_run_chain_hashes_the_template_not_the_rendered_request(config, server):
    from canaryd.backends import make_backend

    plan = load_suite(config.suites[0].path).canaries[0]
    backend = make_backend(config.backend("api"))
    try:
        one = run_chain(backend, plan)
        server.answers["STEP1"] = "other"
        two = run_chain(backend, plan)
        assert [o.request_hash for o in one] == [o.request_hash for o in two]
        assert [o.request_hash for o in one] == [
            backend.request_hash(step_canary(plan, s)) for s in plan.steps
        ]
        assert one[1].request != two[1].request
        # ...and the hash still covers the template and the decoding
        other = plan.model_copy(update={"decoding": plan.decoding.model_copy(update={"seed": 1})})
        assert run_chain(backend, other)[0].request_hash != one[0].request_hash
    finally:
        backend.close()


def test_a_chained_canary_on_an_unreachable_backend_records_each_step_as_an_error(tmp_path):
    suite_file(tmp_path)
    (tmp_path / "canaryd.toml").write_text(
        'state_dir = "state"\nsuites = ["s.toml"]\n[[backends]]\nname = "v"\nkind = "vllm"\n'
        'base_url = "http://127.0.0.1:9/v1"\nmodel = "m"\nretries = 0\n'
    )
    results = passed(load_config(tmp_path / "canaryd.toml"))
    assert [r.observation.canary_id for r in results] == ["plan:extract", "plan:map", "plan:answer", "plain"]
    assert {r.observation.error_kind for r in results} == {ErrorKind.CONNECT}


def test_a_cycle_reports_the_stored_alarm_and_a_step_held_within_noise_is_not_the_first_diverged(
    config, server
):
    server.jitter = 0.01
    work = plan(config, load_suites([x.path for x in config.suites]))
    store = Store(config.storage_url)
    backend = make_backend(config.backend("api"))
    try:
        # a cycle with no calibrated canary leaves the stored detector as it is, and reports it
        raised = DetectorState(50.0, 3, True)
        store.fold_detector("api", lambda _: (raised.as_dict(), None))
        (run,) = run_pass(config, {"api": backend}, work, store)
        assert run.detector == raised

        canaries = work["api"]
        saved = calibrate(backend, canaries, store, k=20, batch_sizes=[1])
        assert {c.canary_id for c in saved if c.problem is None} == {*canaries[0].observed_ids(), "plain"}
        stored = store.fold_detector("api", lambda s: (None, s))
        assert DetectorState.from_dict(stored) == DetectorState()  # calibrating restarts it
        assert {c.model.k for c in saved} == {20}
        # K is K, however it splits over the load levels (7, 7, 6 here)
        probes = shape_of(canaries[1]).calibration_probes(
            backend, canaries[1], canaries, k=20, batch_sizes=[1, 2, 4]
        )
        assert [len(v) for v in probes.values()] == [20]

        server.shift["STEP1"] = 0.2  # 20σ under the first step only; the text does not move
        (run,) = run_pass(config, {"api": backend}, work, store)
        got = by_id(run.results)
        extract = got["plan:extract"].comparison
        assert extract.evidence.out and extract.verdict is Verdict.NOISE
        # one chain of 3 steps + 1 plain canary: 2 canaries, and no count of them is rare enough at K = 20
        assert "1 of 2 calibrated canaries out (too few canaries to alarm in one cycle)" in extract.reasons[0]
        assert got["plan:answer"].comparison.first_diverged_step is None
        assert not run.detector.alarm and run.detector.cycles == 1
    finally:
        backend.close()
        store.close()
