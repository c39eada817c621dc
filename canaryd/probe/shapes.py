"""The three shapes a canary comes in, each with how it is sent, judged and calibrated.

* **plain**: one request per cycle, compared with its baseline (and with its calibrated noise, once
  ``baseline calibrate`` has measured it);
* **chained**: one request per step, each step an observation of its own (``id:step``) with its own
  baseline; the canary's ``expect`` judges the final step, which, once the cycle's decision has settled
  every step's verdict, names the first step that diverged (`chain.mark_divergence`);
* **sampled**: n draws per cycle, judged as a set against the baseline run's n draws by two-sample tests
  (`canaryd.judge.sampled`); it needs no calibration;
* **forced**: a fixed ``continuation`` scored token by token by a kind that can teacher-force; sent,
  judged and calibrated as a plain canary (only its logprobs can move);
* **conformance**: two requests differing in one parameter (`canaryd.conform`), ``id:low`` and ``id:high``,
  each compared with its own baseline; then the pair is judged (`canaryd.judge.conformance.judge_pair`) and
  a side that shows the parameter was not honoured becomes a ``nonconformant`` error.

A plain canary may expect a tool call (``expect.tool_call``): its correctness is the call's check, and a
failed check's reason joins the comparison's.

`shape_of` is the one place that asks which shape a canary is; everything else calls the shape.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from canaryd.canaries import Canary, CheckTimeout, Expect
from canaryd.conform import SIDES
from canaryd.judge import determinism
from canaryd.judge.compare import Comparison, Verdict, basis_of, compare, new_configuration
from canaryd.judge.conformance import judge_pair, tool_call_verdict
from canaryd.judge.learning import Learning, hold, is_learning
from canaryd.judge.sampled import compare_samples
from canaryd.judge.stats import CalibrationError, NoiseModel
from canaryd.observation import ErrorKind, Observation
from canaryd.probe import vet
from canaryd.probe.batching import BUILTIN_FILLERS, collect
from canaryd.probe.chain import mark_divergence, run_chain
from canaryd.stack import IDENTITY_FIELDS, configuration_of

if TYPE_CHECKING:
    from canaryd.backends import Backend
    from canaryd.config import CompareConfig
    from canaryd.store import Reads


Probes = dict[str, list[Observation]]  # observed id → its K calibration probes
Sizes = Sequence[int]  # load levels: 1 alone, b beside b − 1 fillers


@dataclass(frozen=True, slots=True)
class Judged:
    """One observation with its comparison and the baseline observation it was compared with."""

    observation: Observation
    comparison: Comparison
    baseline_id: int | None


def _correct(expect: Expect | None, obs: Observation) -> bool | None:
    """Whether ``obs`` is the known answer (None: no expectation, or a failed probe). `CheckTimeout`."""
    return _checked(expect, obs)[0]


def _checked(expect: Expect | None, obs: Observation) -> tuple[bool | None, str | None]:
    """(correct, why not when the check can say): a tool call is judged on the structured call."""
    if not (expect and obs.ok):
        return None, None
    if expect.tool_call is not None:
        return tool_call_verdict(expect.tool_call, obs)
    return expect.check(obs.text or ""), None


def _timed_out(obs: Observation, e: CheckTimeout) -> None:
    """The check ran out of time: the observation becomes a ``check_timeout`` error (verdict ``error``)."""
    obs.error_kind, obs.error = ErrorKind.CHECK_TIMEOUT, f"canary {obs.canary_id!r}: {e}"


def _compare(store: Reads, settings: CompareConfig, obs: Observation, expect: Expect | None) -> Judged:
    why = None
    try:
        correct, why = _checked(expect, obs)
    except CheckTimeout as e:
        correct = None
        _timed_out(obs, e)
    configuration = configuration_of(obs.stack)  # each serving configuration has its own baseline
    base = store.baseline(obs.backend, obs.canary_id, configuration)
    doc = store.calibration(obs.backend, obs.canary_id, configuration)
    if base is None and obs.ok and (others := store.baselines(obs.backend, obs.canary_id)):
        first = _first_of_configuration(settings, obs, correct, configuration, others)
        return replace(first, comparison=determinism.watch(first.comparison, obs, doc))
    learning, state = settings.learn, None
    try:
        if is_learning(doc):
            state, noise, refused = Learning.from_dict(doc), None, None  # type: ignore[arg-type]
            state = state if state.request_hash == obs.request_hash else None  # an older request's
        else:
            noise, refused = (NoiseModel.from_dict(doc) if doc else None), None
            learning = learning and (noise is None or noise.request_hash != obs.request_hash)
    except (CalibrationError, KeyError, TypeError, ValueError) as e:  # written by an older version
        noise, refused = None, f"stored calibration refused ({e}): run `baseline calibrate`"
    if learning:  # a model for an older request, or none: first contact (`canaryd.probe.learn`) is due
        noise = None
    comparison = compare(
        base.observation if base else None,
        obs,
        correct=correct,
        baseline_correct=base.correct if base else None,
        logprob_tolerance=settings.logprob_tolerance,
        noise=noise,
    )
    if learning and base is not None and (state is None or state.refused is None):
        comparison = hold(comparison, state)
    elif learning and state is not None and obs.ok:  # refused: judged as without learning, and says why
        comparison = replace(comparison, reasons=(*comparison.reasons, state.reason()))
    if refused is not None and obs.ok:
        comparison = replace(comparison, reasons=(*comparison.reasons, refused))
    if why is not None and obs.ok:
        comparison = replace(comparison, reasons=(why, *comparison.reasons))
    comparison = determinism.watch(comparison, obs, doc)
    return Judged(obs, comparison, base.observation_id if base else None)


def _first_of_configuration(
    settings: CompareConfig, obs: Observation, correct: bool | None, configuration: str, others: dict
) -> Judged:
    """A configuration new to a canary that has baselines under others: compared, uncalibrated, with the
    most recent of them, to say how it behaves; it becomes its own configuration's baseline."""
    other, base = max(others.items(), key=lambda kv: kv[1].observation_id)
    # the identity fields differ by definition: the question is whether the answers do
    aligned = {k: v for k, v in base.observation.stack.items() if k not in IDENTITY_FIELDS}
    aligned.update({k: v for k, v in obs.stack.items() if k in IDENTITY_FIELDS})
    view = replace(base.observation, stack=aligned, system_fingerprint=obs.system_fingerprint)
    against = compare(
        view,
        obs,
        correct=correct,
        baseline_correct=base.correct,
        logprob_tolerance=settings.logprob_tolerance,
    )
    if against.verdict is Verdict.BASELINE:  # that baseline is refused or for an older request: no news
        return Judged(obs, against, base.observation_id)
    judged = new_configuration(configuration, other, against)
    moved = base.observation.system_fingerprint != obs.system_fingerprint
    return Judged(obs, replace(judged, fingerprint_changed=moved), base.observation_id)


class Plain:
    """One request per cycle; the base of the other shapes, and their interface."""

    name = "plain"
    single_request = True  # one request per probe: a census can repeat it, a batch can use it as filler
    calibrated = True  # `baseline calibrate` learns a noise model for it

    def send(self, backend: Backend, canary: Canary) -> list[Observation]:
        """The requests of one cycle, as observations in sending order."""
        return [vet.probe(backend, canary)]

    def judge(
        self, store: Reads, settings: CompareConfig, canary: Canary, observations: list[Observation]
    ) -> list[Judged]:
        """Each observation against its baseline, before the backend's cycle is decided."""
        return [_compare(store, settings, obs, canary.expect) for obs in observations]

    def settle(self, canary: Canary, judged: list[Judged]) -> list[Judged]:
        """The judged observations once the cycle's decision has settled their verdicts."""
        return judged

    def calibration_probes(
        self, backend: Backend, canary: Canary, others: Sequence[Canary], *, k: int, batch_sizes: Sizes
    ) -> Probes:
        """K honest probes per observed id, for `canaryd.judge.stats.fit`: split over the load levels (alone,
        and inside crowded batches), the first levels taking the remainder."""
        fillers = fillers_for(canary, others)
        got = []
        for i, size in enumerate(batch_sizes):
            n = k // len(batch_sizes) + (i < k % len(batch_sizes))
            if n:
                got += collect(backend, canary, n=n, batch_sizes=[size], fillers=fillers)[size]
        return {canary.id: got}


class Chained(Plain):
    name, single_request = "chained", False

    def send(self, backend: Backend, canary: Canary) -> list[Observation]:
        return run_chain(backend, canary)

    def judge(
        self, store: Reads, settings: CompareConfig, canary: Canary, observations: list[Observation]
    ) -> list[Judged]:
        final = len(observations) - 1
        return [
            _compare(store, settings, obs, canary.expect if i == final else None)
            for i, obs in enumerate(observations)
        ]

    def settle(self, canary: Canary, judged: list[Judged]) -> list[Judged]:
        marked = mark_divergence(canary, [(j.observation, j.comparison, j.baseline_id) for j in judged])
        return [Judged(*j) for j in marked]

    def calibration_probes(
        self, backend: Backend, canary: Canary, others: Sequence[Canary], *, k: int, batch_sizes: Sizes
    ) -> Probes:
        """The chain run K times in sequence: its steps depend on each other's outputs, so no batching."""
        runs = [run_chain(backend, canary) for _ in range(k)]
        return {obs.canary_id: [r[i] for r in runs] for i, obs in enumerate(runs[0])}


class Sampled(Plain):
    name, calibrated = "sampled", False  # its two-sample test needs no noise model

    def send(self, backend: Backend, canary: Canary) -> list[Observation]:
        """The n samples, one after another; sample i carries seed + i when the canary is seeded."""
        d = canary.decoding
        if d.seed is None:
            return [vet.probe(backend, canary) for _ in range(d.samples)]
        return [
            vet.probe(
                backend, canary.model_copy(update={"decoding": d.model_copy(update={"seed": d.seed + i})})
            )
            for i in range(d.samples)
        ]

    def judge(
        self, store: Reads, settings: CompareConfig, canary: Canary, observations: list[Observation]
    ) -> list[Judged]:
        """Every sample with the set's comparison (its own correctness; a failed sample is an ``error``).

        The baseline set is the run of the stored baseline observation. With pinned seeds every sample of a
        first cycle has its own request hash, so the store may keep a later sample than the first as the
        baseline observation: the set, and sample 0 in it, are the same either way.
        """
        first = observations[0]  # the set is judged as today against its first draw's configuration
        base = store.baseline(first.backend, canary.id, configuration_of(first.stack))
        base = base or store.baseline(first.backend, canary.id)  # or the latest: draws may span several
        baseline_id = base.observation_id if base else None
        try:
            correct = [_correct(canary.expect, obs) for obs in observations]
            verdict = compare_samples(
                store.run_set(baseline_id) if baseline_id is not None else [],
                observations,
                expect=canary.expect,
                alpha=settings.alpha,
            )
        except CheckTimeout as e:  # the set cannot be judged: every sample it would have judged is an error
            correct = [None] * len(observations)
            for obs in observations:
                if obs.ok:
                    _timed_out(obs, e)
        out = []
        for obs, ok in zip(observations, correct, strict=True):
            if obs.ok:
                out.append(Judged(obs, replace(verdict, correct=ok), baseline_id))
            else:
                why = (f"{obs.error_kind}: {obs.error}",)
                error = Comparison(Verdict.ERROR, None, reasons=why, basis=basis_of(obs))
                out.append(Judged(obs, error, baseline_id))
        return out


class Conformance(Plain):
    """The pair of a conformance canary; not a single request (the census leaves it out)."""

    name, single_request = "conformance", False

    @staticmethod
    def side(canary: Canary, side: str) -> Canary:
        """The canary with the varied parameter set to the side's value."""
        spec = canary.conform
        assert spec is not None
        return canary.model_copy(
            update={"decoding": canary.decoding.model_copy(update={spec.param: spec.value(side)})}
        )

    def send(self, backend: Backend, canary: Canary) -> list[Observation]:
        """Both sides, low first. Vetted without the token-count cap: whether the limit held is the pair's
        judgement (`judge_pair`), which names it as the server ignoring max_tokens."""
        out = []
        for side, observed_id in zip(SIDES, canary.observed_ids(), strict=True):
            obs = vet.vet(backend.probe(self.side(canary, side)), None)
            obs.canary_id = observed_id
            out.append(obs)
        return out

    def judge(
        self, store: Reads, settings: CompareConfig, canary: Canary, observations: list[Observation]
    ) -> list[Judged]:
        """The pair first (a failing side becomes a ``nonconformant`` error), then each side against its
        baseline; ``expect``, if any, judges the high side."""
        assert canary.conform is not None
        failed = judge_pair(canary.conform, *observations)
        for side, obs in zip(SIDES, observations, strict=True):
            if side in failed:
                obs.error_kind, obs.error = ErrorKind.NONCONFORMANT, failed[side]
                obs.tokens = []
        return [
            _compare(store, settings, obs, canary.expect if side == "high" else None)
            for side, obs in zip(SIDES, observations, strict=True)
        ]

    def calibration_probes(
        self, backend: Backend, canary: Canary, others: Sequence[Canary], *, k: int, batch_sizes: Sizes
    ) -> Probes:
        """The pair K times, alone (each side's noise model is its own)."""
        runs = [self.send(backend, canary) for _ in range(k)]
        return {obs.canary_id: [r[i] for r in runs] for i, obs in enumerate(runs[0])}


class Forced(Plain):
    """A canary with a fixed ``continuation``, scored token by token by a kind that can teacher-force
    (`canaryd.backends.base.Scorer`): the kind's attempt scores instead of sampling, so sending, retries,
    vetting, the census and calibration are the plain shape's. Its tokens never diverge from the
    baseline's; only logprobs and top-k can move, and no argmax flip can hide or fake a change."""

    name = "forced"


PLAIN, CHAINED, SAMPLED, CONFORMANCE, FORCED = Plain(), Chained(), Sampled(), Conformance(), Forced()


def shape_of(canary: Canary) -> Plain:
    if canary.continuation is not None:
        return FORCED
    if canary.conform is not None:
        return CONFORMANCE
    if canary.steps is not None:
        return CHAINED
    return SAMPLED if canary.decoding.samples > 1 else PLAIN


def fillers_for(canary: Canary, others: Iterable[Canary]) -> list[Canary]:
    """Filler requests for ``canary``: the other single-request canaries, then the built-in prompts, all with
    the canary's decoding, so fillers stay in the batch as long as the canary can (same ``max_tokens``)."""
    pool = [c for c in others if c.id != canary.id and shape_of(c).single_request] + list(BUILTIN_FILLERS)
    return [c.model_copy(update={"decoding": canary.decoding}) for c in pool]
