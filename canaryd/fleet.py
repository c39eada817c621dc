"""Fleets behind one URL: whose a pass's snapshot is, and which configuration a newcomer replaced.

The snapshot is read once per pass, through the backend's URL. Behind a balancer each of its requests
(``/metrics``, ``/version``, ``/server_info``, ``/props``, the engine's arguments) is answered by some
member, not necessarily the one that answered a given canary: a float32 and a bfloat16 vLLM behind nginx
``random`` give a different ``num_gpu_blocks`` from pass to pass, and compared with the baseline member's
they would be a ``stack-change`` on every pass that is only the balancer's choice.

The rule. A backend is a **fleet** when this pass (its answers and first-contact probes) or its stored
baselines show more than one serving configuration (`canaryd.stack.configuration_of`); the only server
replaced (one configuration known, another alone in the pass) is not one. On a fleet, the snapshot's
server-side fields are attributed to an answer only when the snapshot itself names the configuration that
served it (its own identity fields, as an answer's) and that is the answer's configuration: they are then
compared within it, against that configuration's baseline. Otherwise the answer's stack carries
``snapshot.attribution = unattributable``: its server-side fields are still recorded, as read, but
whenever either side of a comparison (an answer and its baseline, a pin and a pass) is so marked they are
set aside, never a ``stack-change`` on their own. vLLM 0.32 names its configuration only in answers
(``system_fingerprint``; ``/metrics``, ``/version`` and ``/server_info`` do not), so through a balancer its
snapshot is unattributable. A member that changes is still reported through its answers: new weights
behind the same fingerprint move its configuration's answers (drift of that configuration), and a restart
in another dtype is a new fingerprint (a ``new-configuration``). Server-side fields are all but canaryd's
own request facts and each answer's own fields (`ATTRIBUTABLE`).

A configuration new to the backend that appears in a pass from which a configuration it knows is missing
(neither an answer nor a first-contact probe reached it) is named as the one that replaced it
(`replacing`): one member restarted in another dtype, its old fingerprint gone.
"""

from __future__ import annotations

from collections.abc import Iterable

from canaryd.stack import IDENTITY_FIELDS, configuration_of, identity_of

MARK = "snapshot.attribution"
UNATTRIBUTABLE = "unattributable"
# Fields that are not a member's: what canaryd asked (request.*, its recorder), the kind it probed, and
# what each answer said of itself (response.*, header.*, a gateway's per-answer deployment).
ATTRIBUTABLE = ("request.", "response.", "header.", "gateway.", "backend.", "canaryd.")


def server_side(field: str) -> bool:
    """Whether ``field`` is read from the server's endpoints (a member's, behind a balancer)."""
    return field != MARK and not field.startswith(ATTRIBUTABLE)


def is_fleet(reached: Iterable[str], known: Iterable[str]) -> bool:
    """More than one configuration in this pass (``reached``: its answers' and probes'), or more than one
    with stored baselines (``known``). Not a new one alone beside the one known: the only server, replaced,
    is compared field by field as before."""
    return len(set(reached)) > 1 or len(set(known)) > 1


def joined(snapshot: dict[str, str], answer: dict[str, str], fleet: bool) -> dict[str, str]:
    """An answer's stack: the pass's snapshot joined with the answer's own fields, marked unattributable on
    a fleet unless the snapshot names the answer's configuration."""
    own = {**snapshot, **answer}
    if not fleet or (identity_of(snapshot) and configuration_of(snapshot) == configuration_of(own)):
        return own
    return {**own, MARK: UNATTRIBUTABLE}


def comparable(before: dict[str, str], after: dict[str, str]) -> tuple[dict, dict, tuple[str, ...]]:
    """The two stacks as compared: when either is unattributable, without their server-side fields (and
    the mark); the third item names the server-side fields set aside because they differ."""
    if before.get(MARK) != UNATTRIBUTABLE and after.get(MARK) != UNATTRIBUTABLE:
        return before, after, ()
    aside = tuple(
        sorted(k for k in before.keys() | after.keys() if server_side(k) and before.get(k) != after.get(k))
    )
    return _attributable(before), _attributable(after), aside


def _attributable(fields: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in fields.items() if k != MARK and not server_side(k)}


def set_aside(aside: tuple[str, ...]) -> str:
    """The reason a comparison gives for the fields it did not compare."""
    n = len(aside)
    return (
        f"{n} server-side snapshot field{'s' if n > 1 else ''} "
        f"({', '.join(aside[:3])}{', …' if n > 3 else ''}) differ, "
        "but belong to whichever fleet member answered the snapshot: recorded, not compared"
    )


def hashed(fields: dict[str, str]) -> dict[str, str]:
    """What a run's stack hash covers: all of it, but for a fleet's unattributable run only the fields
    that are not a member's (the merged fingerprints vary with the balancer's draws too)."""
    if fields.get(MARK) != UNATTRIBUTABLE:
        return fields
    return {k: v for k, v in _attributable(fields).items() if k not in IDENTITY_FIELDS}


def replacing(new: str, reached: Iterable[str], known: Iterable[str]) -> str | None:
    """The reason a ``new-configuration`` gives when configurations the backend knows were reached by
    nothing in this pass (``reached``: its answers' and probes' configurations): it replaced one of them.
    None for a configuration the backend knows (new only to the canary) or when every known one served."""
    gone = sorted(set(known) - set(reached))
    if new in known or not gone:
        return None
    which = gone[0] if len(gone) == 1 else "one of " + ", ".join(gone)
    return (
        f"configuration {new or '(none)'} replaced configuration {which}, which served this backend "
        "before and nothing of this pass"
    )
