"""The CP-SAT model of `synthesize`: an interval per op, a no-overlap per rank,
precedences with transfer delays, a reservoir per rank for the activations, the makespan
minimized, from a known order as the hint; and a bound no order beats (`solve`)."""

from __future__ import annotations

import graphlib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from pipelang.diagnostics import fail
from pipelang.ir import Kind
from pipelang.synthesis.problem import Known, Problem, decimal, timed

EXTRA = "synth"
"""The install extra that brings the solver: `pip install 'pipelang[synth]'`."""


def solver_module():  # type: ignore[no-untyped-def]
    """OR-Tools' CP-SAT, or the error that names the extra that installs it."""
    try:
        from ortools.sat.python import cp_model
    except ImportError:
        raise fail(
            "E0603",
            "`synthesize` needs OR-Tools' CP-SAT solver, which is not installed",
            help=f"pip install 'pipelang[{EXTRA}]'",
        ) from None
    return cp_model


@dataclass(frozen=True)
class Found:
    """What the search found: an order of the ops (None: nothing to offer beyond the
    start), a makespan no order of these ops on this placement beats (in the problem's
    time), whether the solver saw the times exactly, and why its own bound could not be
    used where it could not (then `bound` is the rank bound alone)."""

    orders: tuple[tuple[int, ...], ...] | None
    bound: float
    exact: bool
    why: str = ""


LIMIT = 2**50
"""The largest integer the solver's times, makespan and activations reach: CP-SAT's
integers are 64 bits, sums of them must fit too, and the timing engine's floats hold
every integer up to 2^53 exactly."""


@dataclass(frozen=True)
class Scaled:
    """The problem's times in the solver's integers: every op's time, its transfer to
    another rank, and per op its inputs with the delay after their end; `scale` units
    per unit of time. `exact`: every time is its decimal times `scale` (else each was
    rounded down, which keeps the solver's bound a bound)."""

    scale: Fraction
    exact: bool
    times: list[int]
    transfers: list[int]
    inputs: list[list[tuple[int, int]]]
    pair: list[int] | None
    """Each stage's `FB` (an overlapped pair whose forward is on it), where one is given."""


def scaled(problem: Problem) -> Scaled:
    """The problem's times as integers: exactly (their decimals over a common
    denominator) where the horizon then stays within `LIMIT`, else rounded down to a
    power of two's steps that keep it there."""
    costs = problem.costs
    transfers = [decimal(costs.transfer(op)) for op in problem.ops]
    times = [decimal(t) for t in problem.times]
    pair = (
        [decimal(costs.of("FB", s)) for s in range(problem.layout.program.num_stages)]
        if costs.gives("FB")
        else None
    )
    delayed = [
        [(u, data and problem.ranks[u] != problem.ranks[v]) for u, data in row]
        for v, row in enumerate(problem.inputs)
    ]
    horizon = sum(times) + sum(transfers[u] for row in delayed for u, moved in row if moved)
    horizon += max(pair or [Fraction(0)])
    scale, exact = Fraction(1), True
    if horizon > 0:
        denominator = math.lcm(*(v.denominator for v in (*times, *transfers, *(pair or []))))
        if horizon * denominator <= LIMIT:
            scale = Fraction(denominator)
        else:
            scale, exact = Fraction(2) ** math.floor(math.log2(LIMIT / horizon)), False
            while horizon * scale > LIMIT:  # the logarithm's rounding
                scale /= 2
    units = [math.floor(t * scale) for t in transfers]
    return Scaled(
        scale,
        exact,
        [math.floor(t * scale) for t in times],
        units,
        [[(u, units[u] if moved else 0) for u, moved in row] for row in delayed],
        None if pair is None else [math.floor(t * scale) for t in pair],
    )


def solve(
    cp_model,  # type: ignore[no-untyped-def]
    problem: Problem,
    scaled: Scaled,
    cap: float | None,
    start: Known,
    time_limit: float,
    workers: int | None,
) -> Found:
    """CP-SAT's best order within `time_limit` seconds, starting from `start`, and the
    best bound that holds for every order (`Found`)."""
    scale, exact, times = scaled.scale, scaled.exact, scaled.times
    memory = None if cap is None else activation_units(problem, cap)
    why = _unmodelled(problem, scaled, memory)
    least = _rank_bound(problem, times, scaled.inputs, _paired(problem, scaled))
    hint_ends = timed(problem, start.orders, times, scaled.transfers)
    horizon = round(max(hint_ends, default=0))
    if least >= horizon:  # the start (its ops unpaired) is as fast as any order can be
        return Found(start.orders, float(least / scale), exact, why)
    model = cp_model.CpModel()
    starts = [model.NewIntVar(0, max(0, horizon - d), f"s{i}") for i, d in enumerate(times)]
    by_rank: list[list[object]] = [[] for _ in range(problem.num_ranks)]
    for i, d in enumerate(times):
        if d > 0:
            by_rank[problem.ranks[i]].append(model.NewFixedSizeIntervalVar(starts[i], d, f"o{i}"))
    for intervals in by_rank:
        model.AddNoOverlap(intervals)
    consumed = [False] * problem.size
    for v, inputs in enumerate(scaled.inputs):
        for u, delay in inputs:
            consumed[u] = True
            model.Add(starts[v] >= starts[u] + times[u] + delay)
    makespan = model.NewIntVar(0, horizon, "makespan")
    for i, d in enumerate(times):
        if not consumed[i]:
            model.Add(makespan >= starts[i] + d)
    model.Add(makespan >= least)
    if memory is not None:
        _reservoirs(model, problem, starts, times, memory)
    if not problem.layout.program.after:
        _first_forwards_in_order(model, problem, starts)
    for i, end in enumerate(hint_ends):
        model.AddHint(starts[i], round(end) - times[i])
    model.AddHint(makespan, horizon)
    model.Minimize(makespan)
    solver = _solver(cp_model, time_limit, workers)
    result = solver.Solve(model)
    if result not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return Found(None, float(least / scale), exact, why)
    bound = least if why else max(least, math.floor(solver.BestObjectiveBound() + 1e-6))
    orders = _orders(problem, [solver.Value(s) for s in starts], times)
    return Found(orders, float(bound / scale), exact, why)


def _solver(cp_model, seconds: float, workers: int | None):  # type: ignore[no-untyped-def]
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, seconds)
    solver.parameters.num_workers = workers or min(8, os.cpu_count() or 1)
    solver.parameters.expand_reservoir_constraints = False
    return solver


def _rank_bound(
    problem: Problem,
    times: Sequence[int],
    delays: Sequence[Sequence[tuple[int, int]]],
    saved: Paired | None = None,
) -> int:
    """A makespan no order beats: for each rank, the earliest any of its ops can start,
    then all of its work, then the least time any of its ops needs after it ends (the
    longest chain of inputs before an op, and of consumers after it, with delays). With
    overlapped pairs that may be faster than their ops (`saved`), the chains take each
    op's least time in a pair, and a rank's work its pairs' most saving."""
    spans = times if saved is None else saved.spans
    order = _topological(problem)
    head = [0] * problem.size
    for v in order:
        for u, delay in delays[v]:
            head[v] = max(head[v], head[u] + spans[u] + delay)
    tail = [0] * problem.size
    for v in reversed(order):
        for u, delay in delays[v]:
            tail[u] = max(tail[u], delay + spans[v] + tail[v])
    best = 0
    by_rank: list[list[int]] = [[] for _ in range(problem.num_ranks)]
    for i, rank in enumerate(problem.ranks):
        by_rank[rank].append(i)
    for rank, mine in enumerate(by_rank):
        if mine:
            work = sum(times[i] for i in mine) - (0 if saved is None else saved.work[rank])
            best = max(best, min(head[i] for i in mine) + work + min(tail[i] for i in mine))
    return best


@dataclass(frozen=True)
class Paired:
    """What overlapped pairs may save, in the solver's integers: each op's least time
    from its start to its end when it is in a pair (`spans`), and per rank the most its
    pairs take off its work (as many pairs as it has forwards or backwards, each saving
    the most any F and B (and W) of its stages save as one `FB`)."""

    spans: list[int]
    work: list[int]


def _paired(problem: Problem, scaled: Scaled) -> Paired | None:
    """`Paired` where some pair may take less than its ops one after the other (`FB[a]`
    below F on stage a plus B and W on a stage b of the same rank); None where none is
    faster (pairs gain nothing then, and the solver's model, without them, loses none)."""
    if scaled.pair is None:
        return None
    pair = [Fraction(t) for t in scaled.pair]
    times = scaled.times
    rounding = 0 if scaled.exact else 3  # F, B and W each rounded down by less than 1
    each: dict[tuple[Kind, int, int], int] = {}
    counts = [[0, 0] for _ in range(problem.num_ranks)]  # forwards, backwards
    for i, op in enumerate(problem.ops):
        rank = problem.ranks[i]
        each[(op.kind, op.stage or 0, rank)] = times[i]
        if op.kind is not Kind.W:
            counts[rank][op.kind is not Kind.F] += 1
    least: dict[int, Fraction] = {}
    saving = [Fraction(0)] * problem.num_ranks
    for (kind, stage, rank), f in each.items():
        if kind is Kind.F:
            least[rank] = min(least.get(rank, pair[stage]), pair[stage])
            for (other, b, at), t in each.items():
                if other is Kind.B and at == rank:
                    w = each.get((Kind.W, b, rank), 0)
                    saving[rank] = max(saving[rank], f + t + w - pair[stage] + rounding)
    if not any(saving):
        return None
    spans = list(times)
    for i, op in enumerate(problem.ops):
        rank, stage = problem.ranks[i], op.stage or 0
        cap = pair[stage] if op.kind is Kind.F else least.get(rank, Fraction(0))
        if op.kind is Kind.W:
            cap -= min(Fraction(each.get((Kind.B, stage, rank), 0)), least.get(rank, Fraction(0)))
        spans[i] = min(times[i], max(0, math.floor(cap)))
    work = [min(c) * math.ceil(s) for c, s in zip(counts, saving, strict=True)]
    return Paired(spans, work)


@dataclass(frozen=True)
class Activations:
    """Each op's change of its rank's activations in the solver's integers, and the cap
    in them; `exact` where they are the exact numbers over a common denominator, else
    rounded so that no order the solver takes is over the cap (adds up, frees down, the
    cap down), and the solver's bound is no bound."""

    units: list[int]
    limit: int
    exact: bool


def activation_units(problem: Problem, cap: float) -> Activations:
    """The activations as integers (`Activations`): exactly where every rank's total
    times the common denominator stays within `LIMIT`."""
    changes, most = problem.changes, decimal(cap)
    totals: dict[int, Fraction] = {}
    for i, change in enumerate(changes):
        if change > 0:
            totals[problem.ranks[i]] = totals.get(problem.ranks[i], Fraction(0)) + change
    top = max([most, *totals.values()])
    denominator = math.lcm(most.denominator, *(c.denominator for c in changes))
    if top * denominator <= LIMIT:
        return Activations(
            [int(c * denominator) for c in changes], math.floor(most * denominator), True
        )
    scale = LIMIT / top
    return Activations([math.ceil(c * scale) for c in changes], math.floor(most * scale), False)


def _unmodelled(problem: Problem, scaled: Scaled, memory: Activations | None) -> str:
    """Why the solver's model is not the written file's (then its bound is not used): ''
    where it is, up to the times' rounding, which keeps it a bound."""
    if _paired(problem, scaled) is not None:
        return (
            "the solver does not pair ops: an overlapped pair (`FB`) may be faster than its "
            "ops, so the bound lets every pair take its FB"
        )
    if memory is None or sum(u for u in memory.units if u > 0) <= memory.limit:
        return ""
    if not memory.exact:
        return (
            "the activations and the cap have too many digits to count exactly: the solver "
            "counted them rounded against the order, and the bound is the ranks' alone"
        )
    if any(u > 0 and scaled.times[i] == 0 for i, u in enumerate(memory.units)):
        return (
            "a forward takes no time, which the solver's count of activations over time "
            "does not place as the order does: the bound is the ranks' alone"
        )
    return ""


def _reservoirs(model, problem: Problem, starts, times: Sequence[int], memory: Activations) -> None:  # type: ignore[no-untyped-def]
    """Each rank's activations within the cap: a forward adds its activations at its
    start, a B and a W take theirs away at their ends (`sim.memory.change`)."""
    events: list[tuple[list[object], list[int]]] = [([], []) for _ in range(problem.num_ranks)]
    for i, amount in enumerate(memory.units):
        if amount == 0:
            continue
        at = starts[i] if amount > 0 else starts[i] + times[i]
        events[problem.ranks[i]][0].append(at)
        events[problem.ranks[i]][1].append(amount)
    for at, amounts in events:
        if sum(a for a in amounts if a > 0) > memory.limit:
            model.AddReservoirConstraint(at, amounts, 0, memory.limit)


def _first_forwards_in_order(model, problem: Problem, starts) -> None:  # type: ignore[no-untyped-def]
    """A pipeline's micro-batches enter it in their order: their first forwards start in
    micro-batch order. Alike micro-batches can be renamed, so no order is lost."""
    last: dict[str, int] = {}
    for mb, pipe in enumerate(problem.layout.program.assignment):
        i = problem.index[(Kind.F, mb, 0, pipe, None)]
        if pipe in last:
            model.Add(starts[i] >= starts[last[pipe]])
        last[pipe] = i


def _orders(
    problem: Problem, starts: Sequence[int], times: Sequence[int]
) -> tuple[tuple[int, ...], ...]:
    """Each rank's ops by start time; among ops that start together, those that take
    no time first (a W that frees memory before a forward takes it), then in a
    topological order of the inputs."""
    depth = [0] * problem.size
    for v in _topological(problem):
        for u, _ in problem.inputs[v]:
            depth[v] = max(depth[v], depth[u] + 1)
    rows: list[list[int]] = [[] for _ in range(problem.num_ranks)]
    for i in sorted(range(problem.size), key=lambda i: (starts[i], times[i] > 0, depth[i])):
        rows[problem.ranks[i]].append(i)
    return tuple(map(tuple, rows))


def _topological(problem: Problem) -> list[int]:
    """The ops in an order that puts every op after its inputs."""
    graph = {v: [u for u, _ in inputs] for v, inputs in enumerate(problem.inputs)}
    return list(graphlib.TopologicalSorter(graph).static_order())
