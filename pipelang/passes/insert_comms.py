"""Pass `insert-comms`: a send and a recv for every result that crosses ranks.

Needs: a validated Program of compute ops only (no deadlock).
Guarantees: for every producer and every other rank that consumes its result, a
`send:OP>dst` right after the producer on its rank and one `recv:OP<src` on the
receiving rank; for an `after` dependency alone, `signal:`/`wait:` instead. A producer
sends once per receiving rank; sends after one producer go in rank order. Same-rank
dependencies get nothing. Sends keep the producer's span, recvs their first consumer's.

There is one channel per directed rank pair, and it delivers in the order it is sent, so
recvs are placed in the channel's send order: the recv of the k-th message goes right
before the earliest consumer of messages k, k+1, ... (right before its own first
consumer unless a later message is needed sooner). Recvs before one op go by sending
rank, then in channel order. So the k-th send (or signal) on a channel always matches
the k-th recv (or wait), whatever order the receiver consumes in (the tests verify it
with `check_lowered`; it costs as much as this pass, so it does not run every time).
A compound (`F3@0/main &B0@7/main`) stays whole: its recvs go before it, its sends after.
Hoisting a recv adds no waiting: message k is sent before message j > k,
so it has arrived by the time j has. It only holds k in a buffer a little longer.

    rank 0: F0@0/main F1@0/main B0@0/main B1@0/main
    rank 1: F1@1/main F0@1/main B0@1/main B1@1/main      (F1 is needed first, sent second)
  =>
    rank 0: F0@0/main send:F0@0/main>1 F1@0/main send:F1@0/main>1 recv:B0@1/main<1
            B0@0/main recv:B1@1/main<1 B1@0/main
    rank 1: recv:F0@0/main<0 recv:F1@0/main<0 F1@1/main F0@1/main B0@1/main
            send:B0@1/main>0 B1@1/main send:B1@1/main>0
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import TYPE_CHECKING

from pipelang.diagnostics import InternalError
from pipelang.ir import Action, Kind, Program
from pipelang.ir.graph import Message, OpGraph

if TYPE_CHECKING:
    from pipelang.compiler import Compilation


def insert_comms(program: Program, graph: OpGraph) -> Program:
    """`program` with its transfers made explicit (see the module docstring); `graph` is
    its op graph."""
    listed = sum(map(len, program.ranks))
    if program.weights is not None:  # an asynchronous program's `U`s are not graph ops
        listed -= sum(a.kind is Kind.U for actions in program.ranks for a in actions)
    if graph.listed != listed:
        raise InternalError("insert-comms runs once, on a program of compute ops")
    # Per rank, step -> the comms to put right before / right after the action there.
    before: list[dict[int, list[Action]]] = [defaultdict(list) for _ in program.ranks]
    after: list[dict[int, list[Action]]] = [defaultdict(list) for _ in program.ranks]
    steps = graph.steps
    # Channels come sorted by (src, dst), each in send order: sends after one producer
    # land in dst order, recvs before one op by src, then in channel order.
    ops = graph.ops
    # This loop makes two actions per transfer, 10^5 of them: it builds the tuples
    # directly (NamedTuple's own __new__ is a Python function) and unpacks once.
    make = tuple.__new__
    for (src, dst), sent in graph.channels.items():
        send_after, receive_before = after[src], before[dst]
        for (producer, consumer, _, _, data), at in zip(
            sent, _receive_steps(graph, sent), strict=True
        ):
            kind, mb, stage, pipeline, _, _, chunk, span, _ = ops[producer]
            send, recv = (Kind.SEND, Kind.RECV) if data else (Kind.SIGNAL, Kind.WAIT)
            send_after[steps[producer]].append(
                make(Action, (send, mb, stage, pipeline, dst, kind, chunk, span, False))
            )
            receive_before[at].append(
                make(
                    Action,
                    (recv, mb, stage, pipeline, src, kind, chunk, ops[consumer].span, False),
                )
            )
    spliced = map(_splice, program.ranks, before, after)
    return dataclasses.replace(program, ranks=tuple(spliced))


def _receive_steps(graph: OpGraph, sent: list[Message]) -> list[int]:
    """For each message of one channel (in send order), the step on the receiving rank to
    receive it right before: the first consumer's step of it or of any later message."""
    steps = graph.steps
    at = [steps[m.consumer] for m in sent]
    for k in range(len(at) - 2, -1, -1):
        at[k] = min(at[k], at[k + 1])
    return at


def _splice(
    actions: tuple[Action, ...], before: dict[int, list[Action]], after: dict[int, list[Action]]
) -> tuple[Action, ...]:
    """Put the comms around their steps, keeping each compound (`&`) whole: what comes
    before a fused action goes before the compound, what comes after goes after it."""
    out: list[Action] = []
    pending: list[Action] = []  # sends and signals for after the current compound
    head = 0  # where in `out` the current compound starts
    for step, action in enumerate(actions):
        receives = before.get(step, ())
        if action.fused and step > 0:
            out[head:head] = receives
            head += len(receives)
        else:
            out.extend(pending)
            pending.clear()
            out.extend(receives)
            head = len(out)
        out.append(action)
        pending.extend(after.get(step, ()))
    out.extend(pending)
    return tuple(out)


def run(c: Compilation) -> Compilation:
    """The pass: a send and a recv for every result that crosses ranks."""
    return dataclasses.replace(c, program=insert_comms(c.need_program(), c.need_graph()))
