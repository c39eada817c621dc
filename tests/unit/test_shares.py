"""The fleet's shares (`canaryd.shares`): weighted rendezvous hashing with a capacity bound, a pure
function every daemon computes alike. Known answers pin the hash and the assignment (a change of either
would reshuffle every fleet on upgrade, so it must be deliberate); the balance is checked at a thousand
backends of mixed weight."""

from __future__ import annotations

import json
import random

import pytest

from canaryd.shares import SLACK, assign, loads, score, weights

W6 = {"b1": 60.0, "b2": 60.0, "b3": 120.0, "b4": 240.0, "b5": 60.0, "b6": 60.0}


def test_the_hash_is_of_the_instance_and_the_backend_only():
    assert score("d1#aaaa", "b1") == 11034548391872161475
    assert score("d1#bbbb", "b1") == score("d1#aaaa", "b1")  # a restarted daemon ranks as before
    assert score("d2#aaaa", "b1") == 2812022680269886139
    assert score("d1", "b1") == score("d1#x", "b1")


def test_known_assignments():
    assert assign(W6, ["d1#x", "d2#y", "d3#z"]) == {
        "b4": "d3#z",  # heavier than an even share: the least loaded daemon, ties to the best ranked
        "b3": "d1#x",
        "b1": "d1#x",
        "b2": "d2#y",
        "b5": "d2#y",
        "b6": "d2#y",
    }
    assert assign(W6, ["d1#x", "d2#y"]) == {
        "b4": "d2#y",
        "b3": "d1#x",
        "b1": "d1#x",
        "b2": "d2#y",
        "b5": "d1#x",
        "b6": "d1#x",
    }
    assert loads(assign(W6, ["d1#x", "d2#y"]), W6) == {"d1#x": 0.5, "d2#y": 0.5}
    assert assign(W6, ["solo#1"]) == dict.fromkeys(W6, "solo#1")
    assert assign(W6, []) == {}
    assert assign({}, ["d1#x"]) == {}


def test_a_weight_is_canaries_times_passes_per_hour_over_the_schedules():
    got = weights({"fast": {"a": 3, "b": 1}, "slow": {"a": 2}}, {"fast": 60.0, "slow": 3600.0})
    assert got == {"a": 3 * 60 + 2 * 1, "b": 60.0}


def test_every_daemon_computes_the_same_whatever_order_it_reads_the_live_set_in():
    daemons = ["d1#x", "d2#y", "d3#z", "d4#w"]
    first = assign(W6, daemons)
    for _ in range(5):
        random.shuffle(daemons)
        assert assign(dict(reversed(list(W6.items()))), daemons) == first


def mixed(n: int, seed: int = 1) -> dict[str, float]:
    """Backends of 1 to 10 canaries on schedules of 1 minute to 15 minutes."""
    r = random.Random(seed)
    return {f"route-{i}": r.choice([1, 2, 5, 10]) * r.choice([60.0, 12.0, 4.0]) for i in range(n)}


@pytest.mark.parametrize("n_daemons", [2, 3, 5])
def test_a_thousand_backends_of_mixed_weight_split_within_the_capacitys_bound(n_daemons):
    w = mixed(1000)
    daemons = [f"host-{i}#{i:04x}" for i in range(n_daemons)]
    share = loads(assign(w, daemons), w)
    heaviest = max(w.values()) / sum(w.values())
    assert set(share) == set(daemons)
    over = SLACK / n_daemons + heaviest  # the most a daemon ends over an even share (cap, then one more)
    for d in daemons:
        assert share[d] - 1 / n_daemons <= over, share
        assert 1 / n_daemons - share[d] <= (n_daemons - 1) * over, share  # what the others took over
    if n_daemons == 3:  # the target: 33 ± 5 %
        assert all(0.28 <= s <= 0.38 for s in share.values()), share


def test_a_join_moves_about_its_share_and_a_leave_only_moves_the_leavers_and_a_few_more():
    w = mixed(1000, seed=2)
    three = assign(w, ["a#1", "b#2", "c#3"])
    four = assign(w, ["a#1", "b#2", "c#3", "d#4"])
    moved = [b for b in w if three[b] != four[b]]
    assert sum(1 for b in moved if four[b] == "d#4") >= 0.8 * len(moved)  # mostly to the newcomer
    assert len(moved) <= 0.35 * len(w)  # an even share is 25 %
    back = assign(w, ["a#1", "b#2", "c#3"])
    assert back == three  # the leave restores the assignment before the join


def test_the_fleet_command_on_sqlite_says_one_daemon_probes_everything(tmp_path):
    from tests.harness.scripted_lab import PLAIN, scripted
    from tests.unit.test_cli import canaryd

    (tmp_path / "plain.toml").write_text(PLAIN)
    cfg = tmp_path / "canaryd.toml"
    cfg.write_text(f'state_dir = "{tmp_path}/state"\nsuites = ["plain.toml"]\n' + scripted("a"))
    assert canaryd("-c", str(cfg), "validate").returncode == 0
    missing = canaryd("-c", str(cfg), "fleet")
    assert missing.returncode == 2 and "no history database" in missing.stderr  # reads, never creates
    assert canaryd("-c", str(cfg), "db", "upgrade").returncode == 0
    text = canaryd("-c", str(cfg), "fleet")
    assert text.returncode == 0 and "a single daemon probes every backend" in text.stdout
    doc = json.loads(canaryd("-c", str(cfg), "fleet", "--json").stdout)
    assert doc["exit_code"] == 0 and doc["single_daemon"] is True and doc["daemons"] == []
