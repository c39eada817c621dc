"""The verdict table (``canaryd.judge.verdicts``): complete, ordered as ``compare()`` and the record decide,
and what docs/detection.md, docs/runbook.md and grafana/README.md say about it.

A row without a colour or a meaning does not even import (``Verdict.__new__`` takes every column); the
checks here catch empty or invalid ones, and documents that fell behind the table.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path

import pytest
from rich.style import Style

from canaryd.judge import compare as compare_module
from canaryd.judge.compare import compare
from canaryd.judge.stats import fit
from canaryd.judge.verdicts import Verdict
from canaryd.observation import ErrorKind, Observation, TokenLogprob
from canaryd.report.record import last_flip

# the repository root, wherever under tests/ this file lives
REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
GRAFANA_COLOR = re.compile(
    r"(?:(?:super-light|light|semi-dark|dark)-)?(?:red|orange|yellow|green|blue|purple)"
)
DRIFT = {v for v in Verdict if v.is_drift}


def _names(text: str) -> list[str]:
    return re.findall(r"`([a-z-]+)`", text)


# -- the table -------------------------------------------------------------------------------------------


def test_compare_exports_the_table() -> None:
    assert compare_module.Verdict is Verdict and "Verdict" in compare_module.__all__


def test_every_row_is_complete() -> None:
    assert len(Verdict) == len({v.value for v in Verdict}) >= 1
    for v in Verdict:
        assert re.fullmatch(r"[a-z]+(-[a-z]+)*", v.value), f"{v.name}: a metric label value, kebab-case"
        assert isinstance(v.is_drift, bool), v
        Style.parse(v.style)  # a rich style, or this raises
        assert GRAFANA_COLOR.fullmatch(v.dashboard_color), f"{v}: {v.dashboard_color!r} is no Grafana colour"
        assert v.meaning.strip() == v.meaning and v.meaning, f"{v}: no meaning"
        assert ";" not in v.meaning and "\n" not in v.meaning, f"{v}: one clause (the dashboard joins with ;)"
    assert len({v.dashboard_color for v in Verdict}) == len(Verdict), (
        "the verdict matrix needs distinct colours"
    )


def test_rank_is_the_row_order_and_most_severe_uses_it() -> None:
    assert [v.rank for v in Verdict] == list(range(len(Verdict)))
    assert Verdict.most_severe(reversed(Verdict)) is next(iter(Verdict))
    assert Verdict.most_severe(["identical", Verdict.STACK_CHANGE, "baseline"]) is Verdict.STACK_CHANGE
    with pytest.raises(ValueError):
        Verdict.most_severe([])


def test_errors_outrank_drift_which_outranks_the_rest() -> None:
    """What consumers of the order rely on: `check`'s exit code (error beats drift beats identical) and the
    dashboard, whose worst verdict is a drift exactly when a drift verdict is present."""
    assert next(iter(Verdict)) is Verdict.ERROR and not Verdict.ERROR.is_drift
    quiet = [v for v in Verdict if not v.is_drift and v is not Verdict.ERROR]
    assert DRIFT and quiet
    assert max(v.rank for v in DRIFT) < min(v.rank for v in quiet)


@pytest.mark.parametrize("v", list(Verdict), ids=str)
def test_record_flips_on_exactly_the_drift_verdicts(v: Verdict) -> None:
    """`last_flip` (report/record.py): drift is bad, an error is skipped, every other verdict is good; the
    first answer of a new serving configuration is where the answers' source moved, so explain shows it."""
    flip = last_flip([(3, v.value), (2, "identical"), (1, "baseline")])
    assert flip == ((2, 3) if v.is_drift or v is Verdict.NEW_CONFIG else None)
    if not v.is_drift and v is not Verdict.ERROR:  # a good verdict ends a drift streak
        assert last_flip([(3, "answer-drift"), (2, v.value)]) == (2, 3)


# -- compare() gives the most severe verdict that applies ----------------------------------------------


def _tok(t: str, lp: float) -> TokenLogprob:
    return TokenLogprob(t, lp, top=((t, lp), ("x", -3.0)))


def _obs(tokens: str = "42", lp: float = -0.1, *, stack: str = "0.32.0", error: bool = False) -> Observation:
    o = Observation("b", "c", "s", datetime(2026, 1, 1, tzinfo=UTC), {}, "r1")
    o.tokens = [_tok(t, lp) for t in tokens]
    o.text = tokens
    o.stack = {"vllm.version": stack}
    o.system_fingerprint = "fp"
    o.prompt_tokens = 10
    if error:
        o.error, o.error_kind = "refused", ErrorKind.CONNECT
    return o


CASES = {
    # name: (baseline, current, compare() kwargs, the verdicts whose condition holds)
    "all-at-once": (
        _obs(),
        _obs("41", -0.5, stack="0.33.0"),
        {"correct": False, "baseline_correct": True},
        {Verdict.REGRESSION, Verdict.ANSWER_DRIFT, Verdict.LOGPROB_DRIFT, Verdict.STACK_CHANGE},
    ),
    "regression-and-logprob": (
        _obs(),
        _obs(lp=-0.5),
        {"correct": False, "baseline_correct": True},
        {Verdict.REGRESSION, Verdict.LOGPROB_DRIFT},
    ),
    "answer-and-logprob": (
        _obs(),
        _obs("41", -0.5),
        {"correct": None},
        {Verdict.ANSWER_DRIFT, Verdict.LOGPROB_DRIFT},
    ),
    "answer-and-stack": (
        _obs(),
        _obs("41", stack="0.33.0"),
        {"correct": None},
        {Verdict.ANSWER_DRIFT, Verdict.STACK_CHANGE},
    ),
    "logprob-and-stack": (
        _obs(),
        _obs(lp=-0.5, stack="0.33.0"),
        {"correct": True, "baseline_correct": True},
        {Verdict.LOGPROB_DRIFT, Verdict.STACK_CHANGE},
    ),
    "stack-within-tolerance": (
        _obs(),
        _obs(lp=-0.1001, stack="0.33.0"),
        {"correct": None, "logprob_tolerance": 0.01},
        {Verdict.STACK_CHANGE, Verdict.IDENTICAL},
    ),
    "within-tolerance": (
        _obs(),
        _obs(lp=-0.1001),
        {"correct": None, "logprob_tolerance": 0.01},
        {Verdict.IDENTICAL},
    ),
    "failed": (_obs(), _obs("41", stack="0.33.0", error=True), {"correct": None}, {Verdict.ERROR}),
    "failed-first-probe": (None, _obs(error=True), {"correct": None}, {Verdict.ERROR, Verdict.BASELINE}),
    "first-probe": (None, _obs(), {"correct": True}, {Verdict.BASELINE}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_compare_gives_the_most_severe_verdict_that_applies(name: str) -> None:
    baseline, current, kwargs, applies = CASES[name]
    assert compare(baseline, current, **kwargs).verdict is Verdict.most_severe(applies)


def test_within_noise_ranks_below_stack_change_and_above_identical() -> None:
    calibration = [_obs(lp=-0.1 - 0.01 * i) for i in range(20)]
    model = fit(calibration)
    base, honest = calibration[0], _obs(lp=-0.11)  # a probe calibration has seen: within the noise
    assert compare(base, honest, correct=None, noise=model).verdict is Verdict.NOISE
    moved_stack = _obs(lp=-0.11, stack="0.33.0")
    assert compare(base, moved_stack, correct=None, noise=model).verdict is Verdict.most_severe(
        {Verdict.NOISE, Verdict.STACK_CHANGE}
    )
    assert compare(base, base, correct=None, noise=model).verdict is Verdict.IDENTICAL


# -- the documents ---------------------------------------------------------------------------------------


def test_docs_verdict_table_matches() -> None:
    lines = (REPO / "docs" / "detection.md").read_text().splitlines()
    start = lines.index("| verdict | drift | meaning |")
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows.append((cells[0], cells[1], cells[2]))
    expected = [(f"`{v.value}`", "yes" if v.is_drift else "no") for v in Verdict]
    assert [(name, drift) for name, drift, _ in rows] == expected, (
        "docs/detection.md's verdict table must list every verdict, most severe first, with its drift flag, "
        "as canaryd/judge/verdicts.py does"
    )
    assert all(meaning for _, _, meaning in rows)


def test_runbook_states_the_order_and_the_drift_verdicts() -> None:
    text = " ".join((REPO / "docs" / "runbook.md").read_text().split())
    order = re.search(r"from most to least severe: (.+?)\.(?:\s|$)", text)
    assert order and _names(order.group(1)) == [v.value for v in Verdict], "docs/runbook.md: the order"
    drift = re.search(r"The drift verdicts are (.+?);", text)
    assert drift and _names(drift.group(1)) == [v.value for v in Verdict if v.is_drift], (
        "docs/runbook.md: the drift verdicts, most severe first"
    )


def test_grafana_readme_names_the_drift_verdicts() -> None:
    text = (REPO / "grafana" / "README.md").read_text()
    listed = re.search(r"canaries drifting \(last verdict ([a-z /-]+)\)", text)
    assert listed and listed.group(1).split(" / ") == [v.value for v in Verdict if v.is_drift]
