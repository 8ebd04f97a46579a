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

The work grows about linearly with the number of micro-batches. Ops are found by
number, not by hashing (`_graph`). Each rank keeps its ops in time order with the
activations held after each (`_Line`), and a memory check walks only the ops between
the earliest and the latest place of an op the move shifts. The ops that do not move
are passed over in each rank's order, not visited (`_sweep`). In step 3 each rank keeps
its W's where the last kept move put them (`_Loose`); a move tried re-places only the
W's it can change (those waiting for the moved op, those it overlaps, those that may
fit where it was, and so on from each W that moves), a few per move, not all of the
rank's W's. Each W is searched among all the rank's other ops.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from operator import attrgetter, itemgetter
from typing import TypeVar

from pipelang import memory
from pipelang.diagnostics import InternalError
from pipelang.ir import Action, Kind, Program
from pipelang.orders import Layout

WARM_UP, STEADY, COOL_DOWN = -1, 0, 1
_T = TypeVar("_T")

_END = itemgetter(1)
"""An interval's end. `busy` lists are sorted by start; their intervals do not overlap,
so the ends rise too and can be bisected."""


@dataclass(eq=False, slots=True)
class _Op:
    """One op while squeezing: its rank, its current start, its length and its phase."""

    action: Action
    rank: int
    start: float
    end: float
    length: float
    phase: int
    changes: tuple[int, int]
    """How it changes its rank's activations held to B, and held to W (`memory.change`)."""
    inputs: tuple[tuple[_Op, float], ...] = ()
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


_KEY = attrgetter("start", "end", "seq")
"""Time order: by start, then end, then `seq`."""


class _Line:
    """One rank's ops in time order (`_KEY`), with the activations held after each.

    A move changes the order only among the ops that start between its new and its old
    place, so checking and recording it walks just those (`settle`): the counts before
    them, and after them, stay as they were."""

    def __init__(self, ops: list[_Op]) -> None:
        self.ops = ops
        self.starts = [op.start for op in ops]
        self.held = [(0, 0)]
        """`held[k]`: the activations held to B and to W after the first k ops."""
        held_b = held_w = 0
        for op in ops:
            held_b += op.changes[0]
            held_w += op.changes[1]
            self.held.append((held_b, held_w))
        self.caps = (max(b for b, _ in self.held), max(w for _, w in self.held))
        """The most the rank may hold: the plain order's peaks."""
        self.over: set[int] = set()
        """The k where `held[k]` is above `caps` (none at first; only step 3 makes any)."""

    def copy(self) -> _Line:
        line = _Line.__new__(_Line)  # no __init__: a copy per tried move, not a recount
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
        window = sorted(self.ops[first:last], key=_KEY)
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


def squeeze(
    placed: Sequence[dict[int, Action]], steady: tuple[int, int], layout: Layout
) -> tuple[tuple[Action, ...], ...]:
    """Each rank's order after squeezing (see the module docstring). `placed` holds each
    rank's ops by slot; `steady` is the closed range of slots of the steady state. A plain
    order that cannot run (an op missing or doubled, a deadlock) comes back as it is, for
    `validate` to report."""
    graph = _graph(placed, steady, layout)
    timed = None if graph is None else _time(*graph)
    if timed is None:
        return tuple(tuple(slots[s] for s in sorted(slots)) for slots in placed)
    lines: list[list[_Op]] = [[] for _ in placed]
    for op in timed:
        lines[op.rank].append(op)
    ranks = [_Line(line) for line in lines]
    _move_early(ranks)
    _move_before_ws(timed, ranks)
    return tuple(tuple(op.action for op in line.ops) for line in ranks)


def _graph(
    placed: Sequence[dict[int, Action]], steady: tuple[int, int], layout: Layout
) -> tuple[list[list[_Op]], list[_Op]] | None:
    """Each rank's ops in slot order with their lengths, phases and inputs (their data
    dependencies and `after` edges), and the ops in `Program.compute_ops` order (then
    any op of a kind the schedule does not declare that an `after` edge holds back);
    None when an op is there twice or waits for one that is not there."""
    kinds = {kind: k for k, kind in enumerate(layout.kinds)}
    per_mb = layout.num_stages * len(kinds)

    def number(action: Action) -> int | None:
        """The op's place in `compute_ops`; None if it is not one of them."""
        k, mb, stage = kinds.get(action.kind), action.mb, action.stage
        if k is None or mb is None or stage is None or not 0 <= stage < layout.num_stages:
            return None
        if not 0 <= mb < len(layout.assignment) or action.pipeline != layout.assignment[mb]:
            return None
        return mb * per_mb + stage * len(kinds) + k

    numbered: list[_Op | None] = [None] * (len(layout.assignment) * per_mb)
    others: dict[Action, _Op] = {}
    freed_by = Kind.W if Kind.W in kinds else Kind.B
    op_time = layout.op_time()  # built once: it is a new CostModel with W in B
    ranks: list[list[_Op]] = []
    for r, slots in enumerate(placed):
        ranks.append([])
        for slot in sorted(slots):
            action = slots[slot]
            kind = action.kind
            phase = WARM_UP if slot < steady[0] else COOL_DOWN if slot > steady[1] else STEADY
            op = _Op(
                action,
                r,
                0.0,
                0.0,
                op_time(action),
                phase,
                (memory.change(kind), memory.change(kind, freed_by)),
            )
            at = number(action)
            if at is None:
                if others.setdefault(action, op) is not op:
                    return None
            elif numbered[at] is None:
                numbered[at] = op
            else:
                return None
            ranks[r].append(op)
    pattern, consumed = _pattern(layout, kinds)
    transfer = layout.costs.of("C")
    for at, consumer in enumerate(numbered):
        if consumer is None:
            continue
        inputs = []
        for k, stage in pattern[at % per_mb]:
            dep = None if k is None else numbered[at - at % per_mb + stage * len(kinds) + k]
            if dep is None:
                return None
            inputs.append((dep, transfer if dep.rank != consumer.rank else 0.0))
        consumer.inputs = tuple(inputs)
        consumer.consumed = at % per_mb in consumed
    held_back: list[_Op] = []  # undeclared-kind ops that `after` edges hold back
    for edge in layout.after:
        at = number(edge.earlier)
        earlier = others.get(edge.earlier) if at is None else numbered[at]
        at = number(edge.later)
        later = others.get(edge.later) if at is None else numbered[at]
        if earlier is not None:
            earlier.consumed = True
        if later is None:
            continue
        if earlier is None:
            return None
        if at is None and later not in held_back:
            held_back.append(later)
        later.inputs += ((earlier, 0.0),)
    return ranks, [op for op in numbered if op is not None] + held_back


def _pattern(
    layout: Layout, kinds: dict[Kind, int]
) -> tuple[list[tuple[tuple[int | None, int], ...]], set[int]]:
    """The data dependencies of each stage's op of each kind, by place in `compute_ops`
    (stage, then kind) within its micro-batch: for each, its inputs as (kind number, or
    None for an undeclared kind; stage), all of the same micro-batch
    (`Program.inputs_of`); and the places some op waits for."""
    pattern: list[tuple[tuple[int | None, int], ...]] = []
    consumed: set[int] = set()
    if not layout.assignment:
        return pattern, consumed
    skeleton = Program(
        "", "", (), layout.num_ranks, layout.num_stages, layout.pipelines,
        layout.assignment, layout.kinds, (),
    )  # fmt: skip
    pipeline = layout.assignment[0]
    for stage in range(layout.num_stages):
        for kind in layout.kinds:
            deps = skeleton.inputs_of(Action(kind, 0, stage, pipeline))
            if any(dep.mb != 0 or dep.pipeline != pipeline for dep in deps):
                raise InternalError(f"`{kind.value}` waits for another micro-batch")
            pattern.append(tuple((kinds.get(dep.kind), dep.stage or 0) for dep in deps))
            for dep in deps:
                if dep.kind in kinds and dep.stage is not None:
                    consumed.add(dep.stage * len(kinds) + kinds[dep.kind])
    return pattern, consumed


def _time(ranks: list[list[_Op]], consumers: list[_Op]) -> list[_Op] | None:
    """Time each rank's ops as soon as their inputs and their rank allow; the ops in
    start order, numbered so (`seq`), or None when the order cannot run to its end.
    `consumers` sets the order in which ranks waiting for an op are looked at again,
    which orders the ops that start and end at the same time."""
    waiting: dict[_Op, list[int]] = {}
    for op in consumers:
        for dep, _ in op.inputs:
            waiting.setdefault(dep, []).append(op.rank)
    timed: list[_Op] = []
    done: set[_Op] = set()
    position = [0] * len(ranks)
    free_at = [0.0] * len(ranks)
    todo = deque(range(len(ranks)))
    while todo:
        r = todo.popleft()
        rank = ranks[r]
        while position[r] < len(rank):
            op = rank[position[r]]
            start = free_at[r]
            for dep, delay in op.inputs:
                if dep not in done:
                    break
                start = max(start, dep.end + delay)
            else:
                op.place(start)
                free_at[r] = op.end
                position[r] += 1
                done.add(op)
                timed.append(op)
                todo.extend(waiting.get(op, ()))
                continue
            break
    if len(timed) != sum(map(len, ranks)):
        return None
    # Ops were timed in a topological order: a stable sort keeps it among equal times.
    timed.sort(key=attrgetter("start", "end"))
    for seq, op in enumerate(timed):
        op.seq = seq
    return timed


def _move_early(ranks: list[_Line]) -> None:
    """Step 2: every warm-up and cool-down op, in start order, to its earliest fit."""
    orders = [line.ops[:] for line in ranks]
    _sweep(orders, STEADY, lambda op, busy, _: _move(ranks[op.rank], op, busy))


def _move_before_ws(ops: list[_Op], ranks: list[_Line]) -> None:
    """Step 3: the cool-down's other ops squeezed again with its W's taken out, then the
    W's put back; undone if that ends later than step 2."""
    loose = [
        [op for op in line.ops if op.phase == COOL_DOWN and op.action.kind is Kind.W]
        for line in ranks
    ]
    loose = [[w for w in ws if not w.consumed] for ws in loose]
    if not any(loose):
        return
    before = [(op, op.start) for op in ops]
    saved = [line.copy() for line in ranks]
    span = max(op.end for op in ops)
    taken = {w for ws in loose for w in ws}
    orders = [[op for op in line.ops if op not in taken] for line in ranks]
    put = [_Loose(ws, line) if ws else None for ws, line in zip(loose, ranks, strict=True)]
    waits: dict[_Op, list[tuple[_Loose, int]]] = {}
    for state in put:
        if state is not None:
            for i, w in enumerate(state.ws):
                for dep, _ in w.inputs:
                    waits.setdefault(dep, []).append((state, i))

    def move(op: _Op, busy: list[tuple[float, float]], _: int) -> None:
        state = put[op.rank]
        if state is None:
            _move(ranks[op.rank], op, busy)
        else:
            _move_loose(ranks[op.rank], op, busy, state, waits.get(op, []))

    busy = _sweep(orders, COOL_DOWN, move)
    for rank, ws in enumerate(loose):
        if ws:
            since = min(w.ready() for w in ws)
            _put_back(ws, busy[rank])
            ranks[rank].settle(since, math.inf)
    if max(op.end for op in ops) > span or not all(line.fits() for line in ranks):
        for op, start in before:
            op.place(start)
        ranks[:] = saved


class _Loose:
    """One rank's loose W's in step 3, kept where `_put_back` would put them among the
    rank's other ops at their current places; a move re-places only the W's it can reach
    (`shift`), and is undone in full if it is not kept (`undo`).

    `taken` holds every op of the rank as (start, end, tag), sorted, none overlapping:
    tag -1 for the other ops, else the W's index in `ws`. `_put_back` places the W's in
    the order of `keys` (ready, `seq`), each in the earliest stretch after its ready that
    the ops and the W's placed before it leave; so a W's place depends only on what lies
    between its ready and its end. When a move adds or frees a stretch, the W's whose place
    it can change are those it overlaps, or whose ready-to-end span it meets; each one
    placed again may change others in turn."""

    def __init__(self, ws: list[_Op], line: _Line) -> None:
        self.ws = ws
        self.index = {w: i for i, w in enumerate(ws)}
        self.keys: list[tuple[float, int]] = []
        self.taken: list[tuple[float, float, int]] = []
        self.floor = self.slack = 0.0
        self.stale = False
        """Whether an op of another rank that a W waits for (by an `after` edge) moved."""
        self.refresh(line)
        self._log: list[tuple[bool, tuple[float, float, int]]] = []
        self._moved: dict[int, float] = {}
        self._readies: list[tuple[int, tuple[float, int]]] = []

    def refresh(self, line: _Line) -> None:
        """Put all the W's back, as `_put_back` does, and settle `line` to it."""
        others = [(op.start, op.end) for op in line.ops if op not in self.index]
        _put_back(self.ws, others)
        self.keys = [(w.ready(), w.seq) for w in self.ws]
        self.taken = sorted(
            [(start, end, -1) for start, end in others]
            + [(w.start, w.end, i) for i, w in enumerate(self.ws)]
        )
        self.floor = min(ready for ready, _ in self.keys)
        self.slack = max(w.start - ready for w, (ready, _) in zip(self.ws, self.keys, strict=True))
        """At least the longest wait of a W from its ready to its start."""
        self.stale = False
        line.settle(self.floor, math.inf)

    def shift(self, op: _Op, own: float, waiting: list[int]) -> tuple[float, float]:
        """Re-place the W's after `op` (not a loose W) moved from `own` to its place:
        those `waiting` for it (by index), and those the move reaches. Returns the earliest
        and latest start of the ops that moved, before or after (for `_Line.settle`)."""
        heap: list[tuple[float, int, int]] = []
        for i in waiting:
            key = (self.ws[i].ready(), self.ws[i].seq)
            if key != self.keys[i]:
                self._readies.append((i, self.keys[i]))
                self.keys[i] = key
                heapq.heappush(heap, (*key, i))
        self._take((own, own + op.length, -1))
        self._freed(own, own + op.length, None, heap)
        out = self._clash(op.start, op.end, None, heap)
        self._give((op.start, op.end, -1))
        lo, hi = op.start, own
        done: set[int] = set()
        while heap:
            ready, seq, i = heapq.heappop(heap)
            if i in done:
                continue
            done.add(i)
            w = self.ws[i]
            start = w.start
            if i not in out:
                self._take((start, w.end, i))
            at = self._first_free(ready, w.length, (ready, seq))
            self.slack = max(self.slack, at - ready)
            if at == start and i not in out:
                self._give((start, w.end, i))
                continue
            self._moved.setdefault(i, start)
            self._freed(start, w.end, (ready, seq), heap)
            w.place(at)
            out |= self._clash(at, w.end, (ready, seq), heap)
            self._give((at, w.end, i))
            lo, hi = min(lo, start, at), max(hi, start, at)
        return lo, hi

    def keep(self, waiting: list[int]) -> None:
        """Keep what `shift` did."""
        for i in waiting:
            self.floor = min(self.floor, self.keys[i][0])
        self._log.clear()
        self._moved.clear()
        self._readies.clear()

    def undo(self) -> None:
        """Undo what `shift` did (the caller puts the op back)."""
        for added, entry in reversed(self._log):
            if added:
                del self.taken[bisect.bisect_left(self.taken, entry)]
            else:
                bisect.insort(self.taken, entry)
        for i, start in self._moved.items():
            self.ws[i].place(start)
        for i, key in reversed(self._readies):
            self.keys[i] = key
        self.keep([])

    def _give(self, entry: tuple[float, float, int]) -> None:
        bisect.insort(self.taken, entry)
        self._log.append((True, entry))

    def _take(self, entry: tuple[float, float, int]) -> None:
        at = bisect.bisect_left(self.taken, entry)
        if self.taken[at] != entry:
            raise InternalError(f"squeeze lost track of {entry}")
        del self.taken[at]
        self._log.append((False, entry))

    def _first_free(self, ready: float, length: float, key: tuple[float, int]) -> float:
        """`_first_idle` among the other ops and the W's placed before `key`."""
        at = ready
        keys = self.keys
        taken = self.taken
        for begin, end, i in _tail(taken, bisect.bisect_right(taken, ready, key=_END)):
            if i >= 0 and keys[i] >= key:
                continue
            if begin >= at + length:
                return at
            at = max(at, end)
        return at

    def _freed(
        self,
        begin: float,
        end: float,
        key: tuple[float, int] | None,
        heap: list[tuple[float, int, int]],
    ) -> None:
        """Queue the W's placed after `key` (all, for None) whose span from ready to end
        meets the stretch from `begin` to `end`, which is no longer taken."""
        taken, keys = self.taken, self.keys
        bound = end + self.slack
        for at in range(bisect.bisect_right(taken, begin, key=_END), len(taken)):
            start, _, i = taken[at]
            if start >= bound:
                break
            if i >= 0 and keys[i][0] < end and (key is None or keys[i] > key):
                heapq.heappush(heap, (*keys[i], i))

    def _clash(
        self,
        begin: float,
        end: float,
        key: tuple[float, int] | None,
        heap: list[tuple[float, int, int]],
    ) -> set[int]:
        """Take out and queue the W's placed after `key` (all, for None) that overlap the
        stretch from `begin` to `end`, which is now taken; their indices."""
        taken, keys = self.taken, self.keys
        clash = []
        for at in range(bisect.bisect_right(taken, begin, key=_END), len(taken)):
            entry = taken[at]
            if entry[0] >= end:
                break
            i = entry[2]
            if i >= 0 and (key is None or keys[i] > key):
                clash.append(entry)
        for entry in clash:
            self._take(entry)
            heapq.heappush(heap, (*keys[entry[2]], entry[2]))
        return {entry[2] for entry in clash}


def _sweep(
    orders: list[list[_Op]],
    phase: int,
    move: Callable[[_Op, list[tuple[float, float]], int], None],
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
    visit.sort(key=lambda visited: _KEY(visited[0]))
    busy: list[list[tuple[float, float]]] = [[] for _ in orders]
    passed = [0] * len(orders)
    for op, at in visit:
        _join(busy[op.rank], orders[op.rank][passed[op.rank] : at])
        move(op, busy[op.rank], at)
        _join(busy[op.rank], (op,))
        passed[op.rank] = at + 1
    for rank, order in enumerate(orders):
        _join(busy[rank], order[passed[rank] :])
    return busy


def _join(busy: list[tuple[float, float]], ops: Sequence[_Op]) -> None:
    """Add the intervals of `ops`, in time order, to `busy`, keeping it sorted."""
    intervals = [(op.start, op.end) for op in ops]
    if not busy or (intervals and busy[-1] <= intervals[0]):
        busy.extend(intervals)  # the common case, as insort would leave them
        return
    for interval in intervals:
        bisect.insort(busy, interval)


def _move(line: _Line, op: _Op, busy: list[tuple[float, float]]) -> None:
    """Move `op` to the earliest idle stretch before its start, among the `busy` ops
    visited before it, where its rank's memory stays within bounds (only a forward moved
    earlier holds more than before). The rank's `line` is settled to the result."""
    own = op.start
    check = op.action.kind is Kind.F
    for start in _idle(busy, op.ready(), op.length, own):
        op.place(start)
        if line.settle(start, own, check):
            return
    op.place(own)


def _move_loose(
    line: _Line,
    op: _Op,
    busy: list[tuple[float, float]],
    loose: _Loose,
    waiting: list[tuple[_Loose, int]],
) -> None:
    """`_move` in step 3, on a rank with loose W's taken out: at each try they are put
    back (`_Loose.shift`), and a move is kept only if the rank's memory stays within
    bounds, from its start (or the earliest ready of a W, if earlier) to the end."""
    if loose.stale:
        loose.refresh(line)
    own = op.start
    mine = [i for state, i in waiting if state is loose]
    for start in _idle(busy, op.ready(), op.length, own):
        op.place(start)
        lo, hi = loose.shift(op, own, mine)
        floor = min([loose.floor] + [loose.keys[i][0] for i in mine])
        if line.settle(lo, hi, True, min(start, floor)):
            loose.keep(mine)
            for state, _ in waiting:
                state.stale = state.stale or state is not loose
            return
        loose.undo()
        op.place(own)


def _put_back(ws: Sequence[_Op], busy: list[tuple[float, float]]) -> None:
    """The W's taken out of one rank, in the order their inputs are ready, each into the
    earliest idle stretch after them that holds it, among the rank's other ops (`busy`,
    by start) and the W's put back before it."""
    if not ws:
        return
    ready = sorted((w.ready(), w.seq, w) for w in ws)
    # Nothing that ends before the first W is ready can be in its way.
    taken = busy[bisect.bisect_right(busy, ready[0][0], key=_END) :]
    for at, _, w in ready:
        w.place(_first_idle(taken, at, w.length))
        bisect.insort(taken, (w.start, w.end))


def _idle(
    busy: list[tuple[float, float]], ready: float, length: float, before: float
) -> Iterable[float]:
    """The starts, earliest first and before `before`, of the idle stretches between
    the `busy` intervals that begin at `ready` or later and hold `length`. The last
    stretch runs on after the last busy interval."""
    at = ready
    first = bisect.bisect_right(busy, ready, key=_END)
    for begin, end in _tail(busy, first):
        if at >= before:
            return
        if begin >= at + length:
            yield at
        at = max(at, end)
    if at < before:
        yield at


def _first_idle(busy: list[tuple[float, float]], ready: float, length: float) -> float:
    """The first start `_idle` gives with no bound: the earliest idle stretch among the
    `busy` intervals that begins at `ready` or later and holds `length`."""
    at = ready
    for begin, end in _tail(busy, bisect.bisect_right(busy, ready, key=_END)):
        if begin >= at + length:
            return at
        at = max(at, end)
    return at


def _tail(items: list[_T], first: int) -> Iterator[_T]:
    """The items from `first` on, without stepping over those before (as `islice` does)."""
    return map(items.__getitem__, range(first, len(items)))
