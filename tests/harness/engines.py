"""SGLang, TGI, Ollama (and, for detection, llama.cpp's, vLLM's and LiteLLM's own endpoints) replayed on
loopback from recorded real bodies (``tests/fixtures/engines/<engine>/``, each file naming its ``_source``):
the engine route table of the replay core (`tests.harness.replay`).

Each engine is served under its own prefix, with the paths the real server answers on:
``{replay.root("sglang")}/get_server_info``, ``{replay.base("tgi")}/chat/completions``. A chat answer gets the
text the test wants for the prompt (``answers``: prompt substring → answer) and the logprobs and usage that
text implies, in the envelope the engine recorded. ``edit`` scripts a change on the engine's side (a body's
field), ``restart`` what a restart changes without changing the stack (SGLang's random seed and live state,
Ollama's unload time), ``logprob_shift`` moves every logprob. Every request is recorded (`requests`).
"""

from __future__ import annotations

import copy
import json
import re
import threading
from typing import Any

from tests.harness.fixtures import load
from tests.harness.replay import Server, answer_for, entries, prompt_tokens, tokens, top_k

# (method, path under the engine's root) → recorded body; what is not here answers 404, as the engine does.
ROUTES: dict[str, dict[tuple[str, str], str]] = {
    "sglang": {
        ("GET", "/get_server_info"): "server_info",
        ("GET", "/get_model_info"): "model_info",
        ("POST", "/v1/chat/completions"): "chat",
    },
    "tgi": {("GET", "/info"): "info", ("POST", "/v1/chat/completions"): "chat"},
    "ollama": {
        ("GET", "/api/version"): "version",
        ("GET", "/api/tags"): "tags",
        ("POST", "/api/show"): "show",
        ("GET", "/api/ps"): "ps",
        ("POST", "/v1/chat/completions"): "chat",
    },
    "llamacpp": {("GET", "/props"): "props", ("GET", "/v1/models"): "models"},
    "vllm": {("GET", "/version"): "vllm-detect/version"},
    "litellm": {("GET", "/health/liveliness"): "litellm-detect/liveliness"},
}
# Entries of each engine's logprobs carry bytes, except TGI's (token, logprob, top_logprobs).
NO_BYTES = frozenset({"tgi"})


def fixture(engine: str, name: str) -> dict:
    """A recorded body: ``status``, ``headers``, ``body`` (``_source`` says where from)."""
    return load(f"engines/{name}" if "/" in name else f"engines/{engine}/{name}")


class EngineReplay(Server):
    def __init__(self, answers: dict[str, str] | None = None) -> None:
        self.answers = dict(answers or {})
        self.logprob_shift = 0.0
        self.requests: list[tuple[str, str, str]] = []  # (engine, method, path)
        self._lock = threading.Lock()
        self._recs = {
            e: {key: fixture(e, name) for key, name in routes.items()} for e, routes in ROUTES.items()
        }
        super().__init__()

    def root(self, engine: str) -> str:
        return f"{self.url}/{engine}"

    def base(self, engine: str) -> str:
        """The OpenAI-compatible ``base_url`` of a replayed engine."""
        return f"{self.url}/{engine}/v1"

    def body(self, engine: str, method: str, path: str) -> Any:
        """The recorded body an endpoint answers with (edit it in place, under `lock`)."""
        return self._recs[engine][(method, path)]["body"]

    def edit(self, engine: str, method: str, path: str, **fields: Any) -> None:
        """Change top-level fields of an endpoint's body from the next request on."""
        with self._lock:
            self.body(engine, method, path).update(fields)

    def restart(self) -> None:
        """What an unchanged restart changes: SGLang draws a new random seed and starts its live counters
        again, Ollama's loaded model gets a new unload time. The stack is the same."""
        with self._lock:
            info = self.body("sglang", "GET", "/get_server_info")
            info["random_seed"] += 1
            info["internal_states"][0]["last_gen_throughput"] = 0.0
            for m in self.body("ollama", "GET", "/api/ps")["models"]:
                m["expires_at"] = "2024-06-04T15:02:11.10204-07:00"

    def paths(self, engine: str) -> list[str]:
        with self._lock:
            return [p for e, _, p in self.requests if e == engine]

    # -- answering ----------------------------------------------------------------------------------
    def _answer(self, method: str, url: str, headers: Any, raw: bytes) -> tuple[int, dict[str, str], Any]:
        m = re.match(r"^/([^/]+)(/[^?]*)", url)
        engine, path = (m.group(1), m.group(2)) if m else ("", url)
        with self._lock:
            self.requests.append((engine, method, path))
            rec = self._recs.get(engine, {}).get((method, path))
            rec = copy.deepcopy(rec)
        if rec is None:
            return 404, {}, {"detail": "Not Found"}
        if path != "/v1/chat/completions":
            return rec["status"], rec["headers"], rec["body"]
        try:
            asked = json.loads(raw)
        except ValueError:
            return 400, {}, {"error": "bad JSON"}
        return 200, rec["headers"], self._chat(engine, rec["body"], asked)

    def _chat(self, engine: str, doc: dict, asked: dict) -> dict:
        content = asked["messages"][-1]["content"]
        text = answer_for(content, self.answers)
        answer = tokens(text)
        choice = doc["choices"][0]
        choice["message"]["content"] = text
        choice["finish_reason"] = "stop"
        if asked.get("logprobs"):
            lps = entries(answer, top_k(asked), self.logprob_shift, with_bytes=engine not in NO_BYTES)
            choice["logprobs"] = {"content": lps}
        else:
            choice["logprobs"] = None
        prompt = prompt_tokens(content)
        doc["usage"].update(
            prompt_tokens=prompt, completion_tokens=len(answer), total_tokens=prompt + len(answer)
        )
        return doc
