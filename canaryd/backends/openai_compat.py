"""Kind ``openai``: any OpenAI-compatible API (OpenAI, OpenRouter, Together, SGLang, llama.cpp server …).

Requests go out through `transport.exchange` (plain `httpx2`), not the official ``openai`` SDK: ``timeout_s``
is a deadline for the whole request (connect, send, every read, however slowly the server drips) and the
body is read under ``max_response_bytes``, neither of which the SDK can enforce (its timeouts bound each
read; a server sending a byte a second held a ``check`` with ``timeout_s = 5`` for 130 s), and the SDK adds
its own per-request cost (request building, validation, headers) for nothing canaryd uses. Nothing is
retried here: the shared `Resilient` wrapper retries, visibly. The body sent is the JSON the SDK sent, key
for key and byte for byte (`wire_body`); the body received is parsed by `openai_wire`, so a malformed one is
a named error.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from canaryd import __version__
from canaryd.backends import openai_headers, refusals
from canaryd.backends import openai_wire as wire
from canaryd.backends.base import BackendUnavailable, HttpSettings, log
from canaryd.backends.openai_request import SDK_PARAMS, request_body, request_hash
from canaryd.backends.profile import DEFAULT, RequestProfile
from canaryd.canaries import Canary
from canaryd.lazy import lazy_import
from canaryd.observation import ErrorKind, Observation, canonical_digest, storable, utcnow

httpx2 = lazy_import("httpx2")  # a probe's, not a config check's: `canaryd validate` stays fast
transport = lazy_import("canaryd.backends.transport")

EXAMPLE = """\
# Any OpenAI-compatible API: OpenAI, OpenRouter, Together, SGLang, llama.cpp server ...
# The key is read from the environment variable named here (or from api_key_file, e.g. a systemd
# credential); it never goes in this file, the database, the logs or the metrics.
# [[backends]]
# name = "openai-gpt"
# kind = "openai"
# base_url = "https://api.openai.com/v1"
# model = "gpt-4.1-mini"
# api_key_env = "OPENAI_API_KEY"
# preset = "openai-chat"      # what the provider accepts: openai-reasoning, azure, anthropic-compat,
#                             # gemini-compat, openrouter, groq, together, fireworks, deepseek, mistral, xai
# [backends.request]          # keys here override the preset's (docs/profiles.md)
# logprobs = "prefer"         # require | prefer (answers without them are judged on text) | off
# extra_body = { reasoning_effort = "low" }
"""


class Settings(HttpSettings):
    kind: Literal["openai"] = "openai"


def _user_agent() -> str:
    return f"canaryd/{__version__}"


PREPARED_MAX = 1024  # canaries whose request a prober keeps built


@dataclass(frozen=True, slots=True)
class Prepared:
    """A canary's request as sent: body, its two digests (the baseline key ``hash``, the stored body's key
    ``ref``), bytes on the wire, URL, and the parser of its answer."""

    body: dict
    hash: str
    ref: str
    content: bytes
    url: str
    parse: Callable[[Any], wire.Parsed]


class Prober:
    """The serving side is known only by what responses say about themselves."""

    kind = "openai"
    # Set by the `Resilient` wrapper: once set, introspection calls are no longer made (the daemon stops).
    stopping: threading.Event | None = None

    def __init__(self, cfg: HttpSettings) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.concurrency = cfg.concurrency
        self.profile = cfg.profile
        self._key = cfg.api_key()
        self._requests: dict[Canary, Prepared] = {}  # a plain dict: a race only builds a body twice
        self._dropped_logged = False  # a gateway dropping logprobs is logged once, not per answer
        headers = {"Accept": "application/json", "User-Agent": _user_agent()}
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        self.http = transport.client(
            timeout_s=cfg.timeout_s,
            connect_timeout_s=cfg.connect_timeout_s,
            connections=cfg.concurrency + 2,
            headers=headers,
        )

    def close(self) -> None:
        self.http.close()

    # -- the stack ----------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, str]:
        fields = {"backend.kind": self.kind, "request.model": self.cfg.model}
        if self.profile != DEFAULT:  # absent by default, so stacks recorded before profiles still match
            fields["request.profile"] = self.profile.digest()
        return fields

    def response_stack(self, r: wire.Parsed, headers: httpx2.Headers) -> dict[str, str]:
        """Per-response serving facts: they join the backend snapshot in the observation's stack."""
        return openai_headers.reply_fields(r.model, r.system_fingerprint, r.service_tier, r.provider, headers)

    def gateway_logprobs(self, obs: Observation, r: wire.Parsed, asked: bool) -> None:
        """Through a gateway (LiteLLM's headers, OpenRouter's ``provider``), whether the logprobs asked for
        came back, as the stack field ``gateway.logprobs``: a gateway that drops them (LiteLLM's
        ``drop_params``, an upstream that has none) is a stack change, never an unexplained ``identical``,
        and is logged once per backend."""
        if not asked or not (r.provider is not None or any(k.startswith("gateway.") for k in obs.stack)):
            return
        obs.stack["gateway.logprobs"] = "passed" if r.tokens is not None else "dropped"
        if r.tokens is None and not self._dropped_logged:
            self._dropped_logged = True
            via = obs.stack.get("gateway.model_name") or obs.stack.get("response.provider") or "?"
            log.warning(
                "gateway_dropped_logprobs",
                backend=self.name,
                upstream=via,
                consequence="answers are judged on their text; stack field gateway.logprobs = dropped",
            )

    # -- probing ------------------------------------------------------------------------------------
    def extra_params(self, canary: Canary) -> dict:
        """Engine-specific request fields (none for the generic OpenAI API)."""
        return {}

    def request(self, canary: Canary) -> dict:
        """The body sent for ``canary``: one object per canary, shared by its observations (never changed)."""
        return self._prepared(canary).body

    def request_hash(self, canary: Canary) -> str:
        return self._prepared(canary).hash

    def body(self, canary: Canary, profile: RequestProfile) -> dict:
        """The body for ``canary`` under ``profile``, before the profile's ``extra_body``."""
        return {**request_body(self.cfg.model, canary, profile), **self.extra_params(canary)}

    def route(self, canary: Canary) -> tuple[str, Callable[[Any], wire.Parsed]]:
        """Where the canary's request goes, and the parser of the answer."""
        if canary.messages is not None:
            return f"{self.cfg.base_url}/chat/completions", wire.parse_chat
        return f"{self.cfg.base_url}/completions", wire.parse_completion

    def _prepared(self, canary: Canary) -> Prepared:
        """The canary's request, built once: a canary's body is the same every cycle, and building it
        (a model dump, JSON encodings, its two digests) cost more than parsing the answer. Canaries are
        frozen and hashable; a chain's steps (new text each cycle) only fill the map, which is emptied when
        full.

        The hash is the default profile's body: what the canary decides. A profile change keeps the
        baseline and shows as the stack field ``request.profile``, not as a new canary."""
        hit = self._requests.get(canary)
        if hit is None:
            body = {**self.body(canary, self.profile), **self.profile.extra_body}
            canonical = body if self.profile == DEFAULT else self.body(canary, DEFAULT)
            digests = request_hash(canonical), canonical_digest(body)
            hit = Prepared(body, *digests, wire_body(body), *self.route(canary))
            if len(self._requests) >= PREPARED_MAX:
                self._requests.clear()
            self._requests[canary] = hit
        return hit

    def attempt(self, canary: Canary) -> Observation:
        req = self._prepared(canary)
        obs = Observation(
            self.name, canary.id, canary.suite, utcnow(), req.body, req.hash, request_ref=req.ref
        )
        parse, t0 = req.parse, time.perf_counter()
        try:
            reply = self.exchange("POST", req.url, content=req.content, headers=JSON)
            obs.latency_s = time.perf_counter() - t0
            obs.headers = openai_headers.kept_headers(reply.headers.items())
            if not 200 <= reply.status < 300:
                obs.error_kind, message = refusals.classify(reply.status, reply.text, self.name)
                obs.error = storable(self.redact(message))
                return obs
            r = parse(wire.parse_json(reply.body))
            obs.text, obs.system_fingerprint, obs.response_model = r.text, r.system_fingerprint, r.model
            obs.tool_calls = r.tool_calls
            obs.finish_reason, obs.prompt_tokens, obs.completion_tokens, obs.reasoning_tokens = (
                r.finish_reason,
                r.prompt_tokens,
                r.completion_tokens,
                r.reasoning_tokens,
            )
            obs.stack = self.response_stack(r, reply.headers)
            self.gateway_logprobs(obs, r, asked=bool(req.body.get("logprobs")))
            if r.tokens is not None and self.profile.logprobs != "off":
                obs.tokens = r.tokens
            elif self.profile.logprobs == "require":
                obs.error_kind, obs.error = ErrorKind.NO_LOGPROBS, "response carries no logprobs"
            else:  # judged on its text, usage and stack
                obs.has_logprobs = False
        except (wire.InvalidResponse, transport.BadEncoding) as e:
            obs.error_kind, obs.error = ErrorKind.INVALID_RESPONSE, str(e)
        except transport.DeadlinePassed as e:
            obs.error_kind, obs.error = ErrorKind.TIMEOUT, str(e)
        except transport.TooLarge as e:
            obs.error_kind, obs.error = ErrorKind.TOO_LARGE, str(e)
        except httpx2.TransportError as e:
            obs.error_kind, obs.error = transport_kind(e), storable(self.redact(_describe(e)))
        finally:
            obs.latency_s = obs.latency_s or time.perf_counter() - t0
        return obs

    def exchange(self, method: str, url: str, **kwargs: Any) -> transport.Reply:
        """One request within ``timeout_s`` and ``max_response_bytes`` (see `transport.exchange`)."""
        return transport.exchange(
            self.http,
            method,
            url,
            timeout_s=self.cfg.timeout_s,
            max_bytes=self.cfg.max_response_bytes,
            **kwargs,
        )

    def post(self, url: str, body: dict) -> tuple[int, str]:
        """``body`` POSTed as a probe's is (its wire form, the key, the deadline and the cap): the status
        and the redacted text. No answer at all raises `ConnectionError` with its redacted cause, one line."""
        try:
            r = self.exchange("POST", url, content=wire_body(body), headers=JSON)
        except (
            transport.DeadlinePassed,
            transport.TooLarge,
            transport.BadEncoding,
            httpx2.TransportError,
        ) as e:
            why = str(e).splitlines()[0] if str(e) else e.__class__.__name__
            raise ConnectionError(self.redact(why)) from None
        return r.status, self.redact(r.text)

    def redact(self, message: str) -> str:
        """Belt and braces: a server that echoes our key back must not get it into the store."""
        return message.replace(self._key, "<redacted>") if self._key else message

    def call(self, method: str, url: str, **kwargs: Any) -> httpx2.Response:
        """A raw call to an introspection endpoint, under the same deadline and cap as a probe; a failure
        to get an answer means the backend is unavailable, an HTTP error status raises `HTTPStatusError`."""
        if self.stopping is not None and self.stopping.is_set():
            raise BackendUnavailable(ErrorKind.STOPPED, f"{url}: not called, canaryd is stopping")
        try:
            reply = self.exchange(method, url, **kwargs)
        except transport.DeadlinePassed as e:
            raise BackendUnavailable(ErrorKind.TIMEOUT, f"{url}: {e}") from None
        except transport.TooLarge as e:
            raise BackendUnavailable(ErrorKind.TOO_LARGE, f"{url}: {e}") from None
        except transport.BadEncoding as e:
            raise BackendUnavailable(ErrorKind.INVALID_RESPONSE, f"{url}: {e}") from None
        except httpx2.TimeoutException as e:
            raise BackendUnavailable(
                ErrorKind.TIMEOUT, f"{url}: timed out ({e.__class__.__name__})"
            ) from None
        except httpx2.TransportError as e:
            raise BackendUnavailable(
                ErrorKind.CONNECT, f"{url}: {self.redact(str(e)) or e.__class__.__name__}"
            ) from None
        skip = ("content-encoding", "content-length", "transfer-encoding")  # the body is inflated and whole
        headers = [(k, v) for k, v in reply.headers.multi_items() if k.lower() not in skip]
        r = httpx2.Response(reply.status, headers=headers, content=reply.body, request=reply.request)
        r.raise_for_status()
        return r


JSON = {"Content-Type": "application/json"}


def wire_body(body: dict) -> bytes:
    """The request body as the ``openai`` SDK serialised it (so requests did not change when canaryd
    stopped using it): the model and the messages or prompt first, then the SDK's own parameters in
    alphabetical order, then the rest (``extra_body``) in the order given; compact UTF-8 JSON."""
    first = [k for k in ("model", "messages", "prompt", "input") if k in body]
    sdk = sorted(k for k in body if k in SDK_PARAMS and k not in first)
    extra = [k for k in body if k not in SDK_PARAMS]
    ordered = {k: body[k] for k in (*first, *sdk, *extra)}
    return json.dumps(ordered, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")


def transport_kind(e: httpx2.TransportError) -> ErrorKind:
    """A failure to get a whole answer: a timeout, a connection cut mid-answer, or no connection at all."""
    if isinstance(e, httpx2.TimeoutException):
        return ErrorKind.TIMEOUT
    if isinstance(e, httpx2.RemoteProtocolError | httpx2.ReadError):
        return ErrorKind.TRUNCATED
    return ErrorKind.CONNECT


def _describe(e: Exception) -> str:
    return f"{e.__class__.__name__}: {str(e)[:300] or 'no detail'}"
