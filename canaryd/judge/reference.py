"""Reference checks: is a provider serving the weights it claims? Pure functions, no I/O.

A trusted reference (typically a local vLLM with the open weights) re-scores the provider's answer by
teacher forcing. For greedy decoding the Token-DiFR-style score of token t is

    d_t = logprob_ref(the reference's top-1 at t) − logprob_ref(the provider's token t)   (nats, ≥ 0)

which is 0 wherever the provider chose what the reference would have chosen. Different weights (a 4- or
8-bit round trip, another checkpoint) pick tokens the reference ranks lower, and d grows with every such
token; identical weights on an identical engine give exactly the reference's own d.

A canary's statistic compares the provider's answer with the reference's own greedy answer, both scored
on the reference (text in, re-tokenized: whatever that loses, both lose): 0 when they are the same tokens,
else how far apart the reference ranks the two tokens where the answers part (`parting`: the same prefix,
so the same distribution; where the reference's own token is its top-1 this is the provider token's d).
Flips between near-ties cost little (a provider on other hardware), flips to tokens the reference finds
unlikely cost much (other weights). The mean d over the provider's answer is reported beside it, as the
Token-DiFR figure. The null distribution is the reference's own noise: the same statistic between two of
its own answers. The statistic is tested one-sided against that null with a conformal p-value; the cycle
combines its canaries with a Bonferroni bound, so the chance that an honest provider is called a mismatch
in a cycle is at most ``alpha`` whatever the canaries' dependence (`decide`). When the null never exceeded
``tolerance`` (a deterministic engine: vLLM CPU's is exactly 0) the test is exact: any statistic above
``tolerance`` is out.

A parting needs a flipped token. Where the provider returns logprobs for the tokens the reference scored,
a second statistic needs none: the mean gap between the provider's logprobs and the reference's for the
same tokens, tested against the same gap between the reference's own generated logprobs and its scoring
of them (`canary_p_value` combines the two). Other weights or precision move every logprob.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from canaryd.observation import TokenLogprob


@dataclass(frozen=True, slots=True)
class Divergence:
    """How far the reference finds a provider's answer from its own choices, in nats per token."""

    mean_nats: float  # mean d_t over the scored tokens (the Token-DiFR figure)
    max_nats: float
    tokens: int  # tokens scored (the reference's tokenization of the provider's text)
    # mean |logprob_provider − logprob_ref| over the tokens, where the provider returned logprobs for the
    # same tokenization (None: no provider logprobs, or the tokenizations differ)
    logprob_gap: float | None = None
    retokenized: bool = False  # the provider's own tokens differ from the reference's tokenization

    def as_dict(self) -> dict:
        return {
            "mean_nats": self.mean_nats,
            "max_nats": self.max_nats,
            "tokens": self.tokens,
            "logprob_gap": self.logprob_gap,
            "retokenized": self.retokenized,
        }


def token_divergence(t: TokenLogprob) -> float:
    """d_t: the best logprob the reference ranked at this position minus the scored token's (≥ 0)."""
    best = max([t.logprob, *(lp for _, lp in t.top)])
    return max(0.0, best - t.logprob)


def _same_tokens(a: Sequence[TokenLogprob], b: Sequence[TokenLogprob]) -> bool:
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))


def divergence(scored: Sequence[TokenLogprob], provider: Sequence[TokenLogprob] = ()) -> Divergence:
    """The divergence of a provider's answer as the reference scored it (``scored``: the reference's
    tokenization of the provider's text). ``provider``: the provider's own tokens with logprobs, if it
    returned any; their logprobs are compared where both tokenizations agree."""
    if not scored:
        raise ValueError("nothing was scored")
    d = [token_divergence(t) for t in scored]
    gap, retokenized = None, False
    if provider:
        # a generated answer may end with its stop token, which is no part of the text that was scored
        if len(provider) == len(scored) + 1 and _same_tokens(scored, provider[:-1]):
            provider = provider[:-1]
        if _same_tokens(scored, provider):
            gap = sum(abs(p.logprob - r.logprob) for p, r in zip(provider, scored, strict=True)) / len(d)
        else:
            retokenized = True
    return Divergence(sum(d) / len(d), max(d), len(d), gap, retokenized)


def _same(a: TokenLogprob, b: TokenLogprob) -> bool:
    if a.token_id is not None and b.token_id is not None:
        return a.token_id == b.token_id
    return a.token == b.token


def parting(provider: Sequence[TokenLogprob], own: Sequence[TokenLogprob]) -> float:
    """How far apart the reference ranks two scored answers where they part, in nats: 0 when they are the
    same tokens; else |logprob(provider token) − logprob(own token)| at the first position they differ
    (scored on the same prefix), or, where one answer ended and the other went on, the divergence d of
    the token that went on."""
    for a, b in zip(provider, own, strict=False):
        if not _same(a, b):
            return abs(a.logprob - b.logprob)
    if len(provider) == len(own):
        return 0.0
    longer = provider if len(provider) > len(own) else own
    return token_divergence(longer[min(len(provider), len(own))])


def p_value(statistic: float, null: Sequence[float], tolerance: float = 0.0) -> float:
    """One-sided p-value of ``statistic`` against the reference's own divergences ``null``.

    Exact regime (every null value within ``tolerance``, a deterministic reference): 0 when the statistic
    is beyond ``tolerance``, else 1. Otherwise the conformal p-value ``(1 + #{null ≥ statistic}) / (n + 1)``:
    if the statistic is exchangeable with the null draws (an honest provider), ``P(p ≤ u) ≤ u``.
    """
    if statistic <= tolerance:
        return 1.0
    if not null:
        raise ValueError("no null divergences to compare with")
    if all(x <= tolerance for x in null):
        return 0.0
    return (1 + sum(x >= statistic for x in null)) / (len(null) + 1)


def canary_p_value(
    parting: float,
    null: Sequence[float],
    gap: float | None,
    gap_null: Sequence[float],
    tolerance: float = 0.0,
) -> float:
    """A canary's p-value from its parting and, where the provider returned logprobs for the tokens the
    reference scored, from its logprob gap too: the gap tested against the reference's own (its generated
    logprobs against its own scoring of them), the two combined by Bonferroni. The gap is what catches a
    change that flips no token: other weights or precision move every logprob even where the answer is
    the same."""
    p = p_value(parting, null, tolerance)
    if gap is None or not gap_null:
        return p
    return min(1.0, 2 * min(p, p_value(gap, gap_null, tolerance)))


@dataclass(frozen=True, slots=True)
class ReferenceDecision:
    mismatch: bool
    p_value: float  # the cycle's Bonferroni-combined p-value: min(1, m · min p)
    out: tuple[str, ...]  # canaries whose own p-value is at most alpha / m


def decide(p_values: Mapping[str, float], alpha: float) -> ReferenceDecision:
    """A cycle's reference verdict over its m canaries: mismatch when some canary's p ≤ alpha / m.

    Bonferroni: under an honest provider each p is (super-)uniform, so P(any p ≤ alpha/m) ≤ alpha per
    cycle, with no assumption about how the canaries depend on each other."""
    if not p_values:
        return ReferenceDecision(False, 1.0, ())
    m = len(p_values)
    out = tuple(c for c, p in p_values.items() if p <= alpha / m)
    return ReferenceDecision(bool(out), min(1.0, m * min(p_values.values())), out)
