"""Any OpenAI-compatible API (OpenAI, OpenRouter, Together, SGLang, llama.cpp server, vLLM …).

Requests go through the official ``openai`` client with ``max_retries=0`` and explicit timeouts: a
canary must see every failure, not have the SDK retry it away. We read the raw JSON ourselves so a
malformed body becomes a named error instead of a half-filled object.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import httpx2
import openai

from canaryd.backends import BackendUnavailable
from canaryd.breaker import CircuitBreaker, RetryPolicy
from canaryd.canaries import Canary
from canaryd.config import BackendConfig
from canaryd.observation import ErrorKind, Observation, TokenLogprob
from canaryd.store import utcnow

# Response headers worth keeping with each observation (never credentials or cookies).
RECORDED_HEADERS = (
    "server",
    "openai-version",
    "openai-processing-ms",
    "openai-model",
    "x-request-id",
    "retry-after",
    "via",
)
# Headers that identify the serving side; they join the stack snapshot, so they must be stable per stack.
IDENTITY_HEADERS = ("server", "openai-version", "openai-model", "x-openrouter-provider")


def _keep_header(name: str) -> bool:
    return name in RECORDED_HEADERS or name.startswith("x-ratelimit-")


# Request fields the openai SDK takes as keyword arguments; the rest travel in extra_body.
_SDK_PARAMS = frozenset(
    {
        "model",
        "messages",
        "prompt",
        "temperature",
        "top_p",
        "max_tokens",
        "n",
        "seed",
        "stop",
        "logprobs",
        "top_logprobs",
        "presence_penalty",
        "frequency_penalty",
    }
)


def _seconds(value: str | None) -> float | None:
    """A Retry-After header in seconds (the HTTP-date form is rare for APIs and treated as absent)."""
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


class InvalidResponse(Exception):
    """The server answered 2xx with a body we cannot use; the message names the field."""


@dataclass(frozen=True, slots=True)
class Parsed:
    """What canaryd takes from a completion body; ``tokens`` is None when the server sent no logprobs."""

    text: str | None
    tokens: list[TokenLogprob] | None
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    system_fingerprint: str | None
    model: str | None
    service_tier: str | None


def _typed(value: Any, kind: type | tuple[type, ...], where: str, optional: bool = True) -> Any:
    """``value`` if it has the expected JSON type (or is absent and optional), else `InvalidResponse`."""
    if value is None and optional:
        return None
    if (isinstance(value, bool) and kind is int) or not isinstance(value, kind):
        raise InvalidResponse(f"response field {where} has type {type(value).__name__}")
    return value


def _envelope(body: Any) -> tuple[dict, Parsed]:
    """The first choice, and the fields common to chat and legacy completions."""
    body = _typed(body, dict, "(body)", optional=False)
    choices = _typed(body.get("choices"), list, "choices", optional=False)
    if not choices:
        raise InvalidResponse("response has no choices")
    choice = _typed(choices[0], dict, "choices.0", optional=False)
    usage = _typed(body.get("usage"), dict, "usage") or {}
    return choice, Parsed(
        text=None,
        tokens=None,
        finish_reason=_typed(choice.get("finish_reason"), str, "choices.0.finish_reason"),
        prompt_tokens=_typed(usage.get("prompt_tokens"), int, "usage.prompt_tokens"),
        completion_tokens=_typed(usage.get("completion_tokens"), int, "usage.completion_tokens"),
        system_fingerprint=_typed(body.get("system_fingerprint"), str, "system_fingerprint"),
        model=_typed(body.get("model"), str, "model"),
        service_tier=_typed(body.get("service_tier"), str, "service_tier"),
    )


def _token_ids(choice: dict) -> list | None:
    ids = choice.get("token_ids")  # vLLM with return_token_ids
    return ids if isinstance(ids, list) else None


def parse_chat(body: Any) -> Parsed:
    """A chat completion body."""
    choice, parsed = _envelope(body)
    message = _typed(choice.get("message"), dict, "choices.0.message") or {}
    text = _typed(message.get("content"), str, "choices.0.message.content")
    logprobs = _typed(choice.get("logprobs"), dict, "choices.0.logprobs") or {}
    content = _typed(logprobs.get("content"), list, "choices.0.logprobs.content")
    if content is None:
        return replace(parsed, text=text)
    ids = _token_ids(choice)
    tokens = []
    for i, c in enumerate(content):
        try:
            tokens.append(
                TokenLogprob(
                    token=str(c["token"]),
                    logprob=float(c["logprob"]),
                    token_id=int(ids[i]) if ids is not None and i < len(ids) else None,
                    bytes=tuple(int(b) for b in c["bytes"]) if c.get("bytes") is not None else None,
                    top=tuple((str(t["token"]), float(t["logprob"])) for t in c.get("top_logprobs") or ()),
                )
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise InvalidResponse(
                f"choices.0.logprobs.content.{i}: malformed ({e.__class__.__name__})"
            ) from None
    return replace(parsed, text=text, tokens=tokens)


def parse_completion(body: Any) -> Parsed:
    """A legacy completion body (``logprobs`` as parallel lists)."""
    choice, parsed = _envelope(body)
    text = _typed(choice.get("text"), str, "choices.0.text")
    lp = _typed(choice.get("logprobs"), dict, "choices.0.logprobs") or {}
    if lp.get("tokens") is None:
        return replace(parsed, text=text)
    ids = _token_ids(choice)
    try:
        tops = lp.get("top_logprobs") or [None] * len(lp["tokens"])
        tokens = [
            TokenLogprob(
                token=str(tok),
                logprob=float(val),
                token_id=int(ids[i]) if ids is not None and i < len(ids) else None,
                top=tuple((str(t), float(v)) for t, v in (top or {}).items()),
            )
            for i, (tok, val, top) in enumerate(zip(lp["tokens"], lp["token_logprobs"], tops, strict=True))
        ]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise InvalidResponse(f"choices.0.logprobs: malformed ({e.__class__.__name__})") from None
    return replace(parsed, text=text, tokens=tokens)


def request_hash(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


class OpenAICompatBackend:
    """Kind ``openai``: the serving side is known only by what responses say about themselves."""

    kind = "openai"

    def __init__(self, cfg: BackendConfig) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.concurrency = cfg.concurrency
        self.retry = RetryPolicy(cfg.retries, cfg.retry_backoff, cfg.retry_max_wait)
        self.breaker = CircuitBreaker(cfg.breaker_failures, cfg.breaker_cooldown)
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

    def response_stack(self, r: Parsed, headers: httpx2.Headers) -> dict[str, str]:
        """Per-response serving facts: they join the backend snapshot in the observation's stack."""
        fields = {"response.model": str(r.model), "response.system_fingerprint": str(r.system_fingerprint)}
        if r.service_tier is not None:
            fields["response.service_tier"] = r.service_tier
        fields.update({f"header.{h}": headers[h] for h in IDENTITY_HEADERS if h in headers})
        return fields

    # -- probing ------------------------------------------------------------------------------------
    def extra_params(self, canary: Canary) -> dict:
        """Engine-specific request fields (none for the generic OpenAI API)."""
        return {}

    def request_body(self, canary: Canary) -> dict:
        d = canary.decoding
        body: dict[str, Any] = {
            "model": self.cfg.model,
            "temperature": d.temperature,
            "top_p": d.top_p,
            "max_tokens": d.max_tokens,
            "n": 1,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
        }
        if d.seed is not None:
            body["seed"] = d.seed
        if d.stop:
            body["stop"] = list(d.stop)
        if canary.messages is not None:
            body["messages"] = [m.model_dump() for m in canary.messages]
            body["logprobs"] = True
            body["top_logprobs"] = d.top_logprobs
        else:
            body["prompt"] = canary.prompt
            body["logprobs"] = d.top_logprobs
        return {**body, **self.extra_params(canary)}

    def request_hash(self, canary: Canary) -> str:
        return request_hash(self.request_body(canary))

    def probe(self, canary: Canary) -> Observation:
        """Send one canary, retrying transient failures; never raises."""
        body = self.request_body(canary)
        started = utcnow()
        if not self.breaker.allow():
            obs = self._observation(canary, body, started)
            obs.error_kind, obs.attempts = ErrorKind.CIRCUIT_OPEN, 0
            obs.error = f"not sent: {self.breaker.failures}+ failed probes in a row, cooling down"
            return obs
        attempt = 1
        while True:
            obs = self._attempt(canary, body, started)
            obs.attempts = attempt
            if (
                obs.ok
                or obs.error_kind is None
                or not obs.error_kind.retryable
                or attempt > self.retry.retries
            ):
                break
            retry_after = _seconds(obs.headers.get("retry-after"))
            time.sleep(self.retry.wait_s(attempt, retry_after))
            attempt += 1
        if attempt > 1 and obs.error:
            obs.error = f"{obs.error} (after {attempt} attempts)"
        # Only transport-level failures trip the breaker: a malformed answer is the backend's answer.
        self.breaker.record(obs.ok or not obs.error_kind.retryable)  # type: ignore[union-attr]
        return obs

    def _observation(self, canary: Canary, body: dict, started) -> Observation:
        return Observation(
            backend=self.name,
            canary_id=canary.id,
            suite=canary.suite,
            started_at=started,
            request=body,
            request_hash=request_hash(body),
        )

    def _attempt(self, canary: Canary, body: dict, started) -> Observation:
        obs = self._observation(canary, body, started)
        kwargs = {k: v for k, v in body.items() if k in _SDK_PARAMS}
        extra = {k: v for k, v in body.items() if k not in _SDK_PARAMS}
        endpoint = self.client.chat.completions if canary.messages is not None else self.client.completions
        parse: Callable = parse_chat if canary.messages is not None else parse_completion
        t0 = time.perf_counter()
        try:
            raw = endpoint.with_raw_response.create(**kwargs, extra_body=extra or None)
            obs.latency_s = time.perf_counter() - t0
            obs.headers = {k: v for k, v in raw.headers.items() if _keep_header(k.lower())}
            try:
                payload = json.loads(raw.text)
            except ValueError as e:
                raise InvalidResponse(f"body is not JSON ({e})") from None
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
        except InvalidResponse as e:
            obs.error_kind, obs.error = ErrorKind.INVALID_RESPONSE, str(e)
        except openai.APIError as e:
            obs.error_kind, obs.error = classify(e), self.redact(_describe(e))
            if isinstance(e, openai.APIStatusError):
                obs.headers = {k: v for k, v in e.response.headers.items() if _keep_header(k.lower())}
        obs.latency_s = obs.latency_s or time.perf_counter() - t0
        return obs

    def redact(self, message: str) -> str:
        """Belt and braces: a server that echoes our key back must not get it into the store."""
        return message.replace(self._key, "<redacted>") if self._key else message

    def request(self, method: str, url: str, **kwargs: Any) -> httpx2.Response:
        """A raw call to an introspection endpoint; connection failures mean the backend is down."""
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
    if isinstance(e, openai.APIStatusError):
        return f"HTTP {e.status_code}: {str(e.message)[:300]}"
    return f"{e.__class__.__name__}: {str(e)[:300]}"
