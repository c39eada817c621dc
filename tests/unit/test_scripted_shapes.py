"""Chained and sampled canaries through the scripted kind, the probe pass and a real SQLite store.

A chain's steps are sent in order, each rendered from the outputs before it, and each is an observation of
its own (``id:step``) with its own baseline; the final step names the first step that diverged. A sampled
canary's n draws are judged as a set against the baseline run's n draws: pinned seeds give the same set
every cycle, and a moved answer distribution is drift with its p-value.
"""

from __future__ import annotations

import pytest

from canaryd.observation import ErrorKind
from canaryd.probe.run import one_pass
from tests.harness.scripted_lab import ScriptedLab, by_id, change, scripted, verdicts

# Two plans after canaries/chained.toml: extract the terms → map the facts onto them → answer.
CHAINS = """
[suite]
name = "chained"
[defaults]
max_tokens = 48
[[canary]]
id = "flood"
expect = { choices = ["no", "no."], answer = "No" }
[[canary.steps]]
id = "extract"
messages = [{ role = "user", content = "Policy: fire covered, flood excluded. List the deciding terms." }]
[[canary.steps]]
id = "map"
messages = [{ role = "user", content = "Relevant terms: {{ extract }}\\nMap the storm surge onto them." }]
[[canary.steps]]
id = "answer"
messages = [{ role = "user", content = "Analysis: {{map}}\\nIs the surge covered? Answer yes or no." }]
decoding = { max_tokens = 2 }
[[canary]]
id = "audit"
expect = { choices = ["yes", "yes."], answer = "Yes" }
[[canary.steps]]
id = "extract"
messages = [{ role = "user", content = "Statement: independent unannounced audits. What does it say?" }]
[[canary.steps]]
id = "answer"
messages = [{ role = "user", content = "It says: {{ extract }}\\nDisclosed? Answer yes or no." }]
decoding = { max_tokens = 3 }
"""
ANSWERS = {  # by a substring of each step's prompt
    "List the deciding terms": "flood excluded",
    "Map the storm surge": "surge is flood",
    "Is the surge covered": "No",
    "What does it say": "audits",
    "Disclosed?": "Yes",
}
FLOOD = ["flood:extract", "flood:map", "flood:answer"]
AUDIT = ["audit:extract", "audit:answer"]


def passed(config) -> list:
    """The results of one pass as a command makes it (`one_pass`), every backend's."""
    return [r for run in one_pass(config) for r in run.results]


@pytest.fixture
def make(tmp_path):
    labs = []

    def build(backends: str, suites: dict[str, str], **kwargs) -> ScriptedLab:
        lab = ScriptedLab(tmp_path, backends, suites, **kwargs)
        labs.append(lab)
        return lab

    yield build
    for lab in labs:
        lab.close()


def chain_lab(make, body: str = "", **settings: object) -> ScriptedLab:
    return make(scripted(answers=ANSWERS, concurrency=1, body=body, **settings), {"chains.toml": CHAINS})


# -- chained ------------------------------------------------------------------------------------------


def test_steps_are_stored_as_id_step_each_rendered_from_the_last_and_each_with_its_own_baseline(make):
    lab = chain_lab(make)
    first = lab.cycle()
    assert [r.observation.canary_id for r in first.results] == FLOOD + AUDIT
    assert verdicts(first) == dict.fromkeys(FLOOD + AUDIT, "baseline")
    steps = by_id(first)
    assert [steps[i].observation.text for i in FLOOD] == ["flood excluded", "surge is flood", "No"]
    # the stored request is the one sent: rendered with the step before's output
    sent = steps["flood:map"].observation.request["messages"][0]["content"]
    assert sent.startswith("Relevant terms: flood excluded\n")
    assert "{{" not in steps["flood:answer"].observation.request["messages"][0]["content"]
    # only the final step is judged against expect
    assert [steps[i].comparison.correct for i in FLOOD] == [None, None, True]
    assert steps["audit:answer"].comparison.correct is True
    ids = lab.baselines(FLOOD + AUDIT)
    assert ids == [r.observation_id for r in first.results] and len(set(ids)) == 5

    second = lab.cycle()
    assert verdicts(second) == dict.fromkeys(FLOOD + AUDIT, "identical")
    assert by_id(second)["flood:answer"].comparison.first_diverged_step is None
    assert lab.baselines(FLOOD + AUDIT) == ids


def test_a_change_on_the_chain_from_cycle_3_changes_its_steps_and_the_final_step_names_the_first(make):
    lab = chain_lab(make, change(at=3, canaries=["flood"], logprob_shift=-0.1))
    baselines = [r.observation_id for r in lab.cycle().results]
    assert verdicts(lab.cycle()) == dict.fromkeys(FLOOD + AUDIT, "identical")

    third = by_id(lab.cycle())
    assert [third[i].comparison.verdict.value for i in FLOOD] == ["logprob-drift"] * 3
    final = third["flood:answer"].comparison
    assert final.first_diverged_step == "extract"
    assert final.reasons[-1] == "step 'extract' (1 of 3) diverged first"
    assert all(third[i].comparison.first_diverged_step is None for i in FLOOD[:-1])  # only the final
    assert [third[i].comparison.verdict.value for i in AUDIT] == ["identical"] * 2  # the other plan
    assert lab.baselines(FLOOD + AUDIT) == baselines  # no step re-baselined


def test_an_answer_that_moved_mid_chain_is_named_as_the_first_diverged_step(make):
    """Only the middle step's answer moves (a config rewrite, same store): the first step is identical,
    the last step's request carries the new text (its prompt grew: a stack change, not a new baseline),
    and the final step names ``map``, 2 of 3."""
    lab = chain_lab(make)
    baselines = [r.observation_id for r in lab.cycle().results]
    lab.write(scripted(answers={**ANSWERS, "Map the storm surge": "surge is flood water"}, concurrency=1))
    moved = by_id(lab.cycle())
    assert {i: moved[i].comparison.verdict.value for i in FLOOD} == {
        "flood:extract": "identical",
        "flood:map": "answer-drift",
        "flood:answer": "stack-change",
    }
    final = moved["flood:answer"].comparison
    assert final.prompt_tokens_changed and final.correct is True
    assert final.first_diverged_step == "map" and "step 'map' (2 of 3) diverged first" in final.reasons
    assert lab.baselines(FLOOD + AUDIT) == baselines


def test_a_failed_step_stops_the_plan_and_the_later_steps_are_errors_of_its_kind_not_sent(make):
    lab = chain_lab(make, change(at=2, canaries=["flood"], error="timeout"), retries=0)
    lab.cycle()
    failed = by_id(lab.cycle())
    assert [failed[i].observation.error_kind for i in FLOOD] == [ErrorKind.TIMEOUT] * 3
    assert [failed[i].observation.attempts for i in FLOOD] == [1, 0, 0]
    assert failed["flood:map"].observation.error.startswith("not sent: step 'flood:extract' failed")
    assert verdicts(lab.cycle()) == {**dict.fromkeys(FLOOD, "error"), **dict.fromkeys(AUDIT, "identical")}


def test_a_chain_on_a_backend_that_is_down_records_every_step_as_a_connect_error(make):
    lab = chain_lab(make, change(at=1, down=True))
    run = lab.cycle()
    assert [r.observation.canary_id for r in run.results] == FLOOD + AUDIT
    assert {r.observation.error_kind for r in run.results} == {ErrorKind.CONNECT}
    assert lab.baselines(FLOOD + AUDIT) == [None] * 5


# -- sampled ------------------------------------------------------------------------------------------

COIN = """
[suite]
name = "coin"
[[canary]]
id = "coin"
messages = [{{ role = "user", content = "Flip a coin." }}]
decoding = {{ temperature = 1.0, samples = {n}, max_tokens = 5, seed = {seed} }}
expect = {expect}
"""
FAIR = {"coin": {"heads": 3, "tails": 1}}
BOTH = '{ choices = ["heads", "tails"] }'


def coin_lab(make, n: int = 40, seed: str = "0", expect: str = BOTH, body: str = "", **kw) -> ScriptedLab:
    suite = COIN.format(n=n, seed=seed, expect=expect)
    return make(scripted(distribution=FAIR, body=body, **kw), {"coin.toml": suite})


def test_pinned_seeds_draw_the_same_set_every_cycle(make):
    lab = coin_lab(make, n=40)
    first = lab.cycle()
    assert len(first.results) == 40 and verdicts(first) == {"coin": "baseline"}
    texts = [r.observation.text for r in first.results]
    assert set(texts) == {"heads", "tails"} and 20 < texts.count("heads") < 40  # about 3 in 4
    seeds = [r.observation.request["seed"] for r in first.results]
    assert seeds == list(range(40))  # sample i carries seed + i
    for _ in range(2):
        again = lab.cycle()
        assert [r.observation.text for r in again.results] == texts
        assert {r.comparison.verdict.value for r in again.results} == {"identical"}


@pytest.mark.parametrize(
    ("expect", "verdict"),
    [(BOTH, "answer-drift"), ('{ exact = "heads" }', "regression")],
    ids=["both-correct", "heads-correct"],
)
def test_a_changed_distribution_is_drift_with_its_p_value(make, expect, verdict):
    """The distribution is a backend setting: the config is rewritten between two passes on one store,
    as an operator's two ``canaryd check`` runs would see it (one_pass: a fresh backend each time)."""
    lab = coin_lab(make, n=40, expect=expect)
    alpha = lab.config.compare.alpha
    base = passed(lab.config)
    assert {r.comparison.verdict.value for r in base} == {"baseline"}
    assert {r.comparison.verdict.value for r in passed(lab.config)} == {"identical"}

    lab.write(scripted(distribution={"coin": {"heads": 1, "tails": 3}}))
    moved = passed(lab.config)
    assert {r.comparison.verdict.value for r in moved} == {verdict}
    ev = moved[0].comparison.evidence
    assert all(r.comparison.evidence == ev for r in moved)  # one verdict and evidence for the set
    assert ev.method == "two-sample-answers" and ev.p_value <= alpha and ev.out
    assert ev.e_value == pytest.approx(0.5 * ev.p_value**-0.5)
    answers = ev.detail["answers"]
    assert answers["p_value"] <= alpha / 2 and answers["tv"] > 0.3
    heads = [r.observation.text for r in moved].count("heads")
    assert heads < [r.observation.text for r in base].count("heads")
    if verdict == "regression":  # the Newcombe interval of now - baseline lies below 0
        assert ev.detail["correct"]["difference"]["interval_95"][1] < 0
        assert moved[0].comparison.reasons[0] == "correct rate fell"
    else:
        assert {r.comparison.correct for r in moved} == {True}


def test_same_draws_with_moved_logprobs_are_logprob_drift(make):
    lab = coin_lab(make, n=20, body=change(at=2, logprob_shift=-0.2))
    lab.cycle()
    moved = lab.cycle().results
    assert {r.comparison.verdict.value for r in moved} == {"logprob-drift"}
    ev = moved[0].comparison.evidence
    assert ev.method == "two-sample-logprob" and ev.out
    assert ev.detail["logprob"]["p_value"] <= lab.config.compare.alpha / 2
    assert ev.detail["logprob"]["mean_abs_shift"] == pytest.approx(0.2)
    assert ev.detail["answers"]["tv"] == 0  # the same answers


def test_unpinned_seeds_draw_new_sets_that_stay_within_noise(make):
    """Without seeds every cycle draws anew; with a little logprob noise (a non-exact engine) no two sets
    are the same draws, so each cycle is judged by the two tests alone."""
    suite = COIN.format(n=40, seed='"none"', expect=BOTH)  # the backend's seed pins the draws
    lab = make(scripted(distribution=FAIR, noise=1e-3, seed=0), {"coin.toml": suite})
    first = lab.cycle()
    assert all("seed" not in r.observation.request for r in first.results)
    sets = [[r.observation.text for r in first.results]]
    for _ in range(3):
        run = lab.cycle()
        sets.append([r.observation.text for r in run.results])
        assert {r.comparison.verdict.value for r in run.results} == {"within-noise"}
    assert len({tuple(s) for s in sets}) == 4  # new draws every cycle, never the same set
