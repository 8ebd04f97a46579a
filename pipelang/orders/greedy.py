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

_DEFAULT_PREFER = ("R", "B", "F", "W", "P")


@dataclass
class _Rank:
    """One rank's state during the replay."""

    index: int
    cap: int
    entries: frozenset[tuple[int | None, str | None]]
    """The rank's first (stage, pipeline) of each pipeline: where micro-batches enter."""
    free_at: float = 0.0
    in_flight: int = 0
    waiting: list[tuple[float, int, int]] = field(default_factory=list)
    """(ready at, sequence, op index) of ops whose inputs are done; ties go to the op
    that became ready first."""
    ready: list[tuple[tuple[int, ...], int, int]] = field(default_factory=list)
    held: list[tuple[tuple[int, ...], int, int]] = field(default_factory=list)
    order: list[Action] = field(default_factory=list)


_IDLE = -1
"""An event that only wakes a rank (no op finished)."""


def expand_greedy_order(order: ast.OrderGreedy, layout: Layout) -> tuple[tuple[Action, ...], ...]:
    """Replay in time; each idle rank picks its best ready op under its cap.

    With frozen work, `frozen best` (the default) replays twice, filling bubbles and
    with every frozen forward first, and keeps the order that ends sooner (filling on a
    tie); `frozen fill` and `frozen first` replay once."""
    replay = _Replay(order, layout)
    mode = order.frozen if layout.frozen else "fill"
    if mode != "best":
        return replay.run(upfront=mode == "first")[0]
    fill, fill_end = replay.run(upfront=False)
    first, first_end = replay.run(upfront=True)
    return first if first_end < fill_end else fill


class _Replay:
    """The ops of one schedule, numbered, and their dependencies, built once for any
    number of replays.

    Ops are numbered (in `compute_ops` order, which also breaks ties) and the replay
    works on the numbers: hashing an Action costs a Python call, and this loop touches
    each op a few times."""

    def __init__(self, order: ast.OrderGreedy, layout: Layout) -> None:
        self.order = order
        self.layout = layout
        program = _skeleton(layout)
        self.key_of = _priority(order, layout)
        self.caps = _caps(order, layout)
        self.entries = placement.entries(layout.pipelines, layout.num_ranks)
        self.comm = layout.costs.of("C")
        self.op_time = layout.op_time()
        self.ops = ops = list(program.compute_ops())
        index = {op: i for i, op in enumerate(ops)}
        self.rank_of = [
            -1 if op.kind is Kind.P else program.rank_of(op.stage, op.pipeline)  # type: ignore[arg-type]
            for op in ops
        ]
        extra: dict[Action, list[Action]] = {}
        for dep in layout.after:
            extra.setdefault(dep.later, []).append(dep.earlier)
        self.pending = [0] * len(ops)
        self.consumers: list[list[int]] = [[] for _ in ops]
        self.fed: list[int] = []
        """The ops that read a frozen forward's output: what `frozen first` holds back."""
        for i, op in enumerate(ops):
            inputs = program.inputs_of(op)
            if any(dep.kind is Kind.P for dep in inputs):
                self.fed.append(i)
            for dep in (*inputs, *extra.get(op, ())):
                self.consumers[index[dep]].append(i)
                self.pending[i] += 1

    def run(self, upfront: bool) -> tuple[tuple[tuple[Action, ...], ...], float]:
        """One replay: every rank's order and the time the last op ends. With `upfront`,
        no op that reads a frozen output starts before every frozen forward has ended."""
        order, layout, ops, key_of = self.order, self.layout, self.ops, self.key_of
        rank_of = list(self.rank_of)
        pending = list(self.pending)
        frozen_left = sum(op.kind is Kind.P for op in ops) if upfront else 0
        if frozen_left:
            for i in self.fed:
                pending[i] += 1
        holders = frozenset(layout.frozen or ())
        pool: list[tuple[tuple[int, ...], int, int]] = []
        ready_at = [0.0] * len(ops)
        ranks = [
            _Rank(r, cap, entries)
            for r, (cap, entries) in enumerate(zip(self.caps, self.entries, strict=True))
        ]
        seq = 0
        events: list[tuple[float, int, int, int]] = [(0.0, 1, r.index, _IDLE) for r in ranks]

        def release(i: int, at: float) -> None:
            nonlocal seq
            if at > ready_at[i]:
                ready_at[i] = at
            pending[i] -= 1
            if pending[i] == 0:
                target = ranks[rank_of[i]]
                heapq.heappush(target.waiting, (ready_at[i], seq, i))
                heapq.heappush(events, (ready_at[i], 1, target.index, _IDLE))
                seq += 1

        for i, count in enumerate(pending):
            if count == 0 and ops[i].kind is Kind.P:
                heapq.heappush(pool, (key_of(ops[i]), seq, i))
                seq += 1
            elif count == 0:
                heapq.heappush(ranks[rank_of[i]].waiting, (0.0, seq, i))
                seq += 1
        done = 0
        end = 0.0
        comm, op_time = self.comm, self.op_time
        while events:
            time, _, rank_index, finished = heapq.heappop(events)
            if finished != _IDLE:
                done += 1
                for nxt in self.consumers[finished]:
                    release(nxt, time + comm if rank_of[nxt] != rank_of[finished] else time)
                if ops[finished].kind is Kind.P and frozen_left:
                    frozen_left -= 1
                    if frozen_left == 0:
                        for nxt in self.fed:
                            release(nxt, time)
                continue
            rank = ranks[rank_index]
            if rank.free_at > time:
                continue
            chosen = _pick(rank, time, ops, key_of, pool if rank.index in holders else None)
            if chosen is None:
                continue
            rank_of[chosen] = rank.index
            op = ops[chosen]
            rank.free_at = time + op_time(op)
            end = max(end, rank.free_at)
            rank.order.append(op._replace(span=order.span))
            heapq.heappush(events, (rank.free_at, 0, rank.index, chosen))
            heapq.heappush(events, (rank.free_at, 1, rank.index, _IDLE))
        if done < len(ops):
            left = {op: count for op, count in zip(ops, pending, strict=True) if count}
            raise _stuck(order, ranks, len(ops) - done, layout.after, left)
        return tuple(tuple(r.order) for r in ranks), end


def _pick(
    rank: _Rank,
    time: float,
    ops: list[Action],
    key_of: Callable[[Action], tuple[int, ...]],
    pool: list[tuple[tuple[int, ...], int, int]] | None,
) -> int | None:
    """The index of the op `rank` runs at `time`, or None when it must wait. `pool` holds
    the frozen forwards no rank has taken yet, for a rank that holds the frozen part."""
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
        layout.num_ranks,
        layout.num_stages,
        layout.pipelines,
        layout.assignment,
        layout.kinds,
        (),
        frozen=layout.frozen,
        chunks=layout.chunks,
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
    rank_of: dict[tuple[str | None, int | None], int] = {
        (p.name, s): r for p in layout.pipelines for s, r in enumerate(p.placement)
    }

    def key_of(op: Action) -> tuple[int, ...]:
        env: Env = dict(layout.env)
        env.update(
            mb=op.mb or 0,
            stage=op.stage or 0,
            rank=rank_of[(op.pipeline, op.stage)],
            chunk=op.chunk or 0,
        )
        return (prefer.index(op.kind.value), *(k(env) for k in keys))

    return key_of


def _caps(order: ast.OrderGreedy, layout: Layout) -> list[int]:
    """Each rank's cap: the `cap` expression compiled once, evaluated per rank."""
    if order.cap is None:
        chunks = 1 if layout.chunks is None else layout.chunks.count
        return [len(layout.assignment) * layout.num_stages * chunks] * layout.num_ranks
    why = "in a greedy `cap`, `rank` is the rank the cap is for"
    cap_of = compile_int(order.cap, layout.scope.with_name("rank", order.span, why=why))
    env: Env = dict(layout.env)
    caps = []
    for rank in range(layout.num_ranks):
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
