"""`order greedy { prefer ..  priority ..  cap .. }`: list scheduling by a rule.

The compiler replays the schedule in time with its own cost model (the `cost` line):
whenever a rank is idle it runs, among its ops whose inputs are ready, the one that comes
first by `prefer` (op kinds, first wins) and then by the `priority` keys (integer
expressions over `mb`, `stage`, `rank` and `chunk`, smallest first). A forward that would
bring a new micro-batch onto the rank (a forward of the rank's first stage of its
pipeline) is held back while `cap` micro-batches are in flight there (between that
forward and the backward of the same stage; with sequence chunks, `cap` counts chunks,
Seq1F1B's unit of work); later stages of a micro-batch in flight are never held, so
wave and V placements do not stall on their own second chunk. Frozen forwards (`P`) are
in one pool that every rank holding the frozen part draws from, so by default (`P` last
in `prefer`) an idle holder fills its bubble with the next micro-batch's frozen work;
`frozen best` (the default) also replays with every `P` first and keeps the faster.

    order greedy {                  # zero-bubble flavour
        prefer B, F, W
        priority mb
        cap 2 * (D - rank) - 1
    }
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from pipelang import ast
from pipelang.diagnostics import Label, fail
from pipelang.evaluate import Env, compile_int
from pipelang.ir import Action, Dependency, Kind, Program, placement
from pipelang.orders import Layout
from pipelang.sim.engine import Engine, Input

_DEFAULT_PREFER = ("R", "B", "F", "W", "P")


@dataclass
class _Rank:
    """One rank's side of the rule during a replay."""

    index: int
    cap: int
    entries: frozenset[tuple[int | None, str | None]]
    """The rank's first (stage, pipeline) of each pipeline: where micro-batches enter."""
    in_flight: int = 0
    waiting: list[tuple[float, int, int]] = field(default_factory=list)
    """(ready at, sequence, op index) of ops whose inputs are done; ties go to the op
    that became ready first."""
    ready: list[tuple[tuple[int, ...], int, int]] = field(default_factory=list)
    held: list[tuple[tuple[int, ...], int, int]] = field(default_factory=list)


def expand_greedy_order(order: ast.OrderGreedy, layout: Layout) -> tuple[tuple[Action, ...], ...]:
    """Replay in time; each idle rank picks its best ready op under its cap.

    With frozen work, `frozen best` (the default) replays twice, filling bubbles and
    with every frozen forward first, and keeps the order that ends sooner (filling on a
    tie); `frozen fill` and `frozen first` replay once."""
    replay = _Replay(order, layout)
    mode = order.frozen if layout.program.frozen else "fill"
    if mode != "best":
        return replay.run(upfront=mode == "first")[0]
    fill, fill_end = replay.run(upfront=False)
    first, first_end = replay.run(upfront=True)
    return first if first_end < fill_end else fill


class _Replay:
    """The ops of one schedule, numbered, timed and with their inputs, built once for
    any number of replays on the timing engine (`sim.engine`, as `simulate` times them).

    Ops are numbered (in `compute_ops` order, which also breaks ties) and the replay
    works on the numbers: hashing an Action costs a Python call, and this loop touches
    each op a few times."""

    def __init__(self, order: ast.OrderGreedy, layout: Layout) -> None:
        self.order = order
        self.layout = layout
        program = _skeleton(layout)
        self.key_of = _priority(order, layout)
        self.caps = _caps(order, layout)
        self.entries = placement.entries(layout.program.pipelines, layout.program.num_ranks)
        self.ops = ops = list(program.compute_ops())
        op_time = layout.op_time()
        self.times = [op_time(op) for op in ops]
        index = {op: i for i, op in enumerate(ops)}
        self.rank_of = [
            -1 if op.kind is Kind.P else program.rank_of(op.stage, op.pipeline)  # type: ignore[arg-type]
            for op in ops
        ]
        extra: dict[Action, list[Action]] = {}
        for dep in layout.program.after:
            extra.setdefault(dep.later, []).append(dep.earlier)
        self.inputs: list[list[Input]] = []
        self.fed: list[int] = []
        """The ops that read a frozen forward's output: what `frozen first` holds back."""
        for i, op in enumerate(ops):
            inputs = program.inputs_of(op)
            if any(dep.kind is Kind.P for dep in inputs):
                self.fed.append(i)
            self.inputs.append(
                [(index[dep], True) for dep in inputs]
                + [(index[dep], False) for dep in extra.get(op, ())]
            )

    def run(self, upfront: bool) -> tuple[tuple[tuple[Action, ...], ...], float]:
        """One replay: every rank's order and the time the last op ends. With `upfront`,
        no op that reads a frozen output starts before every frozen forward has ended."""
        layout, ops = self.layout, self.ops
        costs = layout.program.costs
        engine = Engine(self.rank_of, self.times, self.inputs, costs.of("C"), costs.link(), ops)
        rule = _Rule(
            self, engine.ranks, frozenset(layout.program.frozen or ()), upfront and bool(self.fed)
        )
        gated = self.fed if rule.gate else ()
        orders, end, pending = engine.dispatch(rule, layout.program.num_ranks, gated)
        left = len(ops) - sum(map(len, orders))
        if left:
            waits = {op: count for op, count in zip(ops, pending, strict=True) if count}
            raise _stuck(self.order, rule.ranks, left, layout.program.after, waits)
        span = self.order.span
        return tuple(tuple(ops[i]._replace(span=span) for i in row) for row in orders), end


class _Rule:
    """The greedy rule as a `sim.engine.Policy`: each rank's ready ops by `prefer` and
    `priority`, forwards that bring a micro-batch in held back at the cap, and the frozen
    forwards in one pool for the ranks that hold the frozen part."""

    def __init__(self, replay: _Replay, rank_of: list[int], holders: frozenset[int], gate: bool):
        self.ops, self.key_of, self.rank_of = replay.ops, replay.key_of, rank_of
        self.ranks = [
            _Rank(r, cap, entries)
            for r, (cap, entries) in enumerate(zip(replay.caps, replay.entries, strict=True))
        ]
        self.holders = holders
        self.pool: list[tuple[tuple[int, ...], int, int]] = []
        self.seq = 0
        self.gate = gate
        self.frozen_left = sum(op.kind is Kind.P for op in self.ops) if gate else 0
        self.fed = replay.fed

    def queue(self, op: int, at: float) -> int | None:
        self.seq += 1
        if self.ops[op].kind is Kind.P:
            heapq.heappush(self.pool, (self.key_of(self.ops[op]), self.seq, op))
            return None
        rank = self.rank_of[op]
        heapq.heappush(self.ranks[rank].waiting, (at, self.seq, op))
        return rank

    def ended(self, op: int, time: float) -> list[int]:
        if self.frozen_left and self.ops[op].kind is Kind.P:
            self.frozen_left -= 1
            if self.frozen_left == 0:
                return self.fed
        return []

    def pick(self, index: int, time: float) -> int | None:
        """The op rank `index` runs at `time`, or None when it must wait; a rank that
        holds the frozen part may also take the best frozen forward of the pool."""
        rank, ops, key_of = self.ranks[index], self.ops, self.key_of
        pool = self.pool if index in self.holders else None
        while rank.waiting and rank.waiting[0][0] <= time:
            _, seq, i = heapq.heappop(rank.waiting)
            op = ops[i]
            heap = rank.held if op.kind is Kind.F and op[2:4] in rank.entries else rank.ready
            heapq.heappush(heap, (key_of(op), seq, i))
        candidates = [h for h in (rank.ready, rank.held) if h]
        if rank.in_flight >= rank.cap and rank.held:
            candidates = [rank.ready] if rank.ready else []
        if pool:
            candidates.append(pool)
        if not candidates:
            return None
        best = min(candidates, key=lambda h: h[0][:2])
        i = heapq.heappop(best)[2]
        op = ops[i]
        if op[2:4] in rank.entries:
            rank.in_flight += {Kind.F: 1, Kind.B: -1}.get(op.kind, 0)
        return i


def _skeleton(layout: Layout) -> Program:
    return Program(
        "",
        "",
        (),
        layout.program.num_ranks,
        layout.program.num_stages,
        layout.program.pipelines,
        layout.program.assignment,
        layout.program.kinds,
        (),
        frozen=layout.program.frozen,
        chunks=layout.program.chunks,
    )


def _priority(order: ast.OrderGreedy, layout: Layout) -> Callable[[Action], tuple[int, ...]]:
    for kind in order.prefer:
        if order.prefer.count(kind) > 1:
            raise fail("E0102", f"`{kind}` is listed twice in `prefer`", order.span)
    prefer = order.prefer + tuple(k for k in _DEFAULT_PREFER if k not in order.prefer)
    why = "in a greedy `priority`, `mb`, `stage`, `rank` and `chunk` are the op's"
    scope = layout.scope
    for name in ("mb", "stage", "rank", "chunk"):
        scope = scope.with_name(name, order.span, why=why)
    keys = [compile_int(expr, scope) for expr in order.priority]
    rank_of = placement.owners(layout.program.pipelines)

    def key_of(op: Action) -> tuple[int, ...]:
        env: Env = dict(layout.env)
        env.update(
            mb=op.mb or 0,
            stage=op.stage or 0,
            rank=rank_of[(op.stage, op.pipeline)],
            chunk=op.chunk or 0,
        )
        return (prefer.index(op.kind.value), *(k(env) for k in keys))

    return key_of


def _caps(order: ast.OrderGreedy, layout: Layout) -> list[int]:
    """Each rank's cap: the `cap` expression compiled once, evaluated per rank."""
    if order.cap is None:
        chunks = 1 if layout.program.chunks is None else layout.program.chunks.count
        return [
            len(layout.program.assignment) * layout.program.num_stages * chunks
        ] * layout.program.num_ranks
    why = "in a greedy `cap`, `rank` is the rank the cap is for"
    cap_of = compile_int(order.cap, layout.scope.with_name("rank", order.span, why=why))
    env: Env = dict(layout.env)
    caps = []
    for rank in range(layout.program.num_ranks):
        env["rank"] = rank
        cap = cap_of(env)
        if cap < 1:
            raise fail(
                "E0311",
                f"the cap is {cap} on rank {rank}; no forward could ever run",
                order.cap.span,
                help="the cap must be at least 1 on every rank",
            )
        caps.append(cap)
    return caps


def _stuck(
    order: ast.OrderGreedy,
    ranks: list[_Rank],
    left: int,
    after: Sequence[Dependency],
    pending: Mapping[Action, int],
) -> Exception:
    full = [f"rank {r.index} holds {r.in_flight} of {r.cap}" for r in ranks if r.held]
    if full:
        return fail(
            "E0311",
            f"the greedy policy is stuck with {left} ops left",
            order.span,
            notes=tuple(full[:4]),
            help="raise the `cap`, or add `after` dependencies that unblock it",
        )
    # No rank is held back by its cap: ops wait on each other, through an `after`.
    blocking = [d for d in after if pending.get(d.later) and pending.get(d.earlier)]
    labels = [
        Label(d.span, f"`{d.later}` waits for `{d.earlier}`, which never runs")
        for d in blocking[:4]
        if d.span is not None
    ]
    return fail(
        "E0311",
        f"the greedy order is stuck with {left} ops left: they wait on each other",
        blocking[0].span if blocking and blocking[0].span else order.span,
        labels=tuple(labels[1:]),
        notes=(f"{len(blocking)} `after` dependencies wait on ops that wait in turn",),
        help="an `after` makes a cycle with the ops' own order (a backward after its "
        "forward, a stage after the one before): drop it or turn it around",
    )
