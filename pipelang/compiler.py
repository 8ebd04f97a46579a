"""The pass pipeline: source text in, a checked Program with comms and sync out.

Every pass is a pure function from one `Compilation` to the next, `run` in a module of
its own under `pipelang/passes/`, and they run in the order of `passes()`. The first two passes
work on the AST (binding parameters, expanding the orders into per-rank ops); from
`build-dag` on, every pass reads and writes the IR `Program`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from pipelang.bulk import bulk
from pipelang.diagnostics import InternalError
from pipelang.evaluate import MAX_OPS

if TYPE_CHECKING:
    import networkx as nx

    from pipelang import ast
    from pipelang.ir import CostModel, Program
    from pipelang.ir.graph import OpGraph
    from pipelang.ir.streams import StreamProgram
    from pipelang.sim.engine import Link
    from pipelang.sim.timeline import Timeline


Pass = Callable[["Compilation"], "Compilation"]
"""A compiler pass: a pure function from one `Compilation` to the next."""


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
    shard: int = 1
    """The data-parallel copies each stage copy is sharded over (`--dp K --shard`: K);
    1: not sharded (`insert-shard` adds nothing)."""


@dataclass(frozen=True)
class Compilation:
    """Everything known about one schedule so far; each pass fills in one more field."""

    file: ast.File | None
    """The parsed source; None for a Program made elsewhere (`check_program`)."""
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
        from pipelang.sim.timeline import simulate

        program = self.need_program()
        model = program.costs.merged(costs).for_kinds(program.kinds)
        return simulate(program, self.need_graph(), model, link)

    def need_file(self) -> ast.File:
        if self.file is None:
            raise InternalError("a front-end pass ran on a Program made elsewhere")
        return self.file

    def need_program(self) -> Program:
        if self.program is None:
            raise InternalError("a pass ran before `expand-orders`")
        return self.program

    def need_graph(self) -> OpGraph:
        if self.graph is None:
            raise InternalError("a pass ran before `build-dag`")
        return self.graph


PASS_NAMES = (
    "resolve-params",
    "expand-orders",
    "build-dag",
    "validate",
    "insert-holds",
    "insert-shard",
    "insert-comms",
    "insert-sync",
    "streams",
    "check-streams",
)
"""The passes in order, named on the command line as their modules with `-` for `_`
(`--dump-after build-dag`)."""


@functools.cache
def passes() -> tuple[Pass, ...]:
    """The passes in order (`PASS_NAMES`): each the `run(Compilation) -> Compilation` of
    a module of `pipelang/passes/`. Imported the first time a compilation runs, so that a
    command that runs none (`--help`) imports none (benchmarks/RESULTS.md, "Lazy
    imports")."""
    from pipelang.passes import (
        build_dag,
        check_streams,
        expand_orders,
        insert_comms,
        insert_holds,
        insert_shard,
        insert_sync,
        resolve_params,
        streams,
        validate,
    )

    return (
        resolve_params.run,
        expand_orders.run,
        build_dag.run,
        validate.run,
        insert_holds.run,
        insert_shard.run,
        insert_comms.run,
        insert_sync.run,
        streams.run,
        check_streams.run,
    )


SCHEDULE_DONE = "insert-shard"
"""The last pass that decides what each rank computes and when: the ops (a sharded
stage's gathers and reduce-scatters included), the op graph and memory are final. What
follows only lowers transfers and sync (it cannot fail on a validated program), so
`check`, `simulate` and `viz` stop here: on a schedule of 10^6 ops the lowering passes
would take as long again as everything before them."""
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
    return _run(Compilation(file, options), PASS_NAMES[0], stop_after or PROGRAM_DONE)


@bulk
def check_program(program: Program, stop_after: str = "validate") -> Compilation:
    """A compute-only Program made elsewhere (the order a traced run ran) through the
    passes from `build-dag` on, up to `stop_after`, as `run_passes` would take it."""
    return _run(Compilation(None, Options(), program=program), "build-dag", stop_after)


@bulk
def stream_program(program: Program, dp: int = 1) -> StreamProgram:
    """The checked stream program of a lowered Program (`PROGRAM_DONE`'s, or a
    schedule.json's) run as `dp` data-parallel copies: the passes after `PROGRAM_DONE`,
    through `check-streams`, as `run_passes(..., stop_after="check-streams")` runs them.
    What `pipelang run` hands a backend whose ranks run stream programs."""
    first = PASS_NAMES[PASS_NAMES.index(PROGRAM_DONE) + 1]
    c = _run(Compilation(None, Options(dp=dp), program=program), first, "check-streams")
    if c.streams is None:
        raise InternalError("check-streams gave no stream program")
    return c.streams


def _run(c: Compilation, first: str, stop_after: str) -> Compilation:
    start = PASS_NAMES.index(first)
    for run_pass, name in zip(passes()[start:], PASS_NAMES[start:], strict=True):
        c = run_pass(c)
        if name == stop_after:
            break
    return c
