"""Which engine answers at a URL: each one's own introspection endpoint, asked with a few GETs.

`canaryd init --url` writes the matching kind's block and `canaryd doctor` proposes it, so that a backend is
watched by what its engine says about itself, not only as an ``openai`` endpoint. The endpoints tell the
engines apart by what only each returns:

- a LiteLLM proxy (a gateway, whatever is behind it): ``x-litellm-*`` headers on any answer, or
  ``/health/liveliness``' ``"I'm alive!"``;
- Ollama: ``/api/version``;
- llama.cpp's server: ``/props`` with ``default_generation_settings``;
- SGLang: ``/server_info`` (``/get_server_info`` before) with its server arguments;
- TGI: ``/info`` naming ``text-generation-router``, or its router limits;
- vLLM: ``/version``;
- else a plain OpenAI-compatible endpoint (``openai``).

`classify` is the pure part (answers in, verdict out); `detect` asks. Kinds are returned by name: a kind this
canaryd does not register (`canaryd.backends.KINDS`) is the caller's to fall back from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from canaryd.backends.ollama import CONSTANT_FINGERPRINT as OLLAMA_FINGERPRINT
from canaryd.errors import InputError

# GET paths under the server's root, in the order asked (``/get_server_info``: SGLang before 0.5.x).
PATHS = (
    "/api/version",
    "/props",
    "/server_info",
    "/get_server_info",
    "/info",
    "/version",
    "/health/liveliness",
)
TIMEOUT_S = 5.0
# system_fingerprints an engine sends whatever it serves: no identity, whoever reads them.
CONSTANT_FINGERPRINTS = {OLLAMA_FINGERPRINT: "Ollama"}


def constant_fingerprint(fingerprint: str | None) -> str | None:
    """The engine that sends ``fingerprint`` as a constant (it then names nothing), else None."""
    return CONSTANT_FINGERPRINTS.get(fingerprint) if fingerprint else None


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]  # lower-case names
    doc: Any  # the parsed JSON body, None when it was not JSON


@dataclass(frozen=True)
class Detection:
    kind: str
    evidence: str  # what said so, one line
    model: str | None = None  # the first model /v1/models names, when it answers

    def as_dict(self) -> dict[str, str | None]:
        return {"kind": self.kind, "evidence": self.evidence, "model": self.model}


def _ok(answers: dict[str, Answer], path: str) -> Any:
    a = answers.get(path)
    return a.doc if a is not None and a.status == 200 else None


def classify(answers: dict[str, Answer], model: str | None = None) -> Detection:
    """The engine the answers (path → `Answer`) point to, with the evidence."""
    for path, a in answers.items():
        litellm = sorted(h for h in a.headers if h.startswith("x-litellm-"))
        if litellm:
            return Detection("litellm", f"{path} answered with {litellm[0]}: {a.headers[litellm[0]]}", model)
    if _ok(answers, "/health/liveliness") == "I'm alive!":
        return Detection("litellm", '/health/liveliness answered "I\'m alive!" (LiteLLM proxy)', model)
    version = _ok(answers, "/api/version")
    if isinstance(version, dict) and isinstance(version.get("version"), str):
        return Detection("ollama", f"/api/version: Ollama {version['version']}", model)
    props = _ok(answers, "/props")
    if isinstance(props, dict) and isinstance(props.get("default_generation_settings"), dict):
        build = props.get("build_info")
        return Detection("llamacpp", f"/props with default_generation_settings (build {build})", model)
    for path in ("/server_info", "/get_server_info"):
        info = _ok(answers, path)
        if isinstance(info, dict) and {"tp_size", "attention_backend"} & info.keys():
            return Detection("sglang", f"{path}: SGLang server args (version {info.get('version')})", model)
    info = _ok(answers, "/info")
    if isinstance(info, dict) and (
        info.get("router") == "text-generation-router"
        or {"model_id", "max_total_tokens", "validation_workers"} <= info.keys()
    ):
        return Detection("tgi", f"/info: TGI {info.get('version')} serving {info.get('model_id')}", model)
    version = _ok(answers, "/version")
    if isinstance(version, dict) and isinstance(version.get("version"), str):
        return Detection("vllm", f"/version: vLLM {version['version']}", model)
    return Detection("openai", "no engine's own endpoint answered: a plain OpenAI-compatible API", model)


def root_of(url: str) -> str:
    """The server's root for a base URL given with or without ``/v1``."""
    return url.rstrip("/").removesuffix("/v1")


def detect(url: str, *, api_key: str | None = None, timeout_s: float = TIMEOUT_S) -> Detection:
    """Ask the server at ``url`` (its root or its ``/v1`` base URL) which engine it is. A server that
    cannot be reached at all is an `InputError` naming the URL."""
    import httpx2

    from canaryd.backends import transport

    root = root_of(url)
    headers = {"Accept": "application/json"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
    http = transport.client(timeout_s=timeout_s, connect_timeout_s=timeout_s, connections=2, headers=headers)
    answers: dict[str, Answer] = {}
    try:
        for path in (*PATHS, "/v1/models"):
            if path == "/get_server_info" and getattr(answers.get("/server_info"), "status", 404) != 404:
                continue
            try:
                r = transport.exchange(http, "GET", f"{root}{path}", timeout_s=timeout_s, max_bytes=1 << 20)
            except (
                httpx2.TransportError,
                transport.DeadlinePassed,
                transport.TooLarge,
                transport.BadEncoding,
            ) as e:
                if not answers:  # the first request: nothing answers there at all
                    raise InputError(f"{root}: cannot reach it ({e.__class__.__name__}: {e})") from None
                continue
            try:
                doc = json.loads(r.text)
            except ValueError:
                doc = None
            answers[path] = Answer(r.status, {k.lower(): v for k, v in r.headers.items()}, doc)
    finally:
        http.close()
    models = answers.pop("/v1/models", None)
    data = (
        models.doc.get("data") if models and models.status == 200 and isinstance(models.doc, dict) else None
    )
    first = data[0].get("id") if isinstance(data, list) and data and isinstance(data[0], dict) else None
    return classify(answers, str(first) if first is not None else None)
