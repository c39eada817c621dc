"""Conformance judgements: whether an answer made the expected tool call, and whether a server honoured a
parameter a conformance pair varied. Pure functions of the observations; no baseline involved (each side is
compared with its own baseline as any answer is, `canaryd.judge.compare`).
"""

from __future__ import annotations

from canaryd.conform import SIDES, Conform
from canaryd.observation import Observation
from canaryd.toolcalls import ExpectedCall, check_call

# Where the token limit travels in a request body: chat, reasoning models, the Responses API.
LIMIT_KEYS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def tool_call_verdict(expected: ExpectedCall, obs: Observation) -> tuple[bool, str | None]:
    """(correct, why not): the answer's first tool call against the expected one (`check_call`)."""
    why = check_call(expected, obs.tool_calls)
    return why is None, why


def sent_limit(obs: Observation) -> int | None:
    """The token limit the request carried (None: none was sent, e.g. a profile with token_param none)."""
    for key in LIMIT_KEYS:
        value = obs.request.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _count(obs: Observation) -> int | None:
    """Completion tokens, reasoning included (what the limit bounds): usage, else the logprob entries."""
    if obs.completion_tokens is not None:
        return obs.completion_tokens
    return len(obs.tokens) if obs.has_logprobs else None


def judge_pair(spec: Conform, low: Observation, high: Observation) -> dict[str, str]:
    """What each side failed to show, by side (``low``/``high``); empty when the server honoured the
    parameter. A side that already failed (an error) is left to its own error; nothing is judged then."""
    if not (low.ok and high.ok):
        return {}
    pair = {"low": low, "high": high}
    if spec.param == "max_tokens":
        return _max_tokens(spec, pair)
    return _reasoning_effort(spec, pair)


def _max_tokens(spec: Conform, pair: dict[str, Observation]) -> dict[str, str]:
    out: dict[str, str] = {}
    counts: dict[str, int] = {}
    for side in SIDES:
        obs = pair[side]
        limit = sent_limit(obs)  # a reasoning profile adds its hidden budget to the canary's value
        if limit is None:
            out[side] = "cannot judge max_tokens: the request carried no token limit (profile token_param)"
            continue
        n = _count(obs)
        if n is None:
            out[side] = "cannot judge max_tokens: the answer reports no token count (no usage, no logprobs)"
        elif n > limit:
            out[side] = f"max_tokens ignored: {n} completion tokens > the {limit} asked for"
        else:
            counts[side] = n
    if out or spec.wants == "limit":
        return out
    low, high = pair["low"], pair["high"]
    limit = sent_limit(low)
    if counts["low"] < (limit or 0):
        return {
            "low": f"cannot judge max_tokens: the answer ended after {counts['low']} tokens, before the low "
            f"limit {limit} (finish_reason {low.finish_reason!r}): the prompt must ask for a longer answer"
        }
    if low.finish_reason != "length":
        return {"low": f"cut at max_tokens {limit} but finish_reason is {low.finish_reason!r}, not 'length'"}
    if counts["high"] <= counts["low"]:
        return {
            "high": f"max_tokens had no effect: {counts['high']} tokens at max_tokens "
            f"{sent_limit(high)}, {counts['low']} at {limit}"
        }
    return {}


def _reasoning_effort(spec: Conform, pair: dict[str, Observation]) -> dict[str, str]:
    out: dict[str, str] = {}
    for side in SIDES:
        sent = pair[side].request.get("reasoning_effort", (pair[side].request.get("reasoning") or {}))
        sent = sent.get("effort") if isinstance(sent, dict) else sent
        if sent != spec.value(side):
            out[side] = (
                f"cannot judge reasoning_effort: the request carried {sent!r}, not {spec.value(side)!r} "
                "(a profile's extra_body or omit overrides it)"
            )
        elif pair[side].reasoning_tokens is None:
            out[side] = (
                "cannot judge reasoning_effort: the answer reports no reasoning tokens "
                "(usage.completion_tokens_details.reasoning_tokens)"
            )
    if out:
        return out
    lo, hi = pair["low"].reasoning_tokens or 0, pair["high"].reasoning_tokens or 0
    if not hi > lo * spec.min_ratio:
        bound = "more than" if spec.min_ratio == 1 else f"more than {spec.min_ratio:g} ×"
        return {
            "high": f"reasoning_effort had no effect: {hi} reasoning tokens at {spec.high!r}, {lo} at "
            f"{spec.low!r} (expected {bound} the low side's)"
        }
    return {}
