"""Probes sent alone and inside crowded batches: what the census and ``baseline calibrate`` share.

"Same prompt, same weights, temperature 0" gives one answer only on a batch-invariant engine: elsewhere the
result depends on what else shared the batch. So both measure a canary under load: `collect` releases
each probe together with filler requests (other prompts, same decoding; `canaryd.probe.shapes.fillers_for`
chooses them), and the engine batches them with it.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from canaryd import progress
from canaryd.backends import Backend
from canaryd.backends.base import CROWD
from canaryd.canaries import Canary, Message
from canaryd.observation import Observation
from canaryd.probe import vet

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
                    out[b].append(vet.probe(backend, canary))
                    progress.step()
                    continue
                barrier = threading.Barrier(b)

                def send(c: Canary, barrier: threading.Barrier = barrier, b: int = b) -> Observation:
                    barrier.wait()  # the pool has a thread for each of the round's b requests
                    token = CROWD.set(b)  # the pool's threads keep their context between rounds
                    try:
                        return vet.probe(backend, c)
                    finally:
                        CROWD.reset(token)

                mine = pool.submit(send, canary)
                crowd = [pool.submit(send, next(cycle)) for _ in range(b - 1)]
                out[b].append(mine.result())
                for f in crowd:
                    f.result()  # wait, so rounds never overlap; filler observations are discarded
                progress.step()
    return out
