"""Pass `insert-holds`: the partner's side of every eviction (BPipe).

Needs: a validated Program (no deadlock; every `E` loaded back by its `L`).
Guarantees: for every eviction `E3@0/main>3`, one hold `H3@0/main` on rank 3, placed
right before the first op of rank 3 that must wait for the eviction anyway (one that
depends on it, through any chain of order, data and `after` edges), or at the end of
rank 3's list when none does. Holds at one place go in the order of their evictions.
A program without evictions comes back unchanged (the same object).

`insert-comms` then lowers the two hops like any other result that crosses ranks:
`E -> H` (the activations go to the partner) and `H -> L` (they come back), on the
channels of the two rank pairs, in FIFO order with the other traffic.

The place cannot deadlock: the hold waits for its eviction, and every op of rank 3
from that place on depends on the eviction already; every op before it does not, and so
neither depends on the load, which comes after the eviction. The graph stays acyclic.

    rank 0: F0@0/main E0@0/main>1 F1@0/main L0@0/main B0@0/main B1@0/main
    rank 1: F0@1/main B0@1/main F1@1/main B1@1/main
  =>
    rank 1: F0@1/main B0@1/main H0@0/main F1@1/main B1@1/main
            (F1@1/main is rank 1's first op after E0@0/main: it needs F1@0/main)
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import TYPE_CHECKING

from pipelang.ir import Action, Kind, Program
from pipelang.ir.graph import OpGraph, op_graph

if TYPE_CHECKING:
    from pipelang.compiler import Compilation


def insert_holds(program: Program, graph: OpGraph) -> tuple[Program, OpGraph]:
    """`program` with a hold on the partner of every eviction (module docstring), and
    its op graph: `graph` (the graph of `program`) when nothing changed."""
    required = program.num_microbatches * program.num_stages * len(program.kinds)
    if len(graph.ops) == required:  # validated: every required op once, nothing else
        return program, graph
    evictions = [v for v, op in enumerate(graph.ops) if op.kind is Kind.E]
    if not evictions:
        return program, graph
    partners = sorted({p for v in evictions if (p := graph.ops[v].peer) is not None})
    succ: list[list[int]] = [[] for _ in graph.ops]
    for u, v in graph.edges():
        succ[u].append(v)
    first = {p: _first_descendant(graph, succ, p) for p in partners}
    holds: list[dict[int, list[Action]]] = [defaultdict(list) for _ in program.ranks]
    for v in evictions:  # op numbers follow (rank, step): holds come in eviction order
        evict = graph.ops[v]
        partner = evict.peer
        if partner is None:
            continue
        actions = program.ranks[partner]
        at = min(first[partner][v], len(actions))
        while 0 < at < len(actions) and actions[at].fused:
            at -= 1  # never split a compound: hold before its first op
        hold = Action(Kind.H, evict.mb, evict.stage, evict.pipeline, span=evict.span)
        holds[partner][at].append(hold)
    ranks = tuple(_splice(actions, at) for actions, at in zip(program.ranks, holds, strict=True))
    held = dataclasses.replace(program, ranks=ranks)
    return held, op_graph(held)


def _first_descendant(graph: OpGraph, succ: list[list[int]], rank: int) -> list[int]:
    """For every op, the smallest step on `rank` of an op that depends on it (itself
    included); a step past every list when there is none. One pass in reverse
    topological order over `succ`, the graph's successor lists."""
    none = 1 << 62
    first = [none] * len(graph.ops)
    ranks, steps = graph.ranks, graph.steps
    for v in reversed(graph.topological_order()):
        here = steps[v] if ranks[v] == rank else none
        for w in succ[v]:
            if first[w] < here:
                here = first[w]
        first[v] = here
    return first


def _splice(actions: tuple[Action, ...], holds: dict[int, list[Action]]) -> tuple[Action, ...]:
    """`actions` with `holds[at]` put right before step `at` (or at the end)."""
    if not holds:
        return actions
    out: list[Action] = []
    for step, action in enumerate(actions):
        out.extend(holds.get(step, ()))
        out.append(action)
    out.extend(holds.get(len(actions), ()))
    return tuple(out)


def run(c: Compilation) -> Compilation:
    """The pass: the partners' holds of evicted activations (and the graph with them)."""
    program, graph = insert_holds(c.need_program(), c.need_graph())
    return dataclasses.replace(c, program=program, graph=graph)
