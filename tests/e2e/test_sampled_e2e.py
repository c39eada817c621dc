"""Sampled canaries end to end: the real vLLM (CPU) server, the CLI, the store.

The model is a tiny "coin": trained on "Flip a coin." → heads three times out of four, so at temperature
1.0 it answers heads about 75% of the time and tails otherwise: a known answer distribution. Two canaries
draw 30 samples each, one with pinned seeds (seed + i) and one with none. The first probe makes both
baseline sets; with pinned seeds the engine returns the same 30 draws again (identical); unpinned draws
vary but stay within noise cycle after cycle; the same coin with noisy weights is drift, with its evidence.
Two server starts in all.
"""

import json
import sqlite3
from pathlib import Path

import pytest

from canaryd.lab.tinymodel import build_tiny_model, perturb_weights
from tests.e2e.conftest import CACHE
from tests.harness.lab import Lab

pytestmark = pytest.mark.vllm
COIN = [{"role": "user", "content": "Flip a coin."}]

SUITE = """
[suite]
name = "sampled"
[defaults]
temperature = 1.0
max_tokens = 1  # the coin's face is one token
samples = 30
[[canary]]
id = "coin-pinned"
messages = [{ role = "user", content = "Flip a coin." }]
expect = { exact = "heads" }
[[canary]]
id = "coin-free"
messages = [{ role = "user", content = "Flip a coin." }]
decoding = { seed = "none" }
expect = { exact = "heads" }
"""

CONFIG = """
state_dir = "state"
suites = ["suite.toml"]
[[backends]]
name = "local"
kind = "vllm"
base_url = "http://127.0.0.1:{port}/v1"
model = "tiny"
timeout_s = 30
[compare]
alpha = 0.001
"""


def by_canary(report: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in report["results"]:
        out.setdefault(r["canary"], []).append(r)
    return out


def verdict(results: list[dict]) -> str:
    """The set's verdict: every sample of a sampled canary carries the same one."""
    assert len({r["verdict"] for r in results}) == 1, [r["verdict"] for r in results]
    return results[0]["verdict"]


@pytest.fixture(scope="module")
def coin() -> Path:
    # 30 steps take P(heads) to ≈ 0.73 (a few seconds; cached afterwards)
    train = [(COIN, "heads")] * 3 + [(COIN, "tails")]
    return build_tiny_model(CACHE / "coin-3-to-1", seed=0, train=train, steps=30, words=("heads", "tails"))


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> Lab:
    return Lab(tmp_path_factory.mktemp("sampled"), SUITE, CONFIG)


def test_baseline_sets_then_pinned_seeds_identical_and_unpinned_within_noise(lab, coin):
    with lab.serve(coin):
        code, report = lab.json("probe")
        assert code == 0, report
        sets = by_canary(report)
        assert {c: len(rs) for c, rs in sets.items()} == {"coin-pinned": 30, "coin-free": 30}
        assert {verdict(rs) for rs in sets.values()} == {"baseline"}
        texts = [r["text"].strip() for rs in sets.values() for r in rs]
        assert texts.count("heads") + texts.count("tails") >= 50 and texts.count("tails") > 0  # ≈ 2% other
        assert [r["correct"] for rs in sets.values() for r in rs] == [t == "heads" for t in texts]

        db = sqlite3.connect(lab.root / "state" / "canaryd.db")
        q = "select request from observation where canary_id = ? order by id"
        for canary, seeds in (("coin-pinned", list(range(30))), ("coin-free", [None] * 30)):
            assert [json.loads(body).get("seed") for (body,) in db.execute(q, (canary,))] == seeds
        assert db.execute("select count(*) from baseline").fetchone()[0] == 2

        free = []
        for _ in range(4):  # pinned: the same draws again; unpinned: other draws, never a drift verdict
            code, report = lab.json("check")
            assert code == 0, report
            sets = by_canary(report)
            assert verdict(sets["coin-pinned"]) == "identical"
            assert sets["coin-pinned"][0]["reasons"][0] == "the same 30 draws"
            free.append(verdict(sets["coin-free"]))
            ev = sets["coin-free"][0]["evidence"]
            assert ev["detail"]["n"] == {"baseline": 30, "current": 30, "failed": 0}
            assert ev["p_value"] > 0.001 and not ev["out"]
            correct = ev["detail"]["correct"]
            for side in ("baseline", "current"):
                low, high = correct[side]["interval_95"]
                assert low <= correct[side]["rate"] <= high
        # identical only when the unpinned draws happen to repeat the baseline's multiset exactly
        assert set(free) <= {"within-noise", "identical"} and "within-noise" in free, free


def test_noisy_weights_are_drift_with_intervals_and_p_values(lab, coin):
    noisy = perturb_weights(coin, CACHE / "coin-3-to-1-noise0.5", mode="noise", scale=0.5, seed=0)
    with lab.serve(noisy):
        code, report = lab.json("check")
    assert code == 1, report
    for canary, results in by_canary(report).items():
        assert verdict(results) in ("answer-drift", "logprob-drift", "regression"), (canary, results[0])
        ev = results[0]["evidence"]
        assert ev["out"] and ev["statistic"] > ev["threshold"]
        assert ev["p_value"] <= 0.001 and ev["e_value"] == pytest.approx(0.5 * ev["p_value"] ** -0.5)
        d = ev["detail"]
        assert d["alpha"] == 0.001 and d["n"]["baseline"] == d["n"]["current"] == 30
        lp = d["logprob"]
        assert lp["completions_shared"] >= 1 and lp["p_value"] <= 0.0005  # same coin faces, other logprobs
        assert lp["mean_abs_shift"] > 0
        low, high = lp["interval_95"]
        assert (
            low - 1e-9 <= lp["difference"] <= high + 1e-9
        )  # a point, up to rounding: no noise within a face
        for side in ("baseline", "current"):
            low, high = d["correct"][side]["interval_95"]
            assert 0 <= low <= d["correct"][side]["rate"] <= high <= 1
        low, high = d["correct"]["difference"]["interval_95"]
        assert low <= d["correct"]["difference"]["value"] <= high
