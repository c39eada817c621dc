"""Which engine answers at a URL (`canaryd.backends.detect`), from each engine's recorded introspection
bodies (tests/fixtures/engines), and what `canaryd init --url`
and `canaryd doctor` do with it."""

from __future__ import annotations

import tomllib

import pytest

from canaryd.backends.detect import Answer, Detection, classify, constant_fingerprint, detect
from canaryd.errors import InputError
from tests.harness.engines import EngineReplay, fixture


def ok(engine: str, name: str, headers: dict[str, str] | None = None) -> Answer:
    return Answer(200, headers or {}, fixture(engine, name)["body"])


NOT_FOUND = Answer(404, {}, {"detail": "Not Found"})


@pytest.fixture(scope="module")
def replay():
    with EngineReplay() as r:
        yield r


@pytest.mark.parametrize(
    ("answers", "kind", "said"),
    [
        ({"/api/version": ok("ollama", "version")}, "ollama", "Ollama 0.5.1"),
        ({"/props": ok("llamacpp", "props")}, "llamacpp", "default_generation_settings"),
        (
            {"/server_info": NOT_FOUND, "/get_server_info": ok("sglang", "server_info")},
            "sglang",
            "/get_server_info",
        ),
        ({"/server_info": ok("sglang", "server_info")}, "sglang", "0.0.0.dev1+g753da2753"),
        ({"/info": ok("tgi", "info")}, "tgi", "TGI 2.0.2"),  # no router key: its limits say TGI
        ({"/info": ok("tgi", "info-openapi")}, "tgi", "bigscience/blomm-560m"),
        ({"/version": ok("vllm", "vllm-detect/version")}, "vllm", "vLLM 0.11.0"),
        ({"/health/liveliness": ok("litellm", "litellm-detect/liveliness")}, "litellm", "I'm alive!"),
        (
            {"/version": Answer(200, {"x-litellm-version": "1.80.0"}, {"version": "1"})},
            "litellm",
            "x-litellm",
        ),
        (
            {"/props": NOT_FOUND, "/info": Answer(200, {}, {"model_id": "m"}), "/version": NOT_FOUND},
            "openai",
            "",
        ),
        ({}, "openai", "no engine"),
    ],
)
def test_each_engine_is_told_by_its_own_endpoint(answers: dict, kind: str, said: str) -> None:
    found = classify(answers)
    assert found.kind == kind
    assert said in found.evidence and "\n" not in found.evidence


def test_a_gateway_in_front_of_an_engine_is_the_gateway() -> None:
    """LiteLLM passes through nothing of /props, but if its headers are there, the gateway is what answers."""
    answers = {"/props": ok("llamacpp", "props", {"x-litellm-call-id": "c1"})}
    assert classify(answers).kind == "litellm"


def test_detect_over_http_with_the_model_it_serves(replay: EngineReplay) -> None:
    found = detect(replay.base("llamacpp"))
    assert (found.kind, found.model) == ("llamacpp", "tiny")
    assert detect(replay.root("sglang")).kind == "sglang"  # the root works as well as the /v1 base
    assert detect(replay.base("nothing")).kind == "openai"


def test_nothing_listening_is_one_clear_line() -> None:
    with pytest.raises(InputError) as e:
        detect("http://127.0.0.1:9/v1", timeout_s=2)
    assert "http://127.0.0.1:9" in str(e.value) and "\n" not in str(e.value)


def test_ollamas_constant_fingerprint_is_known() -> None:
    assert constant_fingerprint("fp_ollama") == "Ollama"
    assert constant_fingerprint("fp_b3f1157249") is None and constant_fingerprint(None) is None


def test_init_writes_the_found_kind_as_the_one_active_block(tmp_path) -> None:
    from canaryd.config import load_config
    from canaryd.scaffold import write_example

    found = Detection("tgi", "/info: TGI 2.0.2 serving m", "tgi-model")
    cfg = write_example(tmp_path, found=found, url="http://10.0.0.5:8080")[0]
    doc = tomllib.loads(cfg.read_text())
    assert doc["backends"] == [
        {"name": "tgi", "kind": "tgi", "base_url": "http://10.0.0.5:8080/v1", "model": "tgi-model"}
    ]
    assert "# `canaryd init --url` asked http://10.0.0.5:8080: /info: TGI 2.0.2 serving m" in cfg.read_text()
    assert load_config(cfg).backends[0].kind == "tgi"


def test_init_falls_back_to_openai_for_a_kind_this_canaryd_lacks(tmp_path) -> None:
    from canaryd.scaffold import example

    text = example(Detection("someengine", "/x said so"), "http://h:1/v1")
    (backend,) = tomllib.loads(text)["backends"]
    assert backend["kind"] == "openai" and backend["model"] == "my-model"
    assert "no kind 'someengine'" in text


def test_doctor_proposes_the_engines_kind(replay: EngineReplay) -> None:
    from canaryd.backends.discover import discover, engine
    from canaryd.backends.ollama import Settings as OllamaSettings
    from canaryd.backends.openai_compat import Settings

    plain = Settings(name="o", model="llama3", base_url=replay.base("ollama"))
    said = engine(plain)
    assert (said["kind"], said["proposed"]) == ("ollama", "ollama")
    assert (
        engine(OllamaSettings(name="o", model="llama3", base_url=replay.base("ollama")))["proposed"] is None
    )
    assert (
        engine(Settings(name="x", model="m", base_url="http://127.0.0.1:9/v1", timeout_s=2))["kind"] is None
    )
    found = discover(plain)
    assert found.fingerprint is None
    assert "fp_ollama" in found.evidence["fingerprint"] and "constant" in found.evidence["fingerprint"]


def test_init_url_then_doctor_through_the_cli(replay: EngineReplay, tmp_path, monkeypatch) -> None:
    """What a user types: ``init --url`` at an SGLang server writes kind sglang; a config that calls it
    ``openai`` gets the kind proposed by ``doctor`` (in-process, as the CLI runs it)."""
    from typer.testing import CliRunner

    from canaryd.cli import app

    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    r = runner.invoke(app, ["init", "--url", replay.base("sglang"), "canaryd.toml"], prog_name="canaryd")
    assert r.exit_code == 0, r.output
    assert "found sglang at" in r.output
    cfg = tmp_path / "canaryd.toml"
    assert tomllib.loads(cfg.read_text())["backends"][0]["kind"] == "sglang"

    cfg.write_text(cfg.read_text().replace('kind = "sglang"', 'kind = "openai"'))
    r = runner.invoke(app, ["-c", str(cfg), "doctor", "sglang"], prog_name="canaryd")
    assert r.exit_code == 0, r.output
    assert "engine: sglang (/get_server_info: SGLang server args" in r.output
    assert 'kind = "sglang" also reads' in r.output
