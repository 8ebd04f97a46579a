"""What `squeeze` moves: each op timed on its rank (`Op`), each rank's ops in time order
with the activations held after each (`Line`), the plain order's timing (`time_ops`, on
the one timing engine) and the idle stretches of a rank's busy intervals (`idle`,
`first_idle`)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from operator import attrgetter, itemgetter
from typing import TypeVar

from pipelang.ir import Action, CostModel, Kind
from pipelang.sim.engine import Engine, Input

WARM_UP, STEADY, COOL_DOWN = -1, 0, 1


T = TypeVar("T")


END = itemgetter(1)
"""An interval's end. `busy` lists are sorted by start; their intervals do not overlap,
so the ends rise too and can be bisected."""


@dataclass(eq=False, slots=True)
class Op:
    """One op while squeezing: its rank, its current start, its length and its phase."""

    action: Action
    rank: int
    start: float
    end: float
    length: float
    phase: int
    changes: tuple[float, float]
    """How it changes its rank's activations held to B, and held to W (`memory.change`)."""
    inputs: tuple[tuple[Op, float], ...] = ()
    """The ops it waits for, each with the delay from its end (a transfer, or none)."""
    consumed: bool = False
    """Whether some op of the schedule waits for it."""
    seq: int = 0
    """Its place in start order in the plain timing; breaks ties between equal times."""

    def place(self, start: float) -> None:
        self.start, self.end = start, start + self.length

    def ready(self) -> float:
        """When its inputs have all arrived, at their current times."""
        at = 0.0
        for op, delay in self.inputs:
            at = max(at, op.end + delay)
        return at


KEY = attrgetter("start", "end", "seq")
"""Time order: by start, then end, then `seq`."""


class Line:
    """One rank's ops in time order (`KEY`), with the activations held after each.

    A move changes the order only among the ops that start between its new and its old
    place, so checking and recording it walks just those (`settle`): the counts before
    them, and after them, stay as they were."""

    def __init__(self, ops: list[Op]) -> None:
        self.ops = ops
        self.starts = [op.start for op in ops]
        self.held: list[tuple[float, float]] = [(0.0, 0.0)]
        """`held[k]`: the activations held to B and to W after the first k ops."""
        held_b = held_w = 0.0
        for op in ops:
            held_b += op.changes[0]
            held_w += op.changes[1]
            self.held.append((held_b, held_w))
        self.caps = (max(b for b, _ in self.held), max(w for _, w in self.held))
        """The most the rank may hold: the plain order's peaks."""
        self.over: set[int] = set()
        """The k where `held[k]` is above `caps` (none at first; only step 3 makes any)."""

    def copy(self) -> Line:
        line = Line.__new__(Line)  # no __init__: a copy per tried move, not a recount
        line.ops, line.starts, line.held = self.ops[:], self.starts[:], self.held[:]
        line.caps, line.over = self.caps, set(self.over)
        return line

    def fits(self) -> bool:
        """Whether the rank's memory is within its bounds all along (once settled)."""
        cap_b, cap_w = self.caps
        return all(b <= cap_b and w <= cap_w for b, w in self.held)

    def settle(
        self, since: float, until: float, check: bool = False, checked_from: float = math.inf
    ) -> bool:
        """Put the ops that started from `since` to `until`, when last settled, in their
        current time order and count them again; the ops that moved since then must have
        started, and start, in that range. With `check`, only if the rank's memory stays
        within its bounds from `since` (or `checked_from`, if earlier) to the end: else
        nothing changes, and False."""
        first, last = self._range(since, until)
        cap_b, cap_w = self.caps
        if check and self.over:
            lo = min(first, bisect.bisect_left(self.starts, checked_from))
            if any(k >= lo and not first < k <= last for k in self.over):
                return False
        window = sorted(self.ops[first:last], key=KEY)
        held_b, held_w = self.held[first]
        held = []
        over = []
        for k, op in enumerate(window, first + 1):
            held_b += op.changes[0]
            held_w += op.changes[1]
            if held_b > cap_b or held_w > cap_w:
                if check:
                    return False
                over.append(k)
            held.append((held_b, held_w))
        self.ops[first:last] = window
        self.starts[first:last] = [op.start for op in window]
        self.held[first + 1 : last + 1] = held
        if self.over:
            self.over.difference_update(range(first + 1, last + 1))
        self.over.update(over)
        return True

    def _range(self, since: float, until: float) -> tuple[int, int]:
        return bisect.bisect_left(self.starts, since), bisect.bisect_right(self.starts, until)


def time_ops(
    ranks: list[list[Op]], ops: list[Op], inputs: list[list[Input]], costs: CostModel
) -> list[Op] | None:
    """Time each rank's ops as soon as their inputs and their rank allow, on the timing
    engine (`Engine.fixed`, as `simulate` does, transfers by `costs`: `C`, or `C[b]` per
    stage boundary; `ops` numbers them, `inputs` by number) and set each op's `inputs`
    with the engine's delays. Returns the ops in start order, numbered so (`seq`), or
    None when the order cannot run to its end."""
    engine = Engine(
        [op.rank for op in ops],
        [op.length for op in ops],
        inputs,
        costs.of("C"),
        costs.link(),
        [op.action for op in ops],
    )
    for op, timed_inputs in zip(ops, engine.timed_inputs(), strict=True):
        op.inputs = tuple((ops[u], delay) for u, delay in timed_inputs)
    number = {op: i for i, op in enumerate(ops)}
    start, order = engine.fixed([[number[op] for op in rank] for rank in ranks])
    if len(order) != len(ops):
        return None
    timed = [ops[v] for v in order]
    for v in order:
        ops[v].place(start[v])
    # Ops were timed in a topological order: a stable sort keeps it among equal times.
    timed.sort(key=attrgetter("start", "end"))
    for seq, op in enumerate(timed):
        op.seq = seq
    return timed


def sweep(
    orders: list[list[Op]],
    phase: int,
    move: Callable[[Op, list[tuple[float, float]], int], None],
) -> list[list[tuple[float, float]]]:
    """Visit the ops of `phase` (all but the steady state's for STEADY) in time order,
    each with its rank's `busy` intervals: the rank's ops before it in `orders`, where
    they are then. `move(op, busy, place in orders)` may move it; then it joins `busy`.
    The ops not visited join `busy` as the walk passes them. Each rank's `busy` at the
    end holds all its ops."""
    visit = [
        (op, at)
        for order in orders
        for at, op in enumerate(order)
        if (op.phase != STEADY if phase == STEADY else op.phase == phase)
    ]
    visit.sort(key=lambda visited: KEY(visited[0]))
    busy: list[list[tuple[float, float]]] = [[] for _ in orders]
    passed = [0] * len(orders)
    for op, at in visit:
        join(busy[op.rank], orders[op.rank][passed[op.rank] : at])
        move(op, busy[op.rank], at)
        join(busy[op.rank], (op,))
        passed[op.rank] = at + 1
    for rank, order in enumerate(orders):
        join(busy[rank], order[passed[rank] :])
    return busy


def join(busy: list[tuple[float, float]], ops: Sequence[Op]) -> None:
    """Add the intervals of `ops`, in time order, to `busy`, keeping it sorted."""
    intervals = [(op.start, op.end) for op in ops]
    if not busy or (intervals and busy[-1] <= intervals[0]):
        busy.extend(intervals)  # the common case, as insort would leave them
        return
    for interval in intervals:
        bisect.insort(busy, interval)


def move_op(line: Line, op: Op, busy: list[tuple[float, float]]) -> None:
    """Move `op` to the earliest idle stretch before its start, among the `busy` ops
    visited before it, where its rank's memory stays within bounds (only a forward moved
    earlier holds more than before). The rank's `line` is settled to the result."""
    own = op.start
    check = op.action.kind is Kind.F
    for start in idle(busy, op.ready(), op.length, own):
        op.place(start)
        if line.settle(start, own, check):
            return
    op.place(own)


def idle(
    busy: list[tuple[float, float]], ready: float, length: float, before: float
) -> Iterable[float]:
    """The starts, earliest first and before `before`, of the idle stretches between
    the `busy` intervals that begin at `ready` or later and hold `length`. The last
    stretch runs on after the last busy interval."""
    at = ready
    first = bisect.bisect_right(busy, ready, key=END)
    for begin, end in tail(busy, first):
        if at >= before:
            return
        if begin >= at + length:
            yield at
        at = max(at, end)
    if at < before:
        yield at


def first_idle(busy: list[tuple[float, float]], ready: float, length: float) -> float:
    """The first start `idle` gives with no bound: the earliest idle stretch among the
    `busy` intervals that begins at `ready` or later and holds `length`."""
    at = ready
    for begin, end in tail(busy, bisect.bisect_right(busy, ready, key=END)):
        if begin >= at + length:
            return at
        at = max(at, end)
    return at


def tail(items: list[T], first: int) -> Iterator[T]:
    """The items from `first` on, without stepping over those before (as `islice` does)."""
    return map(items.__getitem__, range(first, len(items)))
