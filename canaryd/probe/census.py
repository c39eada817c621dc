"""The nondeterminism census: one canary sent N times, alone and inside crowded batches; what varies?

"Same prompt, same weights, temperature 0" gives one answer only on a batch-invariant engine: elsewhere the
result depends on what else shared the batch (Thinking Machines: 1,000 identical greedy requests to
Qwen3-235B gave 80 distinct completions). The census measures this from outside, per canary × backend:

* ``collect`` sends ``n`` probes of the canary for each batch size ``b``: at ``b = 1`` one after another;
  at ``b > 1`` each probe is released together with ``b − 1`` filler requests (other prompts, same
  decoding), so the engine batches them with it. Filler answers are thrown away.
* ``summarize`` reduces one batch size's probes to a `Group`: distinct completions (by token ids; the text
  when the server gives no ids), distinct **signatures** (text, tokens and every logprob, bit for bit),
  how often the modal completion came back, where the others first left it (a token index histogram),
  and the per-position logprob spread: max − min of the chosen token's logprob at each position of the
  modal completion, over the probes that agree with it up to and including that position.
* a `Census` is **deterministic** when the probes sent alone share one signature, and **batch-invariant**
  when every batch size gave that same single signature.

Failed probes are counted (``errors``) but never enter the statistics. Nothing here touches the history:
census probes would disturb the baselines. ``canaryd baseline calibrate`` reuses `collect` and `fillers_for`.

A backend whose kind serialises its probes (concurrency 1) never batches its fillers with the canary.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from rich.table import Table

from canaryd.backends import Backend
from canaryd.canaries import Canary, Message
from canaryd.errors import InputError
from canaryd.judge.stats import common_prefix
from canaryd.observation import Observation
from canaryd.probe.shapes import shape_of

MAX_BATCH = 256  # the most requests a census puts in flight at once (BackendConfig.concurrency's bound)

# Varied prompts that crowd a batch when the suites offer too few other canaries.
_FILLER_PROMPTS = (
    "Write a haiku about autumn leaves.",
    "List five prime numbers greater than 100.",
    "Explain in one sentence why the sky is blue.",
    "Translate 'good morning' into French, German and Spanish.",
    "Name three rivers in Africa.",
    "Describe a bicycle to someone who has never seen one.",
    "What is the boiling point of water at sea level in Fahrenheit?",
    "Give a synonym for 'rapid'.",
)
BUILTIN_FILLERS = tuple(
    Canary(id=f"census-filler-{i}", messages=(Message(role="user", content=p),), suite="census")
    for i, p in enumerate(_FILLER_PROMPTS)
)


def parse_batch_sizes(value: str) -> tuple[int, ...]:
    """``"1,8,32"`` → ``(1, 8, 32)``: distinct positive integers up to `MAX_BATCH`, in the given order."""
    sizes: list[int] = []
    for part in value.split(","):
        part = part.strip()
        if not part.isdigit() or not 1 <= int(part) <= MAX_BATCH:
            raise InputError(
                f"--batch-sizes: {part!r} is not an integer from 1 to {MAX_BATCH} (e.g. --batch-sizes 1,8,32)"
            )
        if int(part) not in sizes:
            sizes.append(int(part))
    return tuple(sizes)


def fillers_for(canary: Canary, others: Iterable[Canary]) -> list[Canary]:
    """Filler requests for ``canary``: the other single-request canaries, then the built-in prompts, all with
    the canary's decoding, so fillers stay in the batch as long as the canary can (same ``max_tokens``)."""
    pool = [c for c in others if c.id != canary.id and shape_of(c).single_request] + list(BUILTIN_FILLERS)
    return [c.model_copy(update={"decoding": canary.decoding}) for c in pool]


def collect(
    backend: Backend, canary: Canary, *, n: int, batch_sizes: Sequence[int], fillers: Sequence[Canary]
) -> dict[int, list[Observation]]:
    """``n`` probes of ``canary`` per batch size; at ``b > 1`` each shares the moment with ``b − 1`` fillers.

    The ``b`` requests of a round wait on one barrier and are released together, so the engine sees them
    in flight at once (continuous batching puts them in the same steps). Fillers cycle through
    ``fillers`` round after round, varying the batch's make-up. ``backend`` must allow ``max(batch_sizes)``
    requests in flight (its ``concurrency``), or the client queues them and the batch is not crowded.
    """
    if any(b > 1 for b in batch_sizes) and not fillers:
        raise ValueError("batch sizes above 1 need filler canaries")
    cycle = itertools.cycle(fillers)
    out: dict[int, list[Observation]] = {}
    with ThreadPoolExecutor(max_workers=max(batch_sizes), thread_name_prefix="census") as pool:
        for b in batch_sizes:
            out[b] = []
            for _ in range(n):
                if b == 1:
                    out[b].append(backend.probe(canary))
                    continue
                barrier = threading.Barrier(b)

                def send(c: Canary, barrier: threading.Barrier = barrier) -> Observation:
                    barrier.wait()  # the pool has a thread for each of the round's b requests
                    return backend.probe(c)

                mine = pool.submit(send, canary)
                crowd = [pool.submit(send, next(cycle)) for _ in range(b - 1)]
                out[b].append(mine.result())
                for f in crowd:
                    f.result()  # wait, so rounds never overlap; filler observations are discarded
    return out


# -- statistics (pure) ---------------------------------------------------------------------------------


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


def run_census(
    backend: Backend, canary: Canary, *, n: int, batch_sizes: Sequence[int], fillers: Sequence[Canary]
) -> Census:
    """`collect` then `summarize` each batch size."""
    observed = collect(backend, canary, n=n, batch_sizes=batch_sizes, fillers=fillers)
    return Census(backend.name, canary.id, {b: summarize(obs) for b, obs in observed.items()})


def _histogram(h: dict[int, int], limit: int = 4) -> str:
    items = [f"{i}×{c}" for i, c in h.items()]
    return " ".join(items[:limit]) + (" …" if len(items) > limit else "") if items else "-"


def census_table(censuses: Sequence[Census]) -> Table:
    """One row per backend × canary × batch size."""
    t = Table(title="canaryd census", title_justify="left")
    cols = ("backend", "canary", "batch", "ok/n", "completions", "signatures", "modal", "1st div", "spread")
    for col in cols:
        t.add_column(col, overflow="fold")
    for c in censuses:
        for b, g in c.groups.items():
            t.add_row(
                c.backend,
                c.canary,
                str(b),
                f"{g.ok}/{g.n}",
                str(g.distinct_completions),
                str(g.distinct_signatures),
                str(g.modal_count),
                _histogram(g.first_divergence),
                f"{g.max_spread:.3g}",
            )
    return t
