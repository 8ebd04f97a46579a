"""The pass pipeline: source text in, a checked Program with comms and sync out.

Every pass is a pure function from one `Compilation` to the next, in a module of its own
under `pipelang/passes/`, and they run in the order of `PASSES`. The first two passes
work on the AST (binding parameters, expanding the orders into per-rank ops); from
`build-dag` on, every pass reads and writes the IR `Program`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from pipelang.bulk import bulk
from pipelang.diagnostics import InternalError, PipelangError
from pipelang.evaluate import MAX_OPS

if TYPE_CHECKING:
    import networkx as nx

    from pipelang import ast
    from pipelang.ir import CostModel, Program
    from pipelang.passes.build_dag import OpGraph
    from pipelang.simulate import Link, Timeline
    from pipelang.streams import StreamProgram


@dataclass(frozen=True)
class Options:
    """What the command line can change about a compilation."""

    params: Mapping[str, str] = field(default_factory=dict)
    max_activations: int | None = None
    dp: int = 1
    """Data-parallel copies the stream program is lowered for (`streams`)."""
    max_ops: int = MAX_OPS
    """The most ops the schedule may have (E0106 past it; `--max-ops`)."""
    shapes: tuple[tuple[int, int], ...] | None = None
    """(samples, length) of every micro-batch (`--lengths FILE`), instead of the
    schedule's `lengths` and `sizes` lines."""
    costs: CostModel | None = None
    """Cost entries after the schedule's own `cost` lines (`--cost`): an order that
    depends on the costs (`order greedy`, `squeeze`) is expanded under them."""


@dataclass(frozen=True)
class Compilation:
    """Everything known about one schedule so far; each pass fills in one more field."""

    file: ast.File
    options: Options
    params: Mapping[str, int | bool] | None = None
    program: Program | None = None
    graph: OpGraph | None = None
    """The dependency DAG of the compute ops with ops numbered, built once by `build-dag`
    (again by `insert-holds` only when it adds holds) and handed on: what the later
    passes and the simulator walk. Comms and sync actions are not in it."""
    streams: StreamProgram | None = None
    """The stream program, from `streams` (run only when asked for: see `run_passes`)."""

    @cached_property
    def dag(self) -> nx.DiGraph | None:
        """`graph` as a networkx DiGraph, built when first asked for (see `build-dag`)."""
        return None if self.graph is None else self.graph.to_networkx()

    def timeline(self, costs: CostModel | None = None, link: Link | None = None) -> Timeline:
        """The simulated timeline of the program under its own `cost` line with `costs`
        over it, a backward taking B + W where the schedule does not split W off
        (`CostModel.for_kinds`; needs `validate` to have run)."""
        from pipelang.simulate import simulate

        program = self.need_program()
        if self.graph is None:
            raise InternalError("simulating before `build-dag`")
        model = program.costs.merged(costs).for_kinds(program.kinds)
        return simulate(program, self.graph, model, link)

    def need_program(self) -> Program:
        if self.program is None:
            raise InternalError("a pass ran before `expand-orders`")
        return self.program


Pass = Callable[[Compilation], Compilation]

# Each pass imports its module when it runs, so that `pipelang --help`, `list` and
# `explain` start ~10% sooner (benchmarks/RESULTS.md, "Lazy imports").


def _resolve_params(c: Compilation) -> Compilation:
    from pipelang.passes.resolve_params import resolve_params

    return dataclasses.replace(c, params=resolve_params(c.file, c.options.params))


def _expand_orders(c: Compilation) -> Compilation:
    from pipelang.passes.expand_orders import expand_orders

    assert c.params is not None
    options = c.options
    program = expand_orders(c.file, c.params, options.max_ops, options.shapes, options.costs)
    return dataclasses.replace(c, program=program)


def _build_dag(c: Compilation) -> Compilation:
    from pipelang.passes.build_dag import op_graph

    return dataclasses.replace(c, graph=op_graph(c.need_program()))


def _validate(c: Compilation) -> Compilation:
    from pipelang.passes.validate import validate

    assert c.graph is not None
    diagnostics = validate(c.need_program(), c.graph, c.options.max_activations)
    if diagnostics:
        raise PipelangError(diagnostics)
    return c


def _insert_holds(c: Compilation) -> Compilation:
    from pipelang.passes.insert_holds import insert_holds

    assert c.graph is not None
    program, graph = insert_holds(c.need_program(), c.graph)
    return dataclasses.replace(c, program=program, graph=graph)


def _insert_comms(c: Compilation) -> Compilation:
    from pipelang.passes.insert_comms import insert_comms

    assert c.graph is not None
    return dataclasses.replace(c, program=insert_comms(c.need_program(), c.graph))


def _insert_sync(c: Compilation) -> Compilation:
    from pipelang.passes.insert_sync import insert_sync

    return dataclasses.replace(c, program=insert_sync(c.need_program()))


def _streams(c: Compilation) -> Compilation:
    from pipelang.passes.streams import streams

    return dataclasses.replace(c, streams=streams(c.need_program(), c.options.dp))


def _check_streams(c: Compilation) -> Compilation:
    from pipelang.passes.check_streams import check_streams

    assert c.streams is not None
    check_streams(c.streams)
    return c


PASSES: tuple[tuple[str, Pass], ...] = (
    ("resolve-params", _resolve_params),
    ("expand-orders", _expand_orders),
    ("build-dag", _build_dag),
    ("validate", _validate),
    ("insert-holds", _insert_holds),
    ("insert-comms", _insert_comms),
    ("insert-sync", _insert_sync),
    ("streams", _streams),
    ("check-streams", _check_streams),
)
PASS_NAMES = tuple(name for name, _ in PASSES)
SCHEDULE_DONE = "insert-holds"
"""The last pass that decides what each rank computes and when: the ops, the op graph
and memory are final. What follows only lowers transfers and sync (it cannot fail on a
validated program), so `check`, `simulate` and `viz` stop here: on a schedule of 10^6
ops the lowering passes would take as long again as everything before them."""
PROGRAM_DONE = "insert-sync"
"""The last pass a run by default: the Program every backend's eager path reads. The
stream program's passes cost time in ranks x ops and serve graph mode and its checks, so
they run only when `stop_after` names one of them."""


@bulk
def run_passes(file: ast.File, options: Options, stop_after: str | None = None) -> Compilation:
    """Run the passes in order, up to and including `stop_after` (`PROGRAM_DONE` by
    default; name `check-streams` to get a checked stream program too).

    Raises `PipelangError` with every diagnostic of the first pass that finds any.
    """
    c = Compilation(file, options)
    stop_after = stop_after or PROGRAM_DONE
    for name, run in PASSES:
        c = run(c)
        if name == stop_after:
            break
    return c
