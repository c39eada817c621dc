"""The product's calibration that lives, inside the detection bench's detector rows.

After a cycle's decision, `canaryd check` refits each calibrated canary that was out of its noise while the
cycle kept its location (`canaryd.probe.living.refresh`; the rules are `canaryd.judge.living`'s): its
``refit_probes`` more probes, sent alone, join the model when they keep the location too, and later cycles
are judged against the wider noise. A refit follows the decision, so an alarm its cycle raised stands. The
race's detector rows do the same: each test of r cycles starts from the deployment's calibration and refits
as it goes. A refit is not carried from one test (a simulated day) into the next, as a daemon that lives
through those days would carry it: the rows refit less than the product does. The refit probes are
requests of their own, counted per test (`Refits.probes`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from canaryd.canaries import Canary
from canaryd.config import CompareConfig
from canaryd.judge.compare import Comparison, Decision
from canaryd.judge.living import Location, due_refits, location, refit, restarts_detector
from canaryd.judge.stats import DetectorState, NoiseModel, Point, point
from canaryd.observation import Observation
from canaryd.stack import configuration_of

Known = dict[str, dict[str, tuple[Observation, NoiseModel]]]  # canary → configuration → (baseline, model)
KNOBS = CompareConfig()  # the product's defaults: refit_probes probes a refit, widened at most refit_cap×
Judge = Callable[[Canary, Observation, Observation, NoiseModel], Comparison]


class Refits:
    """One test's models as its cycles refit them (a copy of the deployment's), and the probes spent.

    ``observed``: each cycle's answer per canary; ``more(j, canary id)``: the refit probes of cycle j as the
    tested server answers them (the same for every row judging that trial, so that rows stay paired)."""

    def __init__(
        self,
        canaries: Sequence[Canary],
        known: Known,
        observed: Sequence[dict[str, Observation]],
        more: Callable[[int, str], list[Observation]],
        judge: Judge,
    ) -> None:
        self.canaries = {c.id: c for c in canaries}
        self.models = {cid: dict(per) for cid, per in known.items()}
        self.observed, self.more, self.judge = observed, more, judge
        self.changed: set[tuple[str, str]] = set()  # (canary, configuration) refit in this test
        self.probes = 0
        self._locations: dict[int, tuple[NoiseModel, Location]] = {}

    def comparison(self, j: int, cid: str, judged: Comparison) -> Comparison:
        """Cycle j's comparison of a canary: as judged against the deployment, unless this test refit the
        model of its answer's configuration."""
        obs = self.observed[j][cid]
        cfg = configuration_of(obs.stack)
        if (cid, cfg) not in self.changed:
            return judged
        base, model = self.models[cid][cfg]
        return self.judge(self.canaries[cid], base, obs, model)

    def after(self, j: int, cycle: dict[str, Comparison], d: Decision) -> DetectorState:
        """Cycle j's refits (`refresh`'s rule: `due_refits`); the state the next cycle starts from."""
        answers: list[tuple[Comparison, NoiseModel, Point]] = []
        owners: list[tuple[str, str, Observation]] = []
        for cid, comp in cycle.items():
            ev, obs = comp.evidence, self.observed[j][cid]
            cfg = configuration_of(obs.stack)
            if ev is None or ev.method != "conformal-nn" or not obs.ok or cfg not in self.models[cid]:
                continue
            answers.append((comp, self.models[cid][cfg][1], point(obs)))
            owners.append((cid, cfg, obs))
        quiet, due_at = due_refits(answers, self._location)
        if not due_at:
            return d.state
        done = set()
        for i, loc in due_at:
            cid, cfg, obs = owners[i]
            base, model = self.models[cid][cfg]
            extra = self.more(j, cid)
            self.probes += len(extra)
            usable = [point(o) for o in extra if o.ok and configuration_of(o.stack) == cfg]
            got = refit(model, [point(obs), *usable], loc, cap=KNOBS.refit_cap, at="")
            if isinstance(got, NoiseModel):
                self.models[cid][cfg] = (base, got)
                self.changed.add((cid, cfg))
                done.add(cid)
        return DetectorState() if restarts_detector(d.state.alarm, d.out, done, quiet) else d.state

    def _location(self, model: NoiseModel) -> Location:
        # by identity, the model kept beside it: a refit model is a new object with the same first K
        if (hit := self._locations.get(id(model))) is None or hit[0] is not model:
            hit = self._locations[id(model)] = (model, location(model))
        return hit[1]
