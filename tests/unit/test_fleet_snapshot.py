"""A fleet's snapshot belongs to its members (`canaryd.fleet`): two scripted members behind one URL, each
with its own fingerprint, numerics and server-side snapshot fields (a bfloat16 server has twice the
kv-cache blocks), the snapshot read through the balancer from whichever member it picks.

Unchanged passes give no drift of any kind, picked at random or in turn, exact or under the realistic
``gpu-bf16`` noise; a member's new weights behind its fingerprint are drift of its configuration; a
member restarted in another dtype is a new configuration, named as the replacement of its old one; the
only server restarted is still drift (`tests/unit/test_configurations.py`); first contact calls a
configuration exact only on enough probes of its own.
"""

from __future__ import annotations

import pytest

from canaryd.fleet import MARK, UNATTRIBUTABLE, comparable, is_fleet, joined, replacing
from canaryd.judge.compare import Verdict
from canaryd.report.pin import Pin, PinnedBackend, check_pin
from canaryd.stack import configuration_of
from tests.harness.scripted_lab import ScriptedLab, _toml, change, scripted

BLOCKS = "metrics.vllm:cache_config_info.num_gpu_blocks"
FP32 = {BLOCKS: "1000", "metrics.vllm:cache_config_info.cache_dtype": "auto"}
BF16 = {BLOCKS: "2000", "metrics.vllm:cache_config_info.cache_dtype": "auto"}
SUITE = '[suite]\nname = "fleet"\n' + "".join(
    f'[[canary]]\nid = "c{i}"\nprompt = "question {i}"\nexpect = {{ exact = "answer {i}" }}\n'
    for i in range(6)
)
A, B = (configuration_of({"response.system_fingerprint": fp}) for fp in ("vllm-a", "vllm-b"))


def two(body: str = "", **settings) -> str:
    members = ""
    for name, fp, shift, snap in (("fp32", "vllm-a", 0.0, FP32), ("bf16", "vllm-b", -0.03, BF16)):
        members += f'[[backends.fleet]]\nname = "{name}"\nfingerprint = "{fp}"\nlogprob_shift = {shift}\n'
        members += f"snapshot = {_toml(snap)}\n"
    return scripted(body=members + body, **{"concurrency": 4, **settings})


@pytest.fixture
def lab(tmp_path):
    labs = []

    def build(backends: str) -> ScriptedLab:
        root = tmp_path / str(len(labs))
        root.mkdir()
        labs.append(ScriptedLab(root, backends, {"fleet.toml": SUITE}))
        return labs[-1]

    yield build
    for one in labs:
        one.close()


def results(runs):
    return [r for run in runs for r in run.results]


# -- the rule ------------------------------------------------------------------------------------------


def test_a_fleets_snapshot_is_recorded_whole_and_compared_without_its_server_side_fields():
    answer = {"response.system_fingerprint": "vllm-a", "request.model": "m"}
    snap = {**BF16, "vllm.version": "0.32", "request.model": "m"}
    single = joined(snap, answer, fleet=False)
    assert MARK not in single and single[BLOCKS] == "2000"
    mine = joined(snap, answer, fleet=True)
    assert mine[MARK] == UNATTRIBUTABLE and mine[BLOCKS] == "2000"  # recorded as read
    base = joined({**FP32, "vllm.version": "0.32"}, answer, fleet=True)
    before, after, aside = comparable(base, mine)
    assert before == after and aside == (BLOCKS,)
    assert comparable(base, {**mine, "response.system_fingerprint": "vllm-c"})[1] != after  # identity stays
    assert comparable({**FP32}, {**BF16}) == (FP32, BF16, ())  # one server: compared as ever
    # a snapshot that names the configuration it came from is that configuration's, and compared in it
    named = {**snap, "response.system_fingerprint": "vllm-a"}
    assert MARK not in joined(named, answer, fleet=True)
    assert (
        joined(named, {**answer, "response.system_fingerprint": "vllm-b"}, fleet=True)[MARK] == UNATTRIBUTABLE
    )


def test_a_newcomer_replaces_the_known_configurations_nothing_reached():
    assert replacing("c", {"a", "c"}, {"a", "b"}) == (
        "configuration c replaced configuration b, which served this backend before and nothing of this pass"
    )
    assert replacing("c", {"a", "b", "c"}, {"a", "b"}) is None  # a member joined
    assert replacing("a", {"a", "c"}, {"a", "b"}) is None  # known to the backend, new only to a canary
    assert "one of a, b" in replacing("c", {"c"}, {"a", "b"})


def test_a_pin_through_a_fleet_holds_whichever_member_answers_its_snapshot():
    fields = {"response.system_fingerprint": "vllm-a,vllm-b", "request.model": "m", MARK: UNATTRIBUTABLE}
    pin = Pin("t", "0", {"f": PinnedBackend("scripted", {**fields, **FP32}, None, (A, B))})
    assert check_pin(pin, {"f": {**fields, **BF16}}, "p", {"f": (A, B)}).matches
    moved = check_pin(pin, {"f": {**fields, **BF16, "request.model": "n"}}, "p", {"f": (A, B)})
    assert [f.field for f in moved.fields] == ["request.model"]


def test_the_only_server_replaced_is_no_fleet_and_its_snapshot_is_compared_as_before(lab):
    assert not is_fleet({"b"}, {"a"}) and is_fleet({"a", "b"}, {"a"}) and is_fleet({"b"}, {"a", "b"})
    one = lab(scripted(stack=FP32, body=change(at=3, fingerprint="fp2", stack=BF16)))
    one.cycle(), one.cycle()
    replaced = one.cycle().results
    assert {r.comparison.verdict for r in replaced} <= {Verdict.STACK_CHANGE, Verdict.LOGPROB_DRIFT}
    for r in replaced:
        assert MARK not in r.observation.stack
        assert {c.field for c in r.comparison.stack_changes} >= {BLOCKS, "response.system_fingerprint"}


# -- unchanged fleets ------------------------------------------------------------------------------------


@pytest.mark.parametrize("pick", ["random", "round-robin"])
@pytest.mark.parametrize("noise", ["exact", "gpu-bf16"])
def test_an_unchanged_fleet_gives_no_drift_whichever_member_answers_the_snapshot(lab, pick, noise):
    for seed in range(3):
        extra = {} if noise == "exact" else {"noise_model": {"preset": noise}}
        one = lab(two(seed=seed, fleet_pick=pick, **extra))
        runs = [one.cycle() for _ in range(10)]
        seen = results(runs)
        assert {configuration_of(r.observation.stack) for r in seen} == {A, B}
        assert {r.observation.stack[BLOCKS] for r in seen} == {"1000", "2000"}  # every snapshot recorded
        drift = [
            (r.observation.canary_id, r.comparison.verdict.value)
            for r in seen
            if r.comparison.verdict.is_drift
        ]
        assert not drift, (seed, drift)
        assert {r.observation.stack[MARK] for r in seen} == {UNATTRIBUTABLE}


# -- a member that changes -------------------------------------------------------------------------------


def test_new_weights_behind_a_members_fingerprint_are_drift_of_its_configuration(lab):
    # one request at a time, so the seeded picks meet the requests in one order. In parallel, which member
    # answers a first contact's crowded probes depends on thread timing: a configuration left short of its
    # own probes learns, and a change during learning is `learning`, not drift (a flaky CI failure)
    moved = change(at=6, member="bf16", logprob_shift=-0.2, stack={BLOCKS: "2100"})
    one = lab(two(moved, seed=4, concurrency=1))
    for _ in range(5):
        one.cycle()
    later = results([one.cycle() for _ in range(5)])
    on_b = {r.comparison.verdict for r in later if configuration_of(r.observation.stack) == B}
    on_a = {r.comparison.verdict for r in later if configuration_of(r.observation.stack) == A}
    assert Verdict.LOGPROB_DRIFT in on_b and on_b <= {Verdict.LOGPROB_DRIFT, Verdict.NEW_CONFIG}
    assert on_a <= {Verdict.IDENTICAL, Verdict.NEW_CONFIG}


def test_a_member_restarted_in_another_dtype_is_a_new_configuration_named_as_the_replacement(lab):
    restart = change(at=6, member="bf16", fingerprint="vllm-b2", stack={BLOCKS: "4000"})
    one = lab(two(restart, seed=5))
    for _ in range(5):
        one.cycle()
    later = [one.cycle() for _ in range(4)]
    assert [r.comparison.verdict for r in results(later) if r.comparison.verdict.is_drift] == []
    b2 = configuration_of({"response.system_fingerprint": "vllm-b2"})
    firsts = [r for r in results(later) if r.comparison.verdict is Verdict.NEW_CONFIG]
    on_b2 = [r for r in firsts if configuration_of(r.observation.stack) == b2]
    met = {r.observation.canary_id for r in results(later) if configuration_of(r.observation.stack) == b2}
    assert sorted(r.observation.canary_id for r in on_b2) == sorted(met) and met  # once each, at first
    named = f"configuration {b2} replaced configuration {B}, which served this backend before"
    # where the backend first meets it, the newcomer is named as the replacement (a canary the balancer
    # had kept off A until now meets A then too: new to it, not a replacement)
    first_pass = [r for r in later[0].results if r.comparison.verdict is Verdict.NEW_CONFIG]
    assert [r for r in first_pass if r in on_b2]
    for r in first_pass:
        assert (named in r.comparison.reasons[-1]) == (r in on_b2), r.comparison.reasons
    assert not [r for r in firsts if named in r.comparison.reasons[-1] and r not in on_b2]
    assert {configuration_of(r.observation.stack) for r in results(later)} == {A, b2}


# -- first contact behind a balancer ---------------------------------------------------------------------


def test_first_contact_calls_a_noisy_members_configuration_exact_on_no_fewer_than_its_own_probes(lab):
    for seed in range(4):
        one = lab(two(seed=seed, fleet_pick="round-robin", noise_model={"preset": "gpu-bf16"}))
        one.cycle()
        for cid in (f"c{i}" for i in range(6)):
            for configuration in (A, B):
                doc = one.store.calibration("fake", cid, configuration)
                assert doc is None or "learning" in doc, (seed, cid, configuration, doc)
