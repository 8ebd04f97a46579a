"""Pass `insert-comms`: a send and a recv for every result that crosses ranks.

Needs: a validated Program of compute ops only (no crossing transfers, no deadlock).
Guarantees: for every producer and every other rank that consumes its result, a
`send:OP>dst` right after the producer on its rank and a `recv:OP<src` right before the
first consumer on the receiving rank; for an `after` dependency alone, `signal:`/`wait:`
instead. A producer sends once per receiving rank. Sends after one producer go in rank
order; recvs before one consumer go by sending rank, then in channel order. There is one
channel per directed rank pair, and on each channel the k-th send (or signal) matches
the k-th recv (or wait). Sends keep the producer's span, recvs the consumer's.
Same-rank dependencies get nothing.

    rank 0: F0@0/main B0@0/main
    rank 1: F0@1/main B0@1/main
  =>
    rank 0: F0@0/main send:F0@0/main>1 recv:B0@1/main<1 B0@0/main
    rank 1: recv:F0@0/main<0 F0@1/main B0@1/main send:B0@1/main>0
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from itertools import pairwise

from pipelang.diagnostics import InternalError
from pipelang.ir import COMPUTE_KINDS, Action, Kind, Program
from pipelang.passes.build_dag import Message, OpGraph, op_graph


def insert_comms(program: Program) -> Program:
    """`program` with its transfers made explicit (see the module docstring)."""
    if not {a.kind for actions in program.ranks for a in actions} <= COMPUTE_KINDS:
        raise InternalError("insert-comms runs once, on a program of compute ops")
    graph = op_graph(program)
    _check_fifo(graph)
    # Per rank, step -> the comms to put right before / right after the action there.
    before: list[dict[int, list[Action]]] = [defaultdict(list) for _ in program.ranks]
    after: list[dict[int, list[Action]]] = [defaultdict(list) for _ in program.ranks]
    ranks, steps = graph.ranks, graph.steps
    # Channels come sorted by (src, dst), each in send order: sends after one producer
    # land in dst order, recvs before one consumer by src, then in channel order.
    for sent in graph.channels.values():
        for m in sent:
            after[ranks[m.producer]][steps[m.producer]].append(_send(graph, m))
            before[ranks[m.consumer]][steps[m.consumer]].append(_receive(graph, m))
    spliced = map(_splice, program.ranks, before, after)
    return dataclasses.replace(program, ranks=tuple(spliced))


def _splice(
    actions: tuple[Action, ...], before: dict[int, list[Action]], after: dict[int, list[Action]]
) -> tuple[Action, ...]:
    out: list[Action] = []
    for step, action in enumerate(actions):
        if step in before:
            out.extend(before[step])
        out.append(action)
        if step in after:
            out.extend(after[step])
    return tuple(out)


def _send(graph: OpGraph, message: Message) -> Action:
    op = graph.ops[message.producer]
    kind = Kind.SEND if message.data else Kind.SIGNAL
    return Action(kind, op.mb, op.stage, op.pipeline, message.dst, op.kind, op.span)


def _receive(graph: OpGraph, message: Message) -> Action:
    op = graph.ops[message.producer]
    kind = Kind.RECV if message.data else Kind.WAIT
    span = graph.ops[message.consumer].span
    return Action(kind, op.mb, op.stage, op.pipeline, message.src, op.kind, span)


def _check_fifo(graph: OpGraph) -> None:
    """Each channel must be received in the order it is sent; `validate` made sure."""
    steps = graph.steps
    for (src, dst), sent in graph.channels.items():
        needed = [steps[m.consumer] for m in sent]
        if any(a > b for a, b in pairwise(needed)):
            raise InternalError(f"channel {src}->{dst} crosses; was the program validated?")
