"""The daemon (`canaryd.daemon.service.Daemon`) on scripted backends: its scheduler really runs (a 1 s
interval), its listener really serves ``/metrics``, and ``reload()`` swaps the config as SIGHUP does.

Waits poll the metrics registry instead of sleeping a fixed time; each test takes a few seconds, most of
it the 1 s schedule.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import httpx2
import pytest
from prometheus_client import generate_latest

from canaryd.config import load_config
from canaryd.daemon.service import Daemon
from tests.harness.scripted_lab import PLAIN, change, free_port, scripted

IDS = ["add", "capital", "colors"]
EXTRA = """
[suite]
name = "extra"
[[canary]]
id = "greet"
messages = [{ role = "user", content = "Say hello." }]
expect = { exact = "hello", answer = "hello" }
"""


def write(root, backends: str, suites: list[str], listen: int) -> None:
    """The daemon's config: the given backends and suites, metrics on ``listen``, one 1 s schedule."""
    (root / "plain.toml").write_text(PLAIN)
    (root / "extra.toml").write_text(EXTRA)
    (root / "canaryd.toml").write_text(
        f'state_dir = "state"\nsuites = {json.dumps(suites)}\n'
        + backends
        + f'\n[daemon]\nlisten = "127.0.0.1:{listen}"\ninstance = "unit"\n'
        + '[[schedules]]\nname = "fast"\nevery = "1s"\n'
    )


@pytest.fixture
def daemon(tmp_path):
    """Write a config and start a Daemon on it (listener on a free port, scheduler running); every daemon
    started is stopped at the end (scheduler, listener, store)."""
    started: list[Daemon] = []

    def start(backends: str, suites: list[str] | None = None) -> Daemon:
        write(tmp_path, backends, suites or ["plain.toml"], free_port())
        path = tmp_path / "canaryd.toml"
        d = Daemon(path, load_config(path))
        started.append(d)
        d.start()
        return d

    yield start
    for d in started:
        d.stop()


def port(d: Daemon) -> int:
    return d.config.daemon.host_port[1]


def value(d: Daemon, name: str, **labels: str) -> float | None:
    return d.metrics.registry.get_sample_value(name, labels)


def wait(what: str, check: Callable[[], object], timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def shows(d: Daemon, name: str, want: float, at_least: bool = False, **labels: str) -> None:
    """Wait until a series reads ``want`` (or more, ``at_least``). A pass is in the store before the
    daemon folds it into its series, so a count of stored passes does not say the series show it yet."""

    def reads() -> bool:
        v = value(d, name, **labels)
        return v is not None and (v >= want if at_least else v == want)

    wait(f"{name}{labels} {'>=' if at_least else '=='} {want}", reads)


def passes(d: Daemon, backend: str, canary: str) -> int:
    """Probes of one canary, from the store (the series keep only the last probe of each pair)."""
    return len(d.store.observations(backend=backend, canary_id=canary, limit=1000))


def test_the_daemon_probes_on_its_schedule_and_exports_the_scripted_series(daemon):
    d = daemon(scripted())
    wait("two passes", lambda: all(passes(d, "fake", c) >= 2 for c in IDS))
    assert value(d, "canaryd_schedule_runs_total", schedule="fast") >= 2
    for c in IDS:
        shows(d, "canaryd_canary_verdict", 1, backend="fake", canary=c, verdict="identical")
        v = {
            verdict: value(d, "canaryd_canary_verdict", backend="fake", canary=c, verdict=verdict)
            for verdict in ("baseline", "identical", "error")
        }
        # the last pass: identical, and only the current verdict has a series
        assert v == {"baseline": None, "identical": 1, "error": None}, c
        assert value(d, "canaryd_canary_probe_success", backend="fake", canary=c) == 1
        assert value(d, "canaryd_canary_last_probe_timestamp_seconds", backend="fake", canary=c) > 0
    assert value(d, "canaryd_backend_probe_interval_seconds", backend="fake") == 1
    assert value(d, "canaryd_backend_probes_total", backend="fake") >= 2 * len(IDS)
    assert value(d, "canaryd_backend_reachable", backend="fake") == 1
    assert value(d, "canaryd_backend_stack_changes_total", backend="fake") == 0

    # rendered for Prometheus: the stack series names the kind and its engine version
    rendered = generate_latest(d.metrics.registry).decode()
    (info,) = [line for line in rendered.splitlines() if line.startswith("canaryd_backend_stack_info{")]
    assert 'backend="fake"' in info and 'kind="scripted"' in info and 'engine_version="1"' in info
    assert 'fingerprint="fp_scripted"' in info and info.endswith(" 1.0")
    line = 'canaryd_canary_verdict{backend="fake",canary="add",verdict="identical"} 1.0'
    assert line in rendered.splitlines()

    # and the daemon's own listener serves it, from the exposition published once the pass is recorded
    def served() -> list[str]:
        return httpx2.get(f"http://127.0.0.1:{port(d)}/metrics", timeout=5).text.splitlines()

    wait("the pass in the served exposition", lambda: line in served())
    assert info in served()

    # every pass is stored: as many runs as passes, one observation per canary each
    runs = {o.run_id for o in d.store.observations(backend="fake", limit=100)}
    assert len(runs) >= 2


def test_a_change_shows_up_in_the_series_of_the_next_pass(daemon):
    d = daemon(scripted(body=change(at=3, canaries=["add"], logprob_shift=-0.25)))
    wait("the third pass", lambda: passes(d, "fake", "add") >= 3)
    shows(d, "canaryd_canary_verdict", 1, backend="fake", canary="add", verdict="logprob-drift")
    assert value(d, "canaryd_canary_logprob_delta_max", backend="fake", canary="add") == pytest.approx(0.25)
    assert value(d, "canaryd_canary_verdict", backend="fake", canary="capital", verdict="identical") == 1


def test_reload_applies_a_new_suite_and_backend_and_an_invalid_config_keeps_the_old_one(daemon, tmp_path):
    d = daemon(scripted())
    wait("the first pass", lambda: passes(d, "fake", "add") >= 1)

    write(tmp_path, scripted() + scripted("second"), ["plain.toml", "extra.toml"], port(d))
    assert d.reload() is True
    assert value(d, "canaryd_config_reloads_total") == 1
    wait("the new backend and canary", lambda: passes(d, "second", "greet") >= 2)
    assert passes(d, "fake", "greet") >= 1
    shows(d, "canaryd_canary_verdict", 1, backend="second", canary="greet", verdict="identical")
    assert {s.name for s in d.config.schedules} == {"fast"} and len(d.config.backends) == 2

    # a config that does not validate: rejected, counted, and the old one keeps probing
    (tmp_path / "canaryd.toml").write_text(
        (tmp_path / "canaryd.toml").read_text().replace('kind = "scripted"', 'kind = "triton"', 1)
    )
    before = passes(d, "second", "greet")
    assert d.reload() is False
    assert value(d, "canaryd_config_reload_failures_total") == 1
    assert value(d, "canaryd_config_reloads_total") == 2
    wait("a pass after the rejected reload", lambda: passes(d, "second", "greet") > before)
    assert len(d.config.backends) == 2

    # a reload that drops a suite and a backend: their series disappear
    write(tmp_path, scripted(), ["extra.toml"], port(d))
    assert d.reload() is True
    assert value(d, "canaryd_canary_probe_success", backend="fake", canary="add") is None
    assert value(d, "canaryd_canary_probe_success", backend="second", canary="greet") is None
    assert value(d, "canaryd_backend_reachable", backend="second") is None
    after = passes(d, "fake", "greet")
    wait("a pass of the reloaded config", lambda: passes(d, "fake", "greet") > after)
    assert value(d, "canaryd_canary_last_probe_timestamp_seconds", backend="fake", canary="add") is None


def test_a_backend_that_errors_does_not_stop_another_backends_series(daemon):
    d = daemon(
        scripted("good")
        + scripted("down", body=change(at=1, down=True))
        + scripted("failing", retries=0, breaker_failures=1000, body=change(at=1, error="http_5xx"))
    )
    wait(
        "two passes of every backend",
        lambda: all(passes(d, b, "add") >= 2 for b in ("good", "down", "failing")),
    )

    shows(d, "canaryd_canary_verdict", 1, backend="good", canary="add", verdict="identical")
    for b, reason in (("down", "connect"), ("failing", "http_5xx")):
        shows(d, "canaryd_backend_probe_failures_total", 2, True, backend=b, reason=reason)
    assert value(d, "canaryd_backend_reachable", backend="good") == 1
    assert value(d, "canaryd_canary_probe_success", backend="good", canary="add") == 1

    assert value(d, "canaryd_backend_reachable", backend="down") == 0
    assert value(d, "canaryd_canary_probe_success", backend="down", canary="add") == 0

    assert value(d, "canaryd_backend_reachable", backend="failing") == 1  # reachable, but failing probes
    assert value(d, "canaryd_canary_probe_success", backend="failing", canary="add") == 0
    for b in ("down", "failing"):
        assert value(d, "canaryd_canary_verdict", backend=b, canary="add", verdict="error") == 1
        assert d.store.baseline(b, "add") is None
    # the good backend kept being probed on schedule all along
    n = passes(d, "good", "add")
    wait("another pass of the good backend", lambda: passes(d, "good", "add") > n)


def test_a_reference_is_one_backend_of_the_daemon_with_its_stop_event_and_its_breaker_across_passes(
    tmp_path, monkeypatch
):
    """The reference a backend names is built once, with the generation's backends: the daemon's stop event
    reaches it, and its circuit breaker counts on from pass to pass, so a reference that keeps failing is
    left alone for its cool-down instead of being built and asked afresh every pass."""
    from canaryd.backends import scripted as kind
    from canaryd.daemon import service

    built: list[str] = []
    real_init = kind.Prober.__init__

    def counted(self, cfg):
        built.append(cfg.name)
        real_init(self, cfg)

    monkeypatch.setattr(kind.Prober, "__init__", counted)
    runs = []
    real_pass = service.run_pass

    def kept(*args):
        runs.extend(real_pass(*args))
        return runs[-1:]

    monkeypatch.setattr(service, "run_pass", kept)
    (tmp_path / "plain.toml").write_text(PLAIN)
    failing = change(at=1, error="connect")
    (tmp_path / "canaryd.toml").write_text(
        'state_dir = "state"\nsuites = ["plain.toml"]\n'
        + scripted(reference="ref")
        + scripted("ref", retries=0, breaker_failures=3, breaker_cooldown="1h", body=failing)
        + '[[schedules]]\nname = "fast"\nevery = "1s"\nbackends = ["fake"]\n'
    )
    d = Daemon(tmp_path / "canaryd.toml", load_config(tmp_path / "canaryd.toml"))
    try:
        d._pass("fast")
        d._pass("fast")
        ref = d.gen.backends["ref"]
        assert ref.stopping is d.stop_event
        d.stop_event.set()
        stopped = ref.probe(d.gen.work["fast"]["fake"][0])
    finally:
        d.gen.close()
        d.store.close()
    assert built.count("ref") == 1 and built.count("fake") == 1
    assert [r.backend for r in runs] == ["fake", "fake"]
    first, second = ({r.observation.canary_id: r.comparison for r in run.results} for run in runs)
    assert set(first) == set(second) == set(IDS)
    assert all("connect" in first[c].reference["error"] for c in IDS)
    # the breaker opened in the first pass (3 failures in a row) and is still cooling down in the second
    for c in IDS:
        error = second[c].reference["error"]
        assert "circuit_open" in error and "cooling down" in error
        assert any("reference check on 'ref' failed" in r for r in second[c].reasons)
    assert stopped.error_kind.value == "stopped" and stopped.error == "not sent: canaryd is stopping"
