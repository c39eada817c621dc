"""Pins, preflight, explain, the reproducibility record, prune and export.

The store is the real one on SQLite; the CLI runs as a subprocess; where a backend must be down, the config
points at a closed port. Pins and preflight against a live backend are in tests/e2e/test_preflight_e2e.py
(a real vLLM server).
"""

import importlib.util
import json
import sqlite3
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from canaryd.judge.compare import compare
from canaryd.observation import ErrorKind, Observation, TokenLogprob
from canaryd.report.pin import Pin, PinnedBackend, check_pin, to_json
from canaryd.report.record import explain, last_flip, suggest
from canaryd.stack import FieldChange, merge_stacks
from canaryd.store import Store

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
SUITE = """
[suite]
name = "t"
[defaults]
max_tokens = 4
[[canary]]
id = "add"
messages = [{ role = "user", content = "What is 17 + 25?" }]
expect = { number = 42 }
[[canary]]
id = "capital"
messages = [{ role = "user", content = "Capital of France?" }]
"""


def write_config(root: Path, port: int) -> Path:
    (root / "suite.toml").write_text(SUITE)
    cfg = root / "canaryd.toml"
    cfg.write_text(
        f"state_dir = 'state'\nsuites = ['suite.toml']\n[[backends]]\nname = 'api'\nkind = 'openai'\n"
        f"base_url = 'http://127.0.0.1:{port}/v1'\nmodel = 'm'\ntimeout_s = 5\nconnect_timeout_s = 1\n"
        "retries = 0\n"  # a closed port refuses at once: waiting out the backoff of retries proves nothing
    )
    return cfg


def canaryd(cfg: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    p = subprocess.run(
        [sys.executable, "-m", "canaryd", "-c", str(cfg), *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )
    assert "Traceback" not in p.stderr, p.stderr
    return p


def db_path(cfg: Path) -> Path:
    return cfg.parent / "state" / "canaryd.db"


# -- pin and check --pin ------------------------------------------------------------------------------


def test_check_pin_counts_gone_fields_as_moved_and_new_fields_as_reported():
    pin = Pin("t", "0", {"b": PinnedBackend("vllm", {"a": "1", "gone": "x", "header.x-request-id": "r1"})})
    report = check_pin(pin, {"b": {"a": "1", "new": "y", "header.x-request-id": "r2"}}, "p.json")
    assert [(f.field, f.moved) for f in report.fields] == [("gone", True), ("new", False)]
    assert not report.matches and report.as_dict()["new"][0]["field"] == "new"
    assert check_pin(pin, {"b": {"a": "1", "gone": "x", "new": "y"}}).matches  # new fields do not fail
    assert not check_pin(pin, {"b": {}}).matches  # unreachable: cannot be confirmed
    assert merge_stacks([{"fp": "b", "v": "1"}, {"fp": "a", "v": "1"}]) == {"fp": "a,b", "v": "1"}


def test_pin_and_preflight_on_an_unreachable_backend_exit_3_and_do_nothing(tmp_path):
    cfg = write_config(tmp_path, 9)  # nothing listens on port 9
    p = canaryd(cfg, "pin", "--out", str(tmp_path / "pin.json"))
    assert p.returncode == 3 and not (tmp_path / "pin.json").exists() and "nothing pinned" in p.stderr
    (tmp_path / "pin.json").write_text(to_json(Pin("t", "0", {"api": PinnedBackend("openai", {"a": "1"})})))
    marker = tmp_path / "marker"
    pre = canaryd(cfg, "preflight", "--pin", str(tmp_path / "pin.json"), "--", "touch", str(marker))
    assert pre.returncode == 3 and not marker.exists() and "unreachable" in pre.stderr


def test_bad_pin_files_exit_2(tmp_path):
    cfg = write_config(tmp_path, 9)
    (tmp_path / "bad.json").write_text("{}")
    p = canaryd(cfg, "check", "--pin", str(tmp_path / "bad.json"))
    assert p.returncode == 2 and "format" in p.stderr and p.stderr.count("\n") == 1
    (tmp_path / "other.json").write_text(to_json(Pin("t", "0", {"nope": PinnedBackend("vllm", {})})))
    p = canaryd(cfg, "check", "--pin", str(tmp_path / "other.json"))
    assert p.returncode == 2 and "backend 'nope' is not in" in p.stderr


# -- preflight ------------------------------------------------------------------------------------------


# -- explain ---------------------------------------------------------------------------------------------

STACK = {"engine.dtype": "float32", "vllm.version": "0.32.0", "response.system_fingerprint": "fp-a"}


def obs(canary="c", lp=-0.25, stack=None, t=None, text="42"):
    o = Observation("b", canary, "s", t or datetime(2026, 1, 1, tzinfo=UTC), {"model": "m"}, "r1")
    o.text, o.finish_reason, o.system_fingerprint = text, "stop", "fp"
    o.tokens = [TokenLogprob("4", lp, 52, (52,), (("4", lp), ("5", -3.0))), TokenLogprob("2", -1e-9, 50)]
    o.prompt_tokens, o.completion_tokens = 12, 2
    o.stack = dict(stack or STACK)
    return o


def add(store: Store, run: int, o: Observation) -> int:
    """Judge against the stored baseline, as a probe pass does, and store."""
    base = store.baseline(o.backend, o.canary_id)
    c = compare(
        base.observation if base else None, o, correct=True, baseline_correct=base.correct if base else None
    )
    return store.add_observation(run, o, c, base.observation_id if base else None)


def down(canary="c"):
    o = Observation("b", canary, "s", datetime(2026, 1, 1, tzinfo=UTC), {}, "")
    o.error, o.error_kind = "refused", ErrorKind.CONNECT
    return o


def test_last_flip_skips_errors_and_finds_the_newest_transition():
    newest_first = [(9, "identical"), (8, "logprob-drift"), (7, "error"), (6, "answer-drift"), (5, "error")]
    assert last_flip([*newest_first, (4, "identical"), (3, "stack-change"), (2, "baseline")]) == (4, 6)
    assert last_flip([(3, "identical"), (2, "identical"), (1, "baseline")]) is None
    assert last_flip([(2, "logprob-drift"), (1, "error")]) is None


def test_suggestion_names_one_field_or_an_order_for_several():
    one = suggest([FieldChange("vllm.version", "0.32.0", "0.33.0")])
    assert one == "one field changed: vllm.version from 0.32.0 to 0.33.0 — revert it to confirm"
    many = suggest(
        [
            FieldChange("response.system_fingerprint", "a", "b"),
            FieldChange("vllm.version", "0.32.0", "0.33.0"),
            FieldChange("host.env.VLLM_BATCH_INVARIANT", None, "1"),
        ]
    )
    assert many.startswith("3 fields changed at once: change them back one at a time")
    assert many.index("env.VLLM") < many.index("vllm.version") < many.index("response.system_fingerprint")
    assert "(absent) -> 1" in many


def test_explain_names_the_single_changed_field_and_the_multi_field_case(tmp_path):
    cfg = write_config(tmp_path, 9)
    store = Store(f"sqlite:///{db_path(cfg)}")
    run = store.start_run("b")
    for c in ("one", "many"):
        add(store, run, obs(c))  # baseline
        add(store, run, obs(c))  # identical
    add(store, run, down("one"))  # an error between good and bad changes nothing
    bad_one = add(store, run, obs("one", lp=-0.3, stack={**STACK, "vllm.version": "0.33.0"}))
    add(store, run, obs("one", lp=-0.3, stack={**STACK, "vllm.version": "0.33.0"}))  # still drifting
    many = {"engine.dtype": "bfloat16", "vllm.version": "0.33.0", "response.system_fingerprint": "fp-b"}
    add(store, run, obs("many", lp=-0.5, text="41", stack=many))
    doc = explain(store, "b", "one")
    (flip,) = doc["flips"]
    assert flip["first_bad"]["observation_id"] == bad_one and flip["last_good"]["verdict"] == "identical"
    assert flip["first_bad"]["verdict"] == "logprob-drift"
    assert flip["first_bad"]["max_abs_dlogprob"] == pytest.approx(0.05)
    assert flip["stack_changes"] == [{"field": "vllm.version", "from": "0.32.0", "to": "0.33.0"}]
    assert (
        flip["suggestion"] == "one field changed: vllm.version from 0.32.0 to 0.33.0 — revert it to confirm"
    )
    store.close()

    p = canaryd(cfg, "explain", "b", "--json")
    assert p.returncode == 0, p.stderr
    flips = {f["canary"]: f for f in json.loads(p.stdout)["flips"]}
    assert (
        flips["many"]["first_bad"]["verdict"] == "answer-drift"
        and flips["many"]["between"]["text_identical"] is False
    )
    assert flips["many"]["suggestion"].startswith("3 fields changed at once")
    assert [c["field"] for c in flips["many"]["stack_changes"]] == sorted(many)
    human = canaryd(cfg, "explain", "b", "one")
    assert (
        human.returncode == 0
        and "last good" in human.stdout
        and "vllm.version: 0.32.0 -> 0.33.0" in human.stdout
    )


def test_explain_with_nothing_flipped_says_so_and_unknown_backend_exits_2(tmp_path):
    cfg = write_config(tmp_path, 9)
    store = Store(f"sqlite:///{db_path(cfg)}")
    run = store.start_run("b")
    add(store, run, obs())
    add(store, run, obs())
    store.close()
    p = canaryd(cfg, "explain", "b")
    assert p.returncode == 0 and "nothing flipped" in p.stdout
    p = canaryd(cfg, "explain", "nope")
    assert p.returncode == 2 and "no observations of backend 'nope'" in p.stderr


# -- record ----------------------------------------------------------------------------------------------


def test_record_json_is_generated_from_the_store(tmp_path):
    cfg = write_config(tmp_path, 9)
    store = Store(f"sqlite:///{db_path(cfg)}")
    first = store.start_run("b")
    base_id = add(store, first, obs())
    run = store.start_run("b")
    same_id = add(store, run, obs("c"))
    moved_stack = {**STACK, "vllm.version": "0.33.0"}
    drift_id = add(store, run, obs("c", lp=-0.3, stack=moved_stack))
    err_id = add(store, run, down("d"))
    pin = tmp_path / "pin.json"
    pin.write_text(to_json(Pin("t", "0", {"b": PinnedBackend("vllm", STACK)})))
    store.close()

    p = canaryd(cfg, "record", "--run", str(run), "--pin", str(pin), "--format", "json")
    assert p.returncode == 0, p.stderr
    rec = json.loads(p.stdout)
    assert rec["session"]["runs"] == [run]
    assert [c["observation_id"] for c in rec["canaries"]] == [same_id, drift_id, err_id]
    assert [c["verdict"] for c in rec["canaries"]] == ["identical", "logprob-drift", "error"]
    assert rec["canaries"][0]["text"] == "42" and rec["canaries"][2]["error"] == "refused"
    assert rec["stack"]["b"]["fields"] == merge_stacks([STACK, moved_stack])
    assert rec["stack"]["b"]["fields"]["vllm.version"] == "0.32.0,0.33.0"  # two stacks in one session
    assert rec["pin"]["moved"] == [
        {"backend": "b", "field": "vllm.version", "pinned": "0.32.0", "now": "0.32.0,0.33.0"}
    ]
    (change,) = rec["changes"]
    assert (change["observation_id"], change["baseline_id"]) == (drift_id, base_id)
    assert change["stack_changes"] == [{"field": "vllm.version", "from": "0.32.0", "to": "0.33.0"}]
    assert change["suggestion"].startswith("one field changed: vllm.version")
    db = sqlite3.connect(db_path(cfg))
    payloads = {
        r[0] for r in db.execute("select payload_hash from observation where run_id = ?", (run,)) if r[0]
    }
    assert set(rec["storage"]["payload_hashes"]) == payloads
    assert rec["storage"]["database"] == f"sqlite:///{db_path(cfg)}"
    kept = {r[0] for r in db.execute("select observation_id from keep where reason = 'record'")}
    assert kept == {same_id, drift_id, err_id}

    md = canaryd(cfg, "record", "--since", "1h")
    assert md.returncode == 0
    assert (
        md.stdout.count("\n1. **Whole stack:**") == 1
        and "4. **Changes:** 1 observation(s) drifted" in md.stdout
    )
    assert "## 1. Stack of `b`" in md.stdout and "| vllm.version | 0.32.0,0.33.0 |" in md.stdout
    assert canaryd(cfg, "record").returncode == 2
    assert canaryd(cfg, "record", "--since", "yesterday").returncode == 2
    assert canaryd(cfg, "record", "--run", "999").returncode == 2


# -- retention and export ---------------------------------------------------------------------------------


def test_prune_keeps_baselines_and_kept_observations_and_deletes_the_rest_and_orphans(tmp_path):
    cfg = write_config(tmp_path, 9)
    store = Store(f"sqlite:///{db_path(cfg)}")
    old = datetime.now(UTC) - timedelta(days=90)
    base_id = add(store, store.start_run("b"), obs(t=old))
    # a sampled canary's baseline is its run's set of draws (`Store.run_set`): all of them stay
    draws_run = store.start_run("b")
    draws = [add(store, draws_run, obs(canary="coin", t=old)) for _ in range(3)]
    assert store.baseline("b", "coin").observation_id == draws[0]
    run = store.start_run("b")
    old_ids = [add(store, run, obs(t=old + timedelta(minutes=i))) for i in range(3)]  # identical, old
    drifted_old = add(
        store, run, obs(lp=-0.4, stack={**STACK, "vllm.version": "9"}, t=old)
    )  # own payload/stack
    kept_id = add(store, run, obs(lp=-0.7, t=old + timedelta(hours=1)))
    store.keep([kept_id], "record")
    recent = add(store, run, obs(t=datetime.now(UTC)))
    store.close()

    db = sqlite3.connect(db_path(cfg))

    def counts():
        return {
            t: db.execute(f"select count(*) from {t}").fetchone()[0]
            for t in ("observation", "payload", "stack")
        }

    assert counts() == {"observation": 10, "payload": 3, "stack": 2}
    dry = canaryd(cfg, "prune", "--older-than", "30d", "--dry-run")
    assert dry.returncode == 0 and "would delete 4 observations" in dry.stdout, dry.stdout
    assert counts()["observation"] == 10
    p = canaryd(cfg, "prune", "--older-than", "30d")
    assert p.returncode == 0 and "deleted 4 observations" in p.stdout and "1 payload, 1 stack" in p.stdout
    left = {r[0] for r in db.execute("select id from observation")}
    assert left == {base_id, *draws, kept_id, recent} and not left & {*old_ids, drifted_old}
    assert counts() == {"observation": 6, "payload": 2, "stack": 1}
    assert db.execute("pragma foreign_key_check").fetchall() == []
    assert canaryd(cfg, "prune", "--older-than", "soon").returncode == 2


def test_export_round_trips_tokens_logprobs_and_stack_exactly(tmp_path):
    cfg = write_config(tmp_path, 9)
    store = Store(f"sqlite:///{db_path(cfg)}")
    run = store.start_run("b")
    originals = [obs("c", lp=-0.123456789012345), obs("d", lp=-1 / 3, stack={"x": "ü"}), down("e")]
    ids = [add(store, run, o) for o in originals]
    store.close()
    p = canaryd(cfg, "export", "--run", str(run), "--out", str(tmp_path / "run.jsonl"))
    assert p.returncode == 0, p.stderr
    lines = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert [line["id"] for line in lines] == ids
    for line, o in zip(lines, originals, strict=True):
        tokens = [
            TokenLogprob(
                t["token"],
                t["logprob"],
                t["token_id"],
                tuple(t["bytes"]) if t["bytes"] else None,
                tuple((a, b) for a, b in t["top"]),
            )
            for t in line["tokens"]
        ]
        assert tokens == o.tokens and line["stack"] == o.stack and line["request"] == o.request
        assert line["text"] == o.text and line["error_kind"] == (o.error_kind and o.error_kind.value)
        assert datetime.fromisoformat(line["started_at"]) == o.started_at
    assert lines[0]["tokens"][0]["logprob"] == -0.123456789012345
    assert canaryd(cfg, "export", "--run", "999").returncode == 2


def test_identical_observations_cost_under_5_percent_of_distinct_ones(tmp_path):
    spec = importlib.util.spec_from_file_location("storage_bench", REPO / "bench" / "storage_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    identical = bench.growth(200, distinct=False, workdir=tmp_path)
    distinct = bench.growth(200, distinct=True, workdir=tmp_path)
    assert identical < 0.05 * distinct, (identical, distinct)


def test_a_database_from_before_the_dedup_schema_is_a_one_line_storage_error(tmp_path):
    cfg = write_config(tmp_path, 9)
    db_path(cfg).parent.mkdir()
    sqlite3.connect(db_path(cfg)).execute("create table observation (id integer primary key)")
    p = canaryd(cfg, "history")
    assert p.returncode == 4 and "older canaryd" in p.stderr and p.stderr.count("\n") == 1
