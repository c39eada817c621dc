"""The OpenAI wire format, shared by every kind that speaks it: the request body a canary becomes, the
hash baselines are keyed by, and typed parsers for chat and legacy completion bodies.

Parsing reads the raw JSON ourselves, so a malformed body becomes a named error (`InvalidResponse`, with
the field) instead of a half-filled object.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from typing import Any

from canaryd.canaries import Canary
from canaryd.observation import TokenLogprob

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


def keep_header(name: str) -> bool:
    return name in RECORDED_HEADERS or name.startswith("x-ratelimit-")


# Request fields the openai SDK takes as keyword arguments; the rest travel in extra_body.
SDK_PARAMS = frozenset(
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


def request_body(model: str, canary: Canary) -> dict:
    """Every sampling parameter, explicit (servers otherwise fill defaults from files that can change)."""
    d = canary.decoding
    body: dict[str, Any] = {
        "model": model,
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
    return body
