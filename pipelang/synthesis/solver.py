"""The CP-SAT model of `synthesize`: an interval per op, a no-overlap per rank,
precedences with transfer delays, a reservoir per rank for the activations, the makespan
minimized, from a known order as the hint; and a bound no order beats (`solve`)."""

from __future__ import annotations

import graphlib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

from pipelang.diagnostics import fail
from pipelang.ir import Kind
from pipelang.synthesis.problem import Known, Problem, timed

EXTRA = "synth"
"""The install extra that brings the solver: `pip install 'pipelang[synth]'`."""

DIGITS = 3
"""Costs with at most this many decimals are scaled to integers exactly; other costs are
rounded to `ROUNDED_STEPS` steps of the largest (the header says so)."""

ROUNDED_STEPS = 100_000


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
    orders: tuple[tuple[int, ...], ...]
    status: str
    bound: float
    exact: bool


def _scale(values: Sequence[float]) -> tuple[float, bool]:
    """A factor that makes every value an integer, and whether it does so exactly (at
    most `DIGITS` decimals); else one that rounds them to `ROUNDED_STEPS` of the largest."""
    for digits in range(DIGITS + 1):
        scale = 10.0**digits
        if all(abs(v * scale - round(v * scale)) <= 1e-9 * max(1.0, v * scale) for v in values):
            return scale, True
    return ROUNDED_STEPS / max(values), False


@dataclass(frozen=True)
class Scaled:
    """The problem's times in the solver's integers: every op's time and, per op, its
    inputs with the delay after their end (a transfer where they ran on another rank)."""

    scale: float
    exact: bool
    times: list[int]
    inputs: list[list[tuple[int, int]]]


def scaled(problem: Problem) -> Scaled:
    transfers = [problem.costs.transfer(op) for op in problem.ops]
    scale, exact = _scale([t for t in (*problem.times, *transfers) if t > 0] or [1.0])
    inputs = [
        [
            (
                u,
                round(transfers[u] * scale)
                if delayed and problem.ranks[u] != problem.ranks[v]
                else 0,
            )
            for u, delayed in row
        ]
        for v, row in enumerate(problem.inputs)
    ]
    return Scaled(scale, exact, [round(t * scale) for t in problem.times], inputs)


def solve(
    cp_model,  # type: ignore[no-untyped-def]
    problem: Problem,
    scaled: Scaled,
    cap: float | None,
    start: Known,
    time_limit: float,
    workers: int | None,
) -> Found:
    """CP-SAT's best order within `time_limit` seconds, starting from `start`."""
    scale, exact, times = scaled.scale, scaled.exact, scaled.times
    hint_ends = timed(problem, start.orders, times, scale)
    horizon = max(hint_ends, default=0)
    least = _rank_bound(problem, scaled)
    if least >= horizon:  # the start is as fast as any order can be
        return Found(start.orders, "optimal", least / scale, exact)
    model = cp_model.CpModel()
    starts = [model.NewIntVar(0, max(0, round(horizon) - d), f"s{i}") for i, d in enumerate(times)]
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
    makespan = model.NewIntVar(0, round(horizon), "makespan")
    for i, d in enumerate(times):
        if not consumed[i]:
            model.Add(makespan >= starts[i] + d)
    model.Add(makespan >= least)
    if cap is not None:
        _reservoirs(model, problem, starts, times, cap)
    if not problem.layout.after:
        _first_forwards_in_order(model, problem, starts)
    for i, end in enumerate(hint_ends):
        model.AddHint(starts[i], round(end) - times[i])
    model.AddHint(makespan, round(horizon))
    model.Minimize(makespan)
    solver = _solver(cp_model, time_limit, workers)
    result = solver.Solve(model)
    if result not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return Found(start.orders, "kept", least / scale, exact)
    bound = max(least, solver.BestObjectiveBound()) / scale
    if solver.ObjectiveValue() >= horizon and result != cp_model.OPTIMAL:
        return Found(start.orders, "kept", bound, exact)
    orders = _orders(problem, [solver.Value(s) for s in starts], times)
    status = "optimal" if result == cp_model.OPTIMAL else "feasible"
    return Found(orders, status, bound, exact)


def _solver(cp_model, seconds: float, workers: int | None):  # type: ignore[no-untyped-def]
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, seconds)
    solver.parameters.num_workers = workers or min(8, os.cpu_count() or 1)
    solver.parameters.expand_reservoir_constraints = False
    return solver


def _rank_bound(problem: Problem, scaled: Scaled) -> int:
    """A makespan no order beats: for each rank, the earliest any of its ops can start,
    then all of its work, then the least time any of its ops needs after it ends (the
    longest chain of inputs before an op, and of consumers after it, with delays)."""
    times, delays = scaled.times, scaled.inputs
    order = _topological(problem)
    head = [0] * problem.size
    for v in order:
        for u, delay in delays[v]:
            head[v] = max(head[v], head[u] + times[u] + delay)
    tail = [0] * problem.size
    for v in reversed(order):
        for u, delay in delays[v]:
            tail[u] = max(tail[u], delay + times[v] + tail[v])
    best = 0
    for rank in range(problem.num_ranks):
        mine = [i for i in range(problem.size) if problem.ranks[i] == rank]
        if mine:
            work = sum(times[i] for i in mine)
            best = max(best, min(head[i] for i in mine) + work + min(tail[i] for i in mine))
    return best


def _reservoirs(model, problem: Problem, starts, times: Sequence[int], cap: float) -> None:  # type: ignore[no-untyped-def]
    """Each rank's activations within the cap: a forward adds its activations at its
    start, a B and a W take theirs away at their ends (`sim.memory.change`)."""
    scale = problem.memory_scale
    limit = math.floor(cap * scale + 1e-6)
    events: list[tuple[list[object], list[int]]] = [([], []) for _ in range(problem.num_ranks)]
    for i, change in enumerate(problem.changes):
        amount = round(change * scale)
        if amount == 0:
            continue
        at = starts[i] if amount > 0 else starts[i] + times[i]
        events[problem.ranks[i]][0].append(at)
        events[problem.ranks[i]][1].append(amount)
    for at, amounts in events:
        if sum(a for a in amounts if a > 0) > limit:
            model.AddReservoirConstraint(at, amounts, 0, limit)


def _first_forwards_in_order(model, problem: Problem, starts) -> None:  # type: ignore[no-untyped-def]
    """A pipeline's micro-batches enter it in their order: their first forwards start in
    micro-batch order. Alike micro-batches can be renamed, so no order is lost."""
    last: dict[str, int] = {}
    for mb, pipe in enumerate(problem.layout.assignment):
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
