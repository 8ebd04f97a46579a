"""Helpers for the runtime tests: `run` (`pipelang run` in this process), `stdlib` (a
compiled stdlib schedule), and hand-built runnable Programs, independent of the compiler.

`with_comms` does, for a compute-only Program, what the compiler's insert-comms and
insert-sync passes do: a send right after the op that produces a value another rank
needs, the matching receive just before the first op that needs it (earlier messages on
the same channel are received first, so every channel stays FIFO), then each stage
copy's allreduce after its last backward and the optimizer `step` at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import deque

from pipelang.api import load_program
from pipelang.backends.launch import run_program
from pipelang.backends.processes import action_labels
from pipelang.backends.worker import lower_streams
from pipelang.cli.args import add_run_arguments, config_from_args
from pipelang.ir import Action, Kind, Program


def run(program: Program, *options: str) -> int:
    """`pipelang run` on a Program, in this process; returns the exit status."""
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    parser.add_argument("--debug", action="store_true")
    return run_program(program, config_from_args(parser.parse_args(list(options))))


def stdlib(name: str, **params: int) -> Program:
    """A compiled stdlib schedule."""
    return load_program(name, {k: str(v) for k, v in params.items()})


def host_op(program: Program, rank: int, index: int, dp: int = 1) -> str:
    """How a failure names op `index` of program rank `rank` in a gloo run: the stream
    op the host issues there (`r1.compute F0@1/main`), as the launcher labels it."""
    return action_labels(program, lower_streams(program, dp))[rank][index]


def _consumer(program: Program, op: Action) -> Action | None:
    """The compute op on another stage that reads what `op` produces, if any."""
    assert op.stage is not None
    if op.kind is Kind.F and op.stage + 1 < program.num_stages:
        return Action(Kind.F, op.mb, op.stage + 1, op.pipeline)
    if op.kind is Kind.B and op.stage > 0:
        return Action(Kind.B, op.mb, op.stage - 1, op.pipeline)
    return None


def _rank(program: Program, op: Action) -> int:
    assert op.stage is not None and op.pipeline is not None
    return program.rank_of(op.stage, op.pipeline)


def with_comms(program: Program) -> Program:
    """`program` with sends, receives, allreduces and steps inserted (see module doc)."""
    world = program.num_ranks
    position = [0] * world
    out: list[list[Action]] = [[] for _ in range(world)]
    channel: dict[tuple[int, int], deque[Action]] = {}
    received: list[set[Action]] = [set() for _ in range(world)]
    while any(position[r] < len(program.ranks[r]) for r in range(world)):
        progressed = False
        for rank in range(world):
            while position[rank] < len(program.ranks[rank]):
                op = program.ranks[rank][position[rank]]
                if not _receive_inputs(program, op, rank, channel, received, out):
                    break
                out[rank].append(op)
                position[rank] += 1
                progressed = True
                consumer = _consumer(program, op)
                if consumer is not None and (peer := _rank(program, consumer)) != rank:
                    out[rank].append(op._replace(kind=Kind.SEND, peer=peer, of=op.kind))
                    channel.setdefault((rank, peer), deque()).append(op)
        if not progressed:
            raise ValueError("the test program deadlocks")
    _add_sync(program, out)
    return dataclasses.replace(program, ranks=tuple(tuple(r) for r in out))


def _receive_inputs(
    program: Program,
    op: Action,
    rank: int,
    channel: dict[tuple[int, int], deque[Action]],
    received: list[set[Action]],
    out: list[list[Action]],
) -> bool:
    for dep in program.inputs_of(op):
        src = _rank(program, dep)
        if src == rank or dep in received[rank]:
            continue
        queue = channel.get((src, rank), deque())
        if dep not in queue:
            return False
        while True:
            got = queue.popleft()
            received[rank].add(got)
            out[rank].append(got._replace(kind=Kind.RECV, peer=src, of=got.kind))
            if got == dep:
                break
    return True


def _add_sync(program: Program, out: list[list[Action]]) -> None:
    last_grad = Kind.W if Kind.W in program.kinds else Kind.B
    for rank, actions in enumerate(out):
        for stage, pipe in program.stage_copies(rank):
            if len(set(program.replicas(stage))) < 2:
                continue
            last = max(
                i
                for i, a in enumerate(actions)
                if a.kind is last_grad and a.stage == stage and a.pipeline == pipe
            )
            # after the op and any send that follows it
            while last + 1 < len(actions) and actions[last + 1].kind is Kind.SEND:
                last += 1
            actions.insert(last + 1, Action(Kind.ALLREDUCE, None, stage, pipe))
        actions.append(Action(Kind.STEP))
