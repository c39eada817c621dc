"""Kind ``vllm``: a vLLM OpenAI-compatible server, which tells much more about itself than a cloud API.

vLLM's ``system_fingerprint`` ignores the seed, enforce-eager, prefix caching and batch-invariant mode
and names no GPU, so an unchanged fingerprint is not an unchanged stack. The snapshot therefore also
reads ``/version``, ``/v1/models``, every ``*_info`` series on ``/metrics`` (their labels carry the
cache config: kv-cache dtype, block size, number of blocks — a proxy for memory and hardware) and the
token ids ``/tokenize`` gives a fixed chat, which moves when the tokenizer or chat template does.
"""

from __future__ import annotations

import hashlib
import re

import httpx2

from canaryd.backends.openai_compat import OpenAICompatBackend
from canaryd.canaries import Canary

# A fixed conversation whose rendering is hashed: any tokenizer or chat-template change moves it.
TEMPLATE_PROBE = [
    {"role": "system", "content": "You are a canary."},
    {"role": "user", "content": "Say OK."},
]
_INFO_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*_info)\{(.*)\}\s+\S+$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
# Labels of *_info series that change without the stack changing.
_VOLATILE_LABELS = {"engine"}


def info_series(metrics_text: str) -> dict[str, str]:
    """Label sets of every ``*_info`` series in a Prometheus exposition, flattened to dotted keys."""
    out: dict[str, str] = {}
    for line in metrics_text.splitlines():
        m = _INFO_LINE.match(line)
        if not m:
            continue
        for label, value in _LABEL.findall(m.group(2)):
            if label not in _VOLATILE_LABELS:
                out[f"metrics.{m.group(1)}.{label}"] = value.replace('\\"', '"').replace("\\\\", "\\")
    return out


class VLLMServerBackend(OpenAICompatBackend):
    kind = "vllm"

    @property
    def root(self) -> str:
        return self.cfg.base_url.removesuffix("/v1")

    def extra_params(self, canary: Canary) -> dict:
        # vLLM fills unspecified sampling params from the model's generation_config.json: pin them all.
        # Tokens come back as "token_id:N": vLLM renders partial UTF-8 byte tokens as "", which would make
        # different tokens (and top-k alternatives) look equal.
        return {
            "top_k": -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }

    def snapshot(self) -> dict[str, str]:
        fields = super().snapshot()
        fields.update(self._section("vllm", self._version))
        fields.update(self._section("models", self._models))
        fields.update(self._section("metrics", self._metrics))
        fields.update(self._section("template", self._template))
        return fields

    def _section(self, name: str, read) -> dict[str, str]:
        """One introspection endpoint; an HTTP error is recorded as a field (it is a change too)."""
        try:
            return read()
        except httpx2.HTTPStatusError as e:
            return {f"{name}.error": f"HTTP {e.response.status_code}"}
        except (ValueError, KeyError, TypeError) as e:
            return {f"{name}.error": f"unreadable: {e.__class__.__name__}"}

    def _version(self) -> dict[str, str]:
        return {"vllm.version": str(self.request("GET", f"{self.root}/version").json()["version"])}

    def _models(self) -> dict[str, str]:
        cards = self.request("GET", f"{self.cfg.base_url}/models").json()["data"]
        out = {"models.served": ",".join(sorted(str(c["id"]) for c in cards))}
        for card in cards:
            if card["id"] == self.cfg.model:
                for key in ("root", "parent", "max_model_len", "owned_by"):
                    out[f"models.{key}"] = str(card.get(key))
        return out

    def _metrics(self) -> dict[str, str]:
        return info_series(self.request("GET", f"{self.root}/metrics").text)

    def _template(self) -> dict[str, str]:
        r = self.request(
            "POST",
            f"{self.root}/tokenize",
            json={"model": self.cfg.model, "messages": TEMPLATE_PROBE, "add_generation_prompt": True},
        ).json()
        ids = [int(t) for t in r["tokens"]]
        return {
            "template.tokens_sha256": hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16],
            "template.token_count": str(len(ids)),
        }
