"""The request an OpenAI-style kind sends for a canary (chat, legacy completion or Responses API body),
and the hash baselines are keyed by.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from canaryd.backends.profile import DEFAULT, RequestProfile
from canaryd.canaries import Canary
from canaryd.toolcalls import choice_body

# Request fields the openai SDK took as keyword arguments (the rest went in extra_body): they set the key
# order of the JSON canaryd sends (`openai_compat.wire_body`), which stayed byte for byte the SDK's.
SDK_PARAMS = frozenset(
    {
        "model",
        "messages",
        "prompt",
        "temperature",
        "top_p",
        "max_tokens",
        "max_completion_tokens",
        "n",
        "seed",
        "stop",
        "logprobs",
        "top_logprobs",
        "presence_penalty",
        "frequency_penalty",
        "tools",
        "tool_choice",
        "reasoning_effort",
    }
)


def request_hash(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def request_body(model: str, canary: Canary, profile: RequestProfile = DEFAULT) -> dict:
    """Every sampling parameter, explicit (servers otherwise fill defaults from files that can change),
    as the backend's request profile shapes them (its ``extra_body`` is merged by the caller, last)."""
    d = canary.decoding
    chat = canary.messages is not None
    body: dict[str, Any] = {"model": model, "temperature": d.temperature, "top_p": d.top_p}
    if profile.token_param != "none":  # legacy completions know only max_tokens
        body[profile.token_param if chat else "max_tokens"] = d.max_tokens + profile.reasoning_tokens
    body |= {"n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    if d.seed is not None:
        body["seed"] = d.seed
    if d.stop:
        body["stop"] = list(d.stop)
    k = min(d.top_logprobs, profile.top_logprobs)
    if chat:
        body["messages"] = [m.model_dump() for m in canary.messages]
        if profile.logprobs != "off":
            body["logprobs"] = True
            body["top_logprobs"] = k
    else:
        body["prompt"] = canary.prompt
        if profile.logprobs != "off":
            body["logprobs"] = k
    if d.reasoning_effort is not None:
        body["reasoning_effort"] = d.reasoning_effort
    if canary.tools is not None:
        body["tools"] = [t.body() for t in canary.tools]
        if canary.tool_choice is not None:
            body["tool_choice"] = choice_body(canary.tool_choice)
    for key in profile.omit:
        body.pop(key, None)
    return body


RESPONSES_MIN_OUTPUT = 16  # OpenAI refuses max_output_tokens below it


def responses_body(model: str, canary: Canary, profile: RequestProfile = DEFAULT) -> dict:
    """The canary as an OpenAI Responses API request: the messages as ``input``; logprobs come only
    through ``include``. The API takes no seed, stop, penalties or n, so none is sent."""
    d = canary.decoding
    body: dict[str, Any] = {"model": model, "input": [m.model_dump() for m in canary.messages or ()]}
    if profile.token_param != "none":  # OpenAI refuses max_output_tokens below 16
        body["max_output_tokens"] = max(RESPONSES_MIN_OUTPUT, d.max_tokens + profile.reasoning_tokens)
    body |= {"temperature": d.temperature, "top_p": d.top_p}
    if profile.logprobs != "off":
        body["top_logprobs"] = min(d.top_logprobs, profile.top_logprobs)
        body["include"] = ["message.output_text.logprobs"]
    if d.reasoning_effort is not None:
        body["reasoning"] = {"effort": d.reasoning_effort}
    if canary.tools is not None:  # the Responses API's function tools are flat
        body["tools"] = [{"type": "function", **t.function.body()} for t in canary.tools]
        if canary.tool_choice is not None:
            choice = choice_body(canary.tool_choice)
            body["tool_choice"] = (
                choice if isinstance(choice, str) else {"type": "function", **choice["function"]}
            )
    for key in profile.omit:
        body.pop(key, None)
    return body
