"""What every answer must pass before it is judged or stored, whichever kind produced it.

The kinds' parsers already refuse what they can name in their own format (`openai_wire`, `vllm_offline`);
this is the one check every kind passes through, right after sending (each shape's ``send``, a chain's
steps, the census and calibration probes):

* a logprob that is NaN, ±inf, above 0 or absurdly negative (`canaryd.observation.logprob_problem`) makes
  the observation ``invalid_response``: no comparison ever sees it;
* text that UTF-8 cannot encode (a lone surrogate) in the answer, its fingerprint or model, a token or the
  stack makes it ``invalid_response`` too: it could be neither stored nor exported;
* more tokens than the canary's ``max_tokens`` asked for (counted from the logprobs, or from the server's
  ``usage.completion_tokens`` net of its hidden reasoning tokens when there are none) makes it
  ``too_large``: a server that ignores the limit is itself a finding;
* recorded headers are bounded, and every string of every observation (a failed one's error message
  included) is made storable.

An observation marked here keeps its text (escaped where needed) but loses its tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from canaryd.observation import ErrorKind, Observation, storable, text_problem, tokens_problem

if TYPE_CHECKING:
    from canaryd.backends import Backend
    from canaryd.canaries import Canary

MAX_HEADERS = 32  # a kind records a few allow-listed headers; anything beyond this is noise
MAX_HEADER_VALUE = 256


def probe(backend: Backend, canary: Canary) -> Observation:
    """``backend.probe(canary)``, vetted against the canary's own decoding (a forced canary's tokens are
    its continuation's, which no ``max_tokens`` bounds)."""
    limit = canary.decoding.max_tokens if canary.continuation is None else None
    return vet(backend.probe(canary), limit)


def _bad(value: object) -> bool:
    return isinstance(value, str) and text_problem(value) is not None


def _ascii(tokens: list) -> bool:
    """Every token and alternative an ASCII string: none can be a lone surrogate (the common case)."""
    return all(
        type(t.token) is str and t.token.isascii() and all(type(x) is str and x.isascii() for x, _ in t.top)
        for t in tokens
    )


def _text_fields(obs: Observation) -> list[tuple[str, object]]:
    fields: list[tuple[str, object]] = [
        (name, getattr(obs, name))
        for name in ("text", "finish_reason", "system_fingerprint", "response_model")
    ]
    # ASCII tokens have no text problem: skipping them changes no answer of `problem`, only its cost
    for i, t in enumerate(() if _ascii(obs.tokens) else obs.tokens):
        fields.append((f"tokens.{i}.token", t.token))
        fields += [(f"tokens.{i}.top.{j}.token", tok) for j, (tok, _) in enumerate(t.top)]
    for key, value in obs.stack.items():
        fields += [("stack key", key), (f"stack.{storable(str(key))}", value)]
    return fields


def storable_fields(fields: dict[str, str]) -> dict[str, str]:
    """A stack (snapshot or response fields) whose keys and values all have a UTF-8 form (escaped where
    they had none): it is hashed and stored as UTF-8."""
    if not any(_bad(k) or _bad(v) for k, v in fields.items()):
        return fields
    return {storable(str(k)): storable(str(v)) for k, v in fields.items()}


def too_large(obs: Observation, max_tokens: int | None) -> str | None:
    """``N tokens > max_tokens M`` when the answer is longer than the request allowed (None: it is not)."""
    count = len(obs.tokens) if obs.tokens else obs.completion_tokens
    if not obs.tokens and count is not None and obs.reasoning_tokens:  # hidden reasoning has its own budget
        count -= obs.reasoning_tokens
    if max_tokens is not None and count is not None and count > max_tokens:
        return f"{count} tokens > max_tokens {max_tokens}"
    return None


def problem(obs: Observation, max_tokens: int | None) -> tuple[ErrorKind, str] | None:
    """What disqualifies a successful answer (None: nothing)."""
    for where, value in _text_fields(obs):
        if isinstance(value, str) and (why := text_problem(value)) is not None:
            return ErrorKind.INVALID_RESPONSE, f"{where}: {why}"
    if (why := tokens_problem(obs.tokens)) is not None:
        return ErrorKind.INVALID_RESPONSE, why
    if (why := too_large(obs, max_tokens)) is not None:
        return ErrorKind.TOO_LARGE, why
    return None


def vet(obs: Observation, max_tokens: int | None) -> Observation:
    """``obs``, marked with the first problem `problem` finds in it, and made storable either way."""
    if obs.ok:
        found = problem(obs, max_tokens)
    elif obs.error_kind is ErrorKind.NO_LOGPROBS and (why := too_large(obs, max_tokens)) is not None:
        found = ErrorKind.TOO_LARGE, why  # worth knowing even from a server that also dropped the logprobs
    else:
        found = None
    if found is not None:
        obs.error_kind, obs.error = found
        obs.tokens = []
    for name in ("text", "finish_reason", "system_fingerprint", "response_model", "error"):
        if _bad(value := getattr(obs, name)):
            setattr(obs, name, storable(value))
    obs.stack = storable_fields(obs.stack)
    if len(obs.headers) > MAX_HEADERS or any(
        _bad(k) or _bad(v) or len(str(v)) > MAX_HEADER_VALUE for k, v in obs.headers.items()
    ):
        kept = list(obs.headers.items())[:MAX_HEADERS]
        obs.headers = {storable(str(k)): storable(str(v)[:MAX_HEADER_VALUE]) for k, v in kept}
    return obs
