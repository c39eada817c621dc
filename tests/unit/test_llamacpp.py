"""The ``llamacpp`` kind without a server: its parsers on bodies recorded from a real llama-server, and
its snapshot against those bodies replayed on loopback (the real server: tests/e2e/test_llamacpp.py)."""

from __future__ import annotations

import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from canaryd.backends import KINDS, BackendUnavailable, engine_version, make_backend
from canaryd.backends.llamacpp import (
    EXAMPLE,
    Prober,
    Settings,
    metrics_fields,
    models_fields,
    props_fields,
    sha16,
)
from canaryd.canaries import Canary
from canaryd.config import load_config
from canaryd.observation import ErrorKind
from tests.harness.fixtures import every, load, read


def recorded(name: str) -> dict:
    return load(f"engines/llamacpp/{name}")["body"]


PROPS = recorded("props")
MODELS = recorded("models")
METRICS = recorded("metrics")


def test_props_fields_of_a_recorded_body():
    f = props_fields(PROPS)
    assert all(isinstance(v, str) for v in f.values())
    build, commit = PROPS["build_info"].removeprefix("b").split("-", 1)
    assert (f["llamacpp.build"], f["llamacpp.commit"]) == (build, commit)
    assert f["model.ftype"] == PROPS["model_ftype"] == "all F32"
    assert f["model.path"] == PROPS["model_path"] and f["model.alias"] == "tiny"
    assert f["template.sha256"] == sha16(PROPS["chat_template"])
    assert f["engine.n_ctx"] == str(PROPS["default_generation_settings"]["n_ctx"])
    params = PROPS["default_generation_settings"]["params"]
    assert f["engine.temperature"] == json.dumps(params["temperature"])
    assert f["engine.samplers"] == json.dumps(params["samplers"], separators=(",", ":"))
    assert f["engine.total_slots"] == "1" and f["engine.endpoint_metrics"] == "true"
    # per-start random, state, or web UI settings: never stack fields
    assert not [k for k in f if "media_marker" in k or "is_sleeping" in k or "ui_settings" in k]


def test_props_keep_credentials_out_at_any_depth():
    props = copy.deepcopy(PROPS)
    props["api_key"] = "sk-top-1"
    props["default_generation_settings"]["params"]["hf_token"] = "hf-nested-2"
    props["webui"] = {"auth": {"password_file": "/etc/pw-3"}, "theme": "dark"}
    f = props_fields(props)
    assert not [v for v in f.values() if v in ("sk-top-1", "hf-nested-2", "/etc/pw-3")]
    assert f["engine.webui.theme"] == "dark"
    assert f["engine.timings_per_token"] == "false"  # a tokenizer's token, not a credential


def test_a_template_edit_moves_only_template_fields():
    edited = copy.deepcopy(PROPS)
    edited["chat_template"] += "{# edited #}"
    before, after = props_fields(PROPS), props_fields(edited)
    assert {k for k in before if before[k] != after[k]} == {"template.sha256"}


def test_a_requantised_model_moves_the_file_type_and_size():
    q8 = copy.deepcopy(MODELS)
    q8["data"][0]["meta"]["size"] //= 3
    props = {**PROPS, "model_ftype": "Q8_0"}
    assert props_fields(props)["model.ftype"] == "Q8_0"
    before, after = models_fields(MODELS, "tiny"), models_fields(q8, "tiny")
    assert {k for k in before if before[k] != after[k]} == {"model.size"}
    assert before["model.n_params"] == str(MODELS["data"][0]["meta"]["n_params"])


def test_unusual_bodies_are_named_not_guessed():
    assert props_fields({"build_info": "local-dev"})["llamacpp.build_info"] == "local-dev"
    assert props_fields({})["template.sha256"] == "None"
    two = {"data": [{**MODELS["data"][0], "id": "a"}, {**MODELS["data"][0], "id": "b"}]}
    assert models_fields(two, "c") == {"model.error": "no model 'c' in /v1/models"}
    assert models_fields(two, "b")["model.n_vocab"] == str(MODELS["data"][0]["meta"]["n_vocab"])


def test_metrics_give_series_names_only():
    names = metrics_fields(METRICS)["metrics.series"].split(",")
    assert names == sorted(names) and "llamacpp:prompt_tokens_total" in names
    assert metrics_fields("") == {"metrics.series": ""}


def test_the_kind_is_registered_with_its_version_field(tmp_path):
    assert KINDS["llamacpp"] == "canaryd.backends.llamacpp"
    path = tmp_path / "canaryd.toml"
    # the block `canaryd init` writes, uncommented, is a valid config
    lines = [line.removeprefix("# ") for line in EXAMPLE.splitlines() if line.startswith("# ")]
    block = "\n".join(lines[lines.index("[[backends]]") :])
    path.write_text(f"suites = ['s.toml']\n{block}\n")
    cfg = load_config(path)
    assert isinstance(cfg.backends[0], Settings)
    assert engine_version("llamacpp", props_fields(PROPS)) == props_fields(PROPS)["llamacpp.build"]


class _Recorded(BaseHTTPRequestHandler):
    """The recorded bodies on their paths; ``health`` is the /health status to answer."""

    health = 200

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(
                self.health, json.dumps({"status": "ok" if self.health == 200 else "loading"}).encode()
            )
        elif self.path == "/props":
            self._send(200, json.dumps(PROPS).encode())
        elif self.path == "/v1/models":
            self._send(200, json.dumps(MODELS).encode())
        elif self.path == "/metrics":
            self._send(200, METRICS.encode(), "text/plain; version=0.0.4")
        else:
            self._send(404, b"{}")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.path == "/apply-template":
            self._send(200, json.dumps(recorded("apply-template")).encode())
        else:
            self._send(404, b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), type("H", (_Recorded,), {}))
    threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _settings(srv) -> Settings:
    return Settings(name="l", base_url=f"http://127.0.0.1:{srv.server_address[1]}/v1", model="tiny")


def _prober(srv) -> Prober:
    return Prober(_settings(srv))


def test_snapshot_reads_every_endpoint(server):
    p = _prober(server)
    try:
        s = p.snapshot()
    finally:
        p.close()
    assert s["backend.kind"] == "llamacpp" and s["model.ftype"] == "all F32"
    assert s["model.size"] == str(MODELS["data"][0]["meta"]["size"])
    assert s["template.prompt_sha256"] == sha16(recorded("apply-template")["prompt"])
    assert s["metrics.series"] == metrics_fields(METRICS)["metrics.series"]
    assert not [k for k in s if k.endswith(".error")], s


def test_a_loading_server_has_no_snapshot(server):
    server.RequestHandlerClass.health = 503
    backend = make_backend(
        Settings(name="l", base_url=f"http://127.0.0.1:{server.server_address[1]}/v1", model="m")
    )
    try:
        with pytest.raises(BackendUnavailable) as e:
            backend.snapshot()
    finally:
        backend.close()
    assert e.value.kind == ErrorKind.HTTP_5XX and "/health: HTTP 503" in str(e.value)


def test_requests_pin_llamacpp_s_samplers_and_turn_off_prompt_caching(server):
    p = _prober(server)
    try:
        body = p.request(Canary(id="c", messages=[{"role": "user", "content": "hi"}], suite="s"))
    finally:
        p.close()
    assert body["top_k"] == 0 and body["min_p"] == 0.0 and body["cache_prompt"] is False
    assert body["logprobs"] is True and body["temperature"] == 0.0


def test_fixtures_name_their_source():
    for path in every("engines/llamacpp"):
        assert "llama-cpp-python==0.3.36" in read(path)["_source"], path.name
