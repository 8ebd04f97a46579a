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

from pipelang.diagnostics import InternalError
from pipelang.ir import Action, Kind, Program
from pipelang.passes.build_dag import Message, OpGraph, op_graph


def insert_comms(program: Program) -> Program:
    """`program` with its transfers made explicit (see the module docstring)."""
    if any(not a.kind.is_compute for actions in program.ranks for a in actions):
        raise InternalError("insert-comms runs once, on a program of compute ops")
    graph = op_graph(program)
    channels = graph.messages()
    _check_fifo(graph, channels)
    before: dict[int, list[Message]] = defaultdict(list)
    after: dict[int, list[Message]] = defaultdict(list)
    for sent in channels.values():
        for message in sent:
            after[message.producer].append(message)
            before[message.consumer].append(message)
    ranks = []
    for actions in program.ranks:
        out: list[Action] = []
        for action in actions:
            node = graph.index[(action.kind, action.mb, action.stage, action.pipeline)]
            incoming = sorted(before.get(node, ()), key=lambda m: (m.src, graph.steps[m.producer]))
            out.extend(_receive(graph, m) for m in incoming)
            out.append(action)
            outgoing = sorted(after.get(node, ()), key=lambda m: m.dst)
            out.extend(_send(graph, m) for m in outgoing)
        ranks.append(tuple(out))
    return dataclasses.replace(program, ranks=tuple(ranks))


def _send(graph: OpGraph, message: Message) -> Action:
    op = graph.ops[message.producer]
    kind = Kind.SEND if message.data else Kind.SIGNAL
    return Action(kind, op.mb, op.stage, op.pipeline, message.dst, op.kind, op.span)


def _receive(graph: OpGraph, message: Message) -> Action:
    op = graph.ops[message.producer]
    kind = Kind.RECV if message.data else Kind.WAIT
    span = graph.ops[message.consumer].span
    return Action(kind, op.mb, op.stage, op.pipeline, message.src, op.kind, span)


def _check_fifo(graph: OpGraph, channels: dict[tuple[int, int], list[Message]]) -> None:
    """Each channel must be received in the order it is sent; `validate` made sure."""
    steps = graph.steps
    for (src, dst), sent in channels.items():
        received = sorted(sent, key=lambda m: (steps[m.consumer], steps[m.producer]))
        if received != sent:
            raise InternalError(f"channel {src}->{dst} crosses; was the program validated?")
