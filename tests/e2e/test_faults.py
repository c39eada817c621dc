"""Backend faults through a fault-injecting proxy in front of a real vLLM server: every fault becomes an
`error` observation with its reason, transient ones are retried (bounded), a failing backend trips the
circuit breaker, and none of it ever yields a drift verdict or disturbs the baseline.

The retry policy and the breaker as pure logic are in tests/unit/test_faults.py.
"""

import json
import sqlite3
import subprocess
import sys

import pytest

from canaryd.backends import make_backend
from canaryd.canaries import load_suite
from canaryd.config import load_config
from canaryd.daemon.metrics import Metrics
from canaryd.lab.vllm_process import VLLMServer
from canaryd.observation import ErrorKind
from canaryd.probe.run import plan, probe_backend
from canaryd.store import Store
from tests.harness.faultproxy import FaultProxy

SUITE = """
[suite]
name = "faults"
[defaults]
max_tokens = 6
[[canary]]
id = "chat"
messages = [{ role = "user", content = "What is 17 + 25?" }]
[[canary]]
id = "raw"
prompt = "The three primary colors of light are"
"""
CONFIG = """
state_dir = "state"
suites = ["suite.toml"]
[[backends]]
name = "local"
kind = "vllm"
base_url = "{url}/v1"
model = "tiny"
timeout_s = 5
concurrency = 2
retries = 1
retry_backoff = "50ms"
breaker_failures = 3
breaker_cooldown = "1h"
[backends.request]
logprobs = "require"  # an answer without logprobs is an error (the default, "prefer", judges its text)
"""


class Lab:
    def __init__(self, root, proxy):
        self.root, self.proxy = root, proxy
        (root / "suite.toml").write_text(SUITE)
        (root / "canaryd.toml").write_text(CONFIG.format(url=proxy.url))

    def check(self):
        p = subprocess.run(
            [sys.executable, "-m", "canaryd", "-c", str(self.root / "canaryd.toml"), "check", "--json"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert "Traceback" not in p.stderr, p.stderr
        return p.returncode, json.loads(p.stdout)["results"]


@pytest.fixture(scope="module")
def lab(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("faults")
    with VLLMServer(tiny_model, extra_args=["--enforce-eager"], log_path=root / "vllm.log") as server:
        proxy = FaultProxy(server.root_url, hang_s=12)
        try:
            yield Lab(root, proxy)
        finally:
            proxy.stop()


EXPECTED = [
    ("hang", ErrorKind.TIMEOUT, 2),
    ("429", ErrorKind.RATE_LIMITED, 2),
    ("503", ErrorKind.HTTP_5XX, 2),
    ("truncate", ErrorKind.TRUNCATED, 2),
    ("badjson", ErrorKind.INVALID_RESPONSE, 1),  # a malformed 200 is not retried
    ("nologprobs", ErrorKind.NO_LOGPROBS, 1),
]


def test_faults_become_errors_with_reasons_and_never_drift(lab):
    code, results = lab.check()
    assert code == 0 and {r["verdict"] for r in results} == {"baseline"}
    for mode, kind, attempts in EXPECTED:
        lab.proxy.mode, before = mode, lab.proxy.probe_hits
        code, results = lab.check()
        assert code == 3, (mode, results)
        assert {(r["verdict"], r["error_kind"]) for r in results} == {("error", kind.value)}, mode
        assert lab.proxy.probe_hits - before == 2 * attempts, f"{mode}: retries"
        if attempts > 1:
            assert all(r["error"].endswith("(after 2 attempts)") for r in results)
    lab.proxy.mode = "pass"
    code, results = lab.check()
    assert code == 0 and {r["verdict"] for r in results} == {"identical"}  # the baseline survived it all
    db = sqlite3.connect(lab.root / "state" / "canaryd.db")
    assert db.execute("pragma integrity_check").fetchone()[0] == "ok"
    assert (
        db.execute(
            "select count(*) from baseline b join observation o on o.id = b.observation_id "
            "where o.verdict = 'baseline'"
        ).fetchone()[0]
        == 2
    )


def test_a_transient_failure_is_retried_into_a_good_observation(lab):
    lab.proxy.mode, lab.proxy.fail_first, lab.proxy.probe_hits = "pass", 1, 0
    code, results = lab.check()
    assert code == 0 and {r["verdict"] for r in results} == {"identical"}
    assert lab.proxy.probe_hits == 3  # one canary needed a second attempt


def test_the_circuit_breaker_stops_hammering_a_failing_backend(lab):
    lab.proxy.mode, lab.proxy.fail_first = "503", 0
    backend = make_backend(load_config(lab.root / "canaryd.toml").backend("local"))
    canary = load_suite(lab.root / "suite.toml").canaries[0]
    try:
        kinds = [backend.probe(canary).error_kind for _ in range(3)]
        assert kinds == [ErrorKind.HTTP_5XX] * 3
        before = lab.proxy.probe_hits
        tripped = backend.probe(canary)
        assert tripped.error_kind is ErrorKind.CIRCUIT_OPEN and tripped.attempts == 0
        assert lab.proxy.probe_hits == before  # nothing was sent
    finally:
        backend.close()
        lab.proxy.mode = "pass"


def test_a_server_failing_after_the_snapshot_is_not_a_stack_change(lab):
    """A restart can land between a pass's snapshot and its canaries: introspection answers, every probe
    fails. That pass has no stack of its own, so neither it nor the next good pass counts as a change."""
    config = load_config(lab.root / "canaryd.toml")
    work = plan(config, [load_suite(lab.root / "suite.toml")])["local"]
    metrics, store = Metrics(), Store(config.storage_url)
    changes = []
    try:
        for mode in ("pass", "503", "pass"):
            lab.proxy.mode = mode
            backend = make_backend(config.backend("local"))  # a fresh breaker each pass
            try:
                run = probe_backend(backend, work, store, config)
            finally:
                backend.close()
            assert run.unavailable is None and all(r.observation.ok == (mode == "pass") for r in run.results)
            assert bool(run.stack) == (mode == "pass")
            metrics.record(run)
            changes.append(
                metrics.registry.get_sample_value("canaryd_backend_stack_changes_total", {"backend": "local"})
            )
    finally:
        store.close()
        lab.proxy.mode = "pass"
    assert changes == [0, 0, 0]
