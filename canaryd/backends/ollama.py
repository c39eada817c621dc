"""Kind ``ollama``: an Ollama server, probed through its OpenAI-compatible chat API (``/v1``).

Ollama answers every request with the same ``system_fingerprint``, ``fp_ollama``: a constant, which names
no build, no weights and no settings. It is not recorded as a fingerprint (an observation from Ollama
has none), so nothing can take it for a serving identity. What identifies the stack is on the native API:

- ``/api/version``: ``ollama.version``;
- ``/api/tags``: the digest of the model's manifest (``model.digest``), which moves with any change to its
  weights, template, parameters or system prompt;
- ``/api/show``: the weights' family, size, format and quantization (``model.*``, ``model.info.*`` from
  the GGUF metadata), the chat template and system prompt (``template.sha256``,
  ``template.system_sha256``) and the Modelfile parameters Ollama runs the model with (``num_ctx``,
  ``stop``, ``temperature`` … as ``engine.*``: the OpenAI API cannot override most of them);
- ``/api/ps``: the model only while it is loaded, so only a mismatch is recorded: ``model.loaded_digest``
  when the running copy is not the one ``/api/tags`` lists (a pull or re-create not yet picked up).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from typing import Literal

from canaryd.backends import openai_compat
from canaryd.backends.base import HttpSettings
from canaryd.backends.engine_info import flatten, obj, section, text
from canaryd.canaries import Canary
from canaryd.observation import Observation

EXAMPLE = """\
# An Ollama server (its OpenAI-compatible API under /v1). canaryd also reads /api/version, /api/tags
# (the model digest), /api/show (quantization, template, parameters) and /api/ps.
# [[backends]]
# name = "local-ollama"
# kind = "ollama"
# base_url = "http://127.0.0.1:11434/v1"
# model = "llama3.2"
"""
ENGINE_VERSION_FIELD = "ollama.version"
CONSTANT_FINGERPRINT = "fp_ollama"  # what Ollama sends as system_fingerprint, whatever it serves


def tagged(name: str) -> str:
    """A model name as ``/api/tags`` lists it (``llama3`` is ``llama3:latest``)."""
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


def digest_of(tags: dict, model: str) -> dict[str, str]:
    """``model.digest`` of ``model`` in ``/api/tags``' body; ``model.error`` when it is not listed."""
    for entry in tags.get("models") or ():
        if isinstance(entry, dict) and tagged(str(entry.get("name"))) == tagged(model):
            return {"model.digest": text(entry["digest"])}
    return {"model.error": f"{model!r} is not in /api/tags"}


def loaded_mismatch(ps: dict, model: str, digest: str | None) -> dict[str, str]:
    """``model.loaded_digest`` when ``/api/ps`` shows ``model`` loaded from another manifest than
    ``digest``; nothing when it matches or is not loaded (loading comes and goes, the stack does not)."""
    for entry in ps.get("models") or ():
        if isinstance(entry, dict) and tagged(str(entry.get("name"))) == tagged(model):
            loaded = text(entry.get("digest"))
            return {"model.loaded_digest": loaded} if digest and loaded != digest else {}
    return {}


def parameters(block: str) -> dict[str, str]:
    """The Modelfile parameters ``/api/show`` lists (``key  value`` lines; ``stop`` repeated) as
    ``engine.<key>``; a repeated key keeps every value, in order, as a JSON list."""
    seen: dict[str, list[str]] = {}
    for line in block.splitlines():
        key, _, value = line.strip().partition(" ")
        value = value.strip()
        if not key or not value:
            continue
        if value.startswith('"'):
            with contextlib.suppress(ValueError):  # a quoted value, as Modelfiles quote stop strings
                value = str(json.loads(value))
        seen.setdefault(key, []).append(value)
    return flatten({k: v[0] if len(v) == 1 else v for k, v in seen.items()}, "engine")


def _sha(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:16]


def show_fields(doc: dict) -> dict[str, str]:
    """``/api/show``'s body as stack fields. The Modelfile text, license and modification time are left
    out: the manifest digest already moves with them, and the time moves on a copy too."""
    details = obj(doc.get("details") or {}, "details")
    fields = flatten(
        {k: v for k, v in details.items() if v not in ("", [])},
        "model",
        rename={"quantization_level": "model.quantization"},
    )
    info = obj(doc.get("model_info") or {}, "model_info")
    scalars = {k: v for k, v in info.items() if not isinstance(v, list | dict)}
    fields.update(flatten(scalars, "model.info"))
    if "general.file_type" in info:
        fields["model.file_type"] = text(info["general.file_type"])
    if isinstance(doc.get("template"), str):
        fields["template.sha256"] = _sha(doc["template"])
    if isinstance(doc.get("system"), str):
        fields["template.system_sha256"] = _sha(doc["system"])
    if isinstance(doc.get("parameters"), str):
        fields.update(parameters(doc["parameters"]))
    if doc.get("capabilities"):
        fields["model.capabilities"] = text(doc["capabilities"])
    return fields


class Settings(HttpSettings):
    kind: Literal["ollama"] = "ollama"


class Prober(openai_compat.Prober):
    kind = "ollama"

    @property
    def root(self) -> str:
        return self.cfg.base_url.removesuffix("/v1")

    def snapshot(self) -> dict[str, str]:
        fields = super().snapshot()
        model = self.cfg.model
        fields.update(
            section("ollama", lambda: {"ollama.version": text(self._get("/api/version")["version"])})
        )
        # one section per endpoint: each failure is its own field (tags.error, show.error, ps.error)
        fields.update(section("tags", lambda: digest_of(self._get("/api/tags"), model)))
        fields.update(section("show", lambda: show_fields(self._show(model))))
        digest = fields.get("model.digest")
        fields.update(section("ps", lambda: loaded_mismatch(self._get("/api/ps"), model, digest)))
        return fields

    def _show(self, model: str) -> dict:
        return obj(self.call("POST", f"{self.root}/api/show", json={"model": model}).json(), "/api/show")

    def _get(self, path: str) -> dict:
        return obj(self.call("GET", f"{self.root}{path}").json(), path)

    def response_stack(self, r, headers) -> dict[str, str]:
        fields = super().response_stack(r, headers)
        if fields.get("response.system_fingerprint") == CONSTANT_FINGERPRINT:
            del fields["response.system_fingerprint"]
        return fields

    def attempt(self, canary: Canary) -> Observation:
        obs = super().attempt(canary)
        if obs.system_fingerprint == CONSTANT_FINGERPRINT:
            obs.system_fingerprint = None  # a constant is no identity: recorded as no fingerprint
        return obs
