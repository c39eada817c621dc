"""What one daemon carries (`canaryd.daemon.capacity`): the in-flight cap across backends, measured at a
loopback server that answers like vLLM after a delay, and the overrun metric and warning of a pass longer
than its interval (scripted kind with a latency). Passes run by hand (`Daemon._job`), as the scheduler
would run them."""

from __future__ import annotations

import json

import structlog

from canaryd.config import load_config
from canaryd.daemon.capacity import late_backends
from canaryd.daemon.service import Daemon
from tests.harness.loopback import Loopback
from tests.harness.scripted_lab import PLAIN, free_port, scripted


def daemon(root, backends: str, every: str, cap: int | None = None) -> Daemon:
    (root / "plain.toml").write_text(PLAIN)
    cap_line = "" if cap is None else f"max_in_flight = {cap}\n"
    (root / "canaryd.toml").write_text(
        f'state_dir = "state"\nsuites = {json.dumps(["plain.toml"])}\n'
        + backends
        + f'\n[daemon]\nlisten = "127.0.0.1:{free_port()}"\ninstance = "unit"\n{cap_line}'
        + f'[[schedules]]\nname = "s"\nevery = "{every}"\n'
    )
    path = root / "canaryd.toml"
    return Daemon(path, load_config(path))


def value(d: Daemon, name: str, **labels: str) -> float | None:
    return d.metrics.registry.get_sample_value(name, labels)


def test_the_default_cap_is_documented():
    from canaryd.config import DaemonConfig

    assert DaemonConfig().max_in_flight == 64


def test_a_daemon_with_cap_k_never_has_more_than_k_requests_in_flight_across_its_backends(tmp_path):
    """Six backends that would each send four canaries at once (24 requests) to one server: the server
    never holds more than the daemon's cap of 3, and holds 3 at some point (the cap, not some other
    limit, is what bounds it). The pass runs its backends on a pool of 3 threads, not one per backend."""
    with Loopback(delay_s=0.02) as server:
        backends = "".join(
            f'[[backends]]\nname = "v{i}"\nkind = "vllm"\nbase_url = "{server.base("slow")}"\n'
            'model = "m"\nconcurrency = 4\n'
            for i in range(6)
        )
        d = daemon(tmp_path, backends, "60s", cap=3)
        try:
            d._job("s")
            sent = [r for r in server.requests if r.path.endswith("completions")]
            assert len(sent) >= 6 * 3  # every canary of every backend was sent (first contact repeats some)
            assert server.peak == 3 and d.gate.peak == 3 and d.gate.in_flight == 0
            assert len(d.pool._threads) <= 3
            assert value(d, "canaryd_schedule_overruns_total", schedule="s") == 0
            assert 0 < value(d, "canaryd_schedule_last_pass_duration_seconds", schedule="s") < 60
            for i in range(6):
                v = value(d, "canaryd_canary_probe_success", backend=f"v{i}", canary="add")
                assert v == 1
        finally:
            d.stop()
    # without a cap given, the default: the same backends put more than 3 in flight
    with Loopback(delay_s=0.02) as server:
        backends = "".join(
            f'[[backends]]\nname = "v{i}"\nkind = "vllm"\nbase_url = "{server.base("slow")}"\n'
            'model = "m"\nconcurrency = 4\n'
            for i in range(6)
        )
        (tmp_path / "state").mkdir(exist_ok=True)
        d = daemon(tmp_path, backends, "60s")
        try:
            d._job("s")
            assert server.peak > 3 and d.gate.peak <= 64
        finally:
            d.stop()


def test_a_pass_longer_than_its_interval_is_counted_and_names_the_backends_that_made_it_late(tmp_path):
    slow = scripted("slow-a", latency_s=0.5, concurrency=1) + scripted("slow-b", latency_s=0.4, concurrency=1)
    d = daemon(tmp_path, slow + scripted("quick"), "1s")
    try:
        with structlog.testing.capture_logs() as logs:
            d._job("s")
    finally:
        d.stop()
    assert value(d, "canaryd_schedule_overruns_total", schedule="s") == 1
    assert value(d, "canaryd_schedule_last_pass_duration_seconds", schedule="s") > 1
    (warning,) = [e for e in logs if e["event"] == "pass_overran"]
    assert warning["log_level"] == "warning" and warning["interval_s"] == 1
    assert warning["backends"] == ["slow-a", "slow-b"] and warning["late"] == 2  # slowest first
    assert warning["duration_s"] > 1 and warning["in_flight_cap"] == 64


def test_late_backends_are_those_still_probing_when_the_interval_was_up_slowest_first():
    started = {"a": 0.0, "b": 1.0, "c": 0.0, "d": 5.0}
    finished = {"a": 9.0, "b": 12.0, "c": 11.5, "d": 13.0}
    assert late_backends(10.0, started, finished, begun=0.0) == ["c", "b", "d"]
    assert late_backends(20.0, started, finished, begun=0.0) == []
