"""What an HTTP error reply means: a request refused as configured, or a failure of the backend.

A provider that refuses a parameter or a value (OpenAI's ``unsupported_parameter``/``unsupported_value``,
Mistral's 422 ``extra_forbidden``, xAI's "Argument not supported", Groq's and Gemini's logprobs 400s,
o4-mini's logprobs 403, Anthropic's ``temperature`` + ``top_p``) will refuse the same request every time:
that is `ErrorKind.CONFIG`, with a message naming the backend, the parameter and the request-profile key
that fixes it, not an outage (``check`` exits 2 on it and the daemon stops re-sending it). So is an engine
that caps top-k logprobs below what was asked (vLLM's ``--max-logprobs``, TGI's ``--max-top-n-tokens``,
SGLang's prefill-decode limit): the message names ``request.top_logprobs`` and the cap, read from the
server's words by `top_k_limit`, which ``canaryd doctor`` also uses. Every other reply keeps its kind by
status (401/403 ``auth``, 429 ``rate_limited``, 5xx, other 4xx). The bodies this was written against are
under ``tests/fixtures/refusals/``, each with its source.
"""

from __future__ import annotations

import json
import re

from canaryd.backends.profile import TOP_K_MAX
from canaryd.observation import ErrorKind

# The request parameters a profile can change, by the name the provider uses for them.
PARAMS = (
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logprobs",
    "top_logprobs",
    "n",
    "stop",
)
_IN_TEXT = tuple(p for p in PARAMS if p not in ("n", "stop"))  # too common as words to find in a message
# What a refusal says (the provider's code, or its wording): the parameter or value is not accepted.
_CODES = frozenset({"unsupported_parameter", "unsupported_value", "extra_forbidden"})
_REFUSED = re.compile(
    r"unsupported|not supported|does not support|not allowed|not enabled|not permitted|extra inputs"
    r"|cannot both be specified",
    re.IGNORECASE,
)
_COMPLETIONS = re.compile(r"v1/completions|chat model", re.IGNORECASE)
_CODE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,39}$")
# An engine's top-k cap in its own words: (what was capped, the cap). vLLM's SamplingParams
# ("Requested sample|prompt logprobs of 5, which is greater than max allowed: 2"), TGI's router
# ("`top_n_tokens` must be >= 0 and <= 5. Given: 20"), SGLang's prefill-decode split
# ("top_logprobs_num 129 exceeds the maximum 128").
_CAPS = (
    re.compile(r"Requested (sample|prompt) logprobs of \d+, which is greater than max allowed: (\d+)"),
    re.compile(r"`?(top_n_tokens)`? must be >= 0 and <= (\d+)"),
    re.compile(r"(top_logprobs_num) \d+ exceeds the maximum (\d+)"),
)

# The profile key that fixes each refused parameter, and the preset that sets it for the usual family.
_FIX = {
    "max_tokens": 'set request.token_param = "max_completion_tokens"',
    "max_completion_tokens": 'set request.token_param = "max_tokens"',
    "logprobs": 'set request.logprobs = "off" (judged on text)',
    "top_logprobs": 'set request.logprobs = "off" (judged on text)',
    "seed": 'add "seed" to request.omit (Mistral takes request.extra_body = { random_seed = 0 })',
    "completions": "set request.completions = false and send raw-prompt canaries to another backend",
}
_PRESET = {
    "max_tokens": "openai-reasoning",
    "temperature": "openai-reasoning",
    "top_p": "anthropic-compat",
    "seed": "mistral",
    "presence_penalty": "xai",
    "frequency_penalty": "xai",
}
# The family an error envelope's shape gives away, and the preset for it (it beats the table above).
_FAMILY_PRESET = {
    "gemini": "gemini-compat",
    "mistral": "mistral",
    "xai": "xai",
    "anthropic": "anthropic-compat",
}


def classify(status: int, body: str, backend: str) -> tuple[ErrorKind, str]:
    """The kind of an HTTP error reply and its one-line message (for the store, the logs and ``check``)."""
    message, code, param, family = _read(body)
    if status in (400, 422) and (cap := _cap(message)) is not None:
        what = "prompt_logprobs" if cap[0] == "prompt" else "top_logprobs"
        scoring = " (the scoring of forced canaries and reference checks)" if cap[0] == "prompt" else ""
        return ErrorKind.CONFIG, (
            f"backend {backend!r}: HTTP {status}: the server refuses {what} above {cap[1]}{scoring}; "
            f"set request.top_logprobs = {min(cap[1], TOP_K_MAX)}"
        )
    refused = _refused(status, message, code, param)
    if refused is not None:
        return ErrorKind.CONFIG, _explain(backend, status, code, refused, family)
    return _status_kind(status), f"HTTP {status}: {(message or body.strip() or '(empty body)')[:300]}"


def top_k_limit(status: int, body: str) -> int | None:
    """The most top-k logprobs the server says it allows, when an error reply is such a cap."""
    cap = _cap(_read(body)[0]) if status in (400, 422) else None
    return None if cap is None else cap[1]


def _cap(message: str) -> tuple[str, int] | None:
    for pattern in _CAPS:
        if m := pattern.search(message):
            return m.group(1), int(m.group(2))
    return None


def _status_kind(status: int) -> ErrorKind:
    if status == 429:
        return ErrorKind.RATE_LIMITED
    if status in (401, 403):
        return ErrorKind.AUTH
    return ErrorKind.HTTP_5XX if status >= 500 else ErrorKind.HTTP_4XX


def _refused(status: int, message: str, code: str | None, param: str | None) -> str | None:
    """The parameter a refusal names (``completions`` for the endpoint), or None when it is no refusal."""
    if status == 404 and _COMPLETIONS.search(message):
        return "completions"
    named = param if param in PARAMS else _named(message)
    if named is None:
        return None
    if status == 403:  # 403 is auth, except "not allowed to request logprobs" (o4-mini)
        return named if named in ("logprobs", "top_logprobs") and _REFUSED.search(message) else None
    if status in (400, 422) and (code in _CODES or _REFUSED.search(message)):
        if "cannot both be specified" in message and named == "temperature":
            return "top_p"  # Anthropic: temperature and top_p together; canaries decide by temperature
        return named
    return None


def _named(message: str) -> str | None:
    """The first profile parameter a message names (``presencePenalty`` is ``presence_penalty``)."""
    for word in re.findall(r"[A-Za-z_]+", message):
        snake = re.sub(r"(?<=[a-z])([A-Z])", r"_\1", word).lower()
        if snake in _IN_TEXT:
            return snake
    return None


def _explain(backend: str, status: int, code: str | None, param: str, family: str | None) -> str:
    what = "the /completions endpoint" if param == "completions" else param
    if code == "unsupported_value":
        what = f"this value of {param}"
    fix = _FIX.get(param, f'add "{param}" to request.omit')
    preset = _FAMILY_PRESET.get(family or "") or _PRESET.get(param)
    if param in ("logprobs", "top_logprobs") and preset is None:
        preset = "openai-reasoning" if status == 403 else "groq" if family == "openai" else None
    hint = f' (or preset = "{preset}")' if preset and param != "completions" else ""
    label = f" {code}" if code else ""
    return f"backend {backend!r}: HTTP {status}{label}: the server refuses {what}; {fix}{hint}"


def _read(body: str) -> tuple[str, str | None, str | None, str | None]:
    """(message, code, param, family) from an error body in any of the envelopes providers use; a body
    that is no JSON is its own message."""
    try:
        doc = json.loads(body)
    except ValueError:
        return body.strip(), None, None, None
    if isinstance(doc, list) and doc and isinstance(doc[0], dict):  # Gemini's compat layer wraps it in a list
        doc = doc[0]
    if not isinstance(doc, dict):
        return body.strip(), None, None, None
    err = doc.get("error", doc)
    detail = _detail(doc)
    if detail is not None:  # Mistral (FastAPI): the refused field is the last element of ``loc``
        return detail[0], detail[1], detail[2], "mistral"
    if isinstance(err, str):  # xAI: {"code": "Client specified an invalid argument", "error": "..."}
        return err, None, None, "xai" if isinstance(doc.get("code"), str) else None
    if not isinstance(err, dict):
        return body.strip(), None, None, None
    message = err.get("message")
    message = message if isinstance(message, str) else json.dumps(message) if message else body.strip()
    code = next(
        (c for c in (err.get("code"), err.get("type")) if isinstance(c, str) and _CODE.match(c)), None
    )
    if code in ("invalid_request_error", "error"):
        code = None  # the category of every 4xx: says nothing
    param = err.get("param") if isinstance(err.get("param"), str) else None
    family = (
        "gemini"
        if err.get("status") == "INVALID_ARGUMENT"
        else "anthropic"
        if doc.get("type") == "error"
        else "openai"
    )
    return message, code, param, family


def _detail(doc: dict) -> tuple[str, str, str | None] | None:
    """A FastAPI validation error (``detail``, at the top or inside ``message``): (msg, type, field)."""
    inner = doc.get("message")
    detail = doc.get("detail") or (inner.get("detail") if isinstance(inner, dict) else None)
    if not isinstance(detail, list) or not detail or not isinstance(detail[0], dict):
        return None
    first = detail[0]
    loc = first.get("loc")
    field = loc[-1] if isinstance(loc, list) and loc and isinstance(loc[-1], str) else None
    kind = first.get("type") if isinstance(first.get("type"), str) else "invalid"
    return str(first.get("msg") or ""), kind, field
