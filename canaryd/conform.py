"""Parameter-conformance canaries: two requests that differ in one parameter, and what honouring it means.

::

    [[canary]]
    id = "honours-max-tokens"
    messages = [{ role = "user", content = "Count to twenty." }]
    conform = { param = "max_tokens", low = 8, high = 32 }            # expect = "length" by default

    [[canary]]
    id = "honours-effort"
    messages = [{ role = "user", content = "How many primes are below 100?" }]
    decoding = { max_tokens = 4096 }
    conform = { param = "reasoning_effort", low = "low", high = "high" }   # expect = "more"

The canary is sent twice per cycle, as ``<id>:low`` and ``<id>:high`` (each an observation with its own
baseline, compared like any answer), then the pair is judged (`canaryd.judge.conformance`). A server that
does not honour the parameter makes the failing side an ``error`` of kind ``nonconformant``, with the reason.
"""

from __future__ import annotations

from typing import Annotated, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

EFFORTS = ("minimal", "low", "medium", "high")  # OpenAI's reasoning_effort values, in order
SIDES = ("low", "high")


class Conform(BaseModel):
    """``conform``: the parameter varied, its two values, and what the pair must show.

    * ``max_tokens`` (``low`` < ``high``, integers): on each side the completion tokens stay within the
      limit sent; with ``expect = "length"`` (the default) the low limit must cut the answer
      (``finish_reason`` "length") and the high one must allow more tokens than the low one did;
      ``expect = "limit"`` checks only the limits.
    * ``reasoning_effort`` (``low`` < ``high`` among minimal, low, medium, high): both sides report
      reasoning tokens, and the high side spends more than ``min_ratio`` times the low side's
      (``expect = "more"``, the only choice).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    param: Literal["max_tokens", "reasoning_effort"]
    low: Annotated[int, Field(ge=1, le=65536)] | str
    high: Annotated[int, Field(ge=1, le=65536)] | str
    expect: Literal["length", "limit", "more"] | None = None
    min_ratio: Annotated[float, Field(ge=1.0, le=1000.0)] = 1.0

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        if self.param == "max_tokens":
            if not (isinstance(self.low, int) and isinstance(self.high, int)):
                raise ValueError("max_tokens: low and high must be integers")
            if self.low >= self.high:
                raise ValueError(f"max_tokens: low ({self.low}) must be below high ({self.high})")
            if self.expect == "more":
                raise ValueError('max_tokens: expect is "length" or "limit"')
        else:
            for side in SIDES:
                if getattr(self, side) not in EFFORTS:
                    raise ValueError(
                        f"reasoning_effort: {side} {getattr(self, side)!r} is not one of {', '.join(EFFORTS)}"
                    )
            if EFFORTS.index(self.low) >= EFFORTS.index(self.high):  # type: ignore[arg-type]
                raise ValueError(f"reasoning_effort: low ({self.low!r}) must be below high ({self.high!r})")
            if self.expect not in (None, "more"):
                raise ValueError('reasoning_effort: expect is "more"')
        return self

    @property
    def wants(self) -> str:
        """What the pair must show: ``length``, ``limit`` or ``more``."""
        return self.expect or ("length" if self.param == "max_tokens" else "more")

    def value(self, side: str) -> int | str:
        return self.low if side == "low" else self.high
