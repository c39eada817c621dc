"""Teacher forcing over vLLM's OpenAI-compatible API: score a given continuation token by token.

vLLM computes the logprob of every *prompt* token when a completion request asks for ``prompt_logprobs``
(a vLLM extension). Sending the canary's prompt followed by the continuation, as token ids, with
``max_tokens = 1`` therefore scores the continuation at every position, in one prefill, with nothing
sampled that matters. The prompt is tokenized by the server itself (``POST /tokenize``: the chat template
applied with the generation prompt, or a raw prompt with the special tokens a completion adds) and the
continuation without special tokens, so the ids are exactly the ones a generation would have seen.

The response's ``choices[0].prompt_logprobs`` holds, per prompt position, ``null`` (the first) or an
object keyed by token id: ``{"logprob", "rank", "decoded_token"}`` for the top-k tokens plus the actual
one. Tokens are named ``token_id:N`` as the ``vllm`` kind's generated tokens are (`vllm_server`), so a
scored and a generated answer compare position by position.

Every scoring request carries a fresh ``cache_salt`` (`cache_salt`), so it never reads a prefix another
request left in vLLM's prefix cache: ``prompt_logprobs`` change with the order of requests while prefix
caching is on, vLLM's default (vllm#42019: the positions a cache hit covers keep stale values; the fix, PR
#42245, is open). vLLM derives a skip of the cache lookup from ``prompt_logprobs``
(``skip_reading_prefix_cache`` in vllm/sampling_params.py), but that skip is derived, and a frontend that
builds the request otherwise has lost it (ai-dynamo/dynamo#14323); a salt no other request shares holds
whatever serves the request. It goes on the wire only: the recorded request (`score_request`), its hash and
its stored body stay the same from probe to probe, so the canary keeps its baseline.
"""

from __future__ import annotations

import secrets
from typing import Any

from canaryd.backends.openai_request import request_hash
from canaryd.backends.openai_wire import InvalidResponse
from canaryd.canaries import Canary
from canaryd.observation import TokenLogprob, logprob_problem

# The stack field of a kind whose scoring requests carry a fresh `cache_salt` each.
SALTED = {"request.scoring_cache_salt": "per-request"}


def cache_salt() -> str:
    """A salt no other request shares. vLLM (>= 0.9) hashes a request's ``cache_salt`` into its first
    prefix-cache block, and so into every block chained after it (``cache_salt`` on ``CompletionRequest`` in
    vllm/entrypoints/openai/completion/protocol.py; ``cache_salt_keys`` in vllm/v1/core/kv_cache_utils.py):
    requests with different salts never share a cached block. It takes a non-empty string of at most 128
    characters without ``@``, ``/``, ``\\`` or NUL (``validate_cache_salt`` in
    vllm/entrypoints/generate/base/protocol.py): 32 hex digits."""
    return secrets.token_hex(16)


def score_request(model: str, canary: Canary) -> dict:
    """What a forced canary's scoring decides (recorded as its request; ids and a fresh ``cache_salt``
    are filled in when sent)."""
    assert canary.continuation is not None
    body: dict[str, Any] = {"model": model}
    if canary.messages is not None:
        body["messages"] = [m.model_dump() for m in canary.messages]
    else:
        body["prompt"] = canary.prompt
    body.update(
        continuation=canary.continuation,
        prompt_logprobs=canary.decoding.top_logprobs,
        max_tokens=1,
        temperature=0.0,
    )
    return body


def score_hash(model: str, canary: Canary) -> str:
    return request_hash(score_request(model, canary))


def tokenize_prompt(model: str, canary: Canary) -> dict:
    """The ``/tokenize`` body for the canary's prompt as a generation would see it."""
    if canary.messages is not None:
        messages = [m.model_dump() for m in canary.messages]
        return {"model": model, "messages": messages, "add_generation_prompt": True}
    return {"model": model, "prompt": canary.prompt, "add_special_tokens": True}


def tokenize_continuation(model: str, canary: Canary) -> dict:
    return {"model": model, "prompt": canary.continuation, "add_special_tokens": False}


def token_ids(body: Any, what: str) -> list[int]:
    """The ``tokens`` of a ``/tokenize`` answer, or `InvalidResponse` naming ``what``."""
    ids = body.get("tokens") if isinstance(body, dict) else None
    if not isinstance(ids, list) or not all(type(i) is int and i >= 0 for i in ids):
        raise InvalidResponse(f"/tokenize ({what}): 'tokens' is not a list of token ids")
    return ids


def completion_body(model: str, ids: list[int], k: int, salt: str) -> dict:
    """The completion request that scores ``ids`` (prompt + continuation), salted with ``salt``."""
    return {
        "model": model,
        "prompt": ids,
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": k,
        "return_tokens_as_token_ids": True,
        "cache_salt": salt,
    }


def scored_tokens(body: Any, ids: list[int], start: int, k: int) -> list[TokenLogprob]:
    """The continuation's tokens (``ids[start:]``) with their logprobs and top-``k`` alternatives, read
    from a completion answer's ``prompt_logprobs``; `InvalidResponse` naming the field otherwise."""
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise InvalidResponse("scoring: response has no choices")
    plp = choices[0].get("prompt_logprobs")
    if not isinstance(plp, list) or len(plp) != len(ids):
        got = len(plp) if isinstance(plp, list) else type(plp).__name__
        raise InvalidResponse(f"choices.0.prompt_logprobs: expected {len(ids)} positions, got {got}")
    out = []
    for pos in range(start, len(ids)):
        where = f"choices.0.prompt_logprobs.{pos}"
        entry = plp[pos]
        if not isinstance(entry, dict):
            raise InvalidResponse(f"{where}: not an object")
        ranked: list[tuple[int, int, float]] = []
        for key, v in entry.items():
            lp = v.get("logprob") if isinstance(v, dict) else None
            rank = v.get("rank") if isinstance(v, dict) else None
            if not (isinstance(key, str) and key.isdigit()) or (why := logprob_problem(lp)) is not None:
                raise InvalidResponse(f"{where}.{key}: not a token id with a usable logprob ({why or 'key'})")
            ranked.append((rank if type(rank) is int else 1 << 30, int(key), float(lp)))
        actual = next((lp for _, tid, lp in ranked if tid == ids[pos]), None)
        if actual is None:
            raise InvalidResponse(f"{where}: the scored token {ids[pos]} is missing")
        ranked.sort(key=lambda r: (r[0], -r[2]))
        top = tuple((f"token_id:{tid}", lp) for _, tid, lp in ranked[:k])
        out.append(TokenLogprob(f"token_id:{ids[pos]}", actual, ids[pos], None, top))
    return out
