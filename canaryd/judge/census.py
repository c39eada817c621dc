"""The census's statistics: what varies across N identical probes of one canary (pure; no I/O).

``summarize`` reduces one batch size's probes to a `Group`: distinct completions (by token ids; the text
when the server gives no ids), distinct **signatures** (text, tokens and every logprob, bit for bit), how
often the modal completion came back, where the others first left it (a token index histogram), and the
per-position logprob spread: max − min of the chosen token's logprob at each position of the modal
completion, over the probes that agree with it up to and including that position. A `Census` is
**deterministic** when the probes sent alone share one signature, and **batch-invariant** when every batch
size gave that same single signature. Failed probes are counted (``errors``) but never enter the
statistics. `canaryd.probe.census` sends the probes.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from canaryd.judge.stats import common_prefix
from canaryd.observation import Observation


def completion_key(obs: Observation) -> tuple:
    """What makes two completions the same: the token ids, or the text when the server gave no ids."""
    ids = [t.token_id for t in obs.tokens]
    if obs.tokens and None not in ids:
        return ("ids", tuple(ids))
    return ("text", obs.text or "")


def _sequence(obs: Observation) -> tuple:
    """The completion as a sequence whose indices are token positions (characters if there are no tokens)."""
    ids = [t.token_id for t in obs.tokens]
    if obs.tokens:
        return tuple(ids) if None not in ids else tuple(t.token for t in obs.tokens)
    return tuple(obs.text or "")


def signature(obs: Observation) -> str:
    """A bit-exact fingerprint: text, every token and every logprob (chosen and top-k, as float hex)."""
    body = [
        obs.text,
        [[t.token_id, t.token, t.logprob.hex(), [[tok, lp.hex()] for tok, lp in t.top]] for t in obs.tokens],
    ]
    return hashlib.sha256(json.dumps(body).encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Group:
    """The census of one batch size. Every figure counts successful probes only, except ``errors``."""

    n: int  # probes sent, errors included
    errors: int
    distinct_completions: int
    distinct_signatures: int
    modal_count: int  # probes that returned the modal (most frequent) completion
    modal_signature: str | None  # the most frequent signature
    modal_text: str | None
    first_divergence: dict[int, int]  # token index → how many non-modal probes first left the mode there
    spread: tuple[float, ...]  # per position of the modal completion: max − min of the chosen logprob
    max_spread: float

    @property
    def ok(self) -> int:
        return self.n - self.errors

    def as_dict(self) -> dict:
        d = asdict(self)
        d["first_divergence"] = {str(k): v for k, v in self.first_divergence.items()}
        d["spread"] = list(self.spread)
        return d


def summarize(observations: Sequence[Observation]) -> Group:
    """Reduce the probes of one batch size to its `Group` figures."""
    good = [o for o in observations if o.ok]
    if not good:
        return Group(len(observations), len(observations), 0, 0, 0, None, None, {}, (), 0.0)
    keys = [completion_key(o) for o in good]
    by_key = Counter(keys)
    sigs = Counter(signature(o) for o in good)
    modal_key, modal_count = by_key.most_common(1)[0]
    modal = good[keys.index(modal_key)]
    modal_seq = _sequence(modal)
    # where each probe leaves the modal path (its full length for the modal probes themselves)
    left = [common_prefix(modal_seq, _sequence(o)) for o in good]
    divergence = Counter(d for d, k in zip(left, keys, strict=True) if k != modal_key)
    spread: list[float] = []
    for j in range(len(modal.tokens)):
        # probes on the modal path up to and including position j: their chosen logprobs are comparable
        values = [o.tokens[j].logprob for o, d in zip(good, left, strict=True) if d > j and len(o.tokens) > j]
        spread.append(max(values) - min(values))
    return Group(
        n=len(observations),
        errors=len(observations) - len(good),
        distinct_completions=len(by_key),
        distinct_signatures=len(sigs),
        modal_count=modal_count,
        modal_signature=sigs.most_common(1)[0][0],
        modal_text=modal.text,
        first_divergence=dict(sorted(divergence.items())),
        spread=tuple(spread),
        max_spread=max(spread, default=0.0),
    )


@dataclass(frozen=True, slots=True)
class Census:
    """One canary × backend: a `Group` per batch size, and the two verdicts the census exists for."""

    backend: str
    canary: str
    groups: dict[int, Group]

    @property
    def deterministic(self) -> bool | None:
        """Alone (batch size 1), every probe gave one signature; None when batch size 1 was not measured."""
        alone = self.groups.get(1)
        return None if alone is None else alone.distinct_signatures == 1

    @property
    def batch_invariant(self) -> bool | None:
        """Every batch size gave one and the same signature; None with fewer than two batch sizes."""
        if len(self.groups) < 2:
            return None
        gs = self.groups.values()
        return all(g.distinct_signatures == 1 for g in gs) and len({g.modal_signature for g in gs}) == 1

    @property
    def complete(self) -> bool:
        """Every batch size had at least one successful probe (otherwise nothing could be judged)."""
        return all(g.ok for g in self.groups.values())

    def verdict(self) -> str:
        """One line: 'deterministic, batch-invariant', or what is not and why."""
        parts = []
        if self.deterministic is not None:
            alone = self.groups[1]
            parts.append(
                "deterministic"
                if self.deterministic
                else f"NOT deterministic ({alone.distinct_signatures} signatures alone)"
            )
        if self.batch_invariant is not None:
            differ = sorted(b for b, g in self.groups.items() if g.distinct_signatures != 1)
            why = (
                f"several signatures at batch size {', '.join(map(str, differ))}"
                if differ
                else "the signature changes with batch size"
            )
            parts.append("batch-invariant" if self.batch_invariant else f"NOT batch-invariant ({why})")
        return ", ".join(parts) or "nothing to judge"

    def as_dict(self) -> dict:
        return {
            "backend": self.backend,
            "canary": self.canary,
            "deterministic": self.deterministic,
            "batch_invariant": self.batch_invariant,
            "verdict": self.verdict(),
            "groups": [{"batch_size": b, **g.as_dict()} for b, g in self.groups.items()],
        }
