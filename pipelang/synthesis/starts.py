"""The orders `synthesize` knows before it searches (`starting_points`): the schedule's
own, every stdlib schedule's on the same placement, and one micro-batch at a time."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pipelang import api
from pipelang.compiler import Compilation, Options, run_passes
from pipelang.diagnostics import InternalError, PipelangError
from pipelang.ir import Kind, Pipeline
from pipelang.passes.layout import read_weights, schedule_layout
from pipelang.synthesis.problem import Known, Problem


def starting_points(
    problem: Problem,
    sched: str,
    params: Mapping[str, str] | None,
    own: Compilation | None,
    cap: float | None,
) -> list[Known]:
    """The known orders that fit the cap: the schedule's own, every stdlib schedule on the
    same placement (compiled with D and N), and one micro-batch at a time (which always
    fits a cap the least cap allows). Each is timed as the file `synthesize` would write
    of it runs (`Problem.makespan`: its overlapped pairs kept, under the problem's costs
    and `after` edges), and fits the cap exactly."""
    costs = problem.layout.program.costs
    found: list[Known] = []

    def add(name: str, compiled: Compilation) -> None:
        numbered = problem.numbered(compiled.need_program().ranks)
        if numbered is None or not problem.fits(numbered[0], cap):
            return
        orders, fused = numbered
        makespan = problem.makespan(orders, fused)
        if makespan is not None:  # else it breaks an `after` edge of the schedule's
            own = max(compiled.timeline(costs).makespan, makespan)
            found.append(Known(name, orders, own, problem.peak(orders), fused, makespan))

    path, shown = api.find_schedule(sched)
    if own is not None:
        add(f"stdlib {sched}" if shown.startswith("<stdlib>") else f"the order of {sched}", own)
    layout = problem.layout
    shape = _shape(layout.program.pipelines, layout.program.assignment)
    values = {"D": str(layout.program.num_ranks), "N": str(len(layout.program.assignment))}
    for stdlib in api.stdlib_names():
        if own is not None and path == api.find_schedule(stdlib)[0]:
            continue
        try:
            file = api.load_file(stdlib)
            given = {k: v for k, v in values.items() if k in {p.name for p in file.schedule.params}}
            bound = run_passes(file, Options(given, costs=costs), "resolve-params")
            assert bound.params is not None
            other = schedule_layout(file, bound.params)
            if _shape(other.program.pipelines, other.program.assignment) != shape:
                continue
            if other.program.frozen or other.program.chunks or Kind.R in other.program.kinds:
                continue
            if read_weights(file.schedule, other.scope, other.env) is not None:
                continue
            compiled = api.compile_schedule(stdlib, given, costs=costs, stop_after="insert-holds")
        except PipelangError:
            continue  # its `require`s rule these sizes out
        if compiled.need_program().first_eviction() is None:
            add(f"stdlib {stdlib}", compiled)
    orders = problem.one_at_a_time()
    makespan = problem.makespan(orders)
    if makespan is None:
        raise InternalError("one micro-batch at a time waits on itself")
    found.append(
        Known("one micro-batch at a time", orders, makespan, problem.peak(orders), timed=makespan)
    )
    return found


def _shape(pipelines: Sequence[Pipeline], assignment: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Each micro-batch's placement: what two schedules must share to swap orders."""
    placements = {p.name: p.placement for p in pipelines}
    return tuple(placements[name] for name in assignment)
