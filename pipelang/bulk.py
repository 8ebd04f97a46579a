"""`@bulk`: pause the cycle collector while the passes build their 10^5-object results.

A pass over a large schedule allocates hundreds of thousands of tuples, lists and
actions that all survive. Each time the youngest generation fills, CPython's collector
runs, and every so often it rescans the whole heap, finding nothing: these structures
hold no reference cycles. That cost about a third of the time of `build-dag`,
`validate` and `insert-comms` at 10^5 ops, so `run_passes` runs under `@bulk`. The
previous state is restored on exit.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def bulk(fn: Callable[P, R]) -> Callable[P, R]:
    """Run `fn` with the cyclic garbage collector paused (reference counting still frees
    everything that is not in a cycle)."""

    @functools.wraps(fn)
    def paused(*args: P.args, **kwargs: P.kwargs) -> R:
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return paused
