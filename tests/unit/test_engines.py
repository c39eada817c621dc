"""The SGLang, TGI and Ollama snapshots, canonicalised from the engines' recorded bodies
(tests/fixtures/engines): which fields, what is left out (credentials, volatile values), and that a change
of the stack changes exactly the field that names it."""

from __future__ import annotations

import copy

import pytest

from canaryd.backends import KINDS, engine_version, tgi
from canaryd.backends import ollama as ol
from canaryd.backends import sglang as sg
from canaryd.backends.engine_info import flatten, section, text
from canaryd.canaries import Canary
from canaryd.stack import diff
from tests.harness.engines import EngineReplay, fixture

SERVER_INFO = fixture("sglang", "server_info")["body"]


@pytest.fixture(scope="module")
def replay():
    with EngineReplay({"17 + 25": "42"}) as r:
        yield r


def changed(before: dict[str, str], after: dict[str, str]) -> dict[str, tuple]:
    return {c.field: (c.before, c.after) for c in diff(before, after)}


# -- shared -------------------------------------------------------------------------------------------
def test_engine_fields_follow_the_one_secret_rule() -> None:
    doc = {"api_key": "sk-1", "api_key_env": "X", "bos_token_id": 1, "token_path": "/t", "dtype": "auto"}
    assert flatten(doc, "engine") == {"engine.bos_token_id": "1", "engine.dtype": "auto"}


def test_values_keep_their_json_spelling() -> None:
    assert [text(v) for v in ("auto", True, None, 1.0, [1, 2], {"b": 1, "a": 2})] == [
        "auto",
        "true",
        "null",
        "1.0",
        "[1,2]",
        '{"a":2,"b":1}',
    ]


def test_an_unreadable_endpoint_is_a_field_not_an_exception() -> None:
    assert section("tgi", lambda: {}["x"]) == {"tgi.error": "unreadable: KeyError"}


def test_the_kinds_are_registered_with_their_version_field() -> None:
    for kind in ("sglang", "tgi", "ollama"):
        assert kind in KINDS
        assert engine_version(kind, {f"{kind}.version": "1.2.3"}) == "1.2.3"


# -- SGLang -------------------------------------------------------------------------------------------
def test_sglang_server_args_become_engine_fields() -> None:
    f = sg.server_info_fields(SERVER_INFO)
    assert f["engine.dtype"] == "auto"
    assert f["engine.kv_cache_dtype"] == "auto"
    assert f["engine.attention_backend"] == "fa3"
    assert f["engine.tp_size"] == "1"
    assert f["engine.enable_deterministic_inference"] == "false"
    assert f["engine.cuda_graph_bs"] == "[1,2,4]"
    assert f["sglang.version"] == "0.0.0.dev1+g753da2753"
    assert f["sglang.max_total_num_tokens"] == "20480"  # derived: ranked after the arguments
    assert "engine.quantization" not in f  # null: not set
    for gone in ("host", "port", "random_seed", "status", "internal_states", "version", "max_req_input_len"):
        assert f"engine.{gone}" not in f
    assert all(isinstance(v, str) for v in f.values())


def test_sglang_never_stores_a_key_it_was_started_with() -> None:
    doc = {**SERVER_INFO, "api_key": "sk-live-123456", "admin_api_key": "adm-987654", "hf_token": "hf_abcdef"}
    f = sg.server_info_fields(doc)
    assert not any(s in k or s in v for k, v in f.items() for s in ("sk-live", "adm-98", "hf_abc", "api_key"))


def test_sglang_restart_keeps_the_stack_and_a_dtype_switch_moves_one_field() -> None:
    base = sg.server_info_fields(SERVER_INFO)
    restarted = copy.deepcopy(SERVER_INFO)
    restarted.update(random_seed=1, port=30001)
    restarted["internal_states"][0]["last_gen_throughput"] = 12.5
    assert sg.server_info_fields(restarted) == base
    assert changed(base, sg.server_info_fields({**SERVER_INFO, "dtype": "bfloat16"})) == {
        "engine.dtype": ("auto", "bfloat16")
    }


def test_sglang_model_info() -> None:
    f = sg.model_info_fields(fixture("sglang", "model_info")["body"])
    assert f["model.path"] == "qwen/qwen2.5-0.5b-instruct"
    assert f["model.type"] == "qwen2"
    assert f["model.architectures"] == '["Qwen2ForCausalLM"]'
    assert f["model.weight_version"] == "default"
    assert "model.preferred_sampling_params" not in f


def test_sglang_reads_the_renamed_endpoints_first_and_pins_sampling(replay: EngineReplay) -> None:
    p = sg.Prober(sg.Settings(name="s", model="qwen/qwen2.5-0.5b-instruct", base_url=replay.base("sglang")))
    try:
        fields = p.snapshot()
        body = p.request(Canary(id="c", suite="s", messages=({"role": "user", "content": "hi"},)))
    finally:
        p.close()
    assert fields["engine.dtype"] == "auto" and fields["model.type"] == "qwen2"
    assert replay.paths("sglang")[:2] == ["/server_info", "/get_server_info"]  # 404, then the old name
    assert (body["top_k"], body["min_p"], body["repetition_penalty"]) == (-1, 0.0, 1.0)


# -- TGI ----------------------------------------------------------------------------------------------
def test_tgi_info_2x_names_dtype_weights_and_build() -> None:
    f = tgi.info_fields(fixture("tgi", "info")["body"])
    assert f["engine.dtype"] == "torch.float16"
    assert f["engine.device_type"] == "cuda"
    assert f["engine.max_total_tokens"] == "8192"
    assert f["engine.max_batch_total_tokens"] == "1259392"
    assert f["model.id"] == "meta-llama/Meta-Llama-3-70B-Instruct"
    assert "model.sha" not in f  # reported null
    assert (f["tgi.version"], f["tgi.commit"], f["tgi.docker_label"]) == (
        "2.0.2",
        "dccab72549635c7eb5ddb17f43f0b7cdff07c214",
        "sha-dccab72",
    )


def test_tgi_info_3x_has_no_dtype_but_the_weights_commit() -> None:
    body = fixture("tgi", "info-openapi")["body"]
    f = tgi.info_fields(body)
    assert "engine.dtype" not in f
    assert f["model.sha"] == "e985a63cdc139290c5f700ff1929f0b5942cced2"
    assert f["tgi.router"] == "text-generation-router"
    assert f["engine.max_input_tokens"] == "1024"
    other = tgi.info_fields({**body, "model_sha": "0" * 40})
    assert changed(f, other) == {"model.sha": (body["model_sha"], "0" * 40)}


def test_tgi_unreadable_info_is_named(replay: EngineReplay) -> None:
    p = tgi.Prober(tgi.Settings(name="t", model="tgi", base_url=f"{replay.url}/nothing/v1"))
    try:
        assert p.snapshot()["tgi.error"] == "HTTP 404"
    finally:
        p.close()


# -- Ollama -------------------------------------------------------------------------------------------
SHOW = fixture("ollama", "show")["body"]


def test_ollama_show_names_weights_template_and_parameters() -> None:
    f = ol.show_fields(SHOW)
    assert f["model.quantization"] == "Q4_0"
    assert f["model.family"] == "llama"
    assert f["model.parameter_size"] == "8.0B"
    assert f["model.file_type"] == "2"
    assert f["model.info.llama.context_length"] == "8192"
    assert f["model.info.tokenizer.ggml.eos_token_id"] == "128009"
    assert "model.info.tokenizer.ggml.tokens" not in f  # a list (empty unless verbose)
    assert "model.parent_model" not in f  # ""
    assert f["engine.num_keep"] == "24"
    assert f["engine.stop"] == '["<|start_header_id|>","<|end_header_id|>","<|eot_id|>"]'
    assert len(f["template.sha256"]) == 16
    assert not any(k.startswith(("model.modelfile", "model.license", "model.modified")) for k in f)
    edited = {**SHOW, "template": SHOW["template"] + " ", "system": "Be brief."}
    assert set(changed(f, ol.show_fields(edited))) == {"template.sha256", "template.system_sha256"}


def test_ollama_parameters_unquote_and_keep_repeats() -> None:
    assert ol.parameters('num_ctx 4096\nstop "</s>"\nstop "USER:"\ntemperature 0.7\n\n') == {
        "engine.num_ctx": "4096",
        "engine.stop": '["</s>","USER:"]',
        "engine.temperature": "0.7",
    }


def test_ollama_digest_by_tag() -> None:
    tags = fixture("ollama", "tags")["body"]
    digest = "fe938a131f40e6f6d40083c9f0f430a515233eb2edaa6d72eb85c50d64f2300e"
    assert ol.digest_of(tags, "llama3") == ol.digest_of(tags, "llama3:latest") == {"model.digest": digest}
    assert ol.digest_of(tags, "mistral") == {"model.error": "'mistral' is not in /api/tags"}


def test_ollama_ps_records_only_a_mismatch() -> None:
    ps = fixture("ollama", "ps")["body"]
    running = ps["models"][0]["digest"]
    assert ol.loaded_mismatch(ps, "mistral", running) == {}
    assert ol.loaded_mismatch(ps, "mistral", "0" * 64) == {"model.loaded_digest": running}
    assert ol.loaded_mismatch(ps, "llama3", "0" * 64) == {}  # not loaded: nothing, whatever the digest
    assert ol.loaded_mismatch({"models": []}, "mistral", running) == {}


def test_ollama_constant_fingerprint_is_no_identity(replay: EngineReplay) -> None:
    p = ol.Prober(ol.Settings(name="o", model="llama3", base_url=replay.base("ollama")))
    try:
        obs = p.attempt(Canary(id="add", suite="s", messages=({"role": "user", "content": "17 + 25?"},)))
        snap = p.snapshot()
    finally:
        p.close()
    assert obs.error is None and obs.text == "42" and obs.tokens
    assert obs.system_fingerprint is None
    assert "response.system_fingerprint" not in obs.stack
    assert obs.stack["response.model"] == "llama3"
    assert snap["ollama.version"] == "0.5.1" and snap["model.quantization"] == "Q4_0"
    assert "fp_ollama" not in snap.values()


def test_each_failing_ollama_endpoint_is_its_own_field(replay: EngineReplay) -> None:
    p = ol.Prober(ol.Settings(name="o", model="llama3", base_url=f"{replay.url}/nothing/v1"))
    try:
        snap = p.snapshot()
    finally:
        p.close()
    errors = {k: v for k, v in snap.items() if k.endswith(".error")}
    assert errors == {f"{s}.error": "HTTP 404" for s in ("ollama", "tags", "show", "ps")}
