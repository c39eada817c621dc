"""Metrics folded from synthetic probe passes: values, bounded labels, stack-change counting, the lean
layout (a few series per canary × backend), the exposition cached per pass, and the server's /runbook."""

import gzip
import http.client
import re
import threading
import time
import zlib
from datetime import UTC, datetime
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from canaryd.daemon.httpserver import MetricsServer, anchor, runbook_html, runbook_markdown
from canaryd.daemon.metric_table import METRICS, PAIR_FAMILIES, LeaseLoss, MetricDef, Scope
from canaryd.daemon.metrics import Metrics
from canaryd.judge.compare import compare
from canaryd.observation import ErrorKind, Observation, TokenLogprob
from canaryd.probe.run import BackendRun, Result

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())


def run(stack_fp="fp-1", lp=-0.5, error=False, unavailable=None, backend="b", canaries=("c",)):
    return BackendRun(
        backend,
        "vllm",
        1,
        [_result(stack_fp, lp, error, backend, c) for c in canaries],
        {} if error or unavailable else {"vllm.version": "0.32.0", "response.system_fingerprint": stack_fp},
        unavailable,
    )


def _result(stack_fp, lp, error, backend, canary):
    o = Observation(backend, canary, "s", datetime(2026, 1, 1, tzinfo=UTC), {}, "r")
    if error:
        o.error, o.error_kind = "boom", ErrorKind.HTTP_5XX
    else:
        o.text, o.system_fingerprint, o.latency_s = "42", stack_fp, 0.2
        o.tokens = [TokenLogprob("42", lp)]
    base = Observation("b", "c", "s", datetime(2026, 1, 1, tzinfo=UTC), {}, "r")
    base.text, base.tokens, base.system_fingerprint = "42", [TokenLogprob("42", -0.5)], "fp-1"
    cmp = compare(base, o, correct=True if not error else None, baseline_correct=True)
    return Result(1, 1, o, cmp)


def value(m: Metrics, name: str, labels: dict) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_identical_then_drift_then_error():
    m = Metrics()
    m.record(run(), now=100.0)
    bc = {"backend": "b", "canary": "c"}
    assert value(m, "canaryd_canary_verdict", {**bc, "verdict": "identical"}) == 1
    assert value(m, "canaryd_canary_verdict", {**bc, "verdict": "logprob-drift"}) is None  # one series
    assert value(m, "canaryd_canary_logprob_delta_max", bc) == 0
    assert value(m, "canaryd_backend_stack_changes_total", {"backend": "b"}) == 0
    assert value(m, "canaryd_backend_fingerprints", {"backend": "b"}) == 1

    m.record(run(stack_fp="fp-2", lp=-0.51), now=200.0)
    assert value(m, "canaryd_canary_verdict", {**bc, "verdict": "logprob-drift"}) == 1
    assert value(m, "canaryd_canary_verdict", {**bc, "verdict": "identical"}) is None
    assert abs(value(m, "canaryd_canary_logprob_delta_max", bc) - 0.01) < 1e-9
    assert value(m, "canaryd_backend_stack_changes_total", {"backend": "b"}) == 1
    assert value(m, "canaryd_backend_fingerprints", {"backend": "b"}) == 2
    info = {"backend": "b", "kind": "vllm", "engine_version": "0.32.0", "model": ""}
    assert (
        value(
            m,
            "canaryd_backend_stack_info",
            {**info, "fingerprint": "fp-2", "stack_hash": run(stack_fp="fp-2").stack_hash},
        )
        == 1
    )
    assert (
        "fp-1"
        not in generate_latest(m.registry).decode().split("canaryd_backend_stack_info{")[1].split("\n")[0]
    )

    m.record(run(error=True), now=300.0)
    assert value(m, "canaryd_canary_probe_success", bc) == 0
    assert value(m, "canaryd_backend_probe_failures_total", {"backend": "b", "reason": "http_5xx"}) == 1
    assert value(m, "canaryd_backend_probes_total", {"backend": "b"}) == 3
    assert value(m, "canaryd_backend_probe_duration_seconds_count", {"backend": "b"}) == 2  # answers only
    assert value(m, "canaryd_canary_verdict", {**bc, "verdict": "error"}) == 1
    assert value(m, "canaryd_canary_last_probe_timestamp_seconds", bc) == 300.0


def test_fingerprints_age_out_of_the_window():
    m = Metrics(fingerprint_window_s=60)
    m.record(run(stack_fp="a"), now=0.0)
    m.record(run(stack_fp="b"), now=30.0)
    assert value(m, "canaryd_backend_fingerprints", {"backend": "b"}) == 2
    m.record(run(stack_fp="b"), now=100.0)
    assert value(m, "canaryd_backend_fingerprints", {"backend": "b"}) == 1


def test_no_free_text_in_labels():
    m = Metrics()
    m.record(run(error=True))
    text = generate_latest(m.registry).decode()
    assert "boom" not in text and "canaryd_build_info{" in text and "_created" not in text


def test_series_of_canaries_dropped_by_a_reload_disappear():
    m = Metrics()
    m.set_intervals([("b", "c", 300.0), ("b", "gone", 300.0), ("old", "c", 60.0)])
    m.record(run())
    m.set_intervals([("b", "c", 300.0)])
    text = generate_latest(m.registry).decode()
    assert 'canary="gone"' not in text and 'backend="old"' not in text
    assert 'canaryd_canary_verdict{backend="b",canary="c",verdict="identical"} 1.0' in text


def test_a_pass_of_the_old_config_recorded_after_the_reload_does_not_bring_dropped_series_back():
    """The reload drops a canary and a backend while a pass of the old config is still probing them: what
    that pass records afterwards shows only for what the new config keeps (else a stale series of a
    canary nobody probes would stay, and page as stale)."""
    m = Metrics()
    m.set_intervals([("b", "c", 300.0), ("b", "gone", 300.0), ("old", "c", 60.0)])
    m.set_intervals([("b", "c", 300.0)])
    m.record(run(canaries=("c", "gone")))
    m.record(run(backend="old"))
    m.record_failed("b", ["gone"])
    m.set_config_errors("old", 1)
    m.publish()
    text = generate_latest(m.registry).decode()
    assert 'canary="gone"' not in text and 'backend="old"' not in text
    assert 'canaryd_canary_verdict{backend="b",canary="c",verdict="identical"} 1.0' in text


# -- the lean layout and the cached exposition -----------------------------------------------------------


def _samples(text: str, parse=parse_text) -> set[tuple[str, tuple, float]]:
    return {
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for fam in parse(text)
        for s in fam.samples
        if not s.name.startswith(("process_", "python_"))  # CPU time and memory move between renders
    }


def _busy_metrics() -> Metrics:
    """Three backends × 40 canaries: identical, drifting and failing probes, a reload, a failed pass."""
    m = Metrics()
    ids = [f"c{i}" for i in range(40)]
    m.set_intervals([(b, c, 60.0) for b in ("b", "x", "y") for c in ids])
    m.record(run(backend="b", canaries=ids), now=10.0)
    m.record(run(backend="b", canaries=ids, lp=-0.9, stack_fp="fp-2"), now=20.0)
    m.record(run(backend="x", canaries=ids, error=True), now=20.0)
    m.record_failed("y", ids)
    m.schedule_runs.labels("default").inc()
    m.set_lease("b", True)
    m.publish()
    return m


def test_at_most_four_series_per_canary_and_backend():
    """What docs/daemon.md states: 4 series per canary × backend at most, the rest per backend."""
    pairs = (40 + 1) * 3
    m = _busy_metrics()
    body, _ = m.exposition()
    text = body.decode()
    per_pair = [line for line in text.splitlines() if 'canary="' in line]
    assert 0 < len(per_pair) <= 4 * pairs
    for name in (f.name for f in PAIR_FAMILIES):
        keys = [
            re.sub(r",verdict=.*", "", line.split("}")[0]) for line in per_pair if line.startswith(name + "{")
        ]
        assert len(keys) == len(set(keys)), f"{name}: more than one series for a pair"
    assert {line.split("{")[0] for line in per_pair} <= {f.name for f in PAIR_FAMILIES}
    # nothing per pair repeats history: no counters or histograms carry a canary label
    assert not re.search(r'_(total|bucket|sum|count)\{[^}]*canary="', text)


def _steady(body: bytes) -> bytes:
    """An exposition without the process collector's samples, which move between two renders (CPU time)."""
    return b"\n".join(line for line in body.splitlines() if not line.startswith(b"process_"))


@pytest.mark.parametrize("accept", ["", "application/openmetrics-text; version=1.0.0"])
def test_cached_exposition_is_what_the_registry_holds(accept):
    """The cached body (live part + the pass, in both formats, plain or gzipped) parses to the very
    samples a render of the whole registry gives."""
    m = _busy_metrics()
    body, ctype = m.exposition(accept)
    gz, gz_type = m.exposition(accept, gzipped=True)
    assert _steady(gzip.decompress(gz)) == _steady(body) and gz_type == ctype
    # one gzip member, not several: clients built on zlib (Python's among them) stop after the first
    one = zlib.decompressobj(16 + zlib.MAX_WBITS)
    assert _steady(one.decompress(gz)) == _steady(body) and one.eof and not one.unused_data
    if accept:
        assert ctype.startswith("application/openmetrics-text") and body.endswith(b"# EOF\n")
        got = _samples(body.decode(), parse_openmetrics)
        assert {(n.removesuffix("_total"), labels, v) for n, labels, v in got} == {
            (n.removesuffix("_total"), labels, v)
            for n, labels, v in _samples(generate_latest(m.registry).decode())
        }
    else:
        assert ctype.startswith("text/plain; version=0.0.4")
        assert _samples(body.decode()) == _samples(generate_latest(m.registry).decode())


def test_the_pass_shows_once_published_and_canaryd_series_at_once():
    m = Metrics()
    m.record(run(), now=1.0)
    m.schedule_runs.labels("default").inc()
    text = m.exposition()[0].decode()
    assert "canaryd_canary_verdict{" not in text  # recorded, not yet published
    assert 'canaryd_schedule_runs_total{schedule="default"} 1.0' in text  # rendered on every scrape
    m.publish()
    assert (
        'canaryd_canary_verdict{backend="b",canary="c",verdict="identical"} 1.0' in m.exposition()[0].decode()
    )


def test_odd_canary_names_are_escaped_like_the_client_does():
    m = Metrics()
    odd = 'say "hi"\\ \nnow'
    m.record(run(canaries=(odd,)), now=5.0)
    m.publish()
    text = m.exposition()[0].decode()
    assert _samples(text) == _samples(generate_latest(m.registry).decode())
    assert (
        "canaryd_canary_last_probe_timestamp_seconds",
        (("backend", "b"), ("canary", odd)),
        5.0,
    ) in _samples(text)


def test_lease_gauge_per_backend():
    m = Metrics()
    m.set_intervals([("b", "c", 60.0), ("z", "c", 60.0)])
    m.set_lease("b", False)  # a change publishes at once
    assert 'canaryd_backend_lease_held{backend="b"} 0.0' in m.exposition()[0].decode()
    m.set_lease("b", True)
    assert 'canaryd_backend_lease_held{backend="b"} 1.0' in m.exposition()[0].decode()
    m.set_intervals([("z", "c", 60.0)])  # b left the config: its series go
    assert 'backend="b"' not in m.exposition()[0].decode()
    assert value(m, "canaryd_backend_probe_interval_seconds", {"backend": "z"}) == 60


def test_the_registry_is_the_table():
    """Every family canaryd exports is a row of the table, in the table's order (the exposition's)."""
    families = [f for f in Metrics().registry.collect() if f.name.startswith("canaryd_")]
    assert [(f.name, f.type, f.documentation) for f in families] == [
        (m.name, m.type, m.help) for m in METRICS
    ]
    assert len({m.attr for m in METRICS}) == len(METRICS)
    m = Metrics()
    for f in METRICS:
        if f.scope is not Scope.PAIR:
            assert getattr(m, f.attr)._labelnames == f.labels, f.name


def test_a_per_backend_row_must_say_what_a_lost_lease_does():
    with pytest.raises(ValueError, match="lost lease"):
        MetricDef("x", "canaryd_backend_x", "gauge", "x", ("backend",), Scope.PASS)
    with pytest.raises(ValueError, match="lost lease"):
        MetricDef("x", "canaryd_x", "gauge", "x", (), Scope.LIVE, LeaseLoss.DROP)


def populated(backend: str) -> Metrics:
    """Every series of the table set for ``backend`` (and for a bystander, "z"), through the daemon's
    calls where one sets it (pairs, lease, interval) and directly where only a pass's detail would."""
    m = Metrics()
    m.set_intervals([(backend, "c", 60.0), ("z", "c", 60.0)])
    for b in (backend, "z"):
        m.set_lease(b, True)
        m.record(run(backend=b), now=10.0)
        for f in METRICS:
            if f.per_backend and f.scope is Scope.PASS:
                series = getattr(m, f.attr).labels(
                    **{label: b if label == "backend" else "x" for label in f.labels}
                )
                getattr(series, {"counter": "inc", "gauge": "set", "histogram": "observe"}[f.type])(1)
    m.publish()
    return m


def families_of(m: Metrics, backend: str) -> set[str]:
    """The families with a series of ``backend`` in both scrape formats (the same set in each)."""
    out = []
    for accept in ("", "application/openmetrics-text; version=1.0.0"):
        text = m.exposition(accept)[0].decode()
        parse = parse_openmetrics if accept else parse_text
        out.append(
            {
                fam.name.removesuffix("_total")
                for fam in parse(text)
                for s in fam.samples
                if s.labels.get("backend") == backend
            }
        )
    assert out[0] == out[1]
    return out[0]


PER_BACKEND = {f.name for f in METRICS if f.per_backend}


def test_every_per_backend_series_is_set_by_the_fixture():
    assert families_of(populated("b"), "b") == PER_BACKEND


def test_a_backend_dropped_by_a_reload_leaves_no_series():
    """Every per-backend family of the table, as the daemon's reload drops the backend."""
    m = populated("b")
    m.set_intervals([("z", "c", 60.0)])
    assert families_of(m, "b") == set()
    assert families_of(m, "z") == PER_BACKEND


def test_a_lost_lease_leaves_only_what_the_table_keeps():
    """Counters, the histogram, the interval and the lease itself (at 0) stay; every state the holder now
    reports goes (the pairs, the stack, the detector, reachability, the reference, the text basis)."""
    m = populated("b")
    m.set_lease("b", False)
    keep = {f.name for f in METRICS if f.per_backend and f.lease_loss is LeaseLoss.KEEP}
    assert families_of(m, "b") == keep
    assert value(m, "canaryd_backend_lease_held", {"backend": "b"}) == 0
    assert families_of(m, "z") == PER_BACKEND


def test_interval_is_the_backends_longest():
    m = Metrics()
    m.set_intervals([("b", "fast", 60.0), ("b", "slow", 3600.0)])
    assert value(m, "canaryd_backend_probe_interval_seconds", {"backend": "b"}) == 3600


# -- the server: cached /metrics, the runbook -------------------------------------------------------------


@pytest.fixture
def served():
    m = _busy_metrics()
    server = MetricsServer(("127.0.0.1", 0), m)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield m, server.server_address[1]
    server.shutdown()


def _get(port: int, path: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path, headers=headers or {})
    resp = conn.getresponse()
    out = resp.status, dict(resp.getheaders()), resp.read()
    conn.close()
    return out


def test_server_returns_the_cached_exposition(served):
    m, port = served
    status, headers, body = _get(port, "/metrics", {"Accept-Encoding": "gzip"})
    assert status == 200 and headers["Content-Encoding"] == "gzip"
    assert _samples(gzip.decompress(body).decode()) == _samples(m.exposition()[0].decode())
    line = 'canaryd_canary_verdict{backend="x",canary="c0",verdict="identical"} 1.0'
    m.record(run(backend="x", canaries=("c0",)), now=99.0)  # it failed; now it answers
    assert line not in _get(port, "/metrics")[2].decode()  # until the pass is published
    m.publish()
    assert line in _get(port, "/metrics")[2].decode()


def test_server_serves_the_runbook_every_alert_links_to(served):
    _, port = served
    status, headers, page = _get(port, "/runbook")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    ids = set(re.findall(r'<h\d id="([^"]+)"', page.decode()))
    alerts = re.findall(r"runbook_url: \S*#(\w+)", (REPO / "prometheus" / "canaryd-alerts.yml").read_text())
    assert alerts and set(alerts) <= ids
    assert {anchor(h) for h in re.findall(r"^#+ (.+)$", runbook_markdown().decode(), flags=re.M)} == ids
    status, headers, md = _get(port, "/runbook.md")
    assert status == 200 and md == runbook_markdown() and headers["Content-Type"].startswith("text/markdown")
    assert b'href="/runbook"' in _get(port, "/")[2]


# -- the daemon: a pass is published, its listener serves it ------------------------------------------------


def test_the_daemon_publishes_each_pass_and_serves_it(tmp_path):
    """A real Daemon on a scripted backend (1 s schedule): after a pass its listener serves the verdicts,
    and a new daemon publishes the last-probe times it restores before its first pass."""
    from canaryd.config import load_config
    from canaryd.daemon.service import Daemon
    from tests.harness.scripted_lab import free_port, scripted
    from tests.unit.test_scripted_daemon import write

    def start() -> tuple[Daemon, int]:
        listen = free_port()
        write(tmp_path, scripted(), ["plain.toml"], listen)
        d = Daemon(tmp_path / "canaryd.toml", load_config(tmp_path / "canaryd.toml"))
        d.start()
        return d, listen

    def served(listen: int) -> str:
        return _get(listen, "/metrics")[2].decode()

    d, listen = start()
    try:
        line = 'canaryd_canary_verdict{backend="fake",canary="add",verdict="identical"} 1.0'
        deadline = time.monotonic() + 20
        while line not in served(listen).splitlines():
            assert time.monotonic() < deadline, served(listen)
            time.sleep(0.1)
        assert re.search(r'^canaryd_backend_probes_total\{backend="fake"\} [1-9]', served(listen), re.M)
        assert _get(listen, "/runbook")[0] == 200
    finally:
        d.stop()
    # a new daemon publishes the last-probe times it restores from the history, before any pass
    d = Daemon(tmp_path / "canaryd.toml", load_config(tmp_path / "canaryd.toml"))
    try:
        assert "canaryd_canary_last_probe" not in d.metrics.exposition()[0].decode()
        d._restore_last_probes()
        assert 'canaryd_canary_last_probe_timestamp_seconds{backend="fake",canary="add"}' in (
            d.metrics.exposition()[0].decode()
        )
    finally:
        d.stop()


def test_runbook_html_has_an_anchor_per_heading_and_escapes_the_rest():
    page = runbook_html(
        "# Runbook\n\nText <b>&</b>\n\n```\n# not a heading\n```\n## CanarydDown ##\nmore\n"
    ).decode()
    assert re.findall(r'<h(\d) id="([^"]+)">', page) == [("1", "runbook"), ("2", "canaryddown")]
    assert "Text &lt;b&gt;&amp;&lt;/b&gt;" in page and "# not a heading" in page
