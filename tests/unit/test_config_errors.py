"""Config errors are config errors, and the daily budget holds (through the scripted kind, the real CLI,
store and daemon): ``check`` exits 2 with one line naming the backend, the parameter and the fix; the daemon
sends a refused request once, holds it back until a reload, and exports it; a pass that would pass the
budget is skipped (the spend counted from the store survives a restart), and ``check`` refuses it (exit 3).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from canaryd.backends import scripted as scripted_kind
from canaryd.config import load_config
from canaryd.daemon.service import Daemon
from canaryd.errors import EXIT_UNAVAILABLE, EXIT_USAGE
from canaryd.observation import ErrorKind
from canaryd.probe import budget
from tests.harness.scripted_lab import ScriptedLab, change, free_port, scripted
from tests.unit.test_scripted_daemon import IDS, passes, shows, value, wait, write

FIX = 'set request.token_param = "max_completion_tokens" (or preset = "openai-reasoning")'


@pytest.fixture
def lab(tmp_path):
    made: list[ScriptedLab] = []

    def make(backends: str) -> ScriptedLab:
        made.append(ScriptedLab(tmp_path, backends))
        return made[-1]

    yield make
    for one in made:
        one.close()


def test_check_exits_2_with_one_line_naming_the_backend_the_parameter_and_the_fix(lab):
    lb = lab(scripted("o4", body=change(at=1, refuse="max_tokens")) + scripted("fine"))
    p = lb.cli("check")
    assert p.returncode == EXIT_USAGE, p.stderr
    lines = [line for line in p.stderr.splitlines() if "config error" in line]
    assert lines == [
        "canaryd: config error: backend 'o4': HTTP 400 unsupported_parameter: the server refuses max_tokens; "
        + FIX
    ]
    assert "Traceback" not in p.stderr

    code, doc = lb.check_json()
    assert code == doc["exit_code"] == EXIT_USAGE
    assert doc["config_errors"] == [lines[0].removeprefix("canaryd: config error: ")]
    kinds = {(r["backend"], r["error_kind"]) for r in doc["results"]}
    assert kinds == {("o4", "config"), ("fine", None)}

    # a refusal beats an outage: still 2 with another backend down; 3 once the refusal is fixed
    lb.write(scripted("o4", body=change(at=1, down=True)) + scripted("fine"))
    assert lb.cli("check").returncode == EXIT_UNAVAILABLE
    lb.write(
        scripted("o4", body=change(at=1, refuse="seed")) + scripted("fine", body=change(at=1, down=True))
    )
    p = lb.cli("probe")
    assert p.returncode == EXIT_USAGE and 'add "seed" to request.omit' in p.stderr


def test_a_refused_request_is_sent_once_then_held_back_until_the_config_is_reloaded(tmp_path, monkeypatch):
    backends = scripted(body=change(at=1, canaries=["add"], refuse="temperature"))
    write(tmp_path, backends, ["plain.toml"], free_port())
    path = tmp_path / "canaryd.toml"
    d = Daemon(path, load_config(path))
    sent: list[str] = []  # every request that reaches the kind, whichever generation's backend sends it
    attempt = scripted_kind.Prober.attempt
    monkeypatch.setattr(
        scripted_kind.Prober, "attempt", lambda self, canary: sent.append(canary.id) or attempt(self, canary)
    )
    d.start()
    try:
        wait("three passes", lambda: passes(d, "fake", "capital") >= 3)
        assert sent.count("add") == 1 and sent.count("capital") >= 3
        rows = d.store.observations(backend="fake", canary_id="add", limit=10)
        assert all(r.error_kind == ErrorKind.CONFIG for r in rows)
        assert rows[-1].error.startswith("backend 'fake': HTTP 400 unsupported_parameter")
        assert all(
            r.error.startswith("not sent until the config is reloaded: backend 'fake'") for r in rows[:-1]
        )
        shows(d, "canaryd_backend_probe_failures_total", 3, True, backend="fake", reason="config")
        assert value(d, "canaryd_backend_config_errors", backend="fake") == 1
        assert value(d, "canaryd_canary_verdict", backend="fake", canary="add", verdict="error") == 1
        assert value(d, "canaryd_canary_probe_success", backend="fake", canary="capital") == 1

        # a reload (SIGHUP) sends it again, once; with the parameter fixed, it is judged again
        assert d.reload() is True
        before = sent.count("capital")
        wait("two passes after the reload", lambda: sent.count("capital") >= before + 2)
        assert sent.count("add") == 2
        shows(d, "canaryd_backend_config_errors", 1, backend="fake")

        write(tmp_path, scripted(), ["plain.toml"], d.config.daemon.host_port[1])
        assert d.reload() is True
        wait(
            "the fixed canary judged",
            lambda: value(d, "canaryd_canary_probe_success", backend="fake", canary="add") == 1,
        )
        assert value(d, "canaryd_backend_config_errors", backend="fake") == 0
    finally:
        d.stop()


def test_a_pass_past_the_daily_budget_is_skipped_and_the_spend_survives_a_restart(tmp_path):
    # a pass is 3 requests: the first fits 4 requests a day, the second would not
    write(tmp_path, scripted(budget_requests_per_day=4), ["plain.toml"], free_port())
    path = tmp_path / "canaryd.toml"
    d = Daemon(path, load_config(path))
    d.start()
    try:
        wait(
            "a skipped pass",
            lambda: (value(d, "canaryd_backend_budget_skips_total", backend="fake") or 0) >= 2,
        )
        assert [passes(d, "fake", c) for c in IDS] == [1, 1, 1]
        tokens = sum(
            (r.prompt_tokens or 0) + (r.completion_tokens or 0)
            for r in d.store.observations(backend="fake", limit=100)
        )
        assert tokens > 0 and value(d, "canaryd_backend_tokens_total", backend="fake") == tokens
    finally:
        d.stop()

    d = Daemon(path, load_config(path))  # a restart: the day's spend is read back from the store
    d.start()
    try:
        wait(
            "a skipped pass",
            lambda: (value(d, "canaryd_backend_budget_skips_total", backend="fake") or 0) >= 1,
        )
        assert [passes(d, "fake", c) for c in IDS] == [1, 1, 1]
    finally:
        d.stop()

    lb = ScriptedLab(tmp_path, scripted(budget_requests_per_day=4))
    try:
        p = lb.cli("check")
        assert p.returncode == EXIT_UNAVAILABLE
        assert p.stderr.strip().splitlines()[-1] == (
            "canaryd: over budget: backend 'fake': budget_requests_per_day = 4: "
            "3 requests spent today (UTC), this pass would take about 3 more; not probed"
        )
        history = json.loads(lb.cli("history", "--json").stdout)
        assert history["spent_today"] == {"fake": {"tokens": tokens, "requests": 3}}
        assert sum(o["tokens"] for o in history["observations"]) == tokens
        table = lb.cli("history").stdout
        assert "tokens" in table and "spent today (UTC)" in table
        # a budget with room: probed as usual
        lb.write(scripted(budget_requests_per_day=6, budget_tokens_per_day=10_000))
        assert lb.cli("check").returncode == 0
    finally:
        lb.close()


def test_a_pass_is_estimated_from_the_days_mean_or_before_it_from_the_canaries(lab):
    lb = lab(scripted(budget_tokens_per_day=100))
    canaries = lb.canaries()  # 3 canaries, one request each
    fresh = budget.cost(canaries, (0, 0))
    assert fresh[1] == 3 and fresh[0] == sum(budget.tokens_of(c) for c in canaries)
    assert budget.tokens_of(canaries[0]) == -(-len(canaries[0].messages[0].content) // 4) + 16
    assert budget.cost(canaries, (100, 8)) == (38, 3)  # 12.5 tokens a request today, rounded up
    settings = lb.config.backend("fake")
    assert budget.refusal(settings, (60, 8), (38, 3)) is None
    assert budget.refusal(settings, (70, 8), (38, 3)) == (
        "backend 'fake': budget_tokens_per_day = 100: 70 tokens spent today (UTC), this pass would take "
        "about 38 more"
    )
    assert budget.day_start(datetime(2026, 12, 4, 23, 59, tzinfo=UTC)) == datetime(2026, 12, 4, tzinfo=UTC)
