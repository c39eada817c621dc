"""Kind ``openai-responses``: the OpenAI Responses API (``POST {base_url}/responses``), the only API of
some models.

Everything but the body and its parser is the ``openai`` kind's (`openai_compat.Prober`): transport,
deadlines, errors, headers, the stack, the request profile. The canary's messages go out as ``input``;
logprobs are returned only when asked for through ``include`` (and never by reasoning models: use
``request.logprobs = "off"`` there). The API has no seed, stop or penalties, and no raw-prompt endpoint,
so raw-prompt canaries are refused up front.
https://platform.openai.com/docs/api-reference/responses/create
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal

from canaryd.backends import discover, openai_compat
from canaryd.backends import openai_wire as wire
from canaryd.backends.base import HttpSettings
from canaryd.backends.openai_request import responses_body
from canaryd.backends.profile import RequestProfile
from canaryd.canaries import Canary

EXAMPLE = """\
# The OpenAI Responses API (models served only there, or to compare it with chat completions).
# [[backends]]
# name = "openai-responses"
# kind = "openai-responses"
# base_url = "https://api.openai.com/v1"
# model = "gpt-4.1-mini"
# api_key_env = "OPENAI_API_KEY"
# [backends.request]
# logprobs = "prefer"         # reasoning models return none: "off", with a reasoning_tokens budget
"""


class Settings(HttpSettings):
    kind: Literal["openai-responses"] = "openai-responses"

    @property
    def no_completions(self) -> str | None:
        return "kind openai-responses"


class Prober(openai_compat.Prober):
    kind = "openai-responses"

    def body(self, canary: Canary, profile: RequestProfile) -> dict:
        return responses_body(self.cfg.model, canary, profile)

    def route(self, canary: Canary) -> tuple[str, Callable[[Any], wire.Parsed]]:
        return f"{self.cfg.base_url}/responses", wire.parse_responses


class Doctor(discover.Dialect):
    """How `canaryd doctor` asks the Responses API: ``input`` and ``max_output_tokens`` (16 at least), no n,
    penalties or seed, logprobs only when ``include`` asks for them, and no raw-prompt endpoint."""

    path = "/responses"
    responses = True
    token_param = "max_output_tokens"
    fallback_token_param = None
    max_tokens = 16  # the API's smallest max_output_tokens
    sampling: ClassVar[dict[str, Any]] = {"temperature": 0.0, "top_p": 1.0}
    no_completions = "the Responses API has no raw-prompt endpoint"
    reasoning: ClassVar[dict[str, Any]] = {"reasoning": {"effort": "low"}}

    def body(self, model: str, token_param: str, **extra: Any) -> dict:
        return {"model": model, "input": discover.PROMPT, token_param: self.max_tokens, **extra}

    def ask_logprobs(self, k: int) -> dict[str, Any]:
        return {"include": ["message.output_text.logprobs"], "top_logprobs": k}

    def logprobs(self, doc: Any) -> Any:
        parts = [p.get("logprobs") for p in _output_text(doc)]
        return {"content": [e for part in parts if isinstance(part, list) for e in part]}


DOCTOR = Doctor()


def _output_text(doc: Any) -> list[dict]:
    """The ``output_text`` parts of a Responses API answer."""
    items = doc.get("output") if isinstance(doc, dict) else None
    parts = [
        c for i in items or () if isinstance(i, dict) for c in i.get("content") or () if isinstance(c, dict)
    ]
    return [p for p in parts if p.get("type") == "output_text"]
