"""A fleet: two real daemons (`canaryd run` processes) with one config on one real PostgreSQL database.

The backends are of the scripted kind (no network), probed every 2 s. While both daemons live, each
backend's passes come from one daemon: consecutive runs of a backend (the ``run`` table, with the
instance that probed) are an interval apart, never two in one interval. A holder killed with SIGKILL has
its backends taken over by the other when its next pass was due (its presence connection died with it);
one stopped with SIGTERM releases them, and the other takes them over as soon. `Fleet`
(tests/harness/fleet.py) is shared with bench/failover.py.
"""

from __future__ import annotations

import itertools
import signal
import threading
import time
from datetime import UTC, datetime

import pytest
import structlog
from sqlalchemy import text

from canaryd.daemon.service import Daemon
from canaryd.shares import assign
from canaryd.store import Store, lease_seconds
from canaryd.store.leases import Plan, presence_name
from tests.harness.fleet import Fleet, doubles, gaps_after
from tests.harness.postgres import PostgresServer
from tests.harness.scripted_lab import ScriptedLab, scripted

# What a pass may start late on this (shared, 2-core) machine: APScheduler's wake-up, a daemon busy
# storing another backend's pass, the database's commit. Passes of one daemon are otherwise exactly
# INTERVAL apart (no jitter is configured).
SLACK = 1.0


@pytest.fixture(scope="module")
def pg():
    with PostgresServer() as server:
        yield server


@pytest.fixture
def fleet(pg, tmp_path):
    f = Fleet(tmp_path, pg.create_database("fleet"))
    yield f
    f.stop()


def test_two_daemons_share_the_work_and_take_over_from_a_killed_or_stopped_one(fleet):
    interval, lease = fleet.interval, lease_seconds(fleet.interval)
    fleet.start("d1")
    fleet.start("d2")
    both = lambda: all(any(e["event"] == "started" for e in fleet.log(d)) for d in ("d1", "d2"))  # noqa: E731
    fleet.wait_for(both, 60, "both daemons started")
    t_both = time.time()
    time.sleep(4 * interval)  # four intervals with both alive

    runs = fleet.runs()
    both_live = [r for r in runs if r[2] >= t_both]
    assert {b for b, _, _ in both_live} == set(fleet.backends)
    assert doubles(runs, interval) == 0, runs
    holders = fleet.holders()
    assert set(holders) == set(fleet.backends)
    for b in fleet.backends:  # once per interval (by one daemon or, after a late pass, the other) ...
        assert 3 <= sum(1 for rb, _, _ in both_live if rb == b) <= 5, both_live
        # ... and the metrics of both daemons say which
        other = "d2" if holders[b] == "d1" else "d1"
        assert fleet.metric(holders[b], "canaryd_backend_lease_held", b) == 1
        assert fleet.metric(other, "canaryd_backend_lease_held", b) == 0
        assert fleet.metric(other, "canaryd_canary_last_probe_timestamp_seconds", b) is None  # nothing stale
        assert fleet.metric(holders[b], "canaryd_canary_last_probe_timestamp_seconds", b) >= t_both

    # SIGKILL the holder of b1: its backends go to the other as their leases end
    victim = holders["b1"]
    heir = "d2" if victim == "d1" else "d1"
    fleet.procs[victim].send_signal(signal.SIGKILL)
    killed = time.time()
    fleet.procs[victim].wait()
    theirs = {b for b, h in holders.items() if h == victim}
    fleet.wait_for(
        lambda: {b for b, i, t in fleet.runs() if i == heir and t > killed} >= theirs,
        lease + 2 * interval + 10,
        f"{heir} takes over {sorted(theirs)}",
    )
    # (the live daemons share the backends: the first up held them all until the other took its share, so
    # the victim may have probed one it handed over then)
    gaps = gaps_after(fleet.runs(), victim, killed)
    assert set(gaps) >= theirs
    for b in theirs:  # the heir probes when the victim's pass was due (+ a late start)
        gap = gaps[b]
        assert gap <= interval + SLACK, f"{b}: {gap:.2f}s without a probe (interval {interval}s)"
    acquired = [e for e in fleet.log(heir) if e["event"] == "lease.acquired" and e["level"] == "warning"]
    assert {e["backend"] for e in acquired} >= theirs
    assert all(e["previous"].startswith(f"{victim}#") for e in acquired if e["backend"] in theirs)
    assert fleet.metric(heir, "canaryd_backend_lease_held", "b1") == 1

    # Restart the victim (it takes its share back at the heir's passes), then stop the heir cleanly: its
    # leases are released, so the victim takes over at its next pass (an interval at most), not at expiry.
    fleet.start(victim)
    fleet.wait_for(lambda: any(e["event"] == "started" for e in fleet.log(victim)), 60, "restart")
    time.sleep(interval)
    term = time.time()
    fleet.procs[heir].send_signal(signal.SIGTERM)
    assert fleet.procs[heir].wait(timeout=30) == 0, fleet.tail(heir)
    stopped = time.time()
    assert any(e["event"] == "lease.released" for e in fleet.log(heir)), fleet.tail(heir)
    fleet.wait_for(
        lambda: {b for b, i, t in fleet.runs() if i == victim and t > stopped} == set(fleet.backends),
        interval + SLACK + 10,
        f"{victim} takes over after a clean stop",
    )
    runs = fleet.runs()
    took = [
        min(t for b2, i, t in runs if b2 == b and i == victim and t > stopped) - stopped
        for b in fleet.backends
    ]
    assert max(took) <= interval + SLACK, took
    # never two daemons in one interval while both live (the handover itself may come sooner than an
    # interval after the stopped daemon's last pass: released, not expired)
    assert doubles([r for r in runs if r[2] < term], interval) == 0, runs
    assert doubles([r for r in runs if r[2] > term], interval) == 0, runs

    # progress logs: every pass of a backend logged with its canaries and verdicts (the stopped daemon's
    # log is complete)
    log = fleet.log(heir)
    starts = [e for e in log if e["event"] == "pass.start"]
    done = [e for e in log if e["event"] == "pass.done"]
    assert starts and all(e["canaries"] == 3 and e["level"] == "info" for e in starts)
    assert len(done) == len(starts) and all(sum(e["verdicts"].values()) == 3 for e in done)
    assert datetime.now(UTC).timestamp() - t_both < 120


def test_a_killed_holders_leases_end_with_its_presence_a_hung_ones_when_they_expire(pg):
    """The claim statement itself, with two stores: SIGKILL closes the holder's presence connection (here:
    the server ends it), and the lease is free at once; a holder whose presence was never visible keeps
    its lease until it expires; the killed holder's next claim opens a new presence."""
    url = pg.create_database("presence")
    a, b = Store(url, "a"), Store(url, "b")
    try:
        assert a.claim_leases({"x": 60, "y": 60})["x"].holder == a.lease_holder
        refused = b.claim_leases({"x": 60})["x"]
        assert refused.holder == a.lease_holder and 55 < refused.ends_in <= 60
        with a.engine.begin() as c:  # y: a holder without a recorded presence (hidden by a pooler, say)
            c.execute(text("UPDATE lease SET presence = NULL WHERE backend = 'y'"))
            ended = (
                c.execute(
                    text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = :n"
                    ),
                    {"n": presence_name(a.lease_holder)},
                )
                .scalars()
                .all()
            )
        assert ended == [True]
        time.sleep(0.5)  # the server has ended the session
        after = b.claim_leases({"x": 60, "y": 60})
        assert after["x"].holder == b.lease_holder  # taken long before the lease's 60 s
        assert after["y"].holder == a.lease_holder  # no presence recorded: only its expiry frees it
        assert a.claim_leases({"x": 60})["x"].holder == b.lease_holder  # no double: b holds it now
        with a.engine.connect() as c:
            names = c.execute(text("SELECT application_name FROM pg_stat_activity")).scalars().all()
        assert presence_name(a.lease_holder) in names  # a's claim reopened its presence
    finally:
        a.close()
        b.close()


def test_a_new_holder_never_probes_a_backend_within_its_spacing_of_the_last_probe(pg):
    """The lease row's last probe, whoever made it, holds the next one back for the lead schedule's spacing;
    a pass of another schedule neither waits for it nor moves it; only the holder marks it."""
    url = pg.create_database("spacing")
    a, b = Store(url, "a"), Store(url, "b")
    try:
        assert set(a.claim_leases({"x": 60, "y": 60})) == {"x", "y"}
        assert a.start_probes({"x": 10.0, "y": None}) == ({"x", "y"}, {})  # y: another schedule's pass
        assert b.start_probes({"x": 10.0}) == (set(), {})  # not b's
        with a.engine.begin() as c:  # b takes both over (as a takeover or a handover does)
            c.execute(text("UPDATE lease SET holder = :h"), {"h": b.lease_holder})
        kept, early = b.start_probes({"x": 10.0, "y": 10.0})
        assert kept == {"y"} and set(early) == {"x"} and 0 <= early["x"] < 5  # y: never marked
        assert b.start_probes({"x": None}) == ({"x"}, {})  # another schedule's pass probes it
        with a.engine.begin() as c:  # the refused attempt marked nothing: x's last probe ages
            c.execute(text("UPDATE lease SET probed = probed - interval '9 seconds' WHERE backend = 'x'"))
        kept, early = b.start_probes({"x": 10.0})
        assert kept == set() and 9 <= early["x"] < 10
        with a.engine.begin() as c:
            c.execute(text("UPDATE lease SET probed = probed - interval '1 second' WHERE backend = 'x'"))
        assert b.start_probes({"x": 10.0}) == ({"x"}, {})  # its spacing is up
        assert b.start_probes({"x": 10.0, "y": 10.0})[1].keys() == {"x", "y"}  # both just probed
    finally:
        a.close()
        b.close()


def test_a_working_pass_renews_what_it_has_yet_to_probe_and_stamps_each_probe_as_it_starts(pg):
    """The two statements a long pass adds, with two stores: a renewal extends only the renewer's leases,
    in one statement, never shortening one; a worker's start stamps the backend's last probe (the lead
    schedule's pass) and says whether it is still the worker's daemon's."""
    url = pg.create_database("renewal")
    a, b = Store(url, "a"), Store(url, "b")
    try:
        assert set(a.claim_leases({"x": 2, "y": 2})) == {"x", "y"}
        assert b.claim_leases({"z": 2})["z"].holder == b.lease_holder
        assert a.renew_leases({"x": 60, "y": 60, "z": 60}) == {"x", "y"}  # z is b's
        assert a.renew_leases({"x": 1}) == {"x"}  # never shortened
        assert a.renew_leases({"x": 120}, within=30) == {"x"}  # held, and ending in 60 s: left as it is
        time.sleep(2.5)  # z's lease is over; x's and y's go on
        after = b.claim_leases({"x": 60, "y": 60, "z": 60})
        assert after["x"].holder == after["y"].holder == a.lease_holder and 50 < after["x"].ends_in < 60
        assert after["z"].holder == b.lease_holder
        with a.engine.begin() as c:
            c.execute(text("UPDATE lease SET probed = now() - interval '30 seconds'"))
        assert a.started_probe("x", mark=True) and a.started_probe("y", mark=False)
        assert not a.started_probe("z", mark=True)  # b's: a's worker does not probe it
        with a.engine.connect() as c:
            age = dict(c.execute(text("SELECT backend, extract(epoch FROM now() - probed) FROM lease")).all())
        assert age["x"] < 5 and age["y"] >= 30 and age["z"] >= 30  # only x's probe began now
    finally:
        a.close()
        b.close()


def test_a_renewal_leaves_the_leases_another_live_daemon_owns_to_end(pg):
    """With the fleet's plan, a long pass renews only the backends that hash to its daemon (one owned by
    another live daemon is left to end, so that daemon takes it at the holder's next due pass), and records
    its daemon live."""
    url = pg.create_database("renewal_plan")
    a, b = Store(url, "a"), Store(url, "b")
    plan = Plan({"x": 1.0, "y": 1.0}, {"x": 1.0, "y": 1.0}, 60.0)
    try:
        assert set(a.claim_leases({"x": 60, "y": 60}, plan)) == {"x", "y"}  # a alone: both
        assert b.claim_leases({"x": 60, "y": 60}, plan)["x"].holder == a.lease_holder  # b is live now
        owner = assign(plan.weight, [a.lease_holder, b.lease_holder])
        mine = {k for k, d in owner.items() if d == a.lease_holder}
        assert len(mine) == 1  # one each
        with a.engine.begin() as c:  # a's last claim was 30 s ago
            c.execute(text("UPDATE daemon SET seen = now() - interval '30 seconds'"))
        assert a.renew_leases({"x": 120, "y": 120}, plan=plan) == {"x", "y"}  # both still a's ...
        with a.engine.connect() as c:  # the renewal recorded a live again: a long pass stays in the live set
            seen = dict(c.execute(text("SELECT holder, extract(epoch FROM now() - seen) FROM daemon")).all())
        assert seen[a.lease_holder] < 5 and seen[b.lease_holder] >= 30
        with a.engine.connect() as c:
            sql = "SELECT backend, extract(epoch FROM expires - now()) FROM lease"
            left = dict(c.execute(text(sql)).all())
        assert all(left[k] > 100 for k in mine)  # ... and only its own one extended
        assert all(left[k] < 61 for k in {"x", "y"} - mine)
    finally:
        a.close()
        b.close()


def _slow_daemon(tmp_path, url):
    """A daemon (not started: the test runs its passes) of three backends probed one request at a time:
    a first contact's baselines make its pass longer than its lease (3 s: a 2 s interval)."""
    backends = "".join(scripted(f"b{i}", latency_s=0.05) for i in range(1, 4))
    tail = f'[storage]\nurl = "{url}"\n[daemon]\nmax_in_flight = 1\ninstance = "a"\n'
    lab = ScriptedLab(tmp_path, backends, tail=tail + '[[schedules]]\nname = "fast"\nevery = "2s"\n')
    lab.store.close()
    return Daemon(lab.path, lab.config)


def _rival(url, stop, backends):
    """Another daemon's store claiming the backends every 0.2 s until stopped: when it first held each."""
    store, got = Store(url, "b"), {}
    try:
        while not stop.is_set():
            for name, lease in store.claim_leases(dict.fromkeys(backends, 60.0)).items():
                if lease.holder == store.lease_holder:
                    got.setdefault(name, time.monotonic())
            stop.wait(0.2)
    finally:
        store.close()
    return got


def test_a_pass_longer_than_its_lease_keeps_its_backends_a_hung_one_loses_them_at_expiry(pg, tmp_path):
    url = pg.create_database("longpass")
    d = _slow_daemon(tmp_path, url)
    names = ["b1", "b2", "b3"]
    stop, out = threading.Event(), {}
    try:
        assert d._claim(d.gen, names) == set(names)  # first (as the daemon does when it starts)
        rival = threading.Thread(target=lambda: out.update(_rival(url, stop, names)))
        begun = time.monotonic()
        with structlog.testing.capture_logs() as logs:
            rival.start()
            d._job("fast")
            took = time.monotonic() - begun
            stop.set()
            rival.join()
        assert took > d.gen.lease_s["b1"]  # longer than its lease
        done = [e for e in logs if e["event"] == "pass.done"]
        assert [e["backend"] for e in done] == names  # each probed once, one after the other
        assert any(e["event"] == "lease.renewed" for e in logs)
        # none was the rival's before it was probed (a probed one may be: its next probe is spaced from
        # this one by the lease's stamp, whoever holds it)
        finish = dict(zip(names, itertools.accumulate(e["duration_s"] for e in done), strict=True))
        assert all(out[b] - begun >= finish[b] for b in out), (out, begun, finish)
        with d.store.engine.connect() as c:
            starts = c.execute(text("SELECT probed FROM lease ORDER BY backend")).scalars().all()
        # each stamp is its backend's own start, not the pass's: the one before it took that long first
        gaps = [(later - earlier).total_seconds() for earlier, later in itertools.pairwise(starts)]
        assert all(gap >= 0.9 * e["duration_s"] for gap, e in zip(gaps, done, strict=False)), (gaps, done)

        hang, entered = threading.Event(), threading.Event()
        probe = d._probe

        def hung(*a):  # b1's worker hangs: nothing finishes
            entered.set()
            return hang.wait() and probe(*a)

        d._probe = hung
        time.sleep(2)  # the last pass's stamps are a spacing ago
        stop.clear()
        job = threading.Thread(target=d._job, args=["fast"])
        begun = time.monotonic()
        with structlog.testing.capture_logs() as logs:
            job.start()
            # the rival starts once the pass has claimed: on a loaded machine a claim that came after the
            # last pass's leases ended would let it take them before this pass renewed anything
            assert entered.wait(30)
            out.clear()
            rival = threading.Thread(target=lambda: out.update(_rival(url, stop, names)))
            rival.start()
            time.sleep(d.gen.lease_s["b1"] + 1.5)
            stop.set()
            rival.join()
            hang.set()
            job.join()
        assert set(out) == set(names)  # all taken once their leases ended: not renewed
        assert all(t - begun >= d.gen.lease_s["b1"] - 1.0 for t in out.values())  # not before
        assert any(e["event"] == "lease.not_renewed" for e in logs)
        assert [e["backend"] for e in logs if e["event"] == "pass.start"] == ["b1"]  # the others: lost
        assert {e["backend"] for e in logs if e["event"] == "lease.lost"} >= set(names[1:])
    finally:
        stop.set()
        d.stop()
