"""A canaryd upgrade is not a change of the served stack.

What canaryd records in a stack has a version (`canaryd.stack.RECORDER`, stamped on every snapshot as
``canaryd.recorder``). Against a baseline recorded under another version, a field present on one side only
is a *recording change* (canaryd added, dropped or renamed it), reported once as such and never judged a
``stack-change``; a value that moved on a field both sides record still is one. The digest test below is
what makes the version hard to forget: it fails whenever what is recorded from the recorded bodies changes
while the version stays.
"""

from __future__ import annotations

import hashlib
import json

import structlog
from rich.console import Console

from canaryd import stack
from canaryd.backends import engine_args, hostfacts, llamacpp, ollama, openai_compat, scoring, sglang, tgi
from canaryd.backends import openai_wire as wire
from canaryd.backends.openai_headers import GATEWAY_HEADERS, RECORDED_HEADERS
from canaryd.report.console import show_stacks
from canaryd.report.html import load_run, stack_section
from canaryd.report.pin import Pin, PinnedBackend, check_pin
from canaryd.report.record import build_record, to_markdown
from canaryd.stack import RECORDER, RECORDER_FIELD, FieldChange, split
from tests.harness import fixtures
from tests.harness.scripted_lab import scripted, verdicts

CHATS = sorted(fixtures.ROOT.glob("providers/*/chat.json"))
# Each recorder version's digest of what canaryd records from the recorded bodies (`recorded_names`).
DIGESTS = {"2": "57399d51893641f2", "3": "6e1b721c31554b16", "4": "446fbbea3d7c497e"}
# Names the secret rule decides on besides every key of the recorded bodies.
NAMES = (
    "api_key_env",
    "password_file",
    "secret_name",
    "token_path",
    "OPENAI_APIKEY",
    "bos_token_id",
    "ssl_keyfile",
    "AWS_ACCESS_KEY_ID",
    "llama.attention.key_length",
    "VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD",
    "OPENAI_API_KEY_2",
    "GITHUB_TOKEN_READONLY",
    "PRIVATE_KEY_PEM",
)
ENVIRON = {
    "VLLM_API_KEY": "x",
    "VLLM_KEY_FILE": "x",
    "VLLM_S3_SECRET_ACCESS": "x",
    "VLLM_ATTENTION_BACKEND": "FLASH_ATTN",
    "VLLM_LOGGING_LEVEL": "DEBUG",
    "CUDA_VISIBLE_DEVICES": "0",
    "NCCL_P2P_DISABLE": "1",
    "HOME": "/root",
}
ARGV = ["--model", "m", "--dtype", "bfloat16", "--api-key", "k", "--hf-token", "t"]
ARGV += ["--ssl-keyfile", "/k", "--port", "8000"]


def body(name: str) -> dict | str:
    return fixtures.load(name)["body"]


def keys(value: object) -> set[str]:
    if isinstance(value, dict):
        return {str(k) for k in value} | {k for v in value.values() for k in keys(v)}
    return {k for v in value for k in keys(v)} if isinstance(value, list) else set()


def recorded_names() -> list[str]:
    """Every stack field name canaryd records from the recorded bodies (engines' introspection, answers'
    headers and fields), a fixed environment and command line, and the secret rule's verdicts."""
    models = body("engines/llamacpp/models")
    fields = {
        **llamacpp.props_fields(body("engines/llamacpp/props")),
        **llamacpp.models_fields(models, models["data"][0]["id"]),
        **llamacpp.metrics_fields(body("engines/llamacpp/metrics")),
        **sglang.server_info_fields(body("engines/sglang/server_info")),
        **sglang.model_info_fields(body("engines/sglang/model_info")),
        **tgi.info_fields(body("engines/tgi/info")),
        **ollama.show_fields(body("engines/ollama/show")),
        **hostfacts.env_facts(ENVIRON),
        **engine_args.engine_fields(engine_args.parse_args(ARGV)),
        **scoring.SALTED,
        **stack.stamped({}),
    }
    prober = openai_compat.Prober(
        openai_compat.Settings(name="p", kind="openai", base_url="http://127.0.0.1:9/v1", model="m")
    )
    try:
        for answer in [*CHATS, fixtures.ROOT / "shapes/litellm-chat.json"]:
            doc = json.loads(answer.read_text())
            headers = {k.lower(): v for k, v in doc.get("headers", {}).items()}
            fields.update(prober.response_stack(wire.parse_chat(doc["body"]), headers))
    finally:
        prober.close()
    every = set(NAMES).union(*(keys(json.loads(f.read_text())) for f in fixtures.ROOT.rglob("*.json")))
    secret = sorted(f"secret:{n}" for n in every if hostfacts.is_secret_name(n))
    headers = sorted(f"header:{h}" for h in RECORDED_HEADERS | set(GATEWAY_HEADERS.values()))
    return sorted(fields) + headers + secret


def test_what_canaryd_records_is_versioned():
    digest = hashlib.sha256("\n".join(recorded_names()).encode()).hexdigest()[:16]
    assert DIGESTS.get(RECORDER) == digest, (
        f"what canaryd records changed (digest {digest}) under canaryd.stack.RECORDER = {RECORDER!r}: bump "
        "RECORDER and add the new version's digest to DIGESTS, so that the first pass after the upgrade "
        "reports the fields as recorded differently, not as a stack change"
    )


# -- the split -----------------------------------------------------------------------------------------
OLD = {"engine.dtype": "float32", "engine.api_key_env": "LLAMA_KEY"}  # a stack stored before the stamp
NEW = stack.stamped({"engine.dtype": "float32", "engine.bos_token_id": "1"})


def test_fields_on_one_side_only_are_recording_changes_across_versions():
    changed, recorded = split(OLD, NEW)
    assert changed == []
    assert recorded == [
        FieldChange(RECORDER_FIELD, None, RECORDER),
        FieldChange("engine.api_key_env", "LLAMA_KEY", None),
        FieldChange("engine.bos_token_id", None, "1"),
    ]


def test_a_value_both_sides_record_is_a_stack_change_whatever_the_versions():
    changed, recorded = split(OLD, {**NEW, "engine.dtype": "bfloat16"})
    assert changed == [FieldChange("engine.dtype", "float32", "bfloat16")]
    assert [c.field for c in recorded] == [RECORDER_FIELD, "engine.api_key_env", "engine.bos_token_id"]


def test_a_json_value_spelled_anew_is_a_recording_change_across_versions():
    escaped, plain = '["\\u00e9"]', '["é"]'
    before, after = {**OLD, "engine.stop": escaped}, {**NEW, "engine.stop": plain}
    assert "engine.stop" in [c.field for c in split(before, after)[1]]
    same = split(stack.stamped({"engine.stop": escaped}), stack.stamped({"engine.stop": plain}))
    assert same == ([FieldChange("engine.stop", escaped, plain)], [])  # one version: the server's
    moved = split({**OLD, "engine.stop": '["a"]'}, {**NEW, "engine.stop": '["b"]'})[0]
    assert moved == [FieldChange("engine.stop", '["a"]', '["b"]')]


def test_a_field_no_version_in_between_may_add_or_drop_is_the_servers():
    """A baseline kept from before the upgrade must not hide what the server adds or drops later."""
    after = {**NEW, "engine.enforce_eager": "true", "vllm.error": "HTTP 500"}
    changed, recorded = split({**OLD, "vllm.version": "0.9"}, after)
    assert [c.field for c in changed] == ["engine.enforce_eager", "vllm.error", "vllm.version"]
    assert [c.field for c in recorded] == [RECORDER_FIELD, "engine.api_key_env", "engine.bos_token_id"]
    salt = stack.stamped({"request.scoring_cache_salt": "per-request"})
    before = {RECORDER_FIELD: "3", "request.scoring_cache_salt": "per-request"}
    assert split(before, salt) == ([], [FieldChange(RECORDER_FIELD, "3", RECORDER)])
    assert split({RECORDER_FIELD: "2"}, salt)[1][1].field == "request.scoring_cache_salt"  # added by 3
    assert split({RECORDER_FIELD: "3"}, salt)[0][0].field == "request.scoring_cache_salt"  # 3 had it
    assert split({RECORDER_FIELD: "3", "request.scoring_cache_salt": "x"}, salt)[0] != []  # a value moved


def test_two_values_that_parse_alike_but_differ_in_type_are_the_servers():
    changed, _ = split({**OLD, "engine.flag": "0"}, {**NEW, "engine.flag": "false"})
    assert changed == [FieldChange("engine.flag", "0", "false")]
    changed, _ = split({**OLD, "engine.scale": "1"}, {**NEW, "engine.scale": "1.0"})
    assert changed == [FieldChange("engine.scale", "1", "1.0")]


def test_every_version_says_which_fields_it_may_add_or_drop():
    assert sorted(stack.CHANGED_BY, key=int) == [str(v) for v in range(2, int(RECORDER) + 1)]
    assert all(stack.CHANGED_BY.values())


def test_under_one_version_every_difference_is_the_servers():
    after = {**NEW, "engine.max_tokens": "8"}
    assert split(NEW, after) == ([FieldChange("engine.max_tokens", None, "8")], [])
    assert split(OLD, {**OLD, "engine.seed": "0"}) == ([FieldChange("engine.seed", None, "0")], [])


def test_a_pin_from_older_rules_does_not_fail_on_what_canaryd_records_differently():
    pin = Pin("2026-01-01T00:00:00Z", "0.1", {"b": PinnedBackend("vllm", dict(OLD))})
    report = check_pin(pin, {"b": NEW})
    assert report.matches and [f.field for f in report.recorded] == [
        RECORDER_FIELD,
        "engine.api_key_env",
        "engine.bos_token_id",
    ]
    assert len(report.as_dict()["recorded_differently"]) == 3
    moved = check_pin(pin, {"b": {**NEW, "engine.dtype": "bfloat16"}})
    assert [f.field for f in moved.moved] == ["engine.dtype"]


# -- an upgrade, through the scripted kind -------------------------------------------------------------
IDS = ["add", "capital", "colors"]


def upgraded(make, monkeypatch, new_stack: dict[str, str]):
    """A baseline pass recorded under the old rules (version 1, ``engine.api_key_env`` kept), then a pass
    of the new canaryd (``new_stack``: what it records); returns the lab, that run and its logs."""
    lab = make(scripted(stack=OLD))
    monkeypatch.setattr(stack, "RECORDER", "1")
    assert set(verdicts(lab.cycle()).values()) == {"baseline"}
    monkeypatch.undo()
    lab.write(scripted(stack=new_stack))
    with structlog.testing.capture_logs() as logs:
        run = lab.cycle()
    return lab, run, logs


def test_the_first_pass_after_an_upgrade_is_not_a_stack_change(make, monkeypatch):
    lab, run, logs = upgraded(make, monkeypatch, {"engine.dtype": "float32", "engine.bos_token_id": "1"})
    assert verdicts(run) == dict.fromkeys(IDS, "identical")
    expected = [RECORDER_FIELD, "engine.api_key_env", "engine.bos_token_id"]
    assert run.results[0].comparison.recording_changes[0] == FieldChange(RECORDER_FIELD, "1", RECORDER)
    for r in run.results:
        assert r.comparison.stack_changes == () and r.comparison.reasons == ()
        assert [c.field for c in r.comparison.recording_changes] == expected
    # one log line for the backend (not one per canary), naming the fields as what they are
    lines = [e for e in logs if e["event"] == "recording_changed"]
    assert len(lines) == 1 and list(lines[0]["fields"]) == expected and lines[0]["stack_change"] is False
    assert lines[0]["fields"]["engine.api_key_env"] == ("LLAMA_KEY", None)
    with structlog.testing.capture_logs() as logs:  # the next pass, against the same baselines: said once
        assert verdicts(lab.cycle()) == dict.fromkeys(IDS, "identical")
    assert not [e for e in logs if e["event"] == "recording_changed"]
    # the record reports them once for the backend, apart from the stack
    rec = build_record(lab.store, [run.run_id])
    assert [c["field"] for c in rec["stack"]["fake"]["recording_changes"]] == expected
    assert rec["changes"] == []
    assert "recorded differently by canaryd than at its baselines, not by the server: canaryd.recorder" in (
        to_markdown(rec)
    )


def test_a_server_change_in_the_same_pass_is_still_a_stack_change(make, monkeypatch):
    _, run, _ = upgraded(make, monkeypatch, {"engine.dtype": "bfloat16", "engine.bos_token_id": "1"})
    assert verdicts(run) == dict.fromkeys(IDS, "stack-change")
    for r in run.results:
        assert r.comparison.stack_changes == (FieldChange("engine.dtype", "float32", "bfloat16"),)
        assert [c.field for c in r.comparison.recording_changes] == [
            RECORDER_FIELD,
            "engine.api_key_env",
            "engine.bos_token_id",
        ]
        assert r.comparison.reasons == ("stack changed (1 field)",)


def test_the_stack_views_grey_what_canaryd_records_differently(make, monkeypatch):
    lab, run, _ = upgraded(make, monkeypatch, {"engine.dtype": "bfloat16", "engine.bos_token_id": "1"})
    html = stack_section([load_run(lab.store, run.run_id - 1), load_run(lab.store, run.run_id)])
    assert '<tr class="recording" data-field="engine.api_key_env">' in html
    assert '<tr class="cause" data-field="engine.dtype">' in html
    assert "one field changed: engine.dtype from float32 to bfloat16" in html  # the only one to revert
    console = Console(record=True, width=200)
    show_stacks(lab.store.stacks("fake"), False, console)
    lines = console.export_text().splitlines()
    assert (
        "  engine.api_key_env: LLAMA_KEY -> None (recorded differently by canaryd, not the server)" in lines
    )
    assert "  engine.dtype: float32 -> bfloat16" in lines
