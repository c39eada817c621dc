"""The Python API (`canaryd.api`) through the real `scripted` kind: the CLI's exit semantics as result objects
and exceptions, a session as ``preflight`` around a block of Python (the gate at entry, the record at exit,
each sample's serving configuration counted), and the session in the store, `canaryd record` and the HTML
report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import canaryd.api as api
from canaryd.report.html import render
from tests.harness.scripted_lab import ScriptedLab, change, scripted


def lab(root: Path, body: str = "") -> ScriptedLab:
    return ScriptedLab(root, scripted(body=body, cycle_file=root / "cycle"))


def test_a_check_is_the_clis_check(tmp_path):
    lab_ = lab(tmp_path, change(at=3, canaries=["add"], logprob_shift=-0.3))
    cd = api.load(lab_.path)
    first = cd.check()
    assert first.ok and first.exit_code == 0 and set(first.verdicts.values()) == {"baseline"}
    assert first.raise_for_exit() is first
    assert cd.check().ok  # pass 2: unchanged
    p = lab_.cli("check", "--json")  # pass 3, the CLI: the shift
    doc = json.loads(p.stdout)
    assert p.returncode == doc["exit_code"] == 1
    moved = cd.check()  # pass 4, the API: the same verdicts and the same exit code
    assert moved.exit_code == 1 and not moved.ok
    assert moved.verdicts == {("fake", r["canary"]): r["verdict"] for r in doc["results"]}
    with pytest.raises(api.StackMoved, match="fake/add: logprob-drift") as err:
        moved.raise_for_exit()
    assert err.value.exit_code == 1 and err.value.check is moved
    assert [h["canary_id"] for h in cd.history(canary="add", limit=2)] == ["add", "add"]


def test_unreachable_and_bad_config_are_the_clis_exit_3_and_2(tmp_path):
    cd = api.load(lab(tmp_path, change(at=1, down=True)).path)
    with pytest.raises(api.Unavailable) as err:
        cd.check().raise_for_exit()
    assert err.value.exit_code == 3 and "down" in str(err.value)
    (tmp_path / "bad.toml").write_text("suites = 3\n")
    with pytest.raises(api.InputError, match=r"bad\.toml"):
        api.load(tmp_path / "bad.toml")


def test_a_session_gates_at_entry_counts_samples_and_records_at_exit(tmp_path):
    lab_ = lab(tmp_path)
    cd = api.load(lab_.path)
    cd.check()  # the baselines
    pin = tmp_path / "stack.pin.json"
    cd.pin(out=pin)
    out = tmp_path / "eval"
    with cd.session(pin=pin, out_dir=out, harness="notebook", task="arith") as s:
        assert s.before is not None and s.before.ok
        for i in range(20):
            s.sample({"system_fingerprint": "fp_a" if i % 4 else "fp_b", "choices": []})
        s.sample(None, n=2)  # a reply that names no configuration
    assert s.held is True
    rec = json.loads((out / "canaryd-record.json").read_text())
    assert rec == s.record
    [session] = rec["sessions"]
    assert (session["harness"], session["task"], session["samples"], session["held"]) == (
        "notebook",
        "arith",
        22,
        True,
    )
    counts = sorted(session["configurations"].values())
    assert counts == [2, 5, 15] and "" in session["configurations"]
    md = (out / "canaryd-record.md").read_text()
    assert "Evaluation session" in md and "**3 serving configurations answered its samples**" in md
    # `canaryd record` over the run before finds the session in the store
    again = lab_.cli("record", "--run", str(session["runs_before"][0]))
    assert again.returncode == 0 and "Evaluation session" in again.stdout, again.stderr
    html = render(lab_.store, session["runs_before"] + session["runs_after"])
    moved = html[html.index("id=moved") : html.index("id=summary")]
    assert "Evaluation session" in moved and "notebook" in moved and "3 serving configurations" in moved


def test_a_moved_stack_refuses_the_session_before_the_block_runs(tmp_path):
    lab_ = lab(tmp_path, change(at=3, stack={"engine.dtype": "bfloat16"}))
    cd = api.load(lab_.path)
    cd.check()
    pin = tmp_path / "stack.pin.json"
    cd.pin(out=pin)  # pass 2
    ran = []
    session = cd.session(pin=pin, out_dir=tmp_path / "eval")
    with pytest.raises(api.StackMoved, match="fake/add: stack-change") as err, session:  # pass 3: dtype moved
        ran.append(1)
    assert not ran and err.value.exit_code == 1
    assert not (tmp_path / "eval").exists()


def test_a_stack_that_moves_during_the_session_is_said_in_the_record(tmp_path):
    lab_ = lab(tmp_path, change(at=3, stack={"engine.dtype": "bfloat16"}))
    cd = api.load(lab_.path)
    cd.check()
    with cd.session(out_dir=tmp_path / "eval", harness="h") as s:  # pass 2 at entry, pass 3 at exit
        s.sample({"system_fingerprint": "fp"})
    assert s.held is False
    assert "**the stack moved during it**" in (tmp_path / "eval" / "canaryd-record.md").read_text()


def test_configuration_of_a_reply_follows_the_identity_fields():
    a = api.configuration_of_response({"system_fingerprint": "fp_a"})
    assert a and a == api.configuration_of_response({"system_fingerprint": "fp_a", "id": "x"})
    assert a != api.configuration_of_response({"system_fingerprint": "fp_b"})
    routed = api.configuration_of_response({"provider": "Groq", "headers": {"X-OpenRouter-Provider": "Groq"}})
    assert routed and routed != a
    assert api.configuration_of_response(None) == api.configuration_of_response({"choices": []}) == ""
