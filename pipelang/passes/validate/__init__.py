"""Pass `validate`: every problem with the order, collected and reported at once.

Needs: the Program from `expand-orders` and its numbered DAG from `build-dag`.
Guarantees: an empty list exactly when every required op runs once, on the rank its
placement names, after the ops it needs on its own rank, with no deadlock, and (when a
cap is given) no rank over the activation cap. Each diagnostic points at the action
that caused it; they come sorted by position.

Checks, by code: E0301 wrong rank (or an op the schedule does not have), E0302
duplicate, E0303 missing, E0309 undeclared op kind, E0304 B before its F, E0305 W before
its B or R outside F..B, E0317 a frozen forward `P` on a rank that does not hold the
frozen part, E0318 a stage-0 F before its own P on one rank, E0320 a chunk's F before
the F of the chunk before it or its B before the B of the chunk after it, E0306
deadlock, E0308 too many activations; evictions: E0315 an `E`/`L` out of place, E0316 a
bad partner; weight versions (`pipelang.weights`, which also tells the runtime which
version each op reads): E0313 an update that cannot apply, E0314 more versions than
declared. The deadlock check needs a sound graph, so it runs only when no op is missing,
duplicated or misplaced and every eviction is loaded back in order; a same-rank order
mistake is reported as E0304/E0305 and not again as a deadlock. The order in which a
rank consumes what another rank sends does not matter: `insert-comms` receives in the
sender's order (E0307 checks that of lowered programs).

    rank 0: F0@0/main B0@0/main F1@0/main B1@0/main
    rank 1: F1@1/main F0@1/main B0@1/main B1@1/main
  =>
    error[E0306]: the schedule deadlocks: 5 ops wait on each other in a cycle

The package, one module per kind of check: `order.py` (the listing and the order),
`deadlock.py` (E0306), `evictions.py` (E0315, E0316), `memory.py` (E0308), `problems.py`
(many problems merged into one diagnostic), and
`lowered.py` (E0307, for Program files read back: `read_lowered`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipelang.diagnostics import Diagnostic, PipelangError
from pipelang.ir import Program
from pipelang.ir.graph import OpGraph
from pipelang.passes.validate.deadlock import describe_cycle, find_cycle
from pipelang.passes.validate.evictions import check_evictions
from pipelang.passes.validate.memory import check_memory
from pipelang.passes.validate.order import (
    MANY,
    edges_of,
    listed_right,
    missing,
    order_problems,
    order_problems_in,
    take_census,
)
from pipelang.passes.validate.problems import collapse
from pipelang.weights import check_weights

if TYPE_CHECKING:
    from pipelang.compiler import Compilation


def validate(program: Program, graph: OpGraph, max_activations: int | None) -> list[Diagnostic]:
    """Every problem in `program`'s order, sorted by position (see the module docstring).
    `graph` is `program`'s (`ir.graph.op_graph`)."""
    if listed_right(program, graph):
        out_of_order = order_problems(graph)
        found = collapse(out_of_order, MANY)
    else:
        census = take_census(program)
        out_of_order = order_problems_in(program, census)
        found = collapse([*census.problems, *out_of_order], MANY) + missing(program, census)
        found += check_evictions(program)  # a program with `E`/`L` is never listed right
    if not any(d.code in ("E0301", "E0302", "E0303", "E0315", "E0317") for d in found):
        cycle = find_cycle(graph, skip=edges_of(graph, out_of_order))
        if cycle:
            found.append(describe_cycle(program, graph, cycle))
    if max_activations is not None:
        found += check_memory(program, max_activations)
    found += check_weights(program)
    return sorted(found, key=Diagnostic.sort_key)


def run(c: Compilation) -> Compilation:
    """The pass: every diagnostic of the program at once, or the compilation unchanged."""
    diagnostics = validate(c.need_program(), c.need_graph(), c.options.max_activations)
    if diagnostics:
        raise PipelangError(diagnostics)
    return c
