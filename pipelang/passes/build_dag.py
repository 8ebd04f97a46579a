"""Pass `build-dag`: every compute op of a Program and the ops it must wait for.

Needs: a Program from `expand-orders` (comm, allreduce and step actions, if any, are
skipped). Ops may be missing, duplicated or misplaced; that is `validate`'s business.
Guarantees: an `OpGraph`, the DAG with one node per distinct compute op in
`program.ranks` (numbered in (rank, step) order, kept with its action, and the rank and
step where its first occurrence stands) and an edge `u -> v` for every "u must end
before v starts", in one list per reason:

- `order`: u comes right before v in one rank's list;
- `data`: v consumes u's result (`Program.inputs_of`): F(m,s) -> F(m,s+1),
  F(m,s) -> B(m,s), B(m,s+1) -> B(m,s), B(m,s) -> W(m,s), F(m,s) -> R(m,s) -> B(m,s),
  P(m,0) -> F(m,0) (frozen work); with sequence chunks each per chunk, and on one stage
  F(m.c-1) -> F(m.c) and B(m.c+1) -> B(m.c);
  for evicted activations (BPipe), F(m,s) -> E(m,s) -> H(m,s) -> L(m,s) and
  E(m,s) -> L(m,s), and L(m,s) -> R(m,s), L(m,s) -> B(m,s) (the stash kinds are nodes
  too, `ir.GRAPH_KINDS`);
- `after`: an explicit `after` dependency.
A compound (an action and the `&` actions fused to it, see `ir.Action`) starts as one:
every input of a fused op from outside the compound is also a `data` edge into the
compound's first op, so both halves' inputs are ready (and received) before it starts.

An edge whose endpoint is absent is left out. `OpGraph.to_networkx()` (and
`build_dag`) gives the same graph as a `networkx.DiGraph` over the op numbers, each
edge with attribute `why` (`data` over `after` over `order` where reasons join one
pair). The passes walk the numbered lists, which is linear and cheap; the networkx view
is built only when something asks for it (`Compilation.dag`, `--dump-after build-dag`):
at 10^5 ops it would cost 15% of a compile that never reads it. (`validate` hands
networkx only the few ops of a deadlock, to find their cycle.)

    rank 0: F0@0/main B0@0/main
    rank 1: F0@1/main B0@1/main
  =>
    0 F0@0/main -> 1 B0@0/main  data        2 F0@1/main -> 3 B0@1/main  data
    0 F0@0/main -> 2 F0@1/main  data        3 B0@1/main -> 1 B0@0/main  data
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from pipelang.ir.graph import op_graph

if TYPE_CHECKING:
    from pipelang.compiler import Compilation


def run(c: Compilation) -> Compilation:
    """The pass: the op graph of the compute ops, handed on to the later passes."""
    return dataclasses.replace(c, graph=op_graph(c.need_program()))
