"""A fleet that shares the work: three, then four real daemons (`canaryd run` processes) with one config of
12 scripted backends, probed every 3 s, on one real PostgreSQL database.

Each live daemon holds its share of the backends (rendezvous hashing over the live daemons, weighted by
canaries × passes per hour: `canaryd.shares`), reported by `canaryd fleet` and the daemons' metrics. A
daemon that joins takes its share within an interval of its start; one killed with SIGKILL, then one
stopped with SIGTERM, has its share taken over when its next pass was due. Throughout, no backend is
probed twice in one interval (the ``run`` table: consecutive passes of a backend, whoever probed, are never
closer than the lease lets a probe follow another, `canaryd.store.leases.spacing`) and none goes longer
than its lease without a pass.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from sqlalchemy import text

from canaryd.store import Store, lease_seconds
from canaryd.store.fleet import fleet as members_of
from canaryd.store.leases import EARLY_S, Plan, presence_name
from tests.harness.fleet import Fleet, doubles, gaps_after
from tests.harness.postgres import PostgresServer
from tests.harness.suites import ADD, suite

SLACK = 1.0  # a pass's late start on this shared machine (tests/e2e/test_failover.py)
BACKENDS = 12
INTERVAL = 3.0  # seconds: a pass of a dozen backends fits it well on a 2-core machine


@pytest.fixture(scope="module")
def pg():
    with PostgresServer() as server:
        yield server


@pytest.fixture
def fleet(pg, tmp_path):
    f = Fleet(
        tmp_path,
        pg.create_database("shares"),
        backends=BACKENDS,
        interval=INTERVAL,
        suite=suite("one", "", ADD),
    )
    yield f
    f.stop()


def started(fleet: Fleet, instance: str) -> float:
    """When the daemon logged ``started`` (after its first claim), waited for."""
    fleet.wait_for(
        lambda: any(e["event"] == "started" for e in fleet.log(instance)), 60, f"{instance} starts"
    )
    return time.time()


def shares(fleet: Fleet) -> Counter:
    return Counter(fleet.holders().values())


def balanced(fleet: Fleet, daemons: set[str]) -> bool:
    """Every backend held, each of ``daemons`` within 5 points of an even share."""
    held = shares(fleet)
    n = len(daemons)
    return (
        set(held) == daemons
        and sum(held.values()) == BACKENDS
        and all(abs(k / BACKENDS - 1 / n) <= 0.05 for k in held.values())
    )


def gauge(fleet: Fleet, instance: str, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{fleet.ports[instance]}/metrics", timeout=10).read()
    (value,) = [float(x.split()[1]) for x in body.decode().splitlines() if x.startswith(name + " ")]
    return value


def max_spacing(runs, after: float) -> float:
    """The longest time between consecutive passes of a backend, among passes after ``after``."""
    last: dict[str, float] = {}
    worst = 0.0
    for b, _, t in runs:
        if t > after and b in last:
            worst = max(worst, t - last[b])
        last[b] = t
    return worst


def test_daemons_share_the_backends_and_rebalance_on_join_kill_and_stop(fleet):
    interval, lease = fleet.interval, lease_seconds(fleet.interval)
    for d in ("d1", "d2", "d3"):
        fleet.start(d)
    for d in ("d1", "d2", "d3"):
        started(fleet, d)
    # balanced: each within 5 points of a third of the (equally weighted) backends, once the first passes
    # (a first contact with each backend: slower) are done
    fleet.wait_for(lambda: balanced(fleet, {"d1", "d2", "d3"}), 60, "three even shares")
    t_three = time.time()
    time.sleep(2 * interval)
    held = shares(fleet)
    assert balanced(fleet, {"d1", "d2", "d3"}), held
    out = subprocess.run(
        [sys.executable, "-m", "canaryd", "-c", str(fleet.root / "d1.toml"), "fleet", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    doc = json.loads(out.stdout)
    assert out.returncode == doc["exit_code"] == 0, out.stderr
    live = {d["instance"]: d for d in doc["daemons"] if d["live"]}
    assert set(live) == {"d1", "d2", "d3"} and doc["backends_leased"] == BACKENDS
    for (
        d
    ) in live.values():  # equal weights: a daemon's share is its count of backends (a move may be under way)
        assert abs(d["share"] - d["backends"] / BACKENDS) < 1e-3 and d["last_pass_ago_s"] < lease, live
    assert sum(d["backends"] for d in live.values()) == BACKENDS, live

    # each daemon's metrics say the same as the lease table (as of its last claim: within an interval)
    def metrics_agree() -> list:
        held = shares(fleet)
        got = {
            d: [
                gauge(fleet, d, f"canaryd_fleet_{m}")
                for m in ("daemons_live", "weight_share", "backends_held")
            ]
            for d in ("d1", "d2", "d3")
        }
        ok = all(v[0] == 3 and v[1] == v[2] / BACKENDS and v[2] == held[d] for d, v in got.items())
        return [] if ok else [got, held]

    deadline = time.monotonic() + 3 * interval
    while (wrong := metrics_agree()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not wrong, wrong

    # a join: d4 takes its share (a quarter) within an interval of its start, from live holders
    fleet.start("d4")
    t_join = started(fleet, "d4")
    fleet.wait_for(
        lambda: balanced(fleet, {"d1", "d2", "d3", "d4"}), 2 * interval + SLACK, "four even shares"
    )
    ours = {b for b, h in fleet.holders().items() if h == "d4"}
    fleet.wait_for(  # its pass of a backend it just took may still be storing its run
        lambda: ours <= {b for b, i, _ in fleet.runs() if i == "d4"}, interval + SLACK, "d4's runs"
    )
    runs = fleet.runs()
    for b in ours:  # each probed by d4 first at its holder's next pass: within an interval of d4's start
        first = min(t for rb, i, t in runs if rb == b and i == "d4")  # (plus the grace of a late pass)
        assert first <= t_join + lease + SLACK, (b, first - t_join)
    assert not [e for e in fleet.log("d4") if e["event"] == "lease.acquired" and e["level"] == "warning"]

    # a SIGKILL: the victim's backends are probed when its passes were due
    fleet.procs["d1"].send_signal(signal.SIGKILL)
    killed = time.time()
    fleet.procs["d1"].wait()
    theirs = {b for b, h in fleet.holders().items() if h == "d1"}
    fleet.wait_for(
        lambda: {b for b, i, t in fleet.runs() if i != "d1" and t > killed} >= theirs,
        lease + 10,
        "d1's backends taken over",
    )
    gaps = gaps_after(fleet.runs(), "d1", killed)
    assert theirs <= set(gaps) and max(gaps[b] for b in theirs) <= interval + SLACK, gaps

    # a SIGTERM: d2 releases, the others take over at once (at d2's next passes at the latest)
    time.sleep(interval)
    theirs = {b for b, h in fleet.holders().items() if h == "d2"}
    fleet.procs["d2"].send_signal(signal.SIGTERM)
    assert fleet.procs["d2"].wait(timeout=30) == 0, fleet.tail("d2")
    stopped = time.time()
    time.sleep(interval + SLACK)
    runs = fleet.runs()
    for b in theirs:
        assert min(t for rb, i, t in runs if rb == b and t > stopped) <= stopped + interval + SLACK, b
    fleet.wait_for(lambda: balanced(fleet, {"d3", "d4"}), 2 * interval + SLACK, "two even shares")

    # throughout: never two passes of a backend in one interval, never a backend without a pass for
    # longer than its lease (an interval, plus the grace of a pass that starts late)
    runs = fleet.runs()
    assert doubles(runs, interval) == 0, [r for r in runs if r[2] > t_three]
    assert max_spacing(runs, t_three) <= lease + SLACK
    assert time.time() - t_three < 90


# ten backends of one weight, each leased for 3 s (an interval of 2 s and a grace of 1 s)
TEN = {f"b{i}": 60.0 for i in range(10)}
TEN_PLAN = Plan(TEN, dict.fromkeys(TEN, 1.0), 3.0)


@contextmanager
def two_stores(pg, name: str) -> Iterator[tuple[Store, Store]]:
    """Two daemons' stores, "a" and "b", on a new database of their own."""
    url = pg.create_database(name)
    a, b = Store(url, "a"), Store(url, "b")
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def test_a_backend_moves_to_the_daemon_it_hashes_to_only_when_its_holders_next_pass_is_due(pg):
    """The claims themselves, with two stores: the first takes every backend; the second, once live, gets
    none of them before their holder's next pass is due (grace + `EARLY_S` before the lease ends), then
    exactly its half; the holder's own claim then finds those taken, and `canaryd fleet`'s query says so."""
    weight, plan, seconds = TEN, TEN_PLAN, dict.fromkeys(TEN, 3.0)
    with two_stores(pg, "handover") as (a, b):
        assert {x.holder for x in a.claim_leases(seconds, plan).values()} == {a.lease_holder}
        first = b.claim_leases(seconds, plan)
        assert {x.holder for x in first.values()} == {a.lease_holder}  # a's next pass is not due yet
        assert set(b.fleet_view()) == {a.lease_holder, b.lease_holder}
        time.sleep(3.0 - 1.0 - EARLY_S + 0.1)  # within EARLY_S of a's next pass
        got = {k for k, x in b.claim_leases(seconds, plan).items() if x.holder == b.lease_holder}
        assert len(got) == 5, got  # b's even half, and only that
        kept = {k for k, x in a.claim_leases(seconds, plan).items() if x.holder == a.lease_holder}
        assert kept == set(weight) - got  # a's pass renews its own half and skips b's
        members, leased = members_of(a)
        assert leased == 10
        assert {(m.instance, m.live, m.backends, round(m.share, 2)) for m in members} == {
            ("a", True, 5, 0.5),
            ("b", True, 5, 0.5),
        }


def test_a_takeover_that_comes_after_the_holders_claim_still_takes_its_share(pg):
    """On a loaded machine the new owner's takeover pass may start after its holder's claim: that claim
    keeps the backends (its pass probes them) but no longer renews those that hash to the live new owner,
    so the late takeover still takes exactly them; and the holder's pass marks them probed only as its
    worker starts one, so the new owner probes those its worker had not reached at once."""
    weight, plan, seconds = TEN, TEN_PLAN, dict.fromkeys(TEN, 3.0)
    with two_stores(pg, "late_takeover") as (a, b):
        a.claim_leases(seconds, plan)
        b.claim_leases(seconds, plan)  # b is live; a's next pass is not due
        time.sleep(3.0 - 1.0 - EARLY_S + 0.1)  # a's next pass is due, and its claim comes first
        claimed = a.claim_leases(seconds, plan)
        assert {x.holder for x in claimed.values()} == {a.lease_holder}  # a still holds all ten
        left = {k for k, x in claimed.items() if x.ends_in < 2.0}  # ... renewing only its own half
        assert len(left) == 5
        with a.engine.begin() as c:  # every backend was last probed 10 s ago
            c.execute(text("UPDATE lease SET probed = now() - interval '10 seconds'"))
        # a's pass sets out: its own half is marked probed now, b's half only checked (a's worker has not
        # reached it: nothing was probed)
        assert a.start_probes(dict.fromkeys(weight, 5.0)) == (set(weight), {})
        got = {k for k, x in b.claim_leases(seconds, plan).items() if x.holder == b.lease_holder}
        assert got == left
        assert b.start_probes(dict.fromkeys(got, 5.0)) == (got, {})  # so b probes them now, not a pass later
        assert not any(a.started_probe(k, mark=True) for k in got)  # a's worker then skips them


def test_a_gone_holders_backends_are_taken_at_its_next_pass_never_sooner(pg):
    """A holder that renewed its leases and started probing the backends, then died or stopped, is not
    followed by a second probe in that interval: though its presence is gone at once (killed: the server
    ends the session; stopped: it marks its leases and closes its store), another daemon's claim takes its
    backends only from `EARLY_S` before its next pass was due; one it claimed but never probed, at once."""
    url = pg.create_database("gone")
    weight = {f"b{i}": 60.0 for i in range(4)}
    plan = Plan(weight, dict.fromkeys(weight, 1.0), 3.0)  # lease 3 s: interval 2 s + 1 s grace
    seconds = dict.fromkeys(weight, 3.0)
    a, b, c = Store(url, "a"), Store(url, "b"), Store(url, "c")
    try:
        assert {x.holder for x in a.claim_leases({"b0": 3.0, "b1": 3.0}, plan).values()} == {a.lease_holder}
        assert {x.holder for x in c.claim_leases({"b2": 3.0, "b3": 3.0}, plan).values()} == {c.lease_holder}
        assert a.start_probes({"b1": 1.0}) == ({"b1"}, {})
        assert c.start_probes({"b2": 1.0, "b3": 1.0}) == ({"b2", "b3"}, {})
        # their workers start the probes (the mark of one that hashes elsewhere waits for its worker)
        assert a.started_probe("b1", mark=True) and c.started_probe("b2", mark=True)
        assert c.started_probe("b3", mark=True)
        with a.engine.begin() as conn:  # a: killed
            conn.execute(
                text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = :n"),
                {"n": presence_name(a.lease_holder)},
            )
        assert c.release_leases() == 2  # c: stopped
        c.close()
        time.sleep(0.3)  # the server has ended both sessions
        first = b.claim_leases(seconds, plan)  # b0: claimed, never set out to probe: taken at once
        assert {k: x.holder for k, x in first.items()} == {
            "b0": b.lease_holder,
            "b1": a.lease_holder,
            "b2": c.lease_holder,
            "b3": c.lease_holder,
        }
        assert all(first[k].ends_in > 1.0 + EARLY_S for k in ("b1", "b2", "b3")), first
        time.sleep(3.0 - 1.0 - EARLY_S - 0.3 + 0.1)  # within EARLY_S of their next pass
        assert {x.holder for x in b.claim_leases(seconds, plan).values()} == {b.lease_holder}
        assert {x.holder for x in a.claim_leases({"b0": 3.0}, plan).values()} == {b.lease_holder}
    finally:
        a.close()
        b.close()
