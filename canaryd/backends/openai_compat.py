"""Kind ``openai``: any OpenAI-compatible API (OpenAI, OpenRouter, Together, SGLang, llama.cpp server …).

Requests go through the official ``openai`` client with ``max_retries=0`` and explicit timeouts: a
canary must see every failure, not have the SDK retry it away (the shared `Resilient` wrapper retries,
visibly). The body is read raw and parsed by `openai_wire`, so a malformed one is a named error.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from canaryd.backends import openai_wire as wire
from canaryd.backends.base import BackendUnavailable, HttpSettings
from canaryd.canaries import Canary
from canaryd.observation import ErrorKind, Observation, utcnow

if TYPE_CHECKING:
    import httpx2
    import openai

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
"""


class Settings(HttpSettings):
    kind: Literal["openai"] = "openai"


class Prober:
    """The serving side is known only by what responses say about themselves."""

    kind = "openai"

    def __init__(self, cfg: HttpSettings) -> None:
        import httpx2
        import openai

        self.cfg = cfg
        self.name = cfg.name
        self.concurrency = cfg.concurrency
        self._key = cfg.api_key()
        timeout = httpx2.Timeout(cfg.timeout_s, connect=cfg.connect_timeout_s)
        self.http = httpx2.Client(
            timeout=timeout,
            limits=httpx2.Limits(max_connections=cfg.concurrency + 2),
            headers={"Authorization": f"Bearer {self._key}"} if self._key else {},
        )
        self.client = openai.OpenAI(
            base_url=cfg.base_url,
            api_key=self._key or "unused",  # the SDK insists on a value; keyless servers ignore it
            max_retries=0,
            timeout=timeout,
            http_client=self.http,
        )

    def close(self) -> None:
        self.client.close()

    # -- the stack ----------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, str]:
        return {"backend.kind": self.kind, "request.model": self.cfg.model}

    def response_stack(self, r: wire.Parsed, headers: httpx2.Headers) -> dict[str, str]:
        """Per-response serving facts: they join the backend snapshot in the observation's stack."""
        fields = {"response.model": str(r.model), "response.system_fingerprint": str(r.system_fingerprint)}
        if r.service_tier is not None:
            fields["response.service_tier"] = r.service_tier
        fields.update({f"header.{h}": headers[h] for h in wire.IDENTITY_HEADERS if h in headers})
        return fields

    # -- probing ------------------------------------------------------------------------------------
    def extra_params(self, canary: Canary) -> dict:
        """Engine-specific request fields (none for the generic OpenAI API)."""
        return {}

    def request(self, canary: Canary) -> dict:
        return {**wire.request_body(self.cfg.model, canary), **self.extra_params(canary)}

    def request_hash(self, canary: Canary) -> str:
        return wire.request_hash(self.request(canary))

    def attempt(self, canary: Canary) -> Observation:
        import openai

        body = self.request(canary)
        obs = Observation(self.name, canary.id, canary.suite, utcnow(), body, wire.request_hash(body))
        kwargs = {k: v for k, v in body.items() if k in wire.SDK_PARAMS}
        extra = {k: v for k, v in body.items() if k not in wire.SDK_PARAMS}
        endpoint = self.client.chat.completions if canary.messages is not None else self.client.completions
        parse: Callable = wire.parse_chat if canary.messages is not None else wire.parse_completion
        t0 = time.perf_counter()
        try:
            raw = endpoint.with_raw_response.create(**kwargs, extra_body=extra or None)
            obs.latency_s = time.perf_counter() - t0
            obs.headers = {k: v for k, v in raw.headers.items() if wire.keep_header(k.lower())}
            try:
                payload = json.loads(raw.text)
            except ValueError as e:
                raise wire.InvalidResponse(f"body is not JSON ({e})") from None
            r = parse(payload)
            obs.text, obs.system_fingerprint, obs.response_model = r.text, r.system_fingerprint, r.model
            obs.finish_reason, obs.prompt_tokens, obs.completion_tokens = (
                r.finish_reason,
                r.prompt_tokens,
                r.completion_tokens,
            )
            obs.stack = self.response_stack(r, raw.headers)
            if r.tokens is None:
                obs.error_kind, obs.error = ErrorKind.NO_LOGPROBS, "response carries no logprobs"
            else:
                obs.tokens = r.tokens
        except wire.InvalidResponse as e:
            obs.error_kind, obs.error = ErrorKind.INVALID_RESPONSE, str(e)
        except openai.APIError as e:
            obs.error_kind, obs.error = classify(e), self.redact(_describe(e))
            if isinstance(e, openai.APIStatusError):
                obs.headers = {k: v for k, v in e.response.headers.items() if wire.keep_header(k.lower())}
        obs.latency_s = obs.latency_s or time.perf_counter() - t0
        return obs

    def redact(self, message: str) -> str:
        """Belt and braces: a server that echoes our key back must not get it into the store."""
        return message.replace(self._key, "<redacted>") if self._key else message

    def call(self, method: str, url: str, **kwargs: Any) -> httpx2.Response:
        """A raw call to an introspection endpoint; connection failures mean the backend is down."""
        import httpx2

        try:
            r = self.http.request(method, url, **kwargs)
        except httpx2.TimeoutException as e:
            raise BackendUnavailable(
                ErrorKind.TIMEOUT, f"{url}: timed out ({e.__class__.__name__})"
            ) from None
        except httpx2.TransportError as e:
            raise BackendUnavailable(
                ErrorKind.CONNECT, f"{url}: {self.redact(str(e)) or e.__class__.__name__}"
            ) from None
        r.raise_for_status()
        return r


def classify(e: openai.APIError) -> ErrorKind:
    import httpx2
    import openai

    if isinstance(e, openai.APITimeoutError):
        return ErrorKind.TIMEOUT
    if isinstance(e, openai.APIConnectionError):
        cut = isinstance(e.__cause__, httpx2.RemoteProtocolError | httpx2.ReadError)
        return ErrorKind.TRUNCATED if cut else ErrorKind.CONNECT
    if isinstance(e, openai.RateLimitError):
        return ErrorKind.RATE_LIMITED
    if isinstance(e, openai.AuthenticationError | openai.PermissionDeniedError):
        return ErrorKind.AUTH
    if isinstance(e, openai.APIStatusError):
        return ErrorKind.HTTP_5XX if e.status_code >= 500 else ErrorKind.HTTP_4XX
    return ErrorKind.INVALID_RESPONSE  # e.g. APIResponseValidationError


def _describe(e: openai.APIError) -> str:
    import openai

    if isinstance(e, openai.APIStatusError):
        return f"HTTP {e.status_code}: {str(e.message)[:300]}"
    return f"{e.__class__.__name__}: {str(e)[:300]}"
