"""Answers that flip: a canary's learned answer distribution, and its rate of wrong answers.

A cloud API at T = 0 answers an identical greedy request with one of a few texts (gpt-4o-mini: about 24 %
of exact repeats), and a GPU engine's greedy answer flips at a near tie. Such a canary is judged on the
answers its noise model learned (the learning window's texts, or `baseline calibrate`'s K probes: the
``answers`` entry of its calibration row), never on the first text it gave:

* **The distribution.** The learned window holds K answers, counted by text. For each w of ``WINDOWS``,
  the newest w passes since the model was fitted (this one included, read from the observations of the
  canary × backend × serving configuration) are compared with a reference: the learned window and at most
  ``HISTORY`` older passes since the fit that were judged without drift (a change is thus compared, in
  every window that holds it whole, with answers from before it; the learned window never leaves the
  reference). One-sided Fisher exact tests ask, for each reference text, whether its share fell (76 %
  then, 30 % now), and whether texts the reference never held became common. A change of the
  distribution lowers some reference text's share or raises the unseen ones, so these tests cover every
  change. Fisher's test conditions on both samples, so it accounts for K being small (no rate is taken
  as known), and under no change the reference and the newest answers are exchangeable, which makes each
  p-value valid. A Bonferroni correction over the windows and the texts holds the chance of a false
  ``answer-drift`` below ``ALPHA`` per canary-pass (conditional on one learned window the tests are valid
  on average over windows, as the conformal p-values of ``canaryd.judge.stats`` are).
* **Correctness as a rate.** Each learned text is checked against the canary's expected answer, which
  gives its learned count of wrong answers. Learned at 0 (right every time), a wrong answer is a
  ``regression`` at once, as today: under no change, with n exchangeable answers of which exactly one is
  wrong, that one is the newest with chance 1/(n + 1), which bounds a false ``regression`` per
  canary-pass at 1/(K + 1), the exact regime's bound. Learned above 0, a wrong answer is a ``regression``
  only when the newest passes' wrong answers are more than the reference's by the same one-sided Fisher
  test (Bonferroni over ``WINDOWS``, ``ALPHA`` per canary-pass); an honest wrong answer is otherwise
  judged as an answer (within noise, or ``answer-drift`` held back as any out canary is).
* **While learning**, a wrong answer is ``learning`` once the window holds wrong answers (their rate is
  being learned). While every answer in the window so far was right, the pass asks the same request
  again (``learn_first`` times, alone): wrong at least half of those times, it is a ``regression``
  (learning never hides one); else an honest flip, ``learning`` too. Under an honest rate p of wrong
  answers a false ``regression`` there needs the answer and half the re-asks wrong (p = 0.1, 4 re-asks:
  below 0.6 % per canary, once: the window then holds the wrong answer). A window whose newer half is
  wrong more often than its older half is refused as a change (`window_problem`), so a regression during
  learning cannot become the learned rate.

The usage (prompt, visible completion and reasoning tokens) is judged as before, reasoning tokens on their
spread learned from the same window. These verdicts are their own path at their own alpha: the cycle's
decision does not hold them back, and they do not feed the backend's e-CUSUM.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from canaryd.judge.compare import Comparison
from canaryd.judge.evidence import Evidence
from canaryd.judge.stats import NoiseModel, Regime
from canaryd.judge.verdicts import Verdict
from canaryd.observation import utcnow

ALPHA = 1e-4  # a false answer-drift, and a false rate regression, per canary-pass
WINDOWS = (3, 6, 12, 24, 48)  # the recent passes compared, the newest w of them
HISTORY = 48  # the most older passes a reference holds beside the learned window
WINDOW_ALPHA = 0.002  # a learning window whose newer half is wrong more often than by this chance: refused

Check = Callable[[str], bool | None]  # an answer's text → whether it is the known answer (None: unknown)


def _hyper(x: int, drawn: int, marked: int, total: int) -> float:
    """P(X = x) for X the marked items among ``drawn`` of ``total`` (``marked`` of them marked)."""
    if x < 0 or x > drawn or x > marked or drawn - x > total - marked:
        return 0.0
    return math.comb(marked, x) * math.comb(total - marked, drawn - x) / math.comb(total, drawn)


def more(recent: int, w: int, learned: int, k: int) -> float:
    """One-sided Fisher p-value that ``recent`` of w new answers are marked against ``learned`` of k: the
    chance of at least as many among w drawn from the k + w, all exchangeable."""
    marked = recent + learned
    return min(1.0, sum(_hyper(x, w, marked, k + w) for x in range(recent, min(w, marked) + 1)))


def fewer(recent: int, w: int, learned: int, k: int) -> float:
    """One-sided Fisher p-value that only ``recent`` of w new answers are marked against ``learned`` of k."""
    return min(1.0, sum(_hyper(x, w, recent + learned, k + w) for x in range(0, recent + 1)))


@dataclass(frozen=True, slots=True)
class Test:
    """The most surprising of a family of tests, its p-value Bonferroni-corrected over the family."""

    p: float  # the corrected p-value
    window: int  # the recent passes it compared
    what: str

    @property
    def out(self) -> bool:
        return self.p <= ALPHA

    def evidence(self, method: str, detail: Mapping) -> Evidence:
        return Evidence(
            method=method,
            statistic=-math.log10(max(self.p, 1e-300)),
            threshold=-math.log10(ALPHA),
            p_value=self.p,
            e_value=None,  # its own verdict path, at its own alpha: it does not feed the backend's alarm
            detail={"alpha": ALPHA, "window": self.window, **detail},
            basis="text",
        )


Recent = Sequence[tuple[str, bool]]  # newest first, this pass first: (text, whether it may join a reference)


def _splits(learned: Counter[str], recent: Recent) -> list[tuple[int, list[str], Counter[str]]]:
    """For each window w of ``WINDOWS`` the recent answers fill: its w newest texts, and the reference
    they are compared with: the learned texts and the older passes' that were judged without drift."""
    out = []
    for w in (w for w in WINDOWS if w <= len(recent)):
        older = Counter(t for t, honest in recent[w:] if honest)
        out.append((w, [t for t, _ in recent[:w]], learned + older))
    return out


def distribution_shift(learned: Counter[str], recent: Recent) -> Test | None:
    """Whether the newest answers left the learned distribution: a reference text's share fell, or the
    texts the reference never held rose, in the last w passes for each w of ``WINDOWS``."""
    best: Test | None = None
    tests = len(WINDOWS) * (len(learned) + 1)  # per window: the novel texts, and as many reference texts
    for w, now, ref in _splits(learned, recent):  # (its most common) as were learned
        k, seen = sum(ref.values()), Counter(now)
        novel = sum(n for t, n in seen.items() if t not in ref)
        found = [(more(novel, w, 0, k), f"{novel} of the last {w} answers are texts never seen before")]
        for text, n in ref.most_common(len(learned)):
            share = f"{n} of {k} before, {seen[text]} of the last {w}"
            found.append((fewer(seen[text], w, n, k), f"the answer {text!r} became rarer ({share})"))
        for p, what in found:
            if best is None or p * tests < best.p:
                best = Test(min(1.0, p * tests), w, what)
    return best


def rate_rise(learned: Counter[str], recent: Recent, check: Check) -> Test | None:
    """Whether the newest answers are wrong more often than the reference's, in the last w passes for
    each w of ``WINDOWS``."""
    best: Test | None = None
    for w, now, ref in _splits(learned, recent):
        bad, k = sum(check(t) is False for t in now), sum(ref.values())
        p = min(1.0, more(bad, w, wrong_count(ref, check), k) * len(WINDOWS))
        if best is None or p < best.p:
            what = f"{bad} of the last {w} answers wrong, {wrong_count(ref, check)} of {k} before"
            best = Test(p, w, what)
    return best


def wrong_count(texts: Counter[str], check: Check) -> int:
    """How many of the learned answers are not the known answer."""
    return sum(n for t, n in texts.items() if check(t) is False)


def window_problem(texts: Sequence[str], check: Check) -> str | None:
    """Why a learning window must not become the model (None: it may): its newer half is wrong more often
    than its older half beyond chance (one-sided Fisher at ``WINDOW_ALPHA``): a regression while learning."""
    if len(texts) < 8:
        return None
    half = len(texts) // 2
    old, new = [check(t) is False for t in texts[:half]], [check(t) is False for t in texts[half:]]
    if (p := more(sum(new), len(new), sum(old), len(old))) > WINDOW_ALPHA:
        return None
    return (
        f"its newer answers are wrong more often than its older ones ({sum(new)} of {len(new)} against "
        f"{sum(old)} of {len(old)}, Fisher p {p:.3g}): something changed while learning"
    )


def stored(texts: Sequence[str]) -> dict:
    """The ``answers`` entry of a calibration row: the learned texts counted, and when (the recent passes
    compared with them are those after it)."""
    return {"texts": dict(Counter(texts)), "since": utcnow().isoformat()}


def learned(doc: Mapping | None) -> tuple[Counter[str], datetime] | None:
    """A calibration row's learned answers and since when (None: a model stored without them)."""
    entry = (doc or {}).get("answers")
    if not isinstance(entry, Mapping):
        return None
    since = datetime.fromisoformat(str(entry["since"]))
    return Counter({str(t): int(n) for t, n in entry["texts"].items()}), aware(since)


def aware(t: datetime) -> datetime:
    """A stored time as aware UTC (a database may hand back naive UTC)."""
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


def while_learning(
    c: Comparison, texts: Sequence[str], check: Check, why: str, ev: Evidence, again: Sequence[str] = ()
) -> Comparison:
    """A learning canary's comparison: a wrong answer is ``learning`` once the window holds wrong answers
    (their rate is being learned). Before that it is a ``regression`` unless the same request asked
    ``again`` in the same pass was right at least as often as wrong: an honest flip, then also
    ``learning``. A change passes that only when it made the canary wrong at most half of the time, and
    such a rise shows at the fit (`window_problem`)."""
    if c.verdict is not Verdict.REGRESSION:
        return c
    wrong = sum(check(t) is False for t in texts)
    if wrong:
        note = f"wrong, as {wrong} of the {len(texts)} answers learned so far: their rate is being learned"
    else:
        bad = sum(check(t) is False for t in again)
        asked = f"asked again {len(again)} times in this pass, wrong {bad} times"
        if not again or 2 * bad >= len(again):
            return replace(c, reasons=(*c.reasons, asked)) if again else c
        note = f"wrong for the first time while learning, but {asked}: an honest flip, its rate is learned"
    moved = c.stack_changes or c.prompt_tokens_changed
    verdict = Verdict.STACK_CHANGE if moved else Verdict.LEARNING
    reasons = tuple(r for r in c.reasons if r != "was correct, now wrong")
    return replace(c, verdict=verdict, reasons=(why, note, *reasons), evidence=None if moved else ev)


def judge(c: Comparison, texts: Counter[str], recent: Recent, check: Check) -> Comparison:
    """A comparison made against a model with learned answers ``texts``, judged on them: ``recent`` the
    passes since the model was fitted. See the module docstring for the rules."""
    if c.verdict in (Verdict.ERROR, Verdict.BASELINE, Verdict.NEW_CONFIG):
        return c
    wrong = wrong_count(texts, check)
    if c.correct is False and wrong:
        rate = rate_rise(texts, recent, check)
        if rate is not None and rate.out:
            ev = rate.evidence("answer-rate", {"learned_wrong": wrong, "learned": sum(texts.values())})
            reasons = (f"the rate of wrong answers rose: {rate.what} (p {rate.p:.3g})", *c.reasons)
            return replace(c, verdict=Verdict.REGRESSION, reasons=reasons, evidence=ev)
        if c.verdict is Verdict.REGRESSION:  # an honest wrong answer: judged as an answer
            note = f"wrong, as {wrong} of the {sum(texts.values())} learned answers: no rise in the rate"
            if rate is not None:
                note += f" ({rate.what}, p {rate.p:.3g})"
            reasons = tuple(r for r in c.reasons if r != "was correct, now wrong")
            held = Verdict.ANSWER_DRIFT if c.evidence is not None and c.evidence.out else Verdict.NOISE
            c = replace(c, verdict=held, reasons=(note, *reasons))
    if c.verdict is Verdict.REGRESSION:
        return c
    shift = distribution_shift(texts, recent)
    if shift is None or not shift.out:
        return c
    ev = shift.evidence("answer-distribution", {"learned": dict(texts)})
    why = f"the answers left their learned distribution: {shift.what} (p {shift.p:.3g})"
    return replace(c, verdict=Verdict.ANSWER_DRIFT, reasons=(why, *c.reasons), evidence=ev)


def varies(texts: Counter[str], check: Check) -> bool:
    """Whether a model's learned answers flip or are sometimes wrong (else one text, always right, judged
    on the first probe as before: nothing for the tests here to add)."""
    return len(texts) > 1 or wrong_count(texts, check) > 0


@dataclass(frozen=True, slots=True)
class WithAnswers:
    """A noise model saved with the answers it was fitted from (``texts``, one per probe): what
    `Store.save_calibration` stores, the model's row with an ``answers`` entry beside it. ``entry``: a row's
    entry kept as it was (a refit adds logprob references, not answers, and must not restart their clock)."""

    model: NoiseModel
    texts: tuple[str, ...]
    entry: Mapping | None = None

    @property
    def request_hash(self) -> str:
        return self.model.request_hash

    @property
    def k(self) -> int:
        return self.model.k

    @property
    def regime(self) -> Regime:
        return self.model.regime

    def summary(self) -> dict:
        n = len(self.entry["texts"]) if self.entry is not None else len(set(self.texts))
        return {**self.model.summary(), "answers": n}

    def as_dict(self) -> dict:
        entry = dict(self.entry) if self.entry is not None else stored(self.texts)
        return {**self.model.as_dict(), "answers": entry}
