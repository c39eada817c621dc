"""Reference checks and forced canaries on real vLLM servers.

A reference vLLM (the fp32 tiny model, kind ``vllm``) re-scores, by teacher forcing, the answers of a
"provider": a second vLLM behind the ``openai`` kind with ``logprobs = "off"``, so the reference does all
the scoring. The same weights are never a mismatch over five cycles; the provider restarted with an int8
or 4-bit round trip of the weights, or a differently seeded model of the same shape, is a
``reference-mismatch`` within one cycle. The same server is also checked as kind ``vllm`` with its
logprobs (``provider-lp``, two short canaries): its logprob gap is exactly 0 on the same weights, and
other weights are a mismatch by it. The provider's server is also probed as
kind ``vllm`` with forced canaries (a fixed continuation scored token by token): identical across passes,
a logprob drift once its weights change. Every scoring request carries a fresh ``cache_salt``, which the
real server takes and which changes no score on CPU. Five server starts (one reference, four providers),
about 40 s each.
"""

from __future__ import annotations

import json
import re
import time

import httpx2
import pytest

from canaryd.backends import scoring, vllm_server
from canaryd.canaries import load_suite
from canaryd.lab.vllm_process import VLLMServer, free_port
from tests.e2e.conftest import REPO
from tests.harness.faultproxy import FaultProxy
from tests.harness.lab import Lab

pytestmark = pytest.mark.vllm

FORCED = """
[suite]
name = "forced"
[[canary]]
id = "forced-capital"
messages = [{ role = "user", content = "What is the capital of France? Answer with one word." }]
continuation = "Paris"
[[canary]]
id = "forced-colors"
prompt = "The three primary colors of light are red, green and"
continuation = " blue, which together make white light."
"""

# Raw prompts the random model answers with valid UTF-8 in 4 greedy tokens ("cccc" from seed 0 and its
# int8 and 4-bit round trips, "RRRR" from seed 1): most of its answers are bytes that are not UTF-8, whose
# text re-tokenizes otherwise and has no logprob gap
PLAIN = """
[suite]
name = "plain"
[defaults]
max_tokens = 4
[[canary]]
id = "lp-cat"
prompt = "cat"
[[canary]]
id = "lp-paris"
prompt = "Paris is"
"""

CONFIG = """
state_dir = "state"
[[suites]]
path = "{default}"
backends = ["provider"]
[[suites]]
path = "suite.toml"
backends = ["provider-vllm", "ref"]
[[suites]]
path = "plain.toml"
backends = ["provider-lp"]
[[backends]]
name = "ref"
kind = "vllm"
base_url = "http://127.0.0.1:{ref_port}/v1"
model = "tiny"
timeout_s = 120
[[backends]]
name = "provider"
kind = "openai"
base_url = "http://127.0.0.1:{{port}}/v1"
model = "tiny"
timeout_s = 120
reference = "ref"
[backends.request]
logprobs = "off"
[[backends]]
name = "provider-vllm"
kind = "vllm"
base_url = "http://127.0.0.1:{{port}}/v1"
model = "tiny"
timeout_s = 120
[[backends]]
name = "provider-lp"
kind = "vllm"
base_url = "http://127.0.0.1:{{port}}/v1"
model = "tiny"
timeout_s = 120
reference = "ref"
"""


@pytest.fixture(scope="module")
def ref_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def lab(tmp_path_factory, tiny_model, ref_port):
    root = tmp_path_factory.mktemp("reference")
    config = CONFIG.format(default=REPO / "canaries" / "default.toml", ref_port=ref_port)
    lab = Lab(root, FORCED, config)
    (root / "plain.toml").write_text(PLAIN)
    ref = VLLMServer(
        tiny_model, port=ref_port, extra_args=["--enforce-eager"], log_path=root / "vllm-reference.log"
    )
    with ref:
        yield lab


def rows(report: dict, backend: str) -> dict[str, dict]:
    return {r["canary"]: r for r in report["results"] if r["backend"] == backend}


def compared(checked: dict[str, dict]) -> dict[str, float]:
    """The logprob gap of each answer whose tokens the reference scored as the provider gave them. The
    random model answers the raw prompt with bytes that are not UTF-8: its text re-tokenizes otherwise
    (``retokenized``), so only the parting checks it."""
    out = {}
    for c, r in checked.items():
        if not r["text"]:
            continue  # nothing to score
        d = r["reference"]["divergence"]
        assert (d["logprob_gap"] is None) == d["retokenized"], d
        if not d["retokenized"]:
            out[c] = d["logprob_gap"]
    return out


def divergence(report: dict) -> tuple[float, float, float]:
    """Over the provider's checked answers, averaged per canary: the mean divergence d per token as the
    reference scores them, the same for the reference's own answers (both nats/token); the largest parting
    (nats)."""
    refs = [r["reference"] for r in rows(report, "provider").values() if r["text"]]
    assert refs and all(x["error"] is None for x in refs), refs
    both = [
        (x["divergence"]["mean_nats"], x["own_mean_nats"]) for x in refs if x["own_mean_nats"] is not None
    ]
    mean, own = (sum(v) / len(both) for v in zip(*both, strict=True))
    return mean, own, max(x["parting_nats"] for x in refs)


def test_the_same_weights_are_never_a_mismatch_over_five_cycles(lab, tiny_model):
    with lab.serve(tiny_model):
        for cycle in range(5):
            code, report = lab.json("check")
            assert code == 0, [
                (r["backend"], r["canary"], r["verdict"], r["reasons"]) for r in report["results"]
            ]
            provider = rows(report, "provider")
            assert provider and all(r["basis"] == "text" for r in provider.values())
            # every answer with text is checked (an empty answer leaves nothing to score)
            checked = {c: r["reference"] for c, r in provider.items() if r["text"]}
            assert len(checked) >= len(provider) - 2, {c: repr(r["text"]) for c, r in provider.items()}
            assert all(ev and not ev["mismatch"] and ev["error"] is None for ev in checked.values()), checked
            forced = rows(report, "provider-vllm")
            want = "baseline" if cycle == 0 else "identical"
            assert {r["verdict"] for r in forced.values()} == {want}, forced
            with_logprobs = rows(report, "provider-lp")
            assert {r["verdict"] for r in with_logprobs.values()} == {want}, with_logprobs
            gaps = compared(with_logprobs)
            assert gaps and set(gaps.values()) == {0.0}, gaps  # same weights, same engine: not a hair apart
    mean, own, parting = divergence(report)
    assert parting == 0.0
    print(
        f"\nsame weights: divergence {mean:.4f} nats/token (reference's own {own:.4f}), parting {parting:.4f}"
    )


@pytest.mark.parametrize("variant", ["int8", "int4", "seed1"])
def test_other_weights_are_a_reference_mismatch_within_one_cycle(lab, variant, request):
    model = request.getfixturevalue(f"{variant}_model")
    with lab.serve(model):
        code, report = lab.json("check")
    (lab.root / f"check-{variant}.json").write_text(json.dumps(report))  # the evidence, for a failure
    assert code == 1, report
    provider = rows(report, "provider")
    mismatched = [c for c, r in provider.items() if r["verdict"] == "reference-mismatch"]
    assert mismatched, [(c, r["verdict"], r["reference"]) for c, r in provider.items()]
    for c in mismatched:
        ev = provider[c]["reference"]
        assert ev["mismatch"] and ev["parting_nats"] > 0 and ev["p_value"] == 0.0 and ev["backend"] == "ref"
    forced = rows(report, "provider-vllm")
    assert {r["verdict"] for r in forced.values()} == {"logprob-drift"}, forced
    for r in forced.values():  # no sampling: the same tokens, only their logprobs moved
        assert r["delta"]["first_divergence"] is None and r["delta"]["max_abs_dlogprob"] > 0
    assert {r["verdict"] for r in rows(report, "ref").values()} == {"identical"}
    # with the provider's logprobs for the tokens the reference scored, every such answer is out
    with_logprobs = rows(report, "provider-lp")
    gaps = compared(with_logprobs)
    assert gaps and all(gap > 0 for gap in gaps.values()), gaps
    for c in gaps:
        r = with_logprobs[c]
        assert r["verdict"] == "reference-mismatch" and r["reference"]["mismatch"], (c, r)
    print(f"{variant}: logprob gaps (nats/token) {gaps}")
    mean, own, parting = divergence(report)
    print(
        f"\n{variant}: divergence {mean:.4f} nats/token (reference's own {own:.4f}), largest parting "
        f"{parting:.4f} nats; "
        f"{len(mismatched)}/{len(provider)} canaries out"
    )


def _cache_counters(root: str) -> tuple[float, float]:
    """vLLM's prefix-cache counters: (tokens looked up, tokens found cached)."""
    text = httpx2.get(f"{root}/metrics", timeout=30).text

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^vllm:{name}_total\{{[^}}]*\}} (\S+)$", text, re.M))

    return total("prefix_cache_queries"), total("prefix_cache_hits")


def _after(root: str, before: tuple[float, float], post: dict) -> tuple[float, float]:
    """The counters' growth over one completion request (vLLM counts a request as it finishes)."""
    assert httpx2.post(f"{root}/v1/completions", json=post, timeout=60).status_code == 200
    deadline = time.monotonic() + 10
    while (now := _cache_counters(root))[0] == before[0] and time.monotonic() < deadline:
        time.sleep(0.2)
    return now[0] - before[0], now[1] - before[1]


def test_scoring_requests_carry_a_fresh_cache_salt_vllm_takes_and_no_score_moves(lab, ref_port):
    """Each scoring request (forced canaries, reference checks) is salted afresh: the real server answers
    200, the snapshot records it, and on CPU the salted scores are the unsalted ones bit for bit. The salt
    does what it is for: a prefix the same ids left in the cache is found by an unsalted request, never by
    a salted one."""
    root = f"http://127.0.0.1:{ref_port}"
    proxy = FaultProxy(root)
    settings = vllm_server.Settings(name="ref", base_url=f"{proxy.url}/v1", model="tiny", timeout_s=120)
    prober = vllm_server.Prober(settings)
    try:
        assert prober.snapshot()["request.scoring_cache_salt"] == "per-request"
        canaries = load_suite(lab.root / "suite.toml").canaries
        scored = [(c, prober.attempt(c)) for c in canaries for _ in range(2)]
    finally:
        prober.close()
        proxy.stop()
    assert all(obs.ok for _, obs in scored), [obs.error for _, obs in scored]
    sent = [json.loads(body) for path, body in proxy.posted if path.endswith("/completions")]
    salts = [body["cache_salt"] for body in sent]
    assert len(salts) == len(scored) and len(set(salts)) == len(salts), salts
    for body, (canary, obs) in zip(sent, scored, strict=True):
        assert obs.tokens and "cache_salt" not in obs.request
        unsalted = {k: v for k, v in body.items() if k != "cache_salt"}
        reply = httpx2.post(f"{root}/v1/completions", json=unsalted, timeout=60)
        assert reply.status_code == 200, reply.text
        ids, k = body["prompt"], canary.decoding.top_logprobs
        plain = scoring.scored_tokens(reply.json(), ids, len(ids) - len(obs.tokens), k)
        assert plain == obs.tokens  # every logprob, the top-k's included, to the bit
    assert len({(o.canary_id, o.request_hash, o.request_ref) for _, o in scored}) == len(canaries)
    # Full cache blocks (128 tokens each on CPU) of the scored ids, generated without prompt_logprobs so that
    # vLLM looks the cache up: after a first unsalted request, a salted one finds none of it cached and an
    # unsalted one finds its full blocks.
    ids = (sent[0]["prompt"] * 8)[:300]
    body = {"model": "tiny", "prompt": ids, "max_tokens": 1, "temperature": 0.0}
    _after(root, _cache_counters(root), body)
    looked, salted = _after(root, _cache_counters(root), {**body, "cache_salt": scoring.cache_salt()})
    assert looked == len(ids) and salted == 0
    looked, found = _after(root, _cache_counters(root), body)
    assert looked == len(ids) and 0 < found < len(ids)
    print(f"\nprefix cache, {len(ids)} tokens seen before: salted found {salted:g}, unsalted {found:g}")
