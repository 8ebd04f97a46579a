"""The schedules the planner tries, and the memory each optimizer keeps per weight."""

from __future__ import annotations

from collections.abc import Callable

from pipelang.sim.state import state_factor

Params = tuple[tuple[str, int], ...]

FAMILIES: dict[str, Callable[[int], list[tuple[Params, int]]]] = {
    "gpipe": lambda d: [((), 1)],
    "1f1b": lambda d: [((), 1)],
    "zb-h1": lambda d: [((), 1)],
    "zb-h2": lambda d: [((), 1)],
    "interleaved-1f1b": lambda d: [((("v", v),), v) for v in (2, 4)],
    "interleaved-zb": lambda d: [((("v", 2),), 2)],
    "looped-bfs": lambda d: [((("v", 2),), 2)],
    "chimera": lambda d: (
        [((("f", f),), 1) for f in (1, 2, 4) if d % 2 == 0 and (d // 2) % f == 0]
        or [((("f", 1),), 1)]
    ),
    "chimera-fwd-double": lambda d: [((), 1)],
    "chimera-bwd-half": lambda d: [((), 1)],
    "gems": lambda d: [((), 1)],
    "v-half": lambda d: [((), 2)],
    "v-min": lambda d: [((), 2)],
    "zbv": lambda d: [((), 2)],
    "dualpipev": lambda d: [((), 2)],
    "hanayo": lambda d: [((("w", w),), 2 * w) for w in (1, 2)],
}
"""Each synchronous stdlib schedule the planner tries: for D ranks, the other parameter
values to try and, for each, the stages per rank (S = D x that)."""

STATE_FACTOR = {kind: state_factor(kind) for kind in ("adam", "sgd")}
"""Bytes of weight state per byte of weights: weights, gradients, and the optimizer's
moments (Adam two, SGD with momentum one: `sim.state.OPTIMIZER_STATES`, the rule
`simulate --model` counts each process's bytes by), 4 and 3."""
