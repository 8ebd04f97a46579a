"""`order repeat k every T squeeze { ... }`: the warm-up and cool-down, squeezed.

A repeated block leaves idle time where the pipeline fills and drains: the first blocks
have nothing before them, the last nothing after. Controllable Memory (Qi et al., arXiv
2405.15362, section 4) closes much of it by moving ops of the warm-up and cool-down
earlier, into that idle time, while the steady state keeps its pattern and no rank holds
more activations than before. This is that step, timed with the schedule's own cost
model (its `cost` line, unit costs by default), as `order greedy` is.

The steady state is the ops whose slots run from the first block's last op to the last
block's first op; they keep their times. Every other op is *warm-up* (before) or
*cool-down* (after). A rank's memory is counted twice along its order: activations held
from F to B (what `simulate` reports as peak activations) and, in a schedule that splits
W, held from F to W (W still reads the layer's inputs). Neither may rise above the plain
order's peak on that rank.

1. Time the plain order: each op starts as soon as its inputs and its rank allow.
2. Visit the ops by start time; move each warm-up and cool-down op to the earliest idle
   stretch of its rank, before its own start, that begins after its inputs end (plus
   `C` from another rank) and is long enough, if the rank's memory stays within bounds
   there (else the next such stretch; else it stays).
3. Take the cool-down's W ops out (nothing waits for a W), visit the other cool-down
   ops again as in 2, and put each W back in the earliest idle stretch after its B, W's
   in the order their Bs end; a move is kept only if memory stays within bounds with the
   W's put back. This step is kept only if it ends no later than step 2 and every rank's
   memory is within bounds.
4. Each rank runs its ops in their new time order.

Every op lands after its inputs and no two ops of a rank overlap, so the times are a
valid schedule for the new orders: under the schedule's own costs the squeezed makespan
is never longer than the plain one.

    rank 0: F0.s0 F1.s0 .     .     .     .     .     F0.s7 F2.s0 ...   (v-half D=4, plain)
    rank 0: F0.s0 F1.s0 F2.s0 F3.s0 F4.s0 .     .     F0.s7 B0.s7 ...   (squeezed)
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pipelang.ir import Action, Kind, Program
from pipelang.orders import Layout

WARM_UP, STEADY, COOL_DOWN = -1, 0, 1

Input = tuple[Action, bool]
"""An op's input and whether it is data (a transfer from another rank costs `C`) rather
than an `after` edge (which costs nothing)."""


@dataclass
class _Op:
    """One op while squeezing: its rank, its current start, its length and its phase."""

    action: Action
    rank: int
    start: float
    length: float
    phase: int
    seq: int = 0
    """Its place in start order in the plain timing; breaks ties between equal times."""
    inputs: tuple[tuple[_Op, float], ...] = ()
    """The ops it waits for, each with the delay from its end (a transfer, or none)."""
    changes: tuple[int, int] = (0, 0)
    """How it changes its rank's activations held to B, and held to W (`_changes`)."""

    @property
    def end(self) -> float:
        return self.start + self.length

    def key(self) -> tuple[float, float, int]:
        return (self.start, self.end, self.seq)

    def ready(self) -> float:
        """When its inputs have all arrived, at their current times."""
        return max((op.start + op.length + delay for op, delay in self.inputs), default=0.0)


@dataclass(frozen=True)
class _Context:
    """What every move needs: the ops, each rank's ops and their memory bounds."""

    ops: dict[Action, _Op]
    ranks: dict[int, list[_Op]]
    caps: dict[int, tuple[int, int]]
    consumed: set[Action]
    """The ops some other op waits for."""

    def fits(self, rank: int, since: float = -math.inf, until: float = math.inf) -> bool:
        """Whether `rank`'s memory, along its current time order, is within its bounds.
        Only the ops starting from `since` to `until` are walked: the caller knows that
        the counts before and after them are as they were when the rank last fitted."""
        held_b = held_w = 0
        window = []
        for op in self.ranks[rank]:
            if op.start < since:
                held_b += op.changes[0]
                held_w += op.changes[1]
            elif op.start <= until:
                window.append(op)
        window.sort(key=_Op.key)
        cap_b, cap_w = self.caps[rank]
        if held_b > cap_b or held_w > cap_w:
            return False
        for op in window:
            held_b += op.changes[0]
            held_w += op.changes[1]
            if held_b > cap_b or held_w > cap_w:
                return False
        return True


def squeeze(
    placed: Sequence[dict[int, Action]], steady: tuple[int, int], layout: Layout
) -> tuple[tuple[Action, ...], ...]:
    """Each rank's order after squeezing (see the module docstring). `placed` holds each
    rank's ops by slot; `steady` is the closed range of slots of the steady state. A plain
    order that cannot run (an op missing or doubled, a deadlock) comes back as it is, for
    `validate` to report."""
    plain = [[slots[s] for s in sorted(slots)] for slots in placed]
    phase = {
        op: WARM_UP if slot < steady[0] else COOL_DOWN if slot > steady[1] else STEADY
        for slots in placed
        for slot, op in slots.items()
    }
    inputs = _inputs(layout)
    ops = _time(plain, inputs, phase, layout)
    if ops is None:
        return tuple(tuple(rank) for rank in plain)
    ranks: dict[int, list[_Op]] = {r: [] for r in range(len(plain))}
    for op in ops.values():
        ranks[op.rank].append(op)
    split = Kind.W in layout.kinds
    transfer = layout.costs.of("C")
    for op in ops.values():
        op.changes = _changes(op.action.kind, split)
        op.inputs = tuple(
            (ops[dep], transfer if data and ops[dep].rank != op.rank else 0.0)
            for dep, data in inputs.get(op.action, ())
        )
    caps = {r: _peaks(sorted(rank, key=_Op.key)) for r, rank in ranks.items()}
    consumed = {dep for deps in inputs.values() for dep, _ in deps}
    context = _Context(ops, ranks, caps, consumed)
    _move_early(context)
    _move_before_ws(context)
    return tuple(tuple(op.action for op in sorted(ranks[r], key=_Op.key)) for r in ranks)


def _inputs(layout: Layout) -> dict[Action, list[Input]]:
    """Every op's inputs: its data dependencies and its `after` edges."""
    skeleton = Program(
        "", "", (), layout.num_ranks, layout.num_stages, layout.pipelines,
        layout.assignment, layout.kinds, (),
    )  # fmt: skip
    inputs = {op: [(d, True) for d in skeleton.inputs_of(op)] for op in skeleton.compute_ops()}
    for dep in layout.after:
        inputs.setdefault(dep.later, []).append((dep.earlier, False))
    return inputs


def _time(
    plain: list[list[Action]],
    inputs: dict[Action, list[Input]],
    phase: dict[Action, int],
    layout: Layout,
) -> dict[Action, _Op] | None:
    """The plain order timed as soon as possible, numbered in start order; None when it
    cannot run to its end or runs an op twice."""
    rank_of = {op: r for r, rank in enumerate(plain) for op in rank}
    if len(rank_of) != sum(map(len, plain)):
        return None
    waiting: dict[Action, list[int]] = {}
    for op, deps in inputs.items():
        for dep, _ in deps:
            if op in rank_of:
                waiting.setdefault(dep, []).append(rank_of[op])
    transfer = layout.costs.of("C")
    ops: dict[Action, _Op] = {}
    lengths: dict[tuple[str, int | None], float] = {}
    position = [0] * len(plain)
    free_at = [0.0] * len(plain)
    todo = deque(range(len(plain)))
    while todo:
        r = todo.popleft()
        while position[r] < len(plain[r]):
            action = plain[r][position[r]]
            start = free_at[r]
            for dep, data in inputs.get(action, ()):
                if dep not in ops:
                    break
                delay = transfer if data and ops[dep].rank != r else 0.0
                start = max(start, ops[dep].end + delay)
            else:
                cost = (action.kind.value, action.stage)
                if cost not in lengths:
                    lengths[cost] = layout.costs.of(*cost)
                length = lengths[cost]
                ops[action] = _Op(action, r, start, length, phase[action])
                free_at[r] = start + length
                position[r] += 1
                todo.extend(waiting.get(action, ()))
                continue
            break
    if len(ops) != len(rank_of):
        return None
    # Ops were timed in a topological order: a stable sort keeps it among equal times.
    for seq, timed in enumerate(sorted(ops.values(), key=lambda o: (o.start, o.end))):
        timed.seq = seq
    return ops


def _move_early(context: _Context) -> None:
    """Step 2: every warm-up and cool-down op to its earliest fit."""
    busy: dict[int, list[tuple[float, float]]] = {r: [] for r in context.ranks}
    for op in sorted(context.ops.values(), key=_Op.key):
        if op.phase != STEADY:
            _move(context, op, busy[op.rank])
        bisect.insort(busy[op.rank], (op.start, op.end))


def _move_before_ws(context: _Context) -> None:
    """Step 3: the cool-down's other ops squeezed again with its W's taken out, then the
    W's put back; undone if that ends later than step 2."""
    loose: dict[int, list[_Op]] = {r: [] for r in context.ranks}
    consumed = context.consumed
    for op in context.ops.values():
        if op.phase == COOL_DOWN and op.action.kind is Kind.W and op.action not in consumed:
            loose[op.rank].append(op)
    if not any(loose.values()):
        return
    before = {action: op.start for action, op in context.ops.items()}
    span = max(op.end for op in context.ops.values())
    taken = {id(w) for ws in loose.values() for w in ws}
    visit = [op for op in sorted(context.ops.values(), key=_Op.key) if id(op) not in taken]
    rest = {r: deque(op for op in visit if op.rank == r) for r in context.ranks}
    busy: dict[int, list[tuple[float, float]]] = {r: [] for r in context.ranks}
    for op in visit:
        rest[op.rank].popleft()
        if op.phase == COOL_DOWN:
            _move(context, op, busy[op.rank], loose[op.rank], rest[op.rank])
        bisect.insort(busy[op.rank], (op.start, op.end))
    for rank, ws in loose.items():
        _put_back(ws, busy[rank])
    if max(op.end for op in context.ops.values()) > span or not all(
        context.fits(r) for r in context.ranks
    ):
        for action, start in before.items():
            context.ops[action].start = start


def _move(
    context: _Context,
    op: _Op,
    busy: list[tuple[float, float]],
    loose: Sequence[_Op] = (),
    rest: Iterable[_Op] = (),
) -> None:
    """Move `op` to the earliest idle stretch before its start, among the `busy` ops
    visited before it, where its rank's memory stays within bounds; with `loose` W's
    taken out, they are put back first, among `busy`, `op` and the `rest` not visited."""
    own = op.start
    # Only a forward moved earlier, or a W put back later, holds more than before.
    check = bool(loose) or op.action.kind is Kind.F
    floor = min((w.ready() for w in loose), default=math.inf)
    until = math.inf if loose else own
    later = [(o.start, o.end) for o in rest] if loose else []
    for start in _idle(busy, op.ready(), op.length, own):
        op.start = start
        _put_back(loose, _with(busy, floor, op, later))
        if not check or context.fits(op.rank, min(start, floor), until):
            return
    op.start = own
    _put_back(loose, _with(busy, floor, op, later))


def _with(
    busy: list[tuple[float, float]], floor: float, op: _Op, later: list[tuple[float, float]]
) -> list[tuple[float, float]]:
    """The `busy` intervals that end after `floor`, `op`'s in its place, then the `later`
    ones: what the W's put back may meet."""
    intervals = busy[bisect.bisect_right(busy, floor, key=lambda interval: interval[1]) :]
    bisect.insort(intervals, (op.start, op.end))
    return intervals + later


def _put_back(ws: Sequence[_Op], busy: list[tuple[float, float]]) -> None:
    """The W's taken out of one rank, in the order their inputs are ready, each into the
    earliest idle stretch after them that holds it, among the rank's other ops (`busy`,
    by start) and the W's put back before it."""
    if not ws:
        return
    ready = sorted((w.ready(), w.seq, w) for w in ws)
    # Nothing that ends before the first W is ready can be in its way.
    taken = busy[bisect.bisect_right(busy, ready[0][0], key=lambda interval: interval[1]) :]
    for at, _, w in ready:
        w.start = next(iter(_idle(taken, at, w.length, math.inf)))
        bisect.insort(taken, (w.start, w.end))


def _idle(
    busy: list[tuple[float, float]], ready: float, length: float, before: float
) -> Iterable[float]:
    """The starts, earliest first and before `before`, of the idle stretches between
    the `busy` intervals that begin at `ready` or later and hold `length`. The last
    stretch runs on after the last busy interval."""
    at = ready
    # Busy intervals do not overlap, so their ends rise with their starts.
    first = bisect.bisect_right(busy, ready, key=lambda interval: interval[1])
    for begin, end in itertools.islice(busy, first, None):
        if at >= before:
            return
        if begin >= at + length:
            yield at
        at = max(at, end)
    if at < before:
        yield at


def _changes(kind: Kind, split: bool) -> tuple[int, int]:
    """How an op changes the activations held to B, and those held to W when `split`
    (else to B as well): +1 at F; -1 at B, or at W."""
    if kind is Kind.F:
        return 1, 1
    if kind is Kind.B:
        return -1, 0 if split else -1
    if kind is Kind.W and split:
        return 0, -1
    return 0, 0


def _peaks(ops: Iterable[_Op]) -> tuple[int, int]:
    """The most activations held along `ops`: from F to B, as `simulate` counts them, and
    from F to W (`_changes`)."""
    to_b = to_w = peak_b = peak_w = 0
    for op in ops:
        to_b += op.changes[0]
        to_w += op.changes[1]
        peak_b = max(peak_b, to_b)
        peak_w = max(peak_w, to_w)
    return peak_b, peak_w
