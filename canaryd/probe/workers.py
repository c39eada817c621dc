"""Thread pools for probe passes, kept between passes.

A pass sends a backend's canaries on a pool of the backend's concurrency (and `run_pass` its backends on
one of their count). Starting those threads again for every pass cost as much CPU as a probe, so a pool
goes back to an idle list when its pass ends and the next pass of that size takes it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import TypeVar

T, R = TypeVar("T"), TypeVar("R")

_IDLE: dict[tuple[str, int, int], list[ThreadPoolExecutor]] = {}  # (name, workers, pid) → idle pools
_IDLE_LOCK = threading.Lock()
# Idle pools kept per name and size: as many as the passes that ran at once, up to this (a daemon probes
# at most ``max_in_flight`` backends at once, each on a pool of its concurrency, whichever backend it is).
KEEP_IDLE = 64


@contextmanager
def workers(name: str, concurrency: int) -> Iterator[ThreadPoolExecutor]:
    """A pool of ``concurrency`` threads named ``name`` for one pass (of a backend's canaries, or of the
    backends), its own for the pass as before, but kept for a later pass once this one is done: starting
    the threads again cost as much CPU as a probe. Passes at once each take their own pool; a pass that
    fails shuts its pool down, as before. Backends share the pools of their size (not one per backend:
    a thousand backends would keep thousands of idle threads)."""
    key = (name, concurrency, os.getpid())  # a forked child never takes its parent's threads
    with _IDLE_LOCK:
        idle = _IDLE.setdefault(key, [])
        ex = idle.pop() if idle else None
    if ex is None:
        ex = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix=name)
    try:
        yield ex
    except BaseException:
        ex.shutdown(wait=True)
        raise
    with _IDLE_LOCK:
        if len(idle) < KEEP_IDLE:
            idle.append(ex)
            return
    ex.shutdown(wait=True)


def pulled(ex: ThreadPoolExecutor, fn: Callable[[T], R], items: Sequence[T], width: int) -> list[R]:
    """``[fn(x) for x in items]`` on ``width`` of ``ex``'s threads, each taking the next item as it comes
    free: `Executor.map`'s order and as many items at once, but one hand-off per thread instead of one per
    item (handing each canary over cost about 0.2 ms of CPU a probe, `bench/probe_cpu.py`).
    An exception of ``fn`` is raised here once the threads are done, as ``map`` would raise it."""
    out: list = [None] * len(items)
    todo = iter(enumerate(items))  # next() on one iterator from several threads: each item once (the GIL)

    def drain() -> None:
        for i, item in todo:
            out[i] = fn(item)

    futures = [ex.submit(drain) for _ in range(min(width, len(items)))]
    wait(futures)
    for f in futures:
        f.result()
    return out
