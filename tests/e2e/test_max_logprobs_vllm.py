"""A real vLLM (CPU) started with ``--max-logprobs 2``: canaryd's default top-5 is refused, and that is a
configuration error, not an outage.

In order, on one server: ``check`` exits 2 naming ``request.top_logprobs`` and the cap 2 (each canary
shape: chat, raw prompt, forced); ``doctor --write`` finds the cap and writes a profile with top-2 and
logprobs kept; the next ``check`` stores logprob baselines with top-2 alternatives and exits 0.
"""

import json
import sqlite3
import tomllib

import pytest

from canaryd.store.schema import decode_payload
from tests.harness.lab import Lab

pytestmark = pytest.mark.vllm

SUITE = """
[suite]
name = "capped"
[defaults]
max_tokens = 6
[[canary]]
id = "chat"
messages = [{ role = "user", content = "What is 17 + 25?" }]
[[canary]]
id = "raw"
prompt = "The three primary colors of light are"
[[canary]]
id = "forced"
prompt = "The capital of France is"
continuation = " Paris"
"""
CANARIES = {"chat", "raw", "forced"}


@pytest.fixture(scope="module")
def capped(tmp_path_factory, tiny_model):
    lab = Lab(tmp_path_factory.mktemp("max-logprobs"), SUITE)
    with lab.serve(tiny_model, extra_args=["--max-logprobs", "2"]):
        yield lab


def test_the_default_top_5_is_a_config_error_naming_the_key_and_the_cap(capped):
    code, report = capped.json("check")
    assert code == 2, report
    results = {r["canary"]: r for r in report["results"]}
    assert set(results) == CANARIES
    for r in results.values():
        assert r["error_kind"] == "config", r
        assert "set request.top_logprobs = 2" in r["error"] and "above 2" in r["error"], r
    assert "prompt_logprobs" in results["forced"]["error"]
    p = capped.cli("check")
    assert p.returncode == 2 and "request.top_logprobs = 2" in p.stdout + p.stderr
    db = sqlite3.connect(capped.root / "state" / "canaryd.db")
    assert db.execute("select count(*) from baseline").fetchone()[0] == 0


def test_doctor_writes_the_cap_it_found_and_keeps_the_logprobs(capped):
    p = capped.cli("doctor", "local", "--write", "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    found = doc["findings"]
    assert (found["logprobs"], found["top_logprobs"]) == ("returned", 2), found["evidence"]
    assert "the cap it names: accepted" in found["evidence"]["logprobs"]
    request = tomllib.loads((capped.root / "canaryd.toml").read_text())["backends"][0]["request"]
    assert request["logprobs"] == "require" and request["top_logprobs"] == 2


def test_after_doctor_check_stores_top_2_logprob_baselines_and_exits_0(capped):
    code, report = capped.json("check")
    assert code == 0, report
    assert {r["canary"]: r["verdict"] for r in report["results"]} == dict.fromkeys(CANARIES, "baseline")
    db = sqlite3.connect(capped.root / "state" / "canaryd.db")
    rows = db.execute(
        "select o.canary_id, o.request, p.data from observation o join payload p on p.hash = o.payload_hash "
        "where o.verdict = 'baseline'"
    ).fetchall()
    assert {canary for canary, _, _ in rows} == CANARIES
    for canary, request, data in rows:
        sent = json.loads(request)
        asked = sent.get("top_logprobs", sent.get("prompt_logprobs", sent.get("logprobs")))
        assert asked == 2, (canary, sent)
        tokens = decode_payload(data)
        assert tokens and all(len(t.top) == 2 for t in tokens), canary
    assert db.execute("select count(*) from baseline").fetchone()[0] == len(CANARIES)
