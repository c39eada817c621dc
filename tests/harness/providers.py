"""Cloud providers replayed on loopback from recorded response and error bodies (no network needed): the
provider route table of the replay core (`tests.harness.replay`).

Each family (`FAMILIES`: a folder under ``tests/fixtures/providers``, one JSON file per recorded body, each
naming its ``_source``) is served under its own prefix: ``{replay.base("groq")}/chat/completions``. A small
rule per family encodes what the provider documents it accepts (``RULES``: e.g. an o-series model answers
400 to ``max_tokens``), and picks the recorded error body or the recorded answer; an answer gets the text
the test wants for the prompt (``answers``: prompt substring → answer), and the usage counts and logprobs
that text implies, in the family's own shape (OpenAI's, Together's legacy lists, the Responses API's).

``replay.change(...)`` scripts a silent change on the provider's side (`Shift`); every request is recorded
(`Got`: what was sent, what was answered, the tokens it cost), so tests can assert what was and was not
sent and count the spend.
"""

from __future__ import annotations

import copy
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from tests.harness.fixtures import ROOT, load
from tests.harness.replay import (
    Server,
    answer_for,
    entries,
    logprobs,
    prompt_of,
    prompt_tokens,
    tokens,
    top_k,
)

FAMILIES = tuple(sorted(p.name for p in (ROOT / "providers").iterdir() if p.is_dir()))
KEY = "sk-replay-0123456789"  # the key every family expects (a wrong one gets the recorded 401)
# Reasoning tokens the reasoning families spend per answer, by reasoning_effort (medium is the default).
EFFORT = {"minimal": 16, "low": 64, "medium": 192, "high": 640}


def fixture(family: str, name: str) -> dict:
    """A recorded body: ``status``, ``headers`` and ``body`` (``_source`` and ``_note`` say where from)."""
    return load(f"providers/{family}/{name}")


@dataclass
class Shift:
    """What the provider silently changed (None / 0: nothing)."""

    answer: dict[str, str] = field(default_factory=dict)  # prompt substring → the new answer
    fingerprint: str | None = None
    reasoning_tokens: int | None = None  # spent per answer, whatever the effort asked for
    prompt_tokens: int = 0  # added to every prompt's count (a hidden system prompt grew)
    logprob: float = 0.0  # added to every token's logprob


@dataclass(frozen=True)
class Got:
    """One request as the replay server got it, and what it answered."""

    family: str
    method: str
    path: str  # after the family's /v1 prefix: "/chat/completions", "/completions", "/responses"
    headers: dict[str, str]  # lower-case names
    body: Any  # the JSON sent (None when there was no body or it was not JSON)
    status: int
    tokens: int  # the total the answer's usage reports (0 for an error)


@dataclass(frozen=True)
class Asked:
    """What a rule looks at: the path, the JSON body, and the helpers every family shares."""

    path: str
    body: dict

    def has(self, key: str) -> bool:
        return key in self.body

    def truthy(self, key: str) -> bool:
        return bool(self.body.get(key))


def _openai_chat(a: Asked) -> str:
    return "completions-404" if a.path == "/completions" else "chat"


def _openai_reasoning(a: Asked) -> str:
    if a.path == "/completions":
        return "completions-404"
    if a.has("max_tokens"):
        return "max-tokens-400"
    if a.has("temperature") and a.body["temperature"] != 1:
        return "temperature-400"
    return "logprobs-403" if a.truthy("logprobs") or a.has("top_logprobs") else "chat"


def _openai_responses(a: Asked) -> str:
    if a.path != "/responses":
        return "not-found"
    limit = a.body.get("max_output_tokens")
    return "max-output-tokens-400" if isinstance(limit, int) and limit < 16 else "response"


def _anthropic(a: Asked) -> str:
    if a.path != "/chat/completions":
        return "not-found-404"
    return "temperature-top-p-400" if a.has("temperature") and a.has("top_p") else "chat"


def _gemini(a: Asked) -> str:
    if a.path != "/chat/completions":
        return "not-found-404"
    return "logprobs-400" if a.truthy("logprobs") else "chat"


def _openrouter(a: Asked) -> str:
    return "completion" if a.path == "/completions" else "chat"


def _groq(a: Asked) -> str:
    if a.path != "/chat/completions":
        return "not-found-404"
    return "logprobs-400" if a.truthy("logprobs") or a.body.get("top_logprobs") is not None else "chat"


def _mistral(a: Asked) -> str:
    if a.path != "/chat/completions":
        return "not-found-404"
    return "seed-422" if a.has("seed") else "chat"


def _xai(a: Asked) -> str:
    if a.path != "/chat/completions":
        return "not-found-404"
    return "presence-penalty-400" if a.has("presence_penalty") else "chat"


def _deepseek(a: Asked) -> str:
    return "chat" if a.path == "/chat/completions" else "not-found-404"


# Per family: the recorded body a request gets. Each rule is the provider's documented acceptance rule, with
# the source in the fixture it picks.
RULES: dict[str, Callable[[Asked], str]] = {
    "openai-chat": _openai_chat,
    "openai-reasoning": _openai_reasoning,
    "openai-responses": _openai_responses,
    "anthropic-compat": _anthropic,
    "gemini-compat": _gemini,
    "openrouter": _openrouter,
    "together": lambda a: "completion" if a.path == "/completions" else "chat",
    "groq": _groq,
    "mistral": _mistral,
    "xai": _xai,
    "deepseek": _deepseek,
}
# Families that return logprobs when asked, and families whose answers spend reasoning tokens.
LOGPROBS = frozenset({"openai-chat", "openai-responses", "together", "deepseek"})
REASONING = frozenset({"openai-reasoning"})


class Replay(Server):
    """The replay server: ``answers`` maps a prompt substring to the answer text (else `DEFAULT_ANSWER`)."""

    def __init__(self, answers: dict[str, str] | None = None) -> None:
        self.answers = dict(answers or {})
        self.shift = Shift()
        self.requests: list[Got] = []
        self._lock = threading.Lock()
        super().__init__()

    def base(self, family: str) -> str:
        """The ``base_url`` of a replayed family."""
        return f"{self.url}/{family}/v1"

    def change(self, **fields: Any) -> None:
        """Script a silent change from the next request on (fields of `Shift`)."""
        with self._lock:
            self.shift = replace(self.shift, **fields)

    def sent(self, family: str | None = None, path: str | None = None) -> list[Any]:
        """The bodies received, in order (of one family, to one path)."""
        return [g.body for g in self.got(family, path)]

    def got(self, family: str | None = None, path: str | None = None) -> list[Got]:
        with self._lock:
            return [g for g in self.requests if family in (None, g.family) and path in (None, g.path)]

    def spent(self, family: str | None = None) -> int:
        """Tokens the answers' usage reported (what the provider would bill)."""
        return sum(g.tokens for g in self.got(family))

    # -- answering ----------------------------------------------------------------------------------
    def _answer(self, method: str, url: str, headers: Any, raw: bytes) -> tuple[int, dict[str, str], Any]:
        m = re.match(r"^/([^/]+)/v1(/.*)$", url)
        family, path = (m.group(1), m.group(2)) if m else ("", url)
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        if family not in RULES:
            status, hdrs, doc = 404, {}, {"error": {"message": f"no replayed family {family!r}"}}
        elif headers.get("Authorization") != f"Bearer {KEY}":
            rec = fixture("openai-chat", "auth-401")
            status, hdrs, doc = rec["status"], rec["headers"], rec["body"]
        elif not isinstance(body, dict):
            status, hdrs, doc = 400, {}, {"error": {"message": "We could not parse the JSON body"}}
        else:
            with self._lock:
                shift = self.shift
            status, hdrs, doc = self._play(family, Asked(path, body), shift, url)
        cost = _total(doc) if status == 200 else 0
        with self._lock:
            lowered = {k.lower(): v for k, v in headers.items()}
            self.requests.append(Got(family, method, path, lowered, body, status, cost))
        return status, hdrs, doc

    def _play(self, family: str, asked: Asked, shift: Shift, url: str) -> tuple[int, dict, Any]:
        name = RULES[family](asked)
        if name == "not-found":
            return (
                404,
                {},
                {"error": {"message": f"Invalid URL (POST {url})", "type": "invalid_request_error"}},
            )
        rec = fixture(family, name)
        doc = rec["body"]
        if rec["status"] != 200:
            text = json.dumps(doc).replace("/openai/v1/completions", f"/{family}/v1{asked.path}")
            limit = asked.body.get("max_output_tokens")
            text = text.replace("but got 8 instead", f"but got {limit} instead")
            return rec["status"], rec["headers"], json.loads(text)
        fill = (
            _responses
            if asked.path == "/responses"
            else _completion
            if asked.path == "/completions"
            else _chat
        )
        return 200, rec["headers"], fill(family, doc, asked.body, self._text_for(asked.body, shift), shift)

    def _text_for(self, body: dict, shift: Shift) -> str:
        return answer_for(prompt_of(body), shift.answer, self.answers)


# -- filling a recorded answer in ---------------------------------------------------------------------
def _usage(family: str, body: dict, answer: list[str], shift: Shift) -> tuple[int, int, int, bool]:
    """(prompt tokens, reasoning tokens, answer tokens shown, cut by the limit) for one answer."""
    prompt = prompt_tokens(prompt_of(body)) + shift.prompt_tokens
    if family not in REASONING:
        return prompt, 0, len(answer), False
    effort = (body.get("reasoning") or {}).get("effort") or body.get("reasoning_effort") or "medium"
    reasoning = shift.reasoning_tokens if shift.reasoning_tokens is not None else EFFORT.get(effort, 192)
    limit = body.get("max_completion_tokens") or body.get("max_output_tokens")
    if isinstance(limit, int) and limit < reasoning + len(answer):
        return prompt, min(reasoning, limit), 0, True  # the reasoning ate the budget: no visible answer
    return prompt, reasoning, len(answer), False


def _chat(family: str, doc: dict, body: dict, text: str, shift: Shift) -> dict:
    doc = copy.deepcopy(doc)
    answer = tokens(text)
    prompt, reasoning, shown, cut = _usage(family, body, answer, shift)
    answer = answer[:shown]
    choice = doc["choices"][0]
    choice["message"]["content"] = "".join(answer)
    choice["finish_reason"] = "length" if cut else choice["finish_reason"]
    if family in LOGPROBS and body.get("logprobs"):
        lps = logprobs(answer, top_k(body), shift.logprob)
        if family == "together":  # the legacy parallel lists, inside a chat response
            choice["logprobs"] = {"tokens": [t for t, _, _ in lps], "token_logprobs": [v for _, v, _ in lps]}
        else:
            choice["logprobs"] = {"content": entries(answer, top_k(body), shift.logprob)}
    elif "logprobs" in choice:
        choice["logprobs"] = None
    _set_usage(doc["usage"], prompt, reasoning + len(answer), reasoning)
    if shift.fingerprint is not None and doc.get("system_fingerprint") is not None:
        doc["system_fingerprint"] = shift.fingerprint
    return doc


def _completion(family: str, doc: dict, body: dict, text: str, shift: Shift) -> dict:
    doc = copy.deepcopy(doc)
    answer = tokens(text)
    prompt, _, _, _ = _usage(family, body, answer, shift)
    choice = doc["choices"][0]
    choice["text"] = "".join(answer)
    k = body.get("logprobs")
    if family in LOGPROBS and isinstance(k, int) and not isinstance(k, bool):
        lps = logprobs(answer, max(1, min(k, 5)), shift.logprob)
        choice["logprobs"] = {
            "tokens": [t for t, _, _ in lps],
            "token_logprobs": [v for _, v, _ in lps],
            "top_logprobs": [dict(top) for _, _, top in lps],
        }
    else:
        choice["logprobs"] = None
    _set_usage(doc["usage"], prompt, len(answer), 0)
    return doc


def _responses(family: str, doc: dict, body: dict, text: str, shift: Shift) -> dict:
    doc = copy.deepcopy(doc)
    answer = tokens(text)
    prompt, reasoning, shown, cut = _usage(family, body, answer, shift)
    answer = answer[:shown]
    part = doc["output"][0]["content"][0]
    part["text"] = "".join(answer)
    if "message.output_text.logprobs" in (body.get("include") or []):
        part["logprobs"] = entries(answer, top_k(body), shift.logprob)
    else:
        part["logprobs"] = []
    doc["status"] = "incomplete" if cut else "completed"
    doc["max_output_tokens"] = body.get("max_output_tokens")
    doc["usage"].update(
        input_tokens=prompt,
        output_tokens=reasoning + len(answer),
        total_tokens=prompt + reasoning + len(answer),
        output_tokens_details={"reasoning_tokens": reasoning},
    )
    return doc


def _set_usage(usage: dict, prompt: int, completion: int, reasoning: int) -> None:
    usage.update(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
    if "completion_tokens_details" in usage:
        usage["completion_tokens_details"]["reasoning_tokens"] = reasoning


def _total(doc: Any) -> int:
    usage = doc.get("usage") if isinstance(doc, dict) else None
    return int(usage.get("total_tokens") or 0) if isinstance(usage, dict) else 0
