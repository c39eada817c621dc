"""A probe's distances to a noise model's K honest probes, computed column-wise (`Nearest`).

`canaryd.judge.stats.distance` walks one pair of probes dict by dict. Scoring every probe against each
of K references that way was the largest share of a calibrated probe's CPU (about a sixth of the daemon's,
``bench/probe_cpu.py``). Here the references become one array per model, built at its second score
(`NoiseModel.nearest`). A probe is then one pass over its own coordinates, and references with identical
coordinates (all of them in the exact regime, a few modes in the modal one) are measured once.

The results are `distance`'s to the bit. The differences and their scaling are the same IEEE operations
elementwise. The squares are libm's ``pow``, as Python's ``x ** 2`` takes them: numpy's ``float_power``
calls it, where ``x * x`` and numpy's ``power`` differ from it in the last bit now and then. Each sum is
Python's ``sum`` (compensated from Python 3.12). A stored model's leave-one-out distances, computed by
`distance`, therefore compare with these exactly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from canaryd.lazy import lazy_import

if TYPE_CHECKING:
    import numpy

    from canaryd.judge.stats import Key, Point
else:
    numpy = lazy_import("numpy")  # the judge's, not a config check's: `canaryd validate` stays fast


def common_prefix(a: Sequence, b: Sequence) -> int:
    """The first index where ``a`` and ``b`` differ (the shorter length if one is a prefix of the other).
    Token ids or text (strings): one comparison in C first, as most probes repeat their references."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)


class Nearest:
    """The references of one model as arrays: a column per coordinate any of them has."""

    __slots__ = ("_columns", "_first", "_has", "_ids", "_spread", "_values")

    def __init__(self, refs: Sequence[Point], spread: Mapping[Key, float], default: float) -> None:
        first: dict[tuple, int] = {}  # identical references share the first one's distance
        self._first = [first.setdefault((r.ids, tuple(r.coords.items())), i) for i, r in enumerate(refs)]
        self._columns: dict[Key, int] = {}
        for r in refs:
            for k in r.coords:
                self._columns.setdefault(k, len(self._columns))
        n = len(self._columns)  # column n: a coordinate no reference has (never aligned)
        self._values = numpy.zeros((len(refs), n + 1))
        self._has = numpy.zeros((len(refs), n + 1), dtype=bool)
        for i, r in enumerate(refs):
            cols = [self._columns[k] for k in r.coords]
            self._values[i, cols] = list(r.coords.values())
            self._has[i, cols] = True
        self._spread = numpy.array([*(spread.get(k, default) for k in self._columns), default])
        self._ids = [r.ids for r in refs]

    def score(self, x: Point) -> tuple[list[float], int, float]:
        """(``x``'s distance to each reference, the first nearest one's index, the largest aligned |Δ logprob|
        to it): `distance` to each, and `max_abs_delta` to the nearest."""
        if not x.coords:
            return [0.0] * len(self._ids), 0, 0.0
        keys = list(x.coords)
        n = len(self._columns)
        cols = numpy.fromiter((self._columns.get(k, n) for k in keys), dtype=numpy.intp, count=len(keys))
        pos = numpy.fromiter((k[0] for k in keys), dtype=numpy.int64, count=len(keys))
        delta = numpy.fromiter(x.coords.values(), dtype=float, count=len(keys)) - self._values[:, cols]
        squares = numpy.float_power(delta / self._spread[cols], 2.0)
        lasts: list[int] = []  # where x parts from each reference (a twin's is its first's)
        for i, j in enumerate(self._first):
            lasts.append(common_prefix(x.ids, self._ids[i]) if j == i else lasts[j])
        aligned = self._has[:, cols] & (pos <= numpy.array(lasts)[:, None])
        dists: list[float] = []
        for i, j in enumerate(self._first):
            if j < i:
                dists.append(dists[j])
                continue
            terms = squares[i][aligned[i]].tolist()
            dists.append(math.sqrt(sum(terms) / len(terms)) if terms else 0.0)
        nearest = min(range(len(dists)), key=dists.__getitem__)  # the first of its twins
        moved = numpy.abs(delta[nearest][aligned[nearest]])
        return dists, nearest, float(moved.max()) if moved.size else 0.0
