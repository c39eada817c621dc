"""The OpenAI wire format's answers, shared by every kind that speaks it: typed parsers for chat, legacy
completion and Responses API bodies (the request is `openai_request`, the recorded headers
`openai_headers`).

Parsing reads the raw JSON ourselves (`parse_json`), so a malformed body becomes a named error
(`InvalidResponse`, with the field) instead of a half-filled object: a field of the wrong type, a string
with a lone surrogate (no UTF-8 form: it could be neither stored nor exported), and a logprob that is NaN,
±inf, above 0 or absurdly negative (`canaryd.observation.logprob_problem`, top-k alternatives included) are
all refused here, so no comparison ever sees them.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import orjson

from canaryd.observation import (
    LOGPROB_MAX,
    LOGPROB_MIN,
    TokenLogprob,
    ToolCall,
    logprob_problem,
    text_problem,
)


class InvalidResponse(Exception):
    """The server answered 2xx with a body we cannot use; the message names the field."""


def parse_json(body: bytes | str) -> Any:
    """A response body as JSON, or `InvalidResponse` saying why not (not UTF-8, not JSON, nested too deep).

    Transports call this on the raw body bytes (``wire.parse_json(response.content)``) instead of
    ``json.loads``: bytes are decoded as strict UTF-8, a leading BOM ignored (``json.loads`` on bytes would
    let UTF-8-encoded surrogates through), and a body nested deeper than the interpreter's recursion limit
    (about 1,000 levels), which makes ``json.loads`` raise ``RecursionError``, is an invalid response like
    any other instead of an exception that costs the pass.

    A body orjson reads is taken as orjson reads it, in about a third of ``json.loads``'s CPU; what it
    refuses (a BOM, ``NaN``, a number beyond a float, invalid UTF-8, deep nesting) is read as above, with the
    same answers and errors. The one difference: an integer beyond 64 bits arrives as a float, which every
    integer field refuses.
    """
    if isinstance(body, bytes | bytearray | memoryview):
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            pass
        try:
            body = bytes(body).decode("utf-8-sig")  # RFC 8259 8.1: a parser may ignore a BOM
        except UnicodeDecodeError as e:
            raise InvalidResponse(f"body is not UTF-8 (byte {e.start})") from None
    try:
        return json.loads(body)
    except RecursionError:
        raise InvalidResponse("body is not JSON canaryd accepts (nested too deep)") from None
    except ValueError as e:
        raise InvalidResponse(f"body is not JSON ({' '.join(str(e).split())[:200]})") from None


@dataclass(frozen=True, slots=True)
class Parsed:
    """What canaryd takes from a completion body; ``tokens`` is None when the server sent no logprobs.
    ``provider`` is the upstream that answered (OpenRouter's body field)."""

    text: str | None
    tokens: list[TokenLogprob] | None
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    system_fingerprint: str | None
    model: str | None
    service_tier: str | None
    reasoning_tokens: int | None = None
    provider: str | None = None
    tool_calls: tuple[ToolCall, ...] | None = None  # None: the answer called no tool


def _typed(value: Any, kind: type | tuple[type, ...], where: str, optional: bool = True) -> Any:
    """``value`` if it has the expected JSON type (or is absent and optional), else `InvalidResponse`.
    A string must also be storable text (no lone surrogate)."""
    if value is None and optional:
        return None
    if (isinstance(value, bool) and kind is int) or not isinstance(value, kind):
        raise InvalidResponse(f"response field {where} has type {type(value).__name__}")
    if isinstance(value, str) and (why := text_problem(value)) is not None:
        raise InvalidResponse(f"{where}: {why}")
    return value


def _logprob(value: Any, where: str) -> float:
    """A usable logprob (see `canaryd.observation.logprob_problem`), else `InvalidResponse` naming it."""
    if (why := logprob_problem(value)) is not None:
        raise InvalidResponse(f"{where}: {why}")
    return float(value)


def _guarded(parse: Callable[[Any], Parsed]) -> Callable[[Any], Parsed]:
    """The parser, whose only failure is `InvalidResponse`: whatever else a hostile body provokes in it
    costs that observation, never the pass."""

    @functools.wraps(parse)
    def wrapper(body: Any) -> Parsed:
        try:
            return parse(body)
        except InvalidResponse:
            raise
        except RecursionError:
            raise InvalidResponse("response nested too deep") from None
        except Exception as e:
            raise InvalidResponse(f"response malformed ({e.__class__.__name__})") from None

    return wrapper


def _envelope(body: Any) -> tuple[dict, Parsed]:
    """The first choice, and the fields common to chat and legacy completions."""
    body = _typed(body, dict, "(body)", optional=False)
    choices = _typed(body.get("choices"), list, "choices", optional=False)
    if not choices:
        raise InvalidResponse("response has no choices")
    choice = _typed(choices[0], dict, "choices.0", optional=False)
    usage = _typed(body.get("usage"), dict, "usage") or {}
    details = _typed(usage.get("completion_tokens_details"), dict, "usage.completion_tokens_details") or {}
    return choice, Parsed(
        text=None,
        tokens=None,
        finish_reason=_typed(choice.get("finish_reason"), str, "choices.0.finish_reason"),
        prompt_tokens=_typed(usage.get("prompt_tokens"), int, "usage.prompt_tokens"),
        completion_tokens=_typed(usage.get("completion_tokens"), int, "usage.completion_tokens"),
        system_fingerprint=_typed(body.get("system_fingerprint"), str, "system_fingerprint"),
        model=_typed(body.get("model"), str, "model"),
        service_tier=_typed(body.get("service_tier"), str, "service_tier"),
        reasoning_tokens=_typed(
            details.get("reasoning_tokens"), int, "usage.completion_tokens_details.reasoning_tokens"
        ),
        provider=_typed(body.get("provider"), str, "provider"),
    )


def _token_ids(choice: dict) -> list | None:
    ids = choice.get("token_ids")  # vLLM with return_token_ids
    return ids if isinstance(ids, list) else None


def _token_id(ids: list | None, i: int) -> int | None:
    if ids is None or i >= len(ids):
        return None
    if type(value := ids[i]) is int:  # the common case, without building the field's name (a bool is no id)
        return value
    return _typed(value, int, f"choices.0.token_ids.{i}", optional=False)


def _bytes(value: Any, where: str) -> tuple[int, ...] | None:
    raw = _typed(value, list, where)
    if raw is None:
        return None
    for j, b in enumerate(raw):
        if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b <= 255:
            raise InvalidResponse(f"{where}.{j}: not a byte")
    return tuple(raw)


def _usable(token: Any, logprob: Any) -> bool:
    """An ASCII token (no lone surrogate possible) with a float logprob in range (NaN and ±inf fail it)."""
    return (
        type(token) is str
        and token.isascii()
        and type(logprob) is float
        and LOGPROB_MIN <= logprob <= LOGPROB_MAX
    )


def _plain_entry(item: Any) -> tuple[str, float, tuple[int, ...] | None, tuple] | None:
    """A chat logprobs entry of the common kind, checked in a few C calls: (token, logprob, bytes, top).

    None sends the entry through the full checks, which name what is wrong; everything accepted here
    they accept too, with the same values. Checking each field through `_typed` cost more than the
    rest of a probe's parse.
    """
    if type(item) is not dict or not _usable(item.get("token"), item.get("logprob")):
        return None
    raw, alts = item.get("bytes"), item.get("top_logprobs")
    if raw is not None and not (type(raw) is list and all(type(b) is int and 0 <= b <= 255 for b in raw)):
        return None
    top = []
    if alts is not None:
        if type(alts) is not list:
            return None
        for alt in alts:
            if type(alt) is not dict or not _usable(t := alt.get("token"), v := alt.get("logprob")):
                return None
            top.append((t, v))
    return item["token"], item["logprob"], None if raw is None else tuple(raw), tuple(top)


@_guarded
def parse_chat(body: Any) -> Parsed:
    """A chat completion body: logprobs as OpenAI's ``content`` entries, or (Together, Fireworks) as the
    legacy parallel lists."""
    choice, parsed = _envelope(body)
    message = _typed(choice.get("message"), dict, "choices.0.message") or {}
    text = _typed(message.get("content"), str, "choices.0.message.content")
    calls = _tool_calls(message.get("tool_calls"), "choices.0.message.tool_calls")
    parsed = replace(parsed, text=with_calls(text, calls), tool_calls=calls)
    logprobs = _typed(choice.get("logprobs"), dict, "choices.0.logprobs") or {}
    content = _typed(logprobs.get("content"), list, "choices.0.logprobs.content")
    if content is None:
        return replace(parsed, tokens=_legacy_tokens(logprobs, choice))
    tokens = _entries(content, _token_ids(choice), "choices.0.logprobs.content")
    return replace(parsed, tokens=tokens)


TOOL_CALL_TAG = "[tool_call] "  # a tool call in an answer's text: the tag and its JSON, on a line of its own


def with_calls(text: str | None, calls: tuple[ToolCall, ...] | None) -> str | None:
    """The answer's text with each tool call appended as a line ``[tool_call] {"name": …, "arguments": …}``
    (arguments as sent): the store keeps the calls and a baseline compares them, on either basis."""
    if not calls:
        return text
    lines = [
        TOOL_CALL_TAG + json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False)
        for c in calls
    ]
    return "\n".join([text, *lines] if text else lines)


def _arguments(value: Any, where: str) -> str:
    """Arguments as a JSON text: OpenAI sends a string; a provider that sends an object has it serialised."""
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False)
    return _typed(value, str, where, optional=False)


def _tool_calls(value: Any, where: str) -> tuple[ToolCall, ...] | None:
    """OpenAI's ``message.tool_calls`` (``{id, type, function: {name, arguments}}`` each), or None."""
    items = _typed(value, list, where)
    if not items:
        return None
    calls = []
    for i, item in enumerate(items):
        item = _typed(item, dict, f"{where}.{i}", optional=False)
        fn = _typed(item.get("function"), dict, f"{where}.{i}.function", optional=False)
        name = _typed(fn.get("name"), str, f"{where}.{i}.function.name", optional=False)
        calls.append(ToolCall(name, _arguments(fn.get("arguments", ""), f"{where}.{i}.function.arguments")))
    return tuple(calls)


def _entries(content: list, ids: list | None, at: str) -> list[TokenLogprob]:
    """Logprob entries of OpenAI's shape (``token``, ``logprob``, ``bytes``, ``top_logprobs``)."""
    tokens = []
    for i, item in enumerate(content):
        if (plain := _plain_entry(item)) is not None:
            token, logprob, raw, top = plain
            tokens.append(TokenLogprob(token, logprob, _token_id(ids, i), raw, top))
            continue
        where = f"{at}.{i}"
        c = _typed(item, dict, where, optional=False)
        token = _typed(c.get("token"), str, f"{where}.token", optional=False)
        logprob = _logprob(c.get("logprob"), f"{where}.logprob")
        top = []
        for j, alt in enumerate(_typed(c.get("top_logprobs"), list, f"{where}.top_logprobs") or ()):
            t = _typed(alt, dict, f"{where}.top_logprobs.{j}", optional=False)
            top.append(
                (
                    _typed(t.get("token"), str, f"{where}.top_logprobs.{j}.token", optional=False),
                    _logprob(t.get("logprob"), f"{where}.top_logprobs.{j}.logprob"),
                )
            )
        tokens.append(
            TokenLogprob(
                token=token,
                logprob=logprob,
                token_id=_token_id(ids, i),
                bytes=_bytes(c.get("bytes"), f"{where}.bytes"),
                top=tuple(top),
            )
        )
    return tokens


@_guarded
def parse_completion(body: Any) -> Parsed:
    """A legacy completion body (``logprobs`` as parallel lists)."""
    choice, parsed = _envelope(body)
    text = _typed(choice.get("text"), str, "choices.0.text")
    lp = _typed(choice.get("logprobs"), dict, "choices.0.logprobs") or {}
    return replace(parsed, text=text, tokens=_legacy_tokens(lp, choice))


def _legacy_tokens(lp: dict, choice: dict) -> list[TokenLogprob] | None:
    """Logprobs as parallel lists (``tokens``, ``token_logprobs``, ``top_logprobs`` of {token: logprob}
    maps); None when there are none."""
    where = "choices.0.logprobs"
    toks = _typed(lp.get("tokens"), list, f"{where}.tokens")
    if toks is None:
        return None
    values = _typed(lp.get("token_logprobs"), list, f"{where}.token_logprobs", optional=False)
    tops = _typed(lp.get("top_logprobs"), list, f"{where}.top_logprobs") or [None] * len(toks)
    if not len(toks) == len(values) == len(tops):
        raise InvalidResponse(f"{where}: tokens, token_logprobs and top_logprobs differ in length")
    ids = _token_ids(choice)
    tokens = []
    for i, (tok, value, alts) in enumerate(zip(toks, values, tops, strict=True)):
        token = _typed(tok, str, f"{where}.tokens.{i}", optional=False)
        logprob = _logprob(value, f"{where}.token_logprobs.{i}")
        top = []
        for alt, v in (_typed(alts, dict, f"{where}.top_logprobs.{i}") or {}).items():
            alt = _typed(alt, str, f"{where}.top_logprobs.{i}", optional=False)  # the key is the token
            top.append((alt, _logprob(v, f"{where}.top_logprobs.{i}.{alt[:32]!r}")))
        tokens.append(TokenLogprob(token=token, logprob=logprob, token_id=_token_id(ids, i), top=tuple(top)))
    return tokens


@_guarded
def parse_responses(body: Any) -> Parsed:
    """A Responses API body: the ``output_text`` parts of its ``message`` items (reasoning items are
    skipped), their logprobs (None when any part with text has none), and ``status`` as a finish reason."""
    body = _typed(body, dict, "(body)", optional=False)
    texts: list[str] = []
    tokens: list[TokenLogprob] | None = []
    calls: list[ToolCall] = []
    for i, item in enumerate(_typed(body.get("output"), list, "output", optional=False)):
        item = _typed(item, dict, f"output.{i}", optional=False)
        if item.get("type") == "function_call":
            name = _typed(item.get("name"), str, f"output.{i}.name", optional=False)
            calls.append(ToolCall(name, _arguments(item.get("arguments", ""), f"output.{i}.arguments")))
        if item.get("type") != "message":
            continue
        for j, part in enumerate(_typed(item.get("content"), list, f"output.{i}.content") or ()):
            where = f"output.{i}.content.{j}"
            part = _typed(part, dict, where, optional=False)
            if part.get("type") != "output_text":
                continue
            texts.append(_typed(part.get("text"), str, f"{where}.text", optional=False))
            entries = _typed(part.get("logprobs"), list, f"{where}.logprobs")
            if not entries and texts[-1]:
                tokens = None
            elif tokens is not None:
                tokens += _entries(entries or [], None, f"{where}.logprobs")
    usage = _typed(body.get("usage"), dict, "usage") or {}
    details = _typed(usage.get("output_tokens_details"), dict, "usage.output_tokens_details") or {}
    status = _typed(body.get("status"), str, "status")
    incomplete = _typed(body.get("incomplete_details"), dict, "incomplete_details") or {}
    reason = _typed(incomplete.get("reason"), str, "incomplete_details.reason")
    finish = {"completed": "stop", "incomplete": "length" if reason == "max_output_tokens" else reason}
    return Parsed(
        text=with_calls("".join(texts) if texts else None, tuple(calls)),
        tool_calls=tuple(calls) or None,
        tokens=tokens if texts else None,
        finish_reason=finish.get(status or "", status),
        prompt_tokens=_typed(usage.get("input_tokens"), int, "usage.input_tokens"),
        completion_tokens=_typed(usage.get("output_tokens"), int, "usage.output_tokens"),
        system_fingerprint=None,
        model=_typed(body.get("model"), str, "model"),
        service_tier=_typed(body.get("service_tier"), str, "service_tier"),
        reasoning_tokens=_typed(
            details.get("reasoning_tokens"), int, "usage.output_tokens_details.reasoning_tokens"
        ),
    )
