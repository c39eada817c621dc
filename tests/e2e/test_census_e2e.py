"""`canaryd census` against a real vLLM (CPU) server: the engine's own nondeterminism, measured from outside.

One server for the module. The greedy canary must come back bit-identical alone and inside batches of 4 and
16 (this engine is batch-invariant on CPU); the same prompt with sampled decoding and no seed is the
deliberately nondeterministic source, and the census must say so.
"""

import json
import time

import pytest

from tests.harness.lab import Lab

pytestmark = pytest.mark.vllm

SUITE = """
[suite]
name = "census"
[defaults]
max_tokens = 16
[[canary]]
id = "greedy"
messages = [{ role = "user", content = "Count from 1 to 10." }]
[[canary]]
id = "sampled"
messages = [{ role = "user", content = "Count from 1 to 10." }]
decoding = { temperature = 1.0, seed = "none" }
"""


@pytest.fixture(scope="module")
def lab(tmp_path_factory) -> Lab:
    return Lab(tmp_path_factory.mktemp("census"), SUITE)


@pytest.fixture(scope="module")
def served(lab, tiny_model):
    with lab.serve(tiny_model) as server:
        yield server


def test_bad_batch_sizes_exit_2_with_one_line(lab):
    p = lab.cli("census", "--batch-sizes", "1,0,8")
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        "canaryd: error: --batch-sizes: '0' is not an integer from 1 to 256 (e.g. --batch-sizes 1,8,32)"
    ]


def test_unreachable_backend_exits_3(lab):
    p = lab.cli("census", "--json", "-n", "1", "--batch-sizes", "1")
    assert p.returncode == 3, p.stderr
    assert "backend 'local' unreachable" in p.stderr and "Traceback" not in p.stderr
    doc = json.loads(p.stdout)
    assert doc["exit_code"] == 3 and list(doc["unavailable"]) == ["local"] and doc["censuses"] == []


def test_greedy_canary_is_one_completion_deterministic_and_batch_invariant(lab, served):
    report = lab.root / "greedy.json"
    t0 = time.monotonic()
    p = lab.cli(
        "census",
        "--json",
        "--strict",
        "--canary",
        "greedy",
        "-n",
        "8",
        "--batch-sizes",
        "1,4,16",
        "--output",
        str(report),
    )
    wall = time.monotonic() - t0
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert json.loads(report.read_text()) == doc
    print(f"\ngreedy census n=8 × (1,4,16): {wall:.1f}s wall (CLI), {doc['censuses'][0]['wall_s']}s census")
    (census,) = doc["censuses"]
    print(json.dumps({k: v for k, v in census.items() if k != "groups"}))
    for g in census["groups"]:
        print({k: v for k, v in g.items() if k not in ("spread", "modal_text")})
    assert (census["backend"], census["canary"]) == ("local", "greedy")
    assert census["deterministic"] is True and census["batch_invariant"] is True
    assert census["verdict"] == "deterministic, batch-invariant"
    assert [g["batch_size"] for g in census["groups"]] == [1, 4, 16]
    for g in census["groups"]:
        assert (g["n"], g["errors"], g["distinct_completions"], g["distinct_signatures"]) == (8, 0, 1, 1)
        assert g["modal_count"] == 8 and g["first_divergence"] == {} and g["max_spread"] == 0.0
        assert len(g["spread"]) == 16  # one per generated token of the modal completion
    assert len({g["modal_signature"] for g in census["groups"]}) == 1
    assert not (lab.root / "state" / "canaryd.db").exists()  # census probes are never stored


def test_sampled_decoding_without_a_seed_is_reported_nondeterministic(lab, served):
    p = lab.cli("census", "--json", "--strict", "--canary", "sampled", "-n", "8", "--batch-sizes", "1,4")
    assert p.returncode == 1, p.stderr
    (census,) = json.loads(p.stdout)["censuses"]
    print(f"\nsampled: {census['verdict']}")
    for g in census["groups"]:
        print({k: v for k, v in g.items() if k not in ("spread", "modal_text")})
    alone = census["groups"][0]
    assert alone["errors"] == 0 and alone["distinct_completions"] > 1 and alone["distinct_signatures"] > 1
    assert sum(alone["first_divergence"].values()) == 8 - alone["modal_count"]
    assert census["deterministic"] is False and census["batch_invariant"] is False
    assert census["verdict"].startswith("NOT deterministic")


def test_the_table_has_a_row_per_batch_size_and_a_verdict_per_canary(lab, served):
    p = lab.cli("census", "-n", "3", "--batch-sizes", "1,2")
    assert p.returncode == 0, p.stderr  # a report: nondeterminism fails only with --strict
    out = p.stdout
    for col in ("backend", "canary", "batch", "ok/n", "completions", "signatures", "modal", "1st div"):
        assert col in out
    assert out.count("local") >= 4 and out.count("3/3") == 4
    assert "local greedy: deterministic, batch-invariant" in out
    assert "local sampled: NOT deterministic" in out
