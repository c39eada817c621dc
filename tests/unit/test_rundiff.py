"""`canaryd diff`: counting on a real SQLite store filled with synthetic observations, and the command.

The main case reproduces the seed study's "70 / 70 by cancellation": a suite whose score does not move
while two of its answers changed in opposite directions, next to one whose score moved.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from canaryd.config import load_config
from canaryd.judge.compare import Comparison, Verdict
from canaryd.observation import ErrorKind, Observation, TokenLogprob
from canaryd.report.rundiff import Run, diff_runs, step_output
from canaryd.report.tables import diff_table, scores_table
from canaryd.store import Store

ERR = object()  # an observation that failed
# `diff` reads only the store: the suite file need not exist
CONFIG = """state_dir = "state"
suites = ["s.toml"]
[[backends]]
name = "api"
kind = "openai"
base_url = "http://127.0.0.1:9/v1"
model = "m"
"""


def add_run(store: Store, backend: str, spec: list[tuple], *, fp: str = "fp-a", engine: str = "1") -> int:
    """spec: (canary_id, suite, text or ERR, correct[, fingerprint]) in the order sent."""
    run_id = store.start_run(backend)
    for canary_id, suite, text, correct, *rest in spec:
        o = Observation(backend, canary_id, suite, datetime(2026, 1, 1, tzinfo=UTC), {"model": "m"}, "h")
        if text is ERR:
            o.error_kind, o.error = ErrorKind.TIMEOUT, "timed out"
            store.add_observation(run_id, o, Comparison(Verdict.ERROR, None), None)
            continue
        o.text, o.system_fingerprint = text, rest[0] if rest else fp
        o.tokens = [TokenLogprob(ch, -0.5, token_id=ord(ch)) for ch in text]
        o.stack = {"engine.version": engine}
        store.add_observation(run_id, o, Comparison(Verdict.IDENTICAL, correct), None)
    store.finish_run(run_id, len(spec))
    return run_id


def chain(q: str, extract: str, mapped: str, answer: str, correct: bool) -> list[tuple]:
    return [
        (f"{q}:extract", "supply", extract, None),
        (f"{q}:map", "supply", mapped, None),
        (f"{q}:answer", "supply", answer, correct),
    ]


RUN_A = [
    *chain("q1", "terms 1", "map 1", "yes", True),
    *chain("q2", "terms 2", "map 2", "no", False),
    *chain("q3", "terms 3", "map 3", "yes", True),
    *chain("q4", "terms 4", "map 4", "yes", True),
    ("p1", "insurance", "42", True),
    ("p2", "insurance", "7", True),
    ("p3", "insurance", "9", True),
    ("gone", "insurance", "x", None),
]
RUN_B = [
    *chain("q1", "terms 1", "map 1, differently", "no", False),  # correct → wrong, its reasoning moved first
    *chain("q2", "other terms", "map 2", "yes", True),  # wrong → correct: supply's score holds
    *chain("q3", "terms 3", "map 3 again", "yes", True),  # reasoning moved, same answer
    *chain("q4", "terms 4", "map 4", "yes", True),
    ("p1", "insurance", "41", False, "fp-b"),
    ("p2", "insurance", ERR, None),
    ("p3", "insurance", "9", True, "fp-b"),
    ("new", "insurance", "y", None),
]


@pytest.fixture
def lab(tmp_path):
    (tmp_path / "canaryd.toml").write_text(CONFIG)
    store = Store(load_config(tmp_path / "canaryd.toml").storage_url)
    a = add_run(store, "api", RUN_A)
    b = add_run(store, "api", RUN_B, engine="2")
    same = add_run(store, "api", RUN_A)
    yield tmp_path, store, a, b, same
    store.close()


def load(store: Store, run_id: int) -> Run:
    row = store.run(run_id)
    assert row is not None
    steps = tuple(step_output(r, o) for r, o in store.load(store.ids_of_runs([run_id])))
    return Run(run_id, row.backend, row.started_at, steps)


def test_a_held_score_can_hide_two_answers_that_changed_in_opposite_directions(lab):
    _, store, a, b, _ = lab
    d = diff_runs(load(store, a), load(store, b), "API")
    insurance, supply = d.suites
    assert (supply.suite, supply.a.correct, supply.a.judged, supply.b.correct, supply.b.judged) == (
        "supply",
        3,
        4,
        3,
        4,
    )
    assert supply.points == 0.0  # the score held...
    assert {"q1", "q2"} <= set(d.changed_answers)  # ...while two of its answers changed
    assert d.to_wrong == ("q1", "p1") and d.to_right == ("q2",)
    # insurance: 3/3 → 1/2 (p2 failed: not judged, not a change)
    assert (insurance.a.correct, insurance.a.judged, insurance.b.correct, insurance.b.judged) == (3, 3, 1, 2)
    assert insurance.points == pytest.approx(-50.0) and d.largest_move is insurance

    assert (d.answers.changed, d.answers.compared, d.answers.errors) == (3, 6, 1)  # q1, q2, p1 of 6
    # steps: q1 map+answer, q2 extract+answer, q3 map, p1 = 6 of 14 (12 chain steps, p1, p3); p2 apart
    assert (d.steps.changed, d.steps.compared, d.steps.errors) == (6, 14, 1)
    assert (d.questions.changed, d.questions.compared, d.questions.errors) == (4, 6, 1)
    assert d.first_changed_step == {"q1": "q1:map", "q2": "q2:extract", "q3": "q3:map", "p1": "p1"}
    assert d.only_in_a == ("gone",) and d.only_in_b == ("new",)
    assert d.a["system_fingerprints"] == ["fp-a"] and d.b["system_fingerprints"] == ["fp-a", "fp-b"]
    assert len(d.a["stack_hashes"]) == len(d.b["stack_hashes"]) == 1
    assert d.a["stack_hashes"] != d.b["stack_hashes"] and d.changed

    doc = d.as_dict()
    assert doc["final_answers"] == {"changed": 3, "compared": 6, "errors": 1, "questions": ["q1", "q2", "p1"]}
    assert doc["flips"] == {"correct_to_wrong": ["q1", "p1"], "wrong_to_correct": ["q2"]}
    assert doc["largest_score_movement"] == {"suite": "insurance", "points": pytest.approx(-50.0)}
    assert doc["scores"][1] == {
        "suite": "supply",
        "a": {"correct": 3, "judged": 4},
        "b": {"correct": 3, "judged": 4},
        "a_percent": 75.0,
        "b_percent": 75.0,
        "movement_points": 0.0,
    }
    json.dumps(doc)  # serialisable as is


def test_identical_runs_change_nothing(lab):
    _, store, a, _, same = lab
    d = diff_runs(load(store, a), load(store, same))
    assert not d.changed and d.label == f"{a} → {same}"
    assert (d.answers.changed, d.answers.compared) == (0, 8)
    assert (d.steps.changed, d.steps.compared) == (0, 16)
    assert d.questions.changed == 0 and not d.to_wrong and not d.to_right and not d.first_changed_step
    assert {s.points for s in d.suites} == {0.0} and d.a["stack_hashes"] == d.b["stack_hashes"]


def test_steps_match_by_id_and_occurrence_and_a_changed_plan_is_named(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'db.sqlite'}")
    try:
        a = add_run(
            store, "b", [("s", "x", "one", None), ("s", "x", "two", None), *chain("q", "t", "m", "a", True)]
        )
        b_spec = [("s", "x", "one", None), ("s", "x", "2", None), *chain("q", "t", "m", "a", True)]
        del b_spec[3]  # the plan lost its "map" step
        b = add_run(store, "b", b_spec)
        d = diff_runs(load(store, a), load(store, b))
    finally:
        store.close()
    assert (d.steps.changed, d.steps.compared) == (1, 4) and d.first_changed_step == {"s": "s"}
    assert d.only_in_a == ("q:map",) and d.only_in_b == ()
    assert d.answers.compared == 2 and d.changed_answers == ("s",)


def test_tables_put_pairs_side_by_side(lab):
    from rich.console import Console

    _, store, a, b, same = lab
    diffs = [
        diff_runs(load(store, a), load(store, b), "API"),
        diff_runs(load(store, a), load(store, same), "Local"),
    ]
    console = Console(record=True, width=200)
    console.print(diff_table(diffs), scores_table(diffs))
    text = console.export_text()
    for needle in (
        "API",
        "Local",
        "final answers that changed",
        "3 / 6 (1 error)",
        "0 / 8",
        "6 / 14 (1 error)",
        "0 / 16",
        "1 / 2 (different)",
        "1 / 1 (same)",
        "50.0 pt (insurance)",
        "3/4 (75%) → 3/4 (75%), +0.0 pt",
        "3/3 (100%) → 1/2 (50%), -50.0 pt",
    ):
        assert needle in text, needle


def canaryd(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "canaryd", "-c", str(root / "canaryd.toml"), "diff", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_command_exits_like_diff_and_labels_pairs(lab):
    root, _, a, b, same = lab
    p = canaryd(root, str(a), str(same))
    assert p.returncode == 0, p.stderr
    assert "reasoning steps that changed" in p.stdout and "0 / 16" in p.stdout

    p = canaryd(root, str(a), str(b), str(a), str(same), "--label", "API", "--label", "Local", "--json")
    assert p.returncode == 1, p.stderr
    doc = json.loads(p.stdout)
    assert doc["exit_code"] == 1 and [x["label"] for x in doc["pairs"]] == ["API", "Local"]
    assert [x["changed"] for x in doc["pairs"]] == [True, False]
    assert doc["pairs"][0]["steps"] == {"changed": 6, "compared": 14, "errors": 1}

    p = canaryd(root, str(a), str(b))
    assert p.returncode == 1 and "API" not in p.stdout
    assert "changed: q1 (from map), q2 (from extract), q3 (from map), p1\n" in p.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["1"], "diff: run ids come in pairs (A B [C D ...]), got 1"),
        (["1", "999"], "diff: no run 999 in sqlite:///"),
        (["1", "2", "--label", "x", "--label", "y"], "--label: 2 label(s) for 1 pair(s) of runs"),
        (["1", "two"], "Invalid value for 'RUN_A RUN_B'"),
        ([], "Missing argument"),
    ],
)
def test_usage_errors_exit_2_with_one_line(lab, args, message):
    p = canaryd(lab[0], *args)
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr
    if "diff:" in message or "--label:" in message:
        assert p.stderr.count("\n") == 1


def test_a_broken_database_is_a_storage_error(tmp_path):
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "canaryd.db").write_text("this is not a database" * 100)
    (tmp_path / "canaryd.toml").write_text(CONFIG)
    p = canaryd(tmp_path, "1", "2")
    assert (
        p.returncode == 4 and p.stderr.startswith("canaryd: storage error:") and "Traceback" not in p.stderr
    )
