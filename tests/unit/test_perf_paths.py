"""The shortcuts a probe pass takes for CPU (bench/probe_cpu.py) give the answers the long ways gave.

* every engine `make_engine` makes shares one compiled-statement cache: a second store on an equal URL (a
  ``canaryd check`` pass after another) compiles no statement again;
* the stores of one database in a process share one `Cache`, and the generation statement still guards it;
* the detector fold (Core statements) stores and reads back what the ORM did;
* `tokens_problem` and `vet.problem` take a fast path for the common answer, with the same answers;
* a suite file is parsed again only when its text changed;
* a probe's distances to a noise model's references, taken column-wise, are `distance`'s to the bit.
"""

from __future__ import annotations

import json
import math
import random
from datetime import UTC, datetime

import pytest
from sqlalchemy import event

from canaryd.canaries import load_suite
from canaryd.judge.compare import compare
from canaryd.judge.nearest import Nearest
from canaryd.judge.stats import (
    DetectorState,
    NoiseModel,
    Point,
    distance,
    fit_points,
    max_abs_delta,
    score_point,
)
from canaryd.observation import ErrorKind, Observation, TokenLogprob, logprob_problem, tokens_problem
from canaryd.probe import vet
from canaryd.store import Store
from canaryd.store.records import detector_start
from tests.unit.test_store_fleet import counts, make_obs


def one_pass(store: Store, o: Observation) -> None:
    """What `probe_backend` asks of the store in one pass."""
    run = store.start_run(o.backend)
    reads = store.judging(o.backend)
    base = reads.baseline(o.backend, o.canary_id)
    c = compare(base.observation if base else None, o, correct=True, baseline_correct=True)
    store.fold_detector(o.backend, lambda doc: (doc, None))
    store.record(run, [(o, c, base.observation_id if base else None)], 1)


def compiles(store: Store) -> list[str]:
    """The statements ``store``'s engine compiles (a miss of the compiled cache) from now on."""
    missed: list[str] = []

    def after(_conn, _cursor, sql, _params, context, _many):
        if context is not None and context.cache_hit == context.dialect.CACHE_MISS:
            missed.append(sql)

    event.listen(store.engine, "after_cursor_execute", after)
    return missed


def test_a_second_store_on_the_same_url_compiles_no_statement_again(tmp_path):
    url = f"sqlite:///{tmp_path}/h.db"
    first = Store(url)
    missed_first = compiles(first)
    for t in range(3):  # the first pass makes the baseline, the next ones judge against it
        one_pass(first, make_obs(t=datetime(2026, 1, 1, 12, t, tzinfo=UTC)))
    first.close()
    assert missed_first  # the first engine did compile
    second = Store(url)
    missed = compiles(second)
    one_pass(second, make_obs(t=datetime(2026, 1, 1, 13, tzinfo=UTC)))
    assert missed == []
    assert counts(url, "event", "run") == {"event": 4, "run": 4}  # and nothing was lost on the way
    second.close()


def test_stores_of_one_database_share_their_cache_and_other_databases_do_not(tmp_path):
    a, b = Store(f"sqlite:///{tmp_path}/a.db"), Store(f"sqlite:///{tmp_path}/a.db")
    other = Store(f"sqlite:///{tmp_path}/b.db")
    assert a._cache is b._cache
    assert other._cache is not a._cache
    one_pass(a, make_obs())
    b.accept_latest("b")  # another process's accept still moves the generation: the next pass re-reads
    first = a.judging("b").baseline("b", "c")
    one_pass(b, make_obs(t=datetime(2026, 1, 1, 13, tzinfo=UTC)))
    b.accept_latest("b")
    assert a.judging("b").baseline("b", "c").observation_id != first.observation_id
    for s in (a, b, other):
        s.close()


def test_the_detector_fold_stores_and_reads_back_what_it_was_given(tmp_path):
    store = Store(f"sqlite:///{tmp_path}/h.db")
    assert store.fold_detector("b", lambda doc: (None, doc)) == detector_start()
    raised = DetectorState(12.5, 3, True, ("c", "d:1"))
    assert store.fold_detector("b", lambda _: (raised.as_dict(), "result")) == "result"
    stored = store.fold_detector("b", lambda doc: (None, doc))
    assert stored == raised.as_dict()
    assert type(stored["alarm"]) is bool and type(stored["cycles"]) is int
    assert DetectorState.from_dict(stored) == raised
    assert store.fold_detector("other", lambda doc: (None, doc)) == detector_start()  # per backend
    store.close()


def _tokens_problem_reference(tokens) -> str | None:
    """`tokens_problem` as it was before its fast path."""
    for i, t in enumerate(tokens):
        if (why := logprob_problem(t.logprob)) is not None:
            return f"tokens.{i}.logprob: {why}"
        for j, (_, lp) in enumerate(t.top):
            if (why := logprob_problem(lp)) is not None:
                return f"tokens.{i}.top.{j}.logprob: {why}"
    return None


class _Float(float):
    pass


def test_the_logprob_fast_path_answers_as_the_full_checks():
    values = [
        -0.5, 0.0, -0.0, 1e-4, 1.5e-4, -1e5, -1e5 - 1, math.nan, math.inf, -math.inf, 0, -3, 2, True, False,
        None, "x", -(10**400), _Float(-0.1), _Float(math.nan),
    ]  # fmt: skip
    for v in values:
        for w in values:
            cases = [
                [TokenLogprob("a", v), TokenLogprob("b", -0.1, top=(("c", w),))],
                [TokenLogprob("a", -0.1, top=(("b", -0.2), ("c", w))), TokenLogprob("d", v)],
            ]
            for tokens in cases:
                assert tokens_problem(tokens) == _tokens_problem_reference(tokens), (v, w)
                assert tokens_problem(iter(tokens)) == _tokens_problem_reference(tokens)
    assert tokens_problem([]) is None


def test_vetting_still_finds_a_lone_surrogate_in_a_token_or_alternative():
    o = make_obs()
    assert vet.problem(o, None) is None
    o.tokens = [TokenLogprob("ok", -0.1), TokenLogprob("x\ud800", -0.1)]
    assert vet.problem(o, None) == (
        ErrorKind.INVALID_RESPONSE,
        "tokens.1.token: not valid UTF-8 (lone surrogate at index 1)",
    )
    o.tokens = [TokenLogprob("é", -0.1, top=(("ok", -1.0), ("\udfff", -2.0)))]
    assert vet.problem(o, None) == (
        ErrorKind.INVALID_RESPONSE,
        "tokens.0.top.1.token: not valid UTF-8 (lone surrogate at index 0)",
    )
    o.text = "\ud800"  # the text fields come first, as before
    assert vet.problem(o, None)[1].startswith("text: ")


def test_a_suite_is_parsed_again_only_when_its_text_changed(tmp_path):
    path = tmp_path / "s.toml"
    body = '[suite]\nname = "s"\n[[canary]]\nid = "{id}"\nmessages = [{{ role = "user", content = "hi" }}]\n'
    path.write_text(body.format(id="a"))
    first = load_suite(path)
    assert load_suite(path) is first
    path.write_text(body.format(id="b"))
    assert [c.id for c in load_suite(path).canaries] == ["b"]


def test_the_payload_key_is_the_one_the_lists_gave():
    import hashlib
    import json

    from canaryd.store.schema import payload_key

    tokens = [*make_obs().tokens, TokenLogprob('é\n"', -0.0, None, None, ()), TokenLogprob("x", -1e-300, 7)]
    doc = [
        [
            t.token,
            t.logprob,
            t.token_id,
            list(t.bytes) if t.bytes is not None else None,
            [list(x) for x in t.top],
        ]
        for t in tokens
    ]
    canonical = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    assert payload_key(tokens) == (hashlib.sha256(canonical).hexdigest(), canonical)


def test_a_pass_reuses_the_threads_of_the_last_one_and_passes_at_once_get_their_own():
    import threading

    from canaryd.probe.workers import workers

    def names(ex) -> set[int]:
        """The threads of two tasks that wait for each other: both workers, however loaded the machine."""
        both = threading.Barrier(2)
        return set(ex.map(lambda _: (both.wait(timeout=10), threading.get_ident())[1], range(2)))

    with workers("probe-b", 2) as ex:
        first = names(ex)
        with workers("probe-b", 2) as other:  # a second pass of the backend at the same moment
            assert other is not ex
    with workers("probe-b", 2) as again:
        assert again is ex and names(again) <= first  # the last pool idled, and no new thread
    try:
        with workers("probe-b", 2) as failing:
            raise KeyError
    except KeyError:
        pass
    assert failing._shutdown


def test_pulled_items_keep_their_order_run_once_each_at_most_width_at_once_on_width_threads():
    import threading
    import time

    from canaryd.probe.workers import pulled, workers

    lock, seen, running, peak, threads = threading.Lock(), [], [0], [0], set()

    def work(x: int) -> int:
        with lock:
            seen.append(x)
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            threads.add(threading.get_ident())
        time.sleep(0.01 * (x % 3))  # uneven items: a free thread takes the next one
        with lock:
            running[0] -= 1
        return x * x

    with workers("pulled-a", 4) as ex:
        assert pulled(ex, work, list(range(13)), 3) == [x * x for x in range(13)]
        assert sorted(seen) == list(range(13)) and peak[0] <= 3 and len(threads) <= 3
        assert pulled(ex, work, [], 3) == []

        def failing(x: int) -> int:
            if x == 1:
                raise KeyError(x)
            time.sleep(0.05)
            seen.append(("late", x))
            return x

        seen.clear()
        with pytest.raises(KeyError):
            pulled(ex, failing, [0, 1, 2, 3], 2)
        assert sorted(x for _, x in seen) == [0, 2, 3]  # raised once every other item had run


def test_in_memory_databases_share_no_cache():
    a, b = Store("sqlite://"), Store("sqlite:///:memory:")
    c = Store("sqlite://")
    assert a._cache is not c._cache and a._cache is not b._cache
    for s in (a, b, c):
        s.close()


def _point(rng: random.Random, ids: tuple[str, ...]) -> Point:
    """A probe of the tokens ``ids``, with some of each position's top-3 alternatives left out."""
    coords = {}
    for i, tok in enumerate(ids):
        coords[(i, tok)] = -rng.expovariate(3.0)
        for alt in rng.sample("abcde", 3):
            if alt != tok and rng.random() < 0.8:
                coords[(i, alt)] = -rng.uniform(0.5, 9.0) * rng.choice((1e-6, 1.0, 1.0, 37.0))
    return Point(ids, coords)


def test_the_nearest_arrays_give_distance_and_the_largest_move_to_the_bit():
    rng = random.Random(7)
    for case in range(300):
        n = rng.randint(1, 12)
        base = tuple(rng.choice("abcde") for _ in range(n))

        def near(base: tuple[str, ...] = base) -> tuple[str, ...]:  # parts from ``base`` at a random place
            cut = rng.randint(0, len(base))
            tail = tuple(rng.choice("abcde") for _ in range(rng.randint(0, 3)))
            return base if rng.random() < 0.5 else base[:cut] + tail

        refs = [_point(rng, near()) for _ in range(rng.randint(2, 8))]
        if case % 4 == 0:  # the exact regime: identical references
            refs = [refs[0]] * len(refs)
        if case % 7 == 0:  # a reference without logprobs beside the others
            refs[-1] = Point(refs[-1].ids, {})
        model = fit_points("req", tuple(refs), {})
        arrays = Nearest(model.refs, model.spread, model.default_spread)
        probes = [_point(rng, near()) for _ in range(5)] + [refs[0], Point(base, {})]
        for x in probes:
            dists, nearest, moved = arrays.score(x)
            expected = [distance(x, r, model.spread, model.default_spread) for r in model.refs]
            assert dists == expected
            assert nearest == min(range(len(expected)), key=expected.__getitem__)
            assert moved == max_abs_delta(x, model.refs[nearest])
        for r in model.refs:  # `score_point` takes a repeat of a reference for 0 and 0 without them
            dists, nearest, moved = arrays.score(Point(r.ids, dict(r.coords)))
            assert (dists[nearest], moved) == (0.0, 0.0)
        # the first score takes `distance`, later ones the arrays: the same evidence either way
        stored = NoiseModel.from_dict(json.loads(json.dumps(model.as_dict())))
        new = [x for x in probes if x not in refs]
        first, second = score_point(stored, new[0]), score_point(stored, new[0])
        assert stored.nearest() is not None and first == second
