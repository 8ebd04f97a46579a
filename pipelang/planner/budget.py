"""The search's time budget: what a screening will cost (`scaled`), and the deadline inside
the loops whose cost a candidate's size decides.

`plan --time-budget` is judged before each candidate from smaller ones of its family,
and that estimate can be far off (the mapping's local search and the partition DP grow
faster than the ops). So the long loops also call `check()`, which raises `OutOfTime`
once the deadline that the search set with `until` has passed; the search then leaves
that candidate out, saying so, and the budget holds within one loop step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_deadline: ContextVar[float] = ContextVar("deadline", default=math.inf)


class OutOfTime(Exception):
    """The search's deadline passed inside a candidate's work."""


@contextmanager
def until(deadline: float) -> Iterator[None]:
    """Run the block under `deadline` (on `time.perf_counter`)."""
    token = _deadline.set(deadline)
    try:
        yield
    finally:
        _deadline.reset(token)


def check() -> None:
    """Raise OutOfTime when the deadline set by `until` has passed."""
    if time.perf_counter() > _deadline.get():
        raise OutOfTime


def scaled(seen: list[tuple[float, float]], ops: float) -> float:
    """Seconds to handle `ops` ops, from the (ops, seconds) of the last one or two
    screenings of the same schedule: grown as ops^p, p fitted to the two (between 1 and
    3), else 1.5 (compile and simulation grow a little faster than linearly)."""
    if not seen or seen[-1][0] <= 0:
        return 0.0
    power = 1.5
    if len(seen) == 2 and seen[1][0] > seen[0][0] and min(seen[0][1], seen[1][1]) > 0.05:
        power = math.log(seen[1][1] / seen[0][1]) / math.log(seen[1][0] / seen[0][0])
        power = min(3.0, max(1.0, power))
    return seen[-1][1] * (ops / seen[-1][0]) ** power
