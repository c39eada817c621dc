"""Kind ``sglang``: an SGLang server, probed through its OpenAI-compatible chat API.

SGLang's ``system_fingerprint`` is null, so its answers say nothing of the stack. Its native API does:
``/server_info`` (``/get_server_info`` before it was renamed) returns every server argument (dtype,
quantization, kv-cache dtype, attention and sampling backends, tp/dp/pp sizes, deterministic inference,
chunked prefill, CUDA graphs…) and ``/model_info`` (``/get_model_info``) the weights and tokenizer it loaded.
Each server argument becomes ``engine.<arg>``; the memory pool sizes SGLang derives from them become
``sglang.*`` (consequences, ranked after the arguments); the build is ``sglang.version``.

Left out: credentials (``api_key``, ``admin_api_key``, any ``*_key``/``*_token``), the listen address,
the seed SGLang draws at random when none is given, and the scheduler's live state (``status``,
``internal_states``: throughput, memory use), which change without the stack changing.
"""

from __future__ import annotations

from typing import Literal

from canaryd.backends import openai_compat
from canaryd.backends.base import HttpSettings
from canaryd.backends.engine_info import flatten, obj, section, text
from canaryd.canaries import Canary

EXAMPLE = """\
# An SGLang server. canaryd also reads /server_info (every server argument: dtype, quantization,
# attention backend, tp size, deterministic inference ...) and /model_info to snapshot the stack.
# [[backends]]
# name = "local-sglang"
# kind = "sglang"
# base_url = "http://127.0.0.1:30000/v1"
# model = "qwen/qwen2.5-0.5b-instruct"   # the served model name
# api_key_env = "SGLANG_API_KEY"          # if the server was started with --api-key
"""
ENGINE_VERSION_FIELD = "sglang.version"

# Reported, but not a property of the stack: where it listens, its random default seed, its live state.
VOLATILE = frozenset(
    {"host", "port", "nccl_port", "random_seed", "status", "internal_states", "last_gen_throughput"}
    | {"memory_usage"}
)
# Sizes SGLang derives from the arguments and the memory it found: consequences, not causes.
DERIVED = frozenset({"max_total_num_tokens", "max_req_input_len"})


def server_info_fields(doc: dict) -> dict[str, str]:
    """``/server_info``'s body as stack fields: ``engine.<arg>`` per server argument, the derived sizes as
    ``sglang.<name>``, the build as ``sglang.version``."""
    fields = flatten(doc, "engine", skip=VOLATILE | DERIVED | {"version"})
    fields.update(flatten({k: doc.get(k) for k in DERIVED}, "sglang"))
    if doc.get("version") is not None:
        fields["sglang.version"] = text(doc["version"])
    return fields


def model_info_fields(doc: dict) -> dict[str, str]:
    """``/model_info``'s body as ``model.<field>`` (``model_path`` → ``model.path``)."""
    return flatten({k.removeprefix("model_"): v for k, v in doc.items()}, "model")


class Settings(HttpSettings):
    kind: Literal["sglang"] = "sglang"


class Prober(openai_compat.Prober):
    kind = "sglang"

    @property
    def root(self) -> str:
        return self.cfg.base_url.removesuffix("/v1")

    def extra_params(self, canary: Canary) -> dict:
        # SGLang fills unset sampling parameters from the model's generation_config.json
        # (sampling_defaults = "model"): pin them, as for vLLM.
        return {"top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}

    def snapshot(self) -> dict[str, str]:
        fields = super().snapshot()
        fields.update(section("engine", lambda: server_info_fields(self._native("server_info"))))
        fields.update(section("model", lambda: model_info_fields(self._native("model_info"))))
        return fields

    def _native(self, name: str) -> dict:
        """A native endpoint's body: ``/<name>``, else (404) ``/get_<name>``, its name on older servers."""
        from httpx2 import HTTPStatusError

        try:
            doc = self.call("GET", f"{self.root}/{name}").json()
        except HTTPStatusError as e:
            if e.response.status_code != 404:
                raise
            doc = self.call("GET", f"{self.root}/get_{name}").json()
        return obj(doc, f"/{name}")
