"""The op graph: every compute op of a Program, numbered, and the edges between them.

`op_graph(program)` numbers the compute ops in (rank, step) order and collects an edge
`u -> v` for every "u must end before v starts", in one list per reason (`order`: u
right before v in one rank's list; `data`: v reads u's result, by the dependency rule
`deps.inputs`, with the compound edges of fused ops; `after`: an explicit `after`
dependency). The `build-dag` pass makes it (pipelang/passes/build_dag.py says what it
holds, with an example); the later passes and the simulator walk its numbered lists,
and `to_networkx()` gives the same graph as a networkx DiGraph when one is asked for.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import networkx as nx

from pipelang.diagnostics import InternalError
from pipelang.ir import GRAPH_KINDS, Action, Program, deps
from pipelang.ir.deps import Key, op_key

Edge = tuple[int, int]
"""(u, v) by op number: u must end before v starts."""


class Message(NamedTuple):
    """One transfer between ranks: `producer`'s result (or, if not `data`, only the news
    that it ended) goes from rank `src` to rank `dst`, where `consumer` needs it first.

    A NamedTuple rather than a dataclass: a large schedule makes 10^5 of them per pass.
    """

    producer: int
    consumer: int
    src: int
    dst: int
    data: bool


@dataclass(frozen=True)
class OpGraph:
    """The DAG with ops numbered `0..n-1`, for linear-time walks over large schedules.

    `ops[i]` is the first occurrence of op `i`, at `steps[i]` in `program.ranks[ranks[i]]`,
    so ops are numbered by (rank, step); `listed` counts every occurrence (more than
    `len(ops)` when an op is listed twice). `index` finds an op's number by `op_key`.
    Edge lists hold (u, v) pairs by reason, each in rank order of `v` (`order`, `data`)
    or in the order of `program.after`.
    """

    listed: int
    ops: tuple[Action, ...]
    ranks: tuple[int, ...]
    steps: tuple[int, ...]
    index: Mapping[Key, int]
    heads: tuple[int, ...]
    """The first op of each op's compound: itself unless it is fused to the ops before."""
    order: tuple[Edge, ...]
    data: tuple[Edge, ...]
    after: tuple[Edge, ...]

    def find(self, action: Action) -> int | None:
        """The number of `action`'s op, or None when no rank runs it."""
        return self.index.get(op_key(action))

    def edges(self, skip: frozenset[Edge] = frozenset()) -> Iterable[Edge]:
        """Every edge, of every reason, except those in `skip`."""
        for edges in (self.order, self.data, self.after):
            yield from (e for e in edges if e not in skip) if skip else edges

    def topological_order(self, skip: frozenset[Edge] = frozenset()) -> Sequence[int]:
        """Ops in an order that respects every edge but those in `skip` (Kahn's algorithm).

        Ops on a cycle, and those after one, are left out: the list is shorter than `ops`
        exactly when the graph has a cycle. Without `skip` it is computed once per graph
        (validation and `insert-holds` both walk it).
        """
        return self._topological if not skip else self._kahn(skip)

    @cached_property
    def _topological(self) -> tuple[int, ...]:
        return tuple(self._kahn(frozenset()))

    def _kahn(self, skip: frozenset[Edge]) -> list[int]:
        succ: list[list[int]] = [[] for _ in self.ops]
        indegree = [0] * len(self.ops)
        for u, v in self.edges(skip):
            succ[u].append(v)
            indegree[v] += 1
        ready = [v for v, d in enumerate(indegree) if d == 0]
        done: list[int] = []
        while ready:
            u = ready.pop()
            done.append(u)
            for v in succ[u]:
                indegree[v] -= 1
                if indegree[v] == 0:
                    ready.append(v)
        return done

    @cached_property
    def channels(self) -> dict[tuple[int, int], list[Message]]:
        """What crosses between ranks, per channel (src, dst), in the sender's order.

        One message per producer and receiving rank: data when any op there consumes the
        producer's result, else just a signal for `after` dependencies. Its `consumer` is
        the first op there that needs it; the receiver may need messages in another order
        than they are sent (`insert-comms` receives in send order all the same).
        """
        # Keyed and sorted by one int per (producer, receiving rank), which is much
        # cheaper than a tuple at 10^5 messages. Ops are numbered in (rank, step) order,
        # so the lowest-numbered consumer on a rank is its first, and sorting by
        # producer number sorts each channel in its sender's order.
        ranks = self.ranks
        width = max(ranks, default=0) + 1
        first: dict[int, int] = {}  # producer * width + receiving rank -> first consumer
        signals: set[int] = set()  # the keys of `after` edges alone: no data to send
        for data, edges in ((True, self.data), (False, self.after)):
            for u, v in edges:
                dst = ranks[v]
                if ranks[u] == dst:
                    continue
                key = u * width + dst
                seen = first.get(key)
                if seen is None:
                    first[key] = v
                    if not data:
                        signals.add(key)
                elif v < seen:
                    first[key] = v
        channels: dict[tuple[int, int], list[Message]] = defaultdict(list)
        make = tuple.__new__  # Message(...) through its Python __new__ costs 5x more
        for key in sorted(first):
            u, dst = divmod(key, width)
            src = ranks[u]
            channels[(src, dst)].append(
                make(Message, (u, first[key], src, dst, key not in signals))
            )
        return dict(sorted(channels.items()))

    def to_networkx(self) -> nx.DiGraph:
        """The `build-dag` DiGraph: nodes are op numbers with attributes `action`, `rank`
        and `step`; edges carry `why`.

        Integer nodes keep networkx fast at 10^5 ops (an Action hashes in Python, an int
        in C). Edges with one reason share one attribute dict: treat them as read-only.
        """
        # Filling networkx's adjacency dicts directly costs two dict stores per edge;
        # add_edges_from costs about four times as much, which matters at 10^5 ops.
        succ: list[dict[int, dict[str, str]]] = [{} for _ in self.ops]
        pred: list[dict[int, dict[str, str]]] = [{} for _ in self.ops]
        for why, edges in (("order", self.order), ("after", self.after), ("data", self.data)):
            attrs = {"why": why}
            for u, v in edges:
                succ[u][v] = attrs
                pred[v][u] = attrs
        dag = nx.DiGraph()
        dag._node.update(
            (i, {"action": op, "rank": r, "step": s})
            for i, (op, r, s) in enumerate(zip(self.ops, self.ranks, self.steps, strict=True))
        )
        dag._succ.update(enumerate(succ))
        dag._pred.update(enumerate(pred))
        dag.graph["ops"] = self
        return dag


def build_dag(program: Program) -> nx.DiGraph:
    """The dependency DAG of `program`'s compute ops as a networkx graph (see the module
    docstring)."""
    return op_graph(program).to_networkx()


def op_graph(program: Program) -> OpGraph:
    """Number the compute ops of `program` and collect the edges between them."""
    ops: list[Action] = []
    ranks: list[int] = []
    steps: list[int] = []
    index: dict[Key, int] = {}
    heads: list[int] = []
    order: list[Edge] = []
    compute = GRAPH_KINDS
    for rank, actions in enumerate(program.ranks):
        previous = -1
        for step, action in enumerate(actions):
            kind = action.kind
            if kind not in compute:
                continue
            key = (kind, action.mb, action.stage, action.pipeline, action.chunk)
            node = index.get(key)
            if node is None:
                node = index[key] = len(ops)
                ops.append(action)
                ranks.append(rank)
                steps.append(step)
                joined = action.fused and previous >= 0
                heads.append(heads[previous] if joined else node)
            if previous >= 0:
                order.append((previous, node))
            previous = node
    chunks = None if program.chunks is None else program.chunks.count
    data = _data_edges(index, program.num_stages, chunks)
    data += _compound_edges(data, heads)
    after = _after_edges(program, index)
    listed = len(order) + sum(1 for rank in set(ranks))  # one edge fewer than ops per rank
    return OpGraph(
        listed,
        tuple(ops),
        tuple(ranks),
        tuple(steps),
        index,
        tuple(heads),
        tuple(order),
        tuple(data),
        tuple(after),
    )


def _data_edges(index: Mapping[Key, int], num_stages: int, chunks: int | None) -> list[Edge]:
    """The dependency rule (`deps.inputs`) between the listed ops, by number; `chunks` is
    the number of sequence chunks (None: micro-batches are not split)."""
    edges: list[Edge] = []
    get, add, inputs = index.get, edges.append, deps.inputs
    for (kind, mb, stage, pipe, c), v in index.items():
        if stage is None:
            raise InternalError(f"op without a stage: {kind.value}{mb}")
        for key in inputs(kind, mb, stage, pipe, c, num_stages, chunks):
            u = get(key)
            if u is not None:
                add((u, v))
    return edges


def _compound_edges(data: list[Edge], heads: list[int]) -> list[Edge]:
    """For each fused op, its inputs from outside its compound into the compound's head."""
    return [(u, heads[v]) for u, v in data if heads[v] != v and heads[u] != heads[v]]


def _after_edges(program: Program, index: Mapping[Key, int]) -> list[Edge]:
    edges: list[Edge] = []
    for dep in program.after:
        u, v = index.get(op_key(dep.earlier)), index.get(op_key(dep.later))
        if u is not None and v is not None:
            edges.append((u, v))
    return edges
