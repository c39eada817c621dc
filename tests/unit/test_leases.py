"""Leases without PostgreSQL: the lease length, SQLite's single-daemon behaviour, how the daemon follows
what it holds (logs, ``canaryd_backend_lease_held``, dropped gauges) and its pass progress logs.

The claim itself (the atomic upsert on the database's clock) needs PostgreSQL: tests/e2e/test_failover.py
runs it with two real daemons.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from datetime import UTC, datetime

import httpx2
import pytest
import structlog

from canaryd.daemon.generation import Generation
from canaryd.daemon.metric_table import METRICS, LeaseLoss
from canaryd.daemon.metrics import Metrics
from canaryd.daemon.service import Daemon
from canaryd.daemon.tenure import Tenure
from canaryd.store import Store, lease_seconds
from canaryd.store.leases import GRACE_MAX_S, GRACE_MIN_S, Lease, Plan
from tests.harness.scripted_lab import ScriptedLab, scripted
from tests.unit.test_metrics import PER_BACKEND, families_of, populated, run
from tests.unit.test_scripted_daemon import IDS, daemon, passes, port, shows, value, wait  # noqa: F401 (fixture)


@pytest.mark.parametrize("interval", [1.0, 2.0, 10.0, 60.0, 300.0, 3600.0, 86400.0])
@pytest.mark.parametrize("jitter", [0.0, 30.0])
def test_a_lease_outlasts_the_holders_next_pass_by_a_bounded_grace(interval, jitter):
    lease = lease_seconds(interval, jitter)
    grace = lease - interval - jitter  # how late the holder's next pass may start and still renew
    assert GRACE_MIN_S <= grace <= GRACE_MAX_S
    assert grace <= max(interval / 4, GRACE_MIN_S)  # a dead holder is noticed soon after its pass was due
    assert lease_seconds(interval * 2, jitter) > lease  # a slower schedule, a longer lease


def test_on_sqlite_every_backend_is_held_and_nothing_is_written(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/db.sqlite", instance="solo")
    try:
        assert not store.leased
        assert store.lease_holder.startswith("solo#")
        me = store.lease_holder
        assert store.claim_leases({"a": 2.5, "b": 60}) == {"a": Lease(me, 2.5), "b": Lease(me, 60)}
        assert store.release_leases() == 0
        with store.engine.connect() as c:
            assert c.exec_driver_sql("SELECT count(*) FROM lease").scalar() == 0
    finally:
        store.close()


def test_two_stores_of_one_instance_are_two_holders(tmp_path):
    a, b = (Store(f"sqlite:///{tmp_path}/db.sqlite", instance="same") for _ in range(2))
    try:
        assert a.lease_holder != b.lease_holder
    finally:
        a.close()
        b.close()


def test_each_backend_leases_for_its_most_frequent_schedule(tmp_path):
    lab = ScriptedLab(
        tmp_path,
        scripted("both") + scripted("slow"),
        tail=(
            '[[schedules]]\nname = "fast"\nevery = "10s"\njitter = "2s"\nbackends = ["both"]\n'
            '[[schedules]]\nname = "hourly"\nevery = "1h"\n'
        ),
    )
    gen = Generation.build(lab.config)
    try:
        assert gen.lease_s == {"both": lease_seconds(10, 2), "slow": lease_seconds(3600)}
        assert gen.lead == {"both": "fast", "slow": "hourly"}  # the schedule a takeover pass runs
    finally:
        gen.close()
        lab.store.close()


class FleetStore:
    """What `Tenure` asks of the store, answering as a PostgreSQL fleet would: ``holders`` says who holds
    each backend after the next claim (the real claim runs in tests/e2e/test_failover.py)."""

    leased = True
    lease_holder = "me#1"

    def __init__(self) -> None:
        self.holders: dict[str, str | None] = {}
        self.down = False

    def claim_leases(self, seconds, plan=None):
        if self.down:
            raise OSError("connection refused")
        return {
            b: Lease(self.holders.get(b), seconds[b] if self.holders.get(b) == "me#1" else 1.5)
            for b in seconds
        }

    def fleet_view(self):
        return (self.lease_holder,)


def test_a_working_pass_renews_its_backends_only_while_requests_are_answered():
    """`Tenure.keep`: while nothing is answered (a hung daemon) no lease is renewed; once requests are
    answered, every third of a lease the pass's backends are renewed, in one call, a finished one too (its
    next pass comes when this one ends); those the renewal no longer finds held are logged lost. (The
    statement itself: tests/e2e/test_failover.py.)"""
    fleet, renewed, answered = FleetStore(), [], [0]
    fleet.renew_leases = lambda seconds, within, plan: renewed.append(dict(seconds)) or set(seconds) - {"c"}
    futures = {b: Future() for b in ("a", "b", "c")}
    keep = threading.Thread(
        target=Tenure(fleet, Metrics()).keep,
        args=(dict.fromkeys(futures, 0.3), futures, lambda: answered[0]),
    )
    with structlog.testing.capture_logs() as logs:
        keep.start()
        wait("a check without progress", lambda: any(e["event"] == "lease.not_renewed" for e in logs))
        assert renewed == []  # hung: its leases end at their expiry
        futures["a"].set_result(None)
        answered[0] = 3
        wait("a renewal", lambda: renewed)
        for f in ("b", "c"):
            futures[f].set_result(None)
        keep.join()
    assert renewed[0] == {"a": 0.3, "b": 0.3, "c": 0.3}  # a finished: kept for the next pass
    assert [e["backend"] for e in logs if e["event"] == "lease.lost"] == ["c"]


def test_the_daemon_logs_and_exports_each_change_of_what_it_holds():
    fleet, metrics = FleetStore(), Metrics()
    tenure = Tenure(fleet, metrics)
    lease = {"a": 2.5, "b": 2.5}
    held = lambda b: metrics.registry.get_sample_value("canaryd_backend_lease_held", {"backend": b})  # noqa: E731
    fleet.holders = {"a": "me#1", "b": "other#2"}
    with structlog.testing.capture_logs() as logs:
        assert tenure.claim(lease, ["a", "b"]) == ({"a"}, {"b": 1.5})  # when to ask for b again
        assert tenure.claim(lease, ["a", "b"]) == ({"a"}, {"b": 1.5})  # nothing changed: nothing logged
        fleet.holders = {"a": "other#2", "b": "me#1"}  # a pass came late (a lost); b's holder died
        assert tenure.claim(lease, ["a", "b"]) == ({"b"}, {"a": 1.5})
        fleet.down = True
        assert tenure.claim(lease, ["a", "b"]) == (set(), {})
    events = [(e["event"], e["log_level"], e.get("backend")) for e in logs]
    assert events == [
        ("lease.acquired", "info", "a"),
        ("lease.held_elsewhere", "info", "b"),
        ("lease.lost", "warning", "a"),
        ("lease.acquired", "warning", "b"),  # a takeover
        ("lease.claim_failed", "error", None),
    ]
    assert logs[3]["previous"] == "other#2" and logs[2]["holder"] == "other#2"
    assert (held("a"), held("b")) == (0, 1)  # a failed claim changes no series: they age instead


def test_a_lease_lost_between_claims_is_exported_at_once_with_the_share_it_leaves():
    """A backend taken as a pass sets out, as a worker starts it, or at a renewal (`Tenure.lose`) is no
    longer exported as held, and the daemon's share of the plan drops with it, before its next claim."""
    fleet, metrics = FleetStore(), Metrics()
    tenure = Tenure(fleet, metrics)
    fleet.holders = {"a": "me#1", "b": "me#1", "c": "other#2"}
    plan = Plan({"a": 3.0, "b": 1.0, "c": 4.0}, dict.fromkeys("abc", 1.0), 2.5)
    get = metrics.registry.get_sample_value
    assert tenure.claim(dict.fromkeys("abc", 2.5), ["a", "b", "c"], plan)[0] == {"a", "b"}
    assert get("canaryd_fleet_weight_share") == 0.5 and get("canaryd_fleet_backends_held") == 2
    with structlog.testing.capture_logs() as logs:
        tenure.lose({"a"}, "taken before its probe")
    assert [(e["event"], e["backend"], e["reason"]) for e in logs] == [
        ("lease.lost", "a", "taken before its probe")
    ]
    assert get("canaryd_backend_lease_held", {"backend": "a"}) == 0
    assert get("canaryd_fleet_weight_share") == 1 / 8 and get("canaryd_fleet_backends_held") == 1


def test_a_pass_recorded_after_its_lease_was_lost_is_dropped_again_at_the_next_claim():
    """A renewal found the lease lost, but the pass had probed the backend and records it after: the next
    claim, which finds the backend held elsewhere, drops its series again (not for ever exported)."""
    fleet, metrics = FleetStore(), populated("a")
    tenure = Tenure(fleet, metrics)
    fleet.holders = {"a": "me#1", "z": "me#1"}
    assert tenure.claim({"a": 2.5, "z": 2.5}, ["a", "z"])[0] == {"a", "z"}
    tenure.lose({"a"}, "taken during its pass")
    kept = {m.name for m in METRICS if m.per_backend and m.lease_loss is LeaseLoss.KEEP}
    assert families_of(metrics, "a") == kept
    metrics.record(run(backend="a"), now=20.0)  # the pass's run, recorded after the loss
    metrics.publish()
    assert families_of(metrics, "a") > kept
    fleet.holders = {"a": "other#2", "z": "me#1"}
    assert tenure.claim({"a": 2.5, "z": 2.5}, ["a", "z"])[0] == {"z"}
    assert families_of(metrics, "a") == kept


def test_a_lease_taken_by_another_daemon_leaves_only_the_series_the_metric_table_keeps():
    """Every per-backend series of the table, set, then the lease lost through the daemon's `Tenure`."""
    fleet, metrics = FleetStore(), populated("a")
    tenure = Tenure(fleet, metrics)
    fleet.holders = {"a": "me#1", "z": "me#1"}
    assert tenure.claim({"a": 2.5, "z": 2.5}, ["a", "z"])[0] == {"a", "z"}
    assert families_of(metrics, "a") == PER_BACKEND
    fleet.holders = {"a": "other#2", "z": "me#1"}
    assert tenure.claim({"a": 2.5, "z": 2.5}, ["a", "z"])[0] == {"z"}
    kept = {m.name for m in METRICS if m.per_backend and m.lease_loss is LeaseLoss.KEEP}
    assert families_of(metrics, "a") == kept
    assert families_of(metrics, "z") == PER_BACKEND


def test_a_daemon_that_does_not_hold_a_backend_drops_its_gauges_but_not_its_counters(daemon):  # noqa: F811
    d = daemon(scripted())
    shows(d, "canaryd_backend_probes_total", len(IDS), True, backend="fake")  # a pass, recorded
    assert value(d, "canaryd_backend_lease_held", backend="fake") == 1  # SQLite: held
    d.metrics.set_lease("fake", False)
    assert value(d, "canaryd_backend_lease_held", backend="fake") == 0
    for c in IDS:
        assert value(d, "canaryd_canary_last_probe_timestamp_seconds", backend="fake", canary=c) is None
        assert value(d, "canaryd_canary_verdict", backend="fake", canary=c, verdict="identical") is None
        assert passes(d, "fake", c) >= 1  # the history stays, of course
    assert value(d, "canaryd_backend_reachable", backend="fake") is None
    assert value(d, "canaryd_backend_probe_interval_seconds", backend="fake") == 1
    assert value(d, "canaryd_backend_probes_total", backend="fake") >= len(IDS)
    served = httpx2.get(f"http://127.0.0.1:{port(d)}/metrics", timeout=5).text
    assert 'canaryd_backend_lease_held{backend="fake"} 0.0' in served  # published at once
    assert 'canaryd_canary_verdict{backend="fake"' not in served


def test_a_phase_due_while_the_pass_that_respaced_it_still_runs_probes_it(tmp_path):
    """The regular pass that leaves a backend to its phase is still probing another when that phase is due:
    the phase pass probes it all the same (it is not that pass's any more), and it stays on its phase."""
    tail = '[[schedules]]\nname = "fast"\nevery = "1h"\n'
    lab = ScriptedLab(tmp_path, scripted() + scripted(name="slow"), tail=tail)
    lab.store.close()
    d = Daemon(lab.path, lab.config)
    honest, calls = d.store.start_probes, []
    probe, probing, release = d._probe, threading.Event(), threading.Event()

    def fake_probed_40s_ago(spacing):
        calls.append(sorted(spacing))
        return ({"slow"}, {"fake": 40.0}) if len(calls) == 1 else honest(spacing)

    def slow_until_released(gen, schedule, backend, canaries):
        if backend == "slow":
            probing.set()
            release.wait(60)
        return probe(gen, schedule, backend, canaries)

    try:
        d.store.start_probes, d._probe = fake_probed_40s_ago, slow_until_released
        with structlog.testing.capture_logs() as logs:
            regular = threading.Thread(target=d._job, args=("fast",))
            regular.start()
            assert probing.wait(60)
            (job,) = [j for j in d.scheduler.get_jobs() if j.id.startswith("phase:")]
            d._job(*job.args)  # its phase, while the regular pass still probes slow
            release.set()
            regular.join()
        assert calls[0] == ["fake", "slow"] and calls[1] == ["fake"]
        started = [e["backend"] for e in logs if e["event"] == "pass.start"]
        assert sorted(started) == ["fake", "slow"]
        assert "fake" in d._phased and not d._busy  # still on its phase; nothing left marked busy
    finally:
        release.set()
        d.stop()


def test_each_pass_logs_its_start_and_its_verdicts(tmp_path):
    lab = ScriptedLab(tmp_path, scripted(), tail='[[schedules]]\nname = "fast"\nevery = "1h"\n')
    lab.store.close()
    d = Daemon(lab.path, lab.config)
    try:
        with structlog.testing.capture_logs() as logs:
            d._job("fast")
            d._job("fast")
    finally:
        d.stop()
    passes_ = [(e["event"], e["backend"]) for e in logs if e["event"].startswith("pass.")]
    assert passes_ == [("pass.start", "fake"), ("pass.done", "fake")] * 2
    start, done = (
        (e for e in logs if e["event"] == "pass.start"),
        [e for e in logs if e["event"] == "pass.done"],
    )
    assert all(e["canaries"] == len(IDS) and e["log_level"] == "info" for e in start)
    assert done[0]["verdicts"] == {"baseline": len(IDS)} and done[1]["verdicts"] == {"identical": len(IDS)}
    assert all(e["duration_s"] >= 0 and "unavailable" not in e for e in done)
    assert not [e for e in logs if e["event"].startswith("lease.")]  # SQLite: no lease chatter


def test_a_backend_probed_too_recently_is_probed_on_its_own_phase_instead(tmp_path):
    """The lease says the backend was probed (by a takeover, or its previous holder) less than its spacing
    ago: the regular pass leaves it, and a pass of its own probes it an interval after that probe. (The
    check itself, on the lease row, runs on PostgreSQL in tests/e2e/test_failover.py.)"""
    lab = ScriptedLab(tmp_path, scripted(), tail='[[schedules]]\nname = "fast"\nevery = "1h"\n')
    lab.store.close()
    d = Daemon(lab.path, lab.config)
    honest, asked = d.store.start_probes, []

    def probed_40s_ago(spacing):
        asked.append(dict(spacing))
        return set(), {"fake": 40.0}

    try:
        d.store.start_probes = probed_40s_ago
        with structlog.testing.capture_logs() as logs:
            d._job("fast")
        assert asked == [{"fake": 3600 - 180}]  # an hour less 5 %: the slack of a takeover and a late pass
        assert not [e for e in logs if e["event"] == "pass.start"]  # not probed
        (job,) = d.scheduler.get_jobs()
        assert job.id == "phase:fast:fake" and job.args == ("fast", ("fake",), True)
        wait = (job.trigger.run_date - datetime.now(UTC)).total_seconds()
        # on the last probe's phase, within half the spacing's slack (90 s): still spaced as the lease says
        assert 3600 - 40 - 90 - 5 < wait <= 3600 - 40 and 40 + wait > 3600 - 180
        (respaced,) = [e for e in logs if e["event"] == "pass.respaced"]
        assert respaced["log_level"] == "debug" and respaced["backends"] == ["fake"]
        assert value(d, "canaryd_schedule_respaced_total", schedule="fast") == 1
        d.store.start_probes = honest
        with structlog.testing.capture_logs() as logs:
            d._job(*job.args)
        assert [e["event"] for e in logs if e["event"].startswith("pass.")] == ["pass.start", "pass.done"]
        assert value(d, "canaryd_schedule_runs_total", schedule="fast") == 1  # only the regular pass
        again = d.scheduler.get_jobs()[-1]  # the next on that phase, an interval on (not started: pending)
        assert (
            again.id == job.id
            and 3600 - 5 < (again.trigger.run_date - datetime.now(UTC)).total_seconds() <= 3600
        )
        with structlog.testing.capture_logs() as logs:
            d._job("fast")  # a regular pass leaves it to its phase
        assert not [e for e in logs if e["event"] == "pass.start"]
        d.scheduler.remove_all_jobs()
        d._respace(d.gen, "fast", {"a": 40.0, "b": 41.0, "c": 400.0})  # phases a second apart share a pass
        assert sorted(j.args[1] for j in d.scheduler.get_jobs()) == [("a", "b"), ("c",)]
    finally:
        d.stop()
