"""Pass `insert-sync`: gradient allreduce for replicated stages, then the optimizer step.

Needs: a Program after `insert-comms` that cannot deadlock.
Guarantees: every rank holding a copy of a stage that has more than one replica runs
`allreduce@s/pipe` for that copy once, after the copy's last compute op and the sends
that follow it (eager sync, Chimera Fig. 4b), so the allreduce overlaps the rest of the
rank's work; every rank ends with one `step`. All ranks run their allreduces in one
global order of stages, so two ranks that share two groups never wait on each other in
opposite orders (E0312 cannot arise): the order is the one the eager positions already
agree on when they do; otherwise (or if eager positions would deadlock with the
transfers) each allreduce is delayed just enough to keep the global order, and as a
last resort all allreduces move to the end of their rank. Nothing is ever moved earlier
than its copy's last compute op.

    rank 0: F0@0/down ... B0@0/down send:B0@... F2@3/up ... B3@3/up   (Chimera D=4)
  =>
    rank 0: ... B3@3/up allreduce@3/up recv:B0@1/down<1 B0@0/down recv:B1@1/down<1 B1@0/down
            allreduce@0/down step
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence

import networkx as nx

from pipelang.diagnostics import InternalError
from pipelang.ir import COMM_KINDS, Action, Kind, Program

Copy = tuple[int, str]
"""A stage copy: (stage, pipeline)."""


def insert_sync(program: Program) -> Program:
    """`program` with allreduces and a final step on every rank (module docstring)."""
    eager = [_eager_positions(program, r) for r in range(program.num_ranks)]
    if not any(eager):
        return dataclasses.replace(program, ranks=tuple((*a, Action(Kind.STEP)) for a in program.ranks))
    order = _global_order(eager)
    ranks = _place(program, eager, order, at_end=False)
    if _deadlocks(ranks):
        ranks = _place(program, eager, order, at_end=True)
        if _deadlocks(ranks):
            raise InternalError("insert-sync: the program deadlocks even without sync")
    return dataclasses.replace(program, ranks=tuple(ranks))


def _eager_positions(program: Program, rank: int) -> dict[Copy, int]:
    """For each replicated copy `rank` holds, the index to insert its allreduce at."""
    actions = program.ranks[rank]
    replicated = {
        copy for copy in program.stage_copies(rank) if len(program.replicas(copy[0])) > 1
    }
    last: dict[tuple[int | None, str | None], int] = {}
    for step, action in enumerate(actions):
        if action.kind.is_compute:
            last[(action.stage, action.pipeline)] = step
    positions = {}
    for copy in sorted(replicated):
        step = last.get(copy, -1) + 1
        # Sends are non-blocking and a peer may need them before it joins the allreduce.
        while step < len(actions) and actions[step].kind in (Kind.SEND, Kind.SIGNAL):
            step += 1
        positions[copy] = step
    return positions


def _global_order(eager: Sequence[dict[Copy, int]]) -> list[Copy]:
    """One order of all replicated copies that every rank follows.

    The ranks' eager orders, when they agree, give it (ties: higher stage first, as
    backwards finish from the last stage); when they conflict, higher stage first.
    """
    copies = sorted({c for positions in eager for c in positions}, key=_later_stage_first)
    agree = nx.DiGraph()
    agree.add_nodes_from(copies)
    for positions in eager:
        ranked = sorted(positions, key=lambda c: (positions[c], _later_stage_first(c)))
        agree.add_edges_from(zip(ranked, ranked[1:], strict=False))
    if not nx.is_directed_acyclic_graph(agree):
        return copies
    return list(nx.lexicographical_topological_sort(agree, key=_later_stage_first))


def _later_stage_first(copy: Copy) -> tuple[int, str]:
    return (-copy[0], copy[1])


def _place(
    program: Program, eager: Sequence[dict[Copy, int]], order: list[Copy], at_end: bool
) -> list[tuple[Action, ...]]:
    """Insert the allreduces in `order` on every rank, each at its eager position or
    later; or all at the end. Then the step."""
    rank_of = {c: i for i, c in enumerate(order)}
    ranks = []
    for actions, positions in zip(program.ranks, eager, strict=True):
        inserts: dict[int, list[Action]] = defaultdict(list)
        at = 0
        for copy in sorted(positions, key=rank_of.__getitem__):
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
    waits = nx.DiGraph()
    sent: dict[tuple[int, int], list[tuple[object, ...]]] = defaultdict(list)
    received: dict[tuple[int, int], list[tuple[object, ...]]] = defaultdict(list)
    for rank, actions in enumerate(ranks):
        meetings: dict[int | None, int] = defaultdict(int)
        previous = None
        for step, action in enumerate(actions):
            here: tuple[object, ...] = ("at", rank, step)
            if action.kind is Kind.ALLREDUCE:
                here = ("allreduce", action.stage, meetings[action.stage])
                meetings[action.stage] += 1
            waits.add_node(here)
            if previous is not None:
                waits.add_edge(previous, here)
            previous = here
            if action.kind in COMM_KINDS and action.peer is not None:
                outgoing = action.kind in (Kind.SEND, Kind.SIGNAL)
                channel = (rank, action.peer) if outgoing else (action.peer, rank)
                (sent if outgoing else received)[channel].append(here)
    for channel, sends in sent.items():
        waits.add_edges_from(zip(sends, received.get(channel, ()), strict=False))
    return not nx.is_directed_acyclic_graph(waits)
