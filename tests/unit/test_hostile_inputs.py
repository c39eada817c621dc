"""Hostile or unlucky inputs and environments (issue 15): each must end in a bounded time with one line and
the documented exit code, and never freeze, flood or expose the daemon.

* a regex that backtracks catastrophically: its check is cut off (``check_timeout``), the process stays
  responsive, ``validate`` warns;
* suite, config and pin paths that are not regular files (``/dev/zero``, a FIFO, a directory) or are too
  large: exit 2 naming the file, at once;
* files canaryd creates are private whatever the umask; an exposed API key file is warned about;
* a metrics port in use, a state directory or database URL that cannot be used: exit 2 naming the key;
* idle connections to the metrics port cost no thread, and scrapes still succeed;
* SIGTERM during start-up: a clean exit 0.

The CLI runs as a subprocess where the behaviour is the process's; everything runs on the scripted kind.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

import httpx2
import pytest
import structlog
from prometheus_client import CollectorRegistry, Gauge

from canaryd.canaries import CheckTimeout, Expect, backtracking_risk
from canaryd.config import load_config
from canaryd.daemon.httpserver import MetricsServer
from canaryd.daemon.service import Daemon
from tests.harness.hostile_lab import (
    SLOW,
    SLOW_ANSWER,
    SLOW_SUITE,
    canaryd,
    one_error_line,
    scrape,
    write_config,
)
from tests.harness.scripted_lab import PLAIN, ScriptedLab, scripted

# -- 1. regex checks under a time bound -----------------------------------------------------------------


def test_a_backtracking_check_is_cut_off_and_the_issues_pattern_is_fast():
    t = time.monotonic()
    # bounds far above the work and far below the alternative, so that a loaded machine passes: `regex`
    # answers the first in ~1 ms (backtracking would take 2^30 steps); the second is cut off at 0.3 s
    # (uncut, 2^40 steps)
    assert Expect(regex="^(a+)+$").check("a" * 30 + "!") is False
    assert time.monotonic() - t < 3
    t = time.monotonic()
    with pytest.raises(CheckTimeout, match=r"\^\(a\|a\)\*\$"):
        Expect(regex=SLOW).check(SLOW_ANSWER, timeout_s=0.3)
    assert time.monotonic() - t < 5


def test_a_backtracking_check_releases_the_gil():
    ticks = 0
    done = threading.Event()

    def tick() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            time.sleep(0.01)

    t = threading.Thread(target=tick)
    t.start()
    try:
        with pytest.raises(CheckTimeout):
            Expect(regex=SLOW).check(SLOW_ANSWER, timeout_s=0.5)
    finally:
        done.set()
        t.join()
    assert ticks >= 15  # ~50 if the other thread ran throughout; 1 if the match held the GIL


@pytest.mark.parametrize(
    ("text", "expect", "ok"),
    [
        ("PARIS", {"regex": "^paris\\.?$"}, True),
        ("paris.", {"regex": "^Paris\\.?$"}, True),
        ("Paris", {"regex": "^paris$", "case_sensitive": True}, False),
        (" blue sky", {"regex": "^ ?blue"}, True),
        ("x42", {"regex": r"\d+"}, True),
        ("Ж", {"regex": "^ж$"}, True),
    ],
)
def test_regex_checks_behave_as_before(text, expect, ok):
    assert Expect(**expect).check(text) is ok


@pytest.mark.parametrize(
    ("pattern", "risky"),
    [
        ("^(a+)+$", "nested quantifier"),
        ("^(a*)*$", "nested quantifier"),
        ("(.*a){20}", "nested quantifier"),
        (r"^(\w+\s?)*$", "nested quantifier"),
        ("^(a|a)*$", "ambiguous alternation"),
        ("^(a|aa)+$", "ambiguous alternation"),
        ("(ab|a|b)*", "ambiguous alternation"),
        (r"^\d+(\.\d+)*$", None),
        ("^(ab+)*$", None),
        ("(foo|far)*", None),
        ("^paris\\.?$", None),
        ("(?:a++)+", None),  # possessive: never backtracks
        (r"\p{L}+", None),  # `regex`-only syntax: not examined
    ],
)
def test_backtracking_heuristic(pattern, risky):
    assert backtracking_risk(pattern) == risky


def test_a_sampled_canary_whose_check_times_out_is_an_error(tmp_path):
    sampled = SLOW_SUITE.replace("max_tokens = 64", "max_tokens = 64, temperature = 1.0, samples = 5")
    lab = ScriptedLab(tmp_path, scripted(answers={"slow": SLOW_ANSWER}), {"slow.toml": sampled})
    try:
        t = time.monotonic()
        run = lab.cycle()
        assert time.monotonic() - t < 5  # one check runs out of time, not five
    finally:
        lab.close()
    assert len(run.results) == 5
    for r in run.results:
        assert r.comparison.verdict.value == "error"
        assert r.observation.error_kind.value == "check_timeout" and SLOW in (r.observation.error or "")


# -- 2. paths that are not regular files, or too large ----------------------------------------------------


def _fifo(tmp_path: Path) -> Path:
    path = tmp_path / "fifo.toml"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("kind", ["/dev/zero", "fifo", "directory", "17 MB"])
def test_a_suite_that_is_not_a_small_regular_file_is_refused_at_once(tmp_path, kind):
    if kind == "/dev/zero":
        suite = Path("/dev/zero")
    elif kind == "fifo":
        suite = _fifo(tmp_path)
    elif kind == "directory":
        suite = tmp_path / "suite.d"
        suite.mkdir()
    else:
        suite = tmp_path / "big.toml"
        suite.write_bytes(b"#" * (17 << 20))
    cfg = write_config(tmp_path, [str(suite)])
    t = time.monotonic()
    p = canaryd(cfg, "validate", timeout=30)
    assert time.monotonic() - t < 2 + 3  # the interpreter's start under CI load, beyond the 2 s asked
    assert p.returncode == 2, p.stderr
    line = one_error_line(p)
    assert str(suite) in line
    assert ("suite_bytes" in line) if kind == "17 MB" else ("regular file" in line)


def test_config_and_pin_paths_must_be_regular_files(tmp_path):
    fifo = _fifo(tmp_path)
    p = canaryd(fifo, "validate", timeout=30)
    assert p.returncode == 2 and str(fifo) in one_error_line(p) and "a FIFO" in p.stderr
    (tmp_path / "plain.toml").write_text(PLAIN)
    cfg = write_config(tmp_path, ["plain.toml"], backends=scripted())
    p = canaryd(cfg, "check", "--pin", str(fifo), timeout=30)
    assert p.returncode == 2 and str(fifo) in one_error_line(p)


def test_a_reload_onto_a_fifo_suite_is_rejected_at_once(tmp_path):
    (tmp_path / "plain.toml").write_text(PLAIN)
    cfg = write_config(tmp_path, ["plain.toml"], backends=scripted())
    d = Daemon(cfg, load_config(cfg))
    try:
        fifo = _fifo(tmp_path)
        cfg.write_text(cfg.read_text().replace('"plain.toml"', json.dumps(str(fifo))))
        t = time.monotonic()
        assert d.reload() is False
        assert time.monotonic() - t < 2
    finally:
        d.stop()


# -- 3. private files whatever the umask; exposed key files ------------------------------------------------


OPENAI = """[[backends]]
name = "o"
kind = "openai"
base_url = "http://127.0.0.1:9/v1"
model = "m"
api_key_file = "{key}"
"""


@pytest.mark.parametrize(
    ("mode", "link", "warned"),
    [(0o644, False, True), (0o640, False, True), (0o600, True, True), (0o600, False, False)],
)
def test_an_exposed_api_key_file_is_warned_about_and_still_used(tmp_path, mode, link, warned):
    key = tmp_path / "key"
    key.write_text("sk-test\n")
    key.chmod(mode)
    named = key
    if link:
        named = tmp_path / "key-link"
        named.symlink_to(key)
    (tmp_path / "plain.toml").write_text(PLAIN)
    cfg = load_config(write_config(tmp_path, ["plain.toml"], backends=OPENAI.format(key=named)))
    with structlog.testing.capture_logs() as logs:
        assert cfg.backend("o").api_key() == "sk-test"
    exposed = [e for e in logs if e["event"] == "api_key_file_exposed"]
    assert bool(exposed) is warned
    if warned:
        assert exposed[0]["path"] == str(named) and exposed[0]["log_level"] == "warning"


# -- 5. the metrics server: bounded threads, idle connections cost nothing ---------------------------------


def test_idle_connections_are_closed_after_the_timeout_and_excess_requests_wait_or_get_503():
    registry = CollectorRegistry()
    Gauge("x", "x", registry=registry).set(1)

    class Slow:
        def collect(self):
            time.sleep(0.6)
            return []

    registry.register(Slow())
    server = MetricsServer(("127.0.0.1", 0), registry, max_handlers=1, max_queued=1, timeout_s=1.0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        with socket.create_connection(("127.0.0.1", port)) as idle:
            idle.settimeout(5)
            t = time.monotonic()
            assert idle.recv(1) == b""  # closed by the server
            assert time.monotonic() - t < 2.5
        results: list[int] = []
        scrapers = [threading.Thread(target=lambda: results.append(scrape(port)[0])) for _ in range(2)]
        for scraper in scrapers:  # the first holds the one handler for 0.6 s, the second waits its turn
            scraper.start()
            time.sleep(0.15)
        busy = scrape(port)[0]  # the queue (1) is full: refused at once
        for scraper in scrapers:
            scraper.join()
        assert results == [200, 200] and busy == 503
        assert httpx2.get(f"http://127.0.0.1:{port}/nope", timeout=5).status_code == 404
    finally:
        server.shutdown()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1)
