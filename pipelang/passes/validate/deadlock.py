"""Finding and explaining a deadlock: a cycle in the dependency graph of the ops.

`find_cycle` returns a shortest cycle among the ops that cannot run;
`describe_cycle` turns it into the E0306 diagnostic: each op with its source line, the
cycle step by step, and a rank x step grid with the cycle's ops in [brackets].
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection

import networkx as nx

from pipelang.diagnostics import Diagnostic, InternalError, Label
from pipelang.grid import step_grid
from pipelang.ir import Program
from pipelang.ir.graph import Edge, OpGraph

MAX_LABELS = 8
"""Source lines shown for a long cycle."""

MAX_LINES = 24
"""Lines of the note that walks through the cycle, the closing op included."""

WINDOW = 2
"""Steps shown in the grid on either side of each op of the cycle."""

GRID_WIDTH = 100
"""Grid lines are cut at this many characters."""


def find_cycle(graph: OpGraph, skip: frozenset[Edge] = frozenset()) -> list[int]:
    """A shortest cycle among the ops that cannot run (without the edges in `skip`), as op
    numbers where each waits for the one before it, starting at its op that comes first
    by (rank, step); empty when there is none.

    Kahn's algorithm over the numbered graph finds the stuck ops in linear time (networkx's
    own acyclicity test costs several times more at 10^5 ops); networkx then finds a
    cycle among the few stuck ones.
    """
    done = graph.topological_order(skip)
    if len(done) == len(graph.ops):
        return []
    stuck = set(range(len(graph.ops))).difference(done)
    knot = nx.DiGraph((u, v) for u, v in graph.edges(skip) if u in stuck and v in stuck)
    found = nx.find_cycle(knot)
    # networkx gives some cycle; the shortest one through its first op reads better.
    start = min((u for u, _ in found), key=lambda u: (graph.ranks[u], graph.steps[u]))
    cycle = _shortest_cycle_through(start, knot)
    first = min(range(len(cycle)), key=lambda i: (graph.ranks[cycle[i]], graph.steps[cycle[i]]))
    return cycle[first:] + cycle[:first]


def _shortest_cycle_through(start: int, succ: nx.DiGraph) -> list[int]:
    """Breadth-first from `start` back to itself."""
    parent: dict[int, int] = {}
    queue = deque([start])
    while queue:
        u = queue.popleft()
        for v in succ[u]:
            if v == start:
                path = [u]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return path[::-1]
            if v not in parent:
                parent[v] = u
                queue.append(v)
    raise InternalError(f"op {start} lies on no cycle")


def edge_reasons(graph: OpGraph, edges: Collection[Edge]) -> dict[Edge, str]:
    """Why each of `edges` exists: `data` over `after` over `order` (one scan of the graph)."""
    reasons: dict[Edge, str] = {}
    for why, listed in (("order", graph.order), ("after", graph.after), ("data", graph.data)):
        reasons.update((e, why) for e in listed if e in edges)
    return reasons


def describe_cycle(program: Program, graph: OpGraph, cycle: list[int]) -> Diagnostic:
    """The E0306 diagnostic for `cycle` (each op waits for the one before it)."""
    ops, ranks, steps = graph.ops, graph.ranks, graph.steps
    first = ops[cycle[0]]
    waits = [(cycle[i - 1], v) for i, v in enumerate(cycle)]
    labels = []
    for u, v in waits[1 : MAX_LABELS + 1]:
        span = ops[v].span
        if span is not None:
            labels.append(Label(span, f"`{ops[v]}` on rank {ranks[v]} waits for `{ops[u]}`"))
    reasons = edge_reasons(graph, frozenset(waits))
    # A cycle through an `after` declaration is that declaration's doing: point at it.
    declared = {(d.earlier, d.later): d.span for d in program.after}
    through = [
        span
        for u, v in waits
        if reasons[(u, v)] == "after" and (span := declared.get((ops[u], ops[v]))) is not None
    ]
    primary = through[0] if through else first.span
    if through and first.span is not None:
        labels.insert(0, Label(first.span, f"`{first}` is on the cycle"))
    labels += [Label(span, "another `after` on the cycle") for span in through[1:]]
    lines = [f"  {ops[cycle[0]]}  (rank {ranks[cycle[0]]}, step {steps[cycle[0]]})"]
    for u, v in [*waits[1:], waits[0]]:
        reason = reasons[(u, v)]
        lines.append(f"  -> {ops[v]}  (rank {ranks[v]}, step {steps[v]}; {_WHY[reason]})")
    if len(lines) > MAX_LINES:
        skipped = len(lines) - MAX_LINES
        lines[MAX_LINES - 1 : -1] = [f"  -> ... {skipped} more ops"]
    return Diagnostic(
        "E0306",
        f"the schedule deadlocks: {len(cycle)} ops wait on each other in a cycle"
        + (", through this `after`" if through else ""),
        primary,
        tuple(labels),
        notes=(
            "each op waits for the one before it:\n" + "\n".join(lines),
            "rank x step grid, the cycle in [brackets]:\n" + _grid(program, graph, cycle),
        ),
        help="reorder a rank so that each op comes after what it waits for; only the "
        "waits marked `listed after` come from the order",
    )


_WHY = {
    "order": "listed after",
    "data": "needs its result",
    "after": "an `after` dependency",
}


def _grid(program: Program, graph: OpGraph, cycle: list[int]) -> str:
    marked = {(graph.ranks[u], graph.steps[u]) for u in cycle}
    ranks = sorted({r for r, _ in marked})
    longest = max(len(program.ranks[r]) for r in ranks)
    shown = sorted(
        {
            s
            for _, step in marked
            for s in range(step - WINDOW, step + WINDOW + 1)
            if 0 <= s < longest
        }
    )
    return step_grid(program, ranks, shown, marked, GRID_WIDTH)
