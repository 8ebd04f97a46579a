"""Pass `insert-shard`: a sharded stage copy's all-gather and reduce-scatter (`--shard`).

Needs: a validated Program after `insert-holds`, compiled with `Options.shard` K > 1 (the
`--dp K` copies each stage copy is sharded over); without it the program comes back
unchanged (the same object).
Guarantees: on every rank, for each stage copy it holds, one `gather@s/p` right before
the copy's first op of the step (the parameters, sharded over the K data-parallel
copies, are all-gathered and kept gathered for the rest of the step), and one
`reduce_scatter@s/p` right after its last backward (B, or W where W is split off): the
gradients the copy accumulated over its micro-batches are summed over the K copies once
per step, each copy keeping the sum of its own shard, and the gathered parameters are
dropped. Both are ops of the op graph (rebuilt here), so `simulate` and `viz` time them
(cost entries `AG` and `RS`); the runtime performs them with FSDP2 (backends/shard.py).
A program the runtime cannot shard yet (`features.REFUSED["--shard"]`) is E0321.

The K copies of a rank run the same list, so they meet in every collective in one order.

    rank 0: F0@0/main F1@0/main B0@0/main B1@0/main           (shard 2)
  =>
    rank 0: gather@0/main F0@0/main F1@0/main B0@0/main B1@0/main reduce_scatter@0/main
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from pipelang.features import refuse
from pipelang.ir import COMPUTE_KINDS, Action, Kind, Program
from pipelang.ir.graph import OpGraph, op_graph

if TYPE_CHECKING:
    from pipelang.compiler import Compilation

_USES = COMPUTE_KINDS - {Kind.P}
"""The kinds that use a stage copy's weights (a frozen forward `P` does not)."""
_GRADIENTS = frozenset({Kind.B, Kind.W})
"""The kinds that add to a stage copy's gradients."""


def insert_shard(program: Program, shard: int) -> Program:
    """`program` with each stage copy's gather and reduce-scatter (module docstring);
    `shard` is the number of data-parallel copies each stage is sharded over (1: none)."""
    if shard < 2:
        return program
    refuse(program, "--shard", "E0321", program.order_span)
    return dataclasses.replace(program, ranks=tuple(_rank(a) for a in program.ranks))


def _rank(actions: tuple[Action, ...]) -> tuple[Action, ...]:
    first: dict[tuple[int | None, str | None], int] = {}
    last: dict[tuple[int | None, str | None], int] = {}
    for step, action in enumerate(actions):
        copy = (action.stage, action.pipeline)
        if action.kind in _USES:
            first.setdefault(copy, step)
        if action.kind in _GRADIENTS:
            last[copy] = step
    before: dict[int, list[Action]] = {}
    after: dict[int, list[Action]] = {}
    for (stage, pipeline), step in first.items():
        while step > 0 and actions[step].fused:
            step -= 1  # before the whole compound
        before.setdefault(step, []).append(Action(Kind.GATHER, None, stage, pipeline))
    for (stage, pipeline), step in last.items():
        while step + 1 < len(actions) and actions[step + 1].fused:
            step += 1  # after the whole compound
        after.setdefault(step, []).append(Action(Kind.REDUCE_SCATTER, None, stage, pipeline))
    out: list[Action] = []
    for step, action in enumerate(actions):
        out.extend(before.get(step, ()))
        out.append(action)
        out.extend(after.get(step, ()))
    return tuple(out)


def run(c: Compilation) -> Compilation:
    """The pass: each sharded stage copy's gather and reduce-scatter (and the op graph
    with them)."""
    program = c.need_program()
    sharded = insert_shard(program, c.options.shard)
    if sharded is program:
        return c
    graph: OpGraph = op_graph(sharded)
    return dataclasses.replace(c, program=sharded, graph=graph)
