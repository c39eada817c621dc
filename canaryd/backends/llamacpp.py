"""Kind ``llamacpp``: a llama.cpp server (``llama-server``), probed through its OpenAI-compatible chat API.

Its ``system_fingerprint`` is only the build (``b<number>-<commit>``): a re-quantised GGUF behind the same
path, a new chat template or other server settings leave it unchanged. The snapshot therefore reads what
the server says about itself (tools/server/README.md):

- ``/health``: not ready (loading the model) means no snapshot, like a refused connection;
- ``/props``: build and commit (``llamacpp.*``), model path, alias and file type (``model.ftype``: "all F32",
  "Q8_0", …), the chat template (hashed: ``template.sha256``) with its capabilities, and the server
  settings (``engine.*``: context size, slots, enabled endpoints, every default sampling parameter);
- ``/v1/models``: the model's metadata (parameters, size in bytes, vocabulary, training context);
- ``/apply-template``: a fixed conversation rendered by the template (``template.prompt_sha256``): a
  template edit that renders the same prompt moves ``template.sha256`` alone;
- ``/metrics`` when the server enables it (``--metrics``): only the names of its series, since every
  value is a counter or a gauge.

Requests pin the sampling llama.cpp would otherwise fill from its launch defaults, and turn off prompt
caching, which the README says can change logits (prompt processing and generation batch differently).
"""

from __future__ import annotations

import hashlib
import re
from typing import Literal

from canaryd.backends import openai_compat
from canaryd.backends.base import BackendUnavailable, HttpSettings
from canaryd.backends.engine_info import nested, section
from canaryd.canaries import Canary
from canaryd.observation import ErrorKind

EXAMPLE = """\
# A llama.cpp server (llama-server). canaryd also reads /props, /v1/models, /apply-template and (with
# --metrics) /metrics to snapshot the build, the GGUF's file type, the chat template and the settings.
# [[backends]]
# name = "local-llamacpp"
# kind = "llamacpp"
# base_url = "http://127.0.0.1:8080/v1"
# model = "my-model"           # the --alias the server was started with
# api_key_env = "LLAMA_API_KEY" # if the server was started with --api-key
"""
ENGINE_VERSION_FIELD = "llamacpp.build"

# The conversation whose rendering is hashed (the same one the vLLM kind tokenizes).
TEMPLATE_PROBE = [
    {"role": "system", "content": "You are a canary."},
    {"role": "user", "content": "Say OK."},
]
_BUILD = re.compile(r"^b(\d+)-(\S+)$")
# /props keys that are not serving facts: per-start random (media_marker), state (is_sleeping), the web
# UI's own settings; the rest of /props is read key by key below.
_PROPS_READ = {
    "build_info",
    "model_path",
    "model_alias",
    "model_ftype",
    "modalities",
    "chat_template",
    "chat_template_tool_use",
    "chat_template_caps",
    "bos_token",
    "eos_token",
    "default_generation_settings",
}
_PROPS_SKIPPED = {"media_marker", "is_sleeping", "ui_settings"}
_METRIC_TYPE = re.compile(r"^# TYPE (\S+) \S+$", re.M)


class Settings(HttpSettings):
    kind: Literal["llamacpp"] = "llamacpp"


def sha16(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def props_fields(props: dict) -> dict[str, str]:
    """The stack fields of a ``/props`` body (pure: unit-tested on a recorded body)."""
    out: dict[str, str] = {}
    build = str(props.get("build_info", ""))
    m = _BUILD.match(build)
    if m:
        out["llamacpp.build"], out["llamacpp.commit"] = m.group(1), m.group(2)
    else:
        out["llamacpp.build_info"] = build
    out["model.path"] = str(props.get("model_path"))
    out["model.alias"] = str(props.get("model_alias"))
    out["model.ftype"] = str(props.get("model_ftype"))  # absent before llama.cpp reported it: "None"
    out.update(nested("model.modalities", props.get("modalities") or {}))
    template = props.get("chat_template")
    out["template.sha256"] = sha16(template) if isinstance(template, str) else "None"
    if isinstance(props.get("chat_template_tool_use"), str):
        out["template.tool_use_sha256"] = sha16(props["chat_template_tool_use"])
    out.update(nested("template.caps", props.get("chat_template_caps") or {}))
    out["template.bos_token"] = str(props.get("bos_token"))
    out["template.eos_token"] = str(props.get("eos_token"))
    settings = props.get("default_generation_settings") or {}
    out["engine.n_ctx"] = str(settings.get("n_ctx"))
    out.update(nested("engine", settings.get("params") or {}))
    # Everything else /props says (total_slots, endpoint_*, ui, ...) is a server setting.
    rest = {k: v for k, v in props.items() if k not in _PROPS_READ and k not in _PROPS_SKIPPED}
    out.update(nested("engine", rest))
    return out


def models_fields(models: dict, served: str) -> dict[str, str]:
    """The model's metadata from ``/v1/models`` (the card named ``served``, else the only one)."""
    cards = models["data"]
    card = next((c for c in cards if c.get("id") == served), cards[0] if len(cards) == 1 else None)
    if card is None:
        return {"model.error": f"no model {served!r} in /v1/models"}
    return {k: v for k, v in nested("model", card.get("meta") or {}).items() if k != "model.ftype"}


def metrics_fields(text: str) -> dict[str, str]:
    """Which series ``/metrics`` exposes (their values are counters and gauges, never a stack fact)."""
    return {"metrics.series": ",".join(sorted(set(_METRIC_TYPE.findall(text))))}


class Prober(openai_compat.Prober):
    kind = "llamacpp"
    cfg: Settings

    @property
    def root(self) -> str:
        return self.cfg.base_url.removesuffix("/v1")

    def extra_params(self, canary: Canary) -> dict:
        # The samplers llama.cpp applies by default (top-k 40, min-p 0.05, ...), off; no reuse of a
        # previous request's KV cache (cache_prompt: the README warns it can change results).
        return {"top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0, "cache_prompt": False}

    def snapshot(self) -> dict[str, str]:
        from httpx2 import HTTPStatusError

        fields = super().snapshot()
        try:
            self.call("GET", f"{self.root}/health")
        except HTTPStatusError as e:  # 503 while the model loads
            raise BackendUnavailable(
                ErrorKind.HTTP_5XX if e.response.status_code >= 500 else ErrorKind.HTTP_4XX,
                f"{self.root}/health: HTTP {e.response.status_code}, the server is not ready",
            ) from None
        props: dict[str, str] = section("llamacpp", lambda: props_fields(self._get("/props")))
        fields.update(props)
        fields.update(section("model", lambda: models_fields(self._get("/v1/models"), self.cfg.model)))
        fields.update(section("template", self._rendered))
        if props.get("engine.endpoint_metrics") == "true":
            fields.update(
                section("metrics", lambda: metrics_fields(self.call("GET", f"{self.root}/metrics").text))
            )
        return fields

    def _get(self, path: str) -> dict:
        body = self.call("GET", f"{self.root}{path}").json()
        if not isinstance(body, dict):
            raise TypeError(path)
        return body

    def _rendered(self) -> dict[str, str]:
        r = self.call("POST", f"{self.root}/apply-template", json={"messages": TEMPLATE_PROBE}).json()
        return {"template.prompt_sha256": sha16(r["prompt"])}
