"""A backend's daily budget (``budget_tokens_per_day``, ``budget_requests_per_day``): whether a pass fits.

The day is the UTC day, and what it has spent is counted from the store (`Store.spend`), so a restart does
not reset it and a fleet of daemons shares it. A pass's cost is estimated before it is sent: its requests
(a sampled canary's n draws, a chain's steps) times the tokens a request cost today on average, or, before
the first of the day, each canary's prompt (about four characters a token) plus its ``max_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from canaryd.backends import BackendSettings
from canaryd.canaries import Canary
from canaryd.store import Store

CHARS_PER_TOKEN = 4


def day_start(now: datetime | None = None) -> datetime:
    now = now or datetime.now(UTC)
    return now.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)


def requests_of(canary: Canary) -> int:
    return canary.decoding.samples if canary.steps is None else len(canary.steps)


def tokens_of(canary: Canary) -> int:
    """A request's tokens before any was spent: the prompt (estimated from its length) and ``max_tokens``."""
    text = canary.prompt or "".join(m.content for m in canary.messages or ())
    return -(-len(text) // CHARS_PER_TOKEN) + canary.decoding.max_tokens


def cost(canaries: Sequence[Canary], spent: tuple[int, int]) -> tuple[int, int]:
    """(tokens, requests) a pass of ``canaries`` is expected to cost, given what the day has spent."""
    requests = sum(map(requests_of, canaries))
    tokens, sent = spent
    if sent and tokens:
        return -(-tokens * requests // sent), requests
    return sum(tokens_of(c) * requests_of(c) for c in canaries), requests


def refusal(settings: BackendSettings, spent: tuple[int, int], need: tuple[int, int]) -> str | None:
    """Why a pass costing ``need`` would pass the budget after ``spent`` today (None: it fits). Pure."""
    limits = (("tokens", settings.budget_tokens_per_day), ("requests", settings.budget_requests_per_day))
    for (what, limit), used, more in zip(limits, spent, need, strict=True):
        if limit is not None and used + more > limit:
            return (
                f"backend {settings.name!r}: budget_{what}_per_day = {limit}: {used} {what} spent today "
                f"(UTC), this pass would take about {more} more"
            )
    return None


def over_budget(store: Store, settings: BackendSettings, canaries: Sequence[Canary]) -> str | None:
    """Why a pass of ``canaries`` would pass the backend's budget today (None: it fits, or has none)."""
    if settings.budget_tokens_per_day is None and settings.budget_requests_per_day is None:
        return None
    spent = store.spend(settings.name, day_start())
    return refusal(settings, spent, cost(canaries, spent))
