"""SGLang, TGI, Ollama (and, for detection, llama.cpp's, vLLM's and LiteLLM's own endpoints) replayed on
loopback from recorded real bodies (``tests/fixtures/engines/<engine>/``, each file naming its ``_source``).

Each engine is served under its own prefix, with the paths the real server answers on:
``{replay.root("sglang")}/get_server_info``, ``{replay.base("tgi")}/chat/completions``. A chat answer gets the
text the test wants for the prompt (``answers``: prompt substring → answer) and the logprobs and usage that
text implies, in the envelope the engine recorded. ``edit`` scripts a change on the engine's side (a body's
field), ``restart`` what a restart changes without changing the stack (SGLang's random seed and live state,
Ollama's unload time), ``shift`` moves every logprob. Every request is recorded (`requests`).
"""

from __future__ import annotations

import copy
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).parent / "fixtures" / "engines"

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
    "llamacpp": {("GET", "/props"): "llamacpp-detect/props", ("GET", "/v1/models"): "llamacpp-detect/models"},
    "vllm": {("GET", "/version"): "vllm-detect/version"},
    "litellm": {("GET", "/health/liveliness"): "litellm-detect/liveliness"},
}
# Entries of each engine's logprobs carry bytes, except TGI's (token, logprob, top_logprobs).
NO_BYTES = frozenset({"tgi"})


def fixture(engine: str, name: str) -> dict:
    """A recorded body: ``status``, ``headers``, ``body`` (``_source`` says where from)."""
    path = name if "/" in name else f"{engine}/{name}"
    return json.loads((FIXTURES / f"{path}.json").read_text())


class EngineReplay:
    def __init__(self, answers: dict[str, str] | None = None) -> None:
        self.answers = dict(answers or {})
        self.logprob_shift = 0.0
        self.requests: list[tuple[str, str, str]] = []  # (engine, method, path)
        self._lock = threading.Lock()
        self._recs = {
            e: {key: fixture(e, name) for key, name in routes.items()} for e, routes in ROUTES.items()
        }
        replay = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body go out in two writes: no 40 ms ACK wait

            def log_message(self, *args: object) -> None:
                pass

            def _serve(self, method: str) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status, headers, body = replay._answer(method, self.path, raw)
                out = json.dumps(body).encode()
                self.send_response(status)
                for k, v in {"Content-Type": "application/json", **headers}.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def do_GET(self) -> None:
                self._serve("GET")

            def do_POST(self) -> None:
                self._serve("POST")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True).start()

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

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> EngineReplay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- answering ----------------------------------------------------------------------------------
    def _answer(self, method: str, url: str, raw: bytes) -> tuple[int, dict[str, str], Any]:
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
        text = next((a for k, a in self.answers.items() if k in content), "OK")
        tokens = re.findall(r"\s*\S+", text) or [text]
        choice = doc["choices"][0]
        choice["message"]["content"] = text
        choice["finish_reason"] = "stop"
        if asked.get("logprobs"):
            k = int(asked.get("top_logprobs") or 0)
            choice["logprobs"] = {"content": [self._entry(engine, t, i, k) for i, t in enumerate(tokens)]}
        else:
            choice["logprobs"] = None
        prompt = 8 + len(content.split())
        doc["usage"].update(
            prompt_tokens=prompt, completion_tokens=len(tokens), total_tokens=prompt + len(tokens)
        )
        return doc

    def _entry(self, engine: str, token: str, i: int, k: int) -> dict:
        lp = round(-0.01 * (i + 1) + self.logprob_shift, 6)
        alts = [(token, lp)] + [(f"{token.strip()}~{j}", lp - j) for j in range(1, k)]

        def one(t: str, v: float) -> dict:
            return (
                {"token": t, "logprob": v}
                if engine in NO_BYTES
                else {"token": t, "logprob": v, "bytes": list(t.encode())}
            )

        return {**one(token, lp), "top_logprobs": [one(t, v) for t, v in alts[:k]]}
