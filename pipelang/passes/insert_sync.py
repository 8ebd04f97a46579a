"""Pass `insert-sync`: gradient allreduce for replicated stages, then the optimizer step.

Needs: a Program after `insert-comms` that cannot deadlock.
Guarantees: each rank runs `allreduce@s/pipe` once for every stage copy it holds whose
stage has more than one replica, never before the copy's last compute op (and the sends
right after it), and ends with one `step`. Allreduces are eager (Chimera Fig. 4b): each
goes right after its copy's last compute op, so it overlaps the rest of the rank's work.

Collectives must meet in one order: two ranks that share two allreduce groups (stages)
and run them in opposite orders would wait for each other forever. This pass fixes that
rather than reporting E0312: every rank runs its allreduces in one global order of the
stages (the order the eager positions agree on; higher stage first if they conflict),
delaying an allreduce past its eager position where that order needs it. If the result
could still deadlock against the transfers, all allreduces move to the end of each rank,
still in that order (Fig. 4a), which cannot deadlock.

    rank 0: ... B3@3/up send:B3@3/up>1 recv:B0@1/down<1 B0@0/down recv:B1@1/down<1 B1@0/down
  =>
    rank 0: ... B3@3/up send:B3@3/up>1 allreduce@3/up recv:B0@1/down<1 B0@0/down
            recv:B1@1/down<1 B1@0/down allreduce@0/down step        (Chimera, D=4)
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import networkx as nx

from pipelang.diagnostics import InternalError
from pipelang.ir import COMM_KINDS, COMPUTE_KINDS, Action, Kind, Program

if TYPE_CHECKING:
    from pipelang.compiler import Compilation

Copy = tuple[int, str]
"""A stage copy: (stage, pipeline)."""


def insert_sync(program: Program) -> Program:
    """`program` with allreduces and a final step on every rank (module docstring).
    An asynchronous program (`weights ...`) is left as it is: its `U`s are its updates."""
    if program.weights is not None:
        return program
    eager = [_eager_positions(program, r) for r in range(program.num_ranks)]
    if not any(eager):
        return dataclasses.replace(
            program, ranks=tuple((*a, Action(Kind.STEP)) for a in program.ranks)
        )
    order = _global_order(eager)
    ranks = _place(program, eager, order, at_end=False)
    if _deadlocks(ranks):
        ranks = _place(program, eager, order, at_end=True)
        if _deadlocks(ranks):
            raise InternalError("insert-sync: the program deadlocks even without sync")
    return dataclasses.replace(program, ranks=tuple(ranks))


_TRAINS = COMPUTE_KINDS - {Kind.P}
"""The kinds that use a stage copy's weights (a frozen forward `P` does not)."""


def _eager_positions(program: Program, rank: int) -> dict[Copy, int]:
    """For each replicated copy `rank` holds, the index to insert its allreduce at."""
    actions = program.ranks[rank]
    replicated = {copy for copy in program.stage_copies(rank) if len(program.replicas(copy[0])) > 1}
    last: dict[tuple[int | None, str | None], int] = {}
    for step in range(len(actions) - 1, -1, -1) if replicated else ():
        action = actions[step]
        copy = (action.stage, action.pipeline)
        if copy not in last and copy in replicated and action.kind in _TRAINS:
            last[copy] = step
            if len(last) == len(replicated):
                break
    positions = {}
    for copy in sorted(replicated):
        step = last.get(copy, -1) + 1
        # Sends are non-blocking and a peer may need them before it joins the allreduce.
        while step < len(actions) and actions[step].kind in (Kind.SEND, Kind.SIGNAL):
            step += 1
        positions[copy] = step
    return positions


def _global_order(eager: Sequence[dict[Copy, int]]) -> list[int]:
    """One order of the allreduce groups (stages) that every rank follows.

    The ranks' eager orders give it when they agree (ties: higher stage first, as
    backwards finish from the last stage); when they conflict, higher stage first.
    """
    stages = sorted({stage for positions in eager for stage, _ in positions}, reverse=True)
    agree = nx.DiGraph()
    agree.add_nodes_from(stages)
    for positions in eager:
        ranked = sorted(positions, key=lambda c: (positions[c], -c[0]))
        agree.add_edges_from((a[0], b[0]) for a, b in itertools.pairwise(ranked) if a[0] != b[0])
    if not nx.is_directed_acyclic_graph(agree):
        return stages
    return list(nx.lexicographical_topological_sort(agree, key=lambda stage: -stage))


def _place(
    program: Program, eager: Sequence[dict[Copy, int]], order: list[int], at_end: bool
) -> list[tuple[Action, ...]]:
    """Insert the allreduces in the `order` of their stages on every rank, each at its
    eager position or later; or all at the end. Then the step."""
    turn = {stage: i for i, stage in enumerate(order)}
    ranks = []
    for actions, positions in zip(program.ranks, eager, strict=True):
        inserts: dict[int, list[Action]] = defaultdict(list)
        at = 0
        for copy in sorted(positions, key=lambda c: (turn[c[0]], c[1])):
            at = len(actions) if at_end else max(at, positions[copy])
            inserts[at].append(Action(Kind.ALLREDUCE, None, copy[0], copy[1]))
        out: list[Action] = []
        for step, action in enumerate(actions):
            out.extend(inserts.get(step, ()))
            out.append(action)
        out.extend(inserts.get(len(actions), ()))
        out.append(Action(Kind.STEP))
        ranks.append(tuple(out))
    return ranks


def _deadlocks(ranks: Sequence[Sequence[Action]]) -> bool:
    """Whether the ranks wait on each other in a cycle: each rank runs its list in
    order, the k-th send on a channel feeds the k-th recv, and the k-th allreduce of a
    stage on every rank is one meeting that all of them wait for."""
    ids = itertools.count()
    meetings: dict[tuple[int | None, int], int] = {}
    edges: list[tuple[int, int]] = []
    sent: dict[tuple[int, int], list[int]] = defaultdict(list)
    received: dict[tuple[int, int], list[int]] = defaultdict(list)
    for rank, actions in enumerate(ranks):
        seen: dict[int | None, int] = defaultdict(int)
        previous = -1
        for action in actions:
            if action.kind is Kind.ALLREDUCE:
                key = (action.stage, seen[action.stage])
                seen[action.stage] += 1
                here = meetings.setdefault(key, next(ids))
            else:
                here = next(ids)
            if previous >= 0:
                edges.append((previous, here))
            previous = here
            if action.kind in COMM_KINDS and action.peer is not None:
                outgoing = action.kind in (Kind.SEND, Kind.SIGNAL)
                channel = (rank, action.peer) if outgoing else (action.peer, rank)
                (sent if outgoing else received)[channel].append(here)
    for channel, sends in sent.items():
        edges.extend(zip(sends, received.get(channel, ()), strict=False))
    return not _acyclic(next(ids), edges)


def _acyclic(count: int, edges: list[tuple[int, int]]) -> bool:
    """Kahn's algorithm over nodes `0..count-1`."""
    succ: list[list[int]] = [[] for _ in range(count)]
    indegree = [0] * count
    for u, v in edges:
        succ[u].append(v)
        indegree[v] += 1
    ready = [v for v in range(count) if indegree[v] == 0]
    done = 0
    while ready:
        done += 1
        for v in succ[ready.pop()]:
            indegree[v] -= 1
            if indegree[v] == 0:
                ready.append(v)
    return done == count


def run(c: Compilation) -> Compilation:
    """The pass: the replicas' allreduce and the optimizer step."""
    return dataclasses.replace(c, program=insert_sync(c.need_program()))
