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
activations held after each (`Line`), and a memory check walks only the ops between
the earliest and the latest place of an op the move shifts. The ops that do not move
are passed over in each rank's order, not visited (`sweep`). In step 3 each rank keeps
its W's where the last kept move put them (`_Loose`); a move tried re-places only the
W's it can change (those waiting for the moved op, those it overlaps, those that may
fit where it was, and so on from each W that moves), a few per move, not all of the
rank's W's. Each W is searched among all the rank's other ops.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence

from pipelang.diagnostics import InternalError
from pipelang.ir import Action, Kind, Program
from pipelang.orders import Layout
from pipelang.orders.timed import (
    COOL_DOWN,
    END,
    STEADY,
    WARM_UP,
    Line,
    Op,
    first_idle,
    idle,
    move_op,
    sweep,
    tail,
    time_ops,
)
from pipelang.sim import memory
from pipelang.sim.engine import Input


def squeeze(
    placed: Sequence[dict[int, Action]], steady: tuple[int, int], layout: Layout
) -> tuple[tuple[Action, ...], ...]:
    """Each rank's order after squeezing (see the module docstring). `placed` holds each
    rank's ops by slot; `steady` is the closed range of slots of the steady state. A plain
    order that cannot run (an op missing or doubled, a deadlock) comes back as it is, for
    `validate` to report."""
    graph = _graph(placed, steady, layout)
    timed = None if graph is None else time_ops(*graph, layout.program.costs)
    if timed is None:
        return tuple(tuple(slots[s] for s in sorted(slots)) for slots in placed)
    lines: list[list[Op]] = [[] for _ in placed]
    for op in timed:
        lines[op.rank].append(op)
    ranks = [Line(line) for line in lines]
    _move_early(ranks)
    _move_before_ws(timed, ranks)
    return tuple(tuple(op.action for op in line.ops) for line in ranks)


def _graph(
    placed: Sequence[dict[int, Action]], steady: tuple[int, int], layout: Layout
) -> tuple[list[list[Op]], list[Op], list[list[Input]]] | None:
    """Each rank's ops in slot order with their lengths and phases; the ops numbered in
    `Program.compute_ops` order (then any op of a kind the schedule does not declare
    that an `after` edge holds back, then the rest); and each op's inputs by number (its
    data dependencies, `delayed`, and its `after` edges). None when an op is there twice
    or waits for one that is not there."""
    kinds = {kind: k for k, kind in enumerate(layout.program.kinds)}
    per_mb = layout.program.num_stages * len(kinds)

    def number(action: Action) -> int | None:
        """The op's place in `compute_ops`; None if it is not one of them."""
        k, mb, stage = kinds.get(action.kind), action.mb, action.stage
        if k is None or mb is None or stage is None or not 0 <= stage < layout.program.num_stages:
            return None
        if (
            not 0 <= mb < len(layout.program.assignment)
            or action.pipeline != layout.program.assignment[mb]
        ):
            return None
        return mb * per_mb + stage * len(kinds) + k

    numbered: list[Op | None] = [None] * (len(layout.program.assignment) * per_mb)
    others: dict[Action, Op] = {}
    to_w = 1.0 if Kind.W in kinds else None  # counted whole until W, where W is split
    op_time = layout.op_time()  # built once: it is a new CostModel with W in B
    ranks: list[list[Op]] = []
    for r, slots in enumerate(placed):
        ranks.append([])
        for slot in sorted(slots):
            action = slots[slot]
            kind = action.kind
            phase = WARM_UP if slot < steady[0] else COOL_DOWN if slot > steady[1] else STEADY
            changes = (memory.change(kind), memory.change(kind, to_w))
            op = Op(action, r, 0.0, 0.0, op_time(action), phase, changes)
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
    wants: dict[Op, list[tuple[Op, bool]]] = {}
    for at, consumer in enumerate(numbered):
        if consumer is None:
            continue
        reads = wants[consumer] = []
        for k, stage in pattern[at % per_mb]:
            dep = None if k is None else numbered[at - at % per_mb + stage * len(kinds) + k]
            if dep is None:
                return None
            reads.append((dep, True))
        consumer.consumed = at % per_mb in consumed
    held_back: list[Op] = []  # undeclared-kind ops that `after` edges hold back
    for edge in layout.program.after:
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
        wants.setdefault(later, []).append((earlier, False))
    ops = [op for op in numbered if op is not None] + held_back
    listed = set(ops)
    ops += [op for rank in ranks for op in rank if op not in listed]
    index = {op: i for i, op in enumerate(ops)}
    inputs = [[(index[dep], delayed) for dep, delayed in wants.get(op, ())] for op in ops]
    return ranks, ops, inputs


def _pattern(
    layout: Layout, kinds: dict[Kind, int]
) -> tuple[list[tuple[tuple[int | None, int], ...]], set[int]]:
    """The data dependencies of each stage's op of each kind, by place in `compute_ops`
    (stage, then kind) within its micro-batch: for each, its inputs as (kind number, or
    None for an undeclared kind; stage), all of the same micro-batch
    (`Program.inputs_of`); and the places some op waits for."""
    pattern: list[tuple[tuple[int | None, int], ...]] = []
    consumed: set[int] = set()
    if not layout.program.assignment:
        return pattern, consumed
    skeleton = Program(
        "", "", (), layout.program.num_ranks, layout.program.num_stages, layout.program.pipelines,
        layout.program.assignment, layout.program.kinds, (),
    )  # fmt: skip
    pipeline = layout.program.assignment[0]
    for stage in range(layout.program.num_stages):
        for kind in layout.program.kinds:
            deps = skeleton.inputs_of(Action(kind, 0, stage, pipeline))
            if any(dep.mb != 0 or dep.pipeline != pipeline for dep in deps):
                raise InternalError(f"`{kind.value}` waits for another micro-batch")
            pattern.append(tuple((kinds.get(dep.kind), dep.stage or 0) for dep in deps))
            for dep in deps:
                if dep.kind in kinds and dep.stage is not None:
                    consumed.add(dep.stage * len(kinds) + kinds[dep.kind])
    return pattern, consumed


def _move_early(ranks: list[Line]) -> None:
    """Step 2: every warm-up and cool-down op, in start order, to its earliest fit."""
    orders = [line.ops[:] for line in ranks]
    sweep(orders, STEADY, lambda op, busy, _: move_op(ranks[op.rank], op, busy))


def _move_before_ws(ops: list[Op], ranks: list[Line]) -> None:
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
    waits: dict[Op, list[tuple[_Loose, int]]] = {}
    for state in put:
        if state is not None:
            for i, w in enumerate(state.ws):
                for dep, _ in w.inputs:
                    waits.setdefault(dep, []).append((state, i))

    def move(op: Op, busy: list[tuple[float, float]], _: int) -> None:
        state = put[op.rank]
        if state is None:
            move_op(ranks[op.rank], op, busy)
        else:
            _move_loose(ranks[op.rank], op, busy, state, waits.get(op, []))

    busy = sweep(orders, COOL_DOWN, move)
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

    def __init__(self, ws: list[Op], line: Line) -> None:
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

    def refresh(self, line: Line) -> None:
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

    def shift(self, op: Op, own: float, waiting: list[int]) -> tuple[float, float]:
        """Re-place the W's after `op` (not a loose W) moved from `own` to its place:
        those `waiting` for it (by index), and those the move reaches. Returns the earliest
        and latest start of the ops that moved, before or after (for `Line.settle`)."""
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
        """`first_idle` among the other ops and the W's placed before `key`."""
        at = ready
        keys = self.keys
        taken = self.taken
        for begin, end, i in tail(taken, bisect.bisect_right(taken, ready, key=END)):
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
        for at in range(bisect.bisect_right(taken, begin, key=END), len(taken)):
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
        for at in range(bisect.bisect_right(taken, begin, key=END), len(taken)):
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


def _move_loose(
    line: Line,
    op: Op,
    busy: list[tuple[float, float]],
    loose: _Loose,
    waiting: list[tuple[_Loose, int]],
) -> None:
    """`move` in step 3, on a rank with loose W's taken out: at each try they are put
    back (`_Loose.shift`), and a move is kept only if the rank's memory stays within
    bounds, from its start (or the earliest ready of a W, if earlier) to the end."""
    if loose.stale:
        loose.refresh(line)
    own = op.start
    mine = [i for state, i in waiting if state is loose]
    for start in idle(busy, op.ready(), op.length, own):
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


def _put_back(ws: Sequence[Op], busy: list[tuple[float, float]]) -> None:
    """The W's taken out of one rank, in the order their inputs are ready, each into the
    earliest idle stretch after them that holds it, among the rank's other ops (`busy`,
    by start) and the W's put back before it."""
    if not ws:
        return
    ready = sorted((w.ready(), w.seq, w) for w in ws)
    # Nothing that ends before the first W is ready can be in its way.
    taken = busy[bisect.bisect_right(busy, ready[0][0], key=END) :]
    for at, _, w in ready:
        w.place(first_idle(taken, at, w.length))
        bisect.insort(taken, (w.start, w.end))
