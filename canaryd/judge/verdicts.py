"""The verdict table: every verdict canaryd gives, one row each, most severe first.

Each row holds, in order: the value (what the store, ``--json`` and the ``verdict`` metric label carry),
whether it counts as drift (``is_drift``: what ``check`` exits 1 on, what the drift alerts and the
"drifting" panels count), the colour ``canaryd check``/``history`` print it in (a rich style), the colour
the Grafana dashboard shows it in (a Grafana named colour), and its meaning in one line. The row's position
is its severity ``rank`` (0 = most severe): ``compare()`` gives an observation the most severe verdict that
applies, and the dashboard shows the most severe one when several canaryd instances disagree.
``new-configuration`` ranks below the drift verdicts (it is no evidence of change: a fleet grew, or a
router found another provider) and above the quiet ones: a configuration nobody had seen is worth a look.
``learning`` ranks below it: a canary still learning its noise (``[compare] learn``) that moved.
``determinism-broken`` ranks below the wrong-answer verdicts and above the other drift verdicts: a backend
that declares itself exact and is not breaks the promise its users rely on (`canaryd.judge.determinism`).

Everything else reads this table: ``compare.py`` and ``sampled.py`` (the rules), ``report/tables.py``
(colours), ``grafana/build_dashboard.py`` (codes, colours, the drift set), the metrics (one series per
verdict), and the tests that hold docs/detection.md, docs/runbook.md and the alert rules to it. Adding a
verdict is one row here plus the rule in ``compare.py`` that gives it; the tests then say which documents,
alerts and generated files still need it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

__all__ = ["Verdict"]


class Verdict(enum.StrEnum):
    """A verdict; iterating the enum yields them most severe first (``rank`` 0, 1, …)."""

    is_drift: bool
    rank: int
    style: str  # rich style, for the terminal tables
    dashboard_color: str  # Grafana named colour, for the dashboard's verdict panels
    meaning: str

    # fmt: off
    #               value            drift  terminal    dashboard
    #               meaning
    ERROR         = ("error",         False, "magenta",  "dark-red",
                     "the probe failed and nothing is judged (never a drift verdict)")
    REGRESSION    = ("regression",    True,  "bold red", "red",
                     "the baseline answered correctly, this one does not")
    REFERENCE_MISMATCH = ("reference-mismatch", True, "bold red", "dark-orange",
                     "the backend's reference (the weights it claims, e.g. a local vLLM) scores its answers "
                     "further from its own choices than the reference's own noise allows")
    DETERMINISM_BROKEN = ("determinism-broken", True, "bold yellow", "dark-yellow",
                     "the stack declares a deterministic mode (vLLM batch invariance, SGLang deterministic "
                     "inference), but this canary's answers are not bit-identical: its first-contact probes "
                     "differ, or an answer left its exact model")
    ANSWER_DRIFT  = ("answer-drift",  True,  "red",      "orange",
                     "the generated tokens differ from the baseline's")
    LOGPROB_DRIFT = ("logprob-drift", True,  "yellow",   "yellow",
                     "same tokens, but a logprob (chosen or top-k alternative) moved beyond tolerance, "
                     "or the top-k set itself changed")
    STACK_CHANGE  = ("stack-change",  True,  "yellow",   "purple",
                     "same tokens and logprobs, but the serving stack or prompt token count changed")
    NEW_CONFIG    = ("new-configuration", False, "blue", "semi-dark-blue",
                     "the first answer from a serving configuration this canary × backend had not shown "
                     "before: it becomes that configuration's baseline (never drift: its reasons say how "
                     "it compares with another configuration)")
    LEARNING      = ("learning",      False, "bright_cyan", "light-blue",
                     "this canary × backend has no noise model yet and is learning one from probes spread "
                     "over passes: its answer or logprobs moved, which is not judged until the model is fit")
    NOISE         = ("within-noise",  False, "green",    "light-green",
                     "something moved, but no more than the calibrated noise of this canary × backend "
                     "allows (once learning or `baseline calibrate` has measured it)")
    IDENTICAL     = ("identical",     False, "green",    "green",
                     "nothing measurable moved")
    BASELINE      = ("baseline",      False, "cyan",     "blue",
                     "no baseline existed for this canary × backend (or its request changed), so this "
                     "observation becomes it")
    # fmt: on

    def __new__(cls, value: str, is_drift: bool, style: str, dashboard_color: str, meaning: str) -> Verdict:
        member = str.__new__(cls, value)
        member._value_ = value
        member.is_drift = is_drift
        member.rank = len(cls._member_names_)  # the rows defined before this one
        member.style = style
        member.dashboard_color = dashboard_color
        member.meaning = meaning
        return member

    @classmethod
    def most_severe(cls, verdicts: Iterable[Verdict | str]) -> Verdict:
        """The most severe of ``verdicts`` (values or members); ValueError when there are none."""
        return min((cls(v) for v in verdicts), key=lambda v: v.rank)
