"""The search's time budget inside the loops whose cost a candidate's size decides.

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
