"""The detection bench's text-only provider: the same servers' answers with their logprobs withheld, as an
endpoint without logprobs gives them (Anthropic's and Gemini's OpenAI-compatible ones, most OpenRouter
providers). Only what reads text competes: canaryd on its text basis (the shipped suite and the tracking
suite, calibrated on text-only probes), exact match, the two-sample text test, the MET kernel and
Token-DiFR (the verifier re-scores the text; it never read the provider's logprobs). LT and the
teacher-forced canaries need logprobs, and the reference-gap check needs the provider's, so they sit out.
The T = 1 samples are left as served: MET and the two-sample test read their texts and token sequences
(which the verifier's tokenizer gives from the text), never a logprob.
"""

from __future__ import annotations

from dataclasses import replace

from bench.detection_lab import Served
from bench.detection_methods import METHODS, SHIPPED, TRACKING_ROW, Reference
from bench.detection_peers import DIFR, MET, PEERS
from canaryd.observation import Observation

TEXT_METHODS = {
    name: method
    for name, method in (METHODS | PEERS).items()
    if name in (SHIPPED, TRACKING_ROW, "exact text match", "two-sample text (T=1)", DIFR, MET)
}


def without_logprobs(obs: Observation) -> Observation:
    """An answer as a provider without logprobs returns it: the text, the usage, no per-token logprobs."""
    return replace(obs, tokens=[], has_logprobs=False)


def _pools(pools: dict[str, list[Observation]]) -> dict[str, list[Observation]]:
    return {cid: [without_logprobs(o) for o in obs] for cid, obs in pools.items()}


def text_only(ref: Reference, servers: dict[str, list[Served]]) -> tuple[Reference, dict[str, list[Served]]]:
    """The run as a text-only provider serves it: every answer the tested and calibrated servers gave, its
    logprobs withheld (the reference, a local engine, keeps its scorings: Token-DiFR's verifier)."""
    cal = _pools(ref.calibration)
    tref = replace(
        ref,
        calibration=cal,
        baseline={cid: obs[0] for cid, obs in cal.items()},
        tracking_calibration=_pools(ref.tracking_calibration),
    )
    keep = ("calibration", "tracking", "tracking calibration")
    out = {
        variant: [
            replace(
                s,
                greedy=_pools(s.greedy),
                extra={k: _pools(v) for k, v in s.extra.items() if k in keep},
            )
            for s in served
        ]
        for variant, served in servers.items()
    }
    return tref, out
