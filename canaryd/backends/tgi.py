"""Kind ``tgi``: a Hugging Face Text Generation Inference server, probed through its OpenAI-compatible
chat API (``/v1/chat/completions``).

TGI's ``system_fingerprint`` is its version and Docker label, nothing about the weights. ``/info`` says more:
the model id and the Hub commit of its weights (``model_sha``), the dtype (TGI 1.x and 2.x report
``model_dtype``; 3.x no longer does), the device, the router's token and batch limits, and TGI's own
version and git commit. The limits and dtype are launch arguments (``--dtype``, ``--max-total-tokens`` …)
and become ``engine.*``; the weights are ``model.*``; the build is ``tgi.version`` / ``tgi.commit``.
"""

from __future__ import annotations

from typing import Literal

from canaryd.backends import openai_compat
from canaryd.backends.base import HttpSettings
from canaryd.backends.engine_info import flatten, obj, section

EXAMPLE = """\
# A Hugging Face TGI server (its Messages API). canaryd also reads /info (model_sha, dtype, version,
# token limits) to snapshot the stack.
# [[backends]]
# name = "local-tgi"
# kind = "tgi"
# base_url = "http://127.0.0.1:8080/v1"
# model = "tgi"               # TGI serves one model, whatever name is sent
"""
ENGINE_VERSION_FIELD = "tgi.version"

# /info keys with a field name of their own; every other key is a launch argument (``engine.<key>``).
RENAME = {
    "model_id": "model.id",
    "model_sha": "model.sha",
    "model_pipeline_tag": "model.pipeline_tag",
    "model_dtype": "engine.dtype",
    "model_device_type": "engine.device_type",
    "version": "tgi.version",
    "sha": "tgi.commit",
    "docker_label": "tgi.docker_label",
    "router": "tgi.router",
}


def info_fields(doc: dict) -> dict[str, str]:
    """``/info``'s body as stack fields (absent and null keys left out)."""
    return flatten(doc, "engine", rename=RENAME)


class Settings(HttpSettings):
    kind: Literal["tgi"] = "tgi"


class Prober(openai_compat.Prober):
    kind = "tgi"

    def snapshot(self) -> dict[str, str]:
        fields = super().snapshot()
        fields.update(section("tgi", lambda: info_fields(self._info())))
        return fields

    def _info(self) -> dict:
        return obj(self.call("GET", f"{self.cfg.base_url.removesuffix('/v1')}/info").json(), "/info")
