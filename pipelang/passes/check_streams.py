"""check-streams: prove that a stream program is free of races and cannot hang.

Needs: a `StreamProgram` (from the `streams` pass, or read from a dump by hand).
Guarantees, or reports with the line of every op involved:

- every `wait eN` comes after its `record eN` in its process's issue order (E0505; on a
  GPU a wait issued before its record is silently a no-op);
- no wait cycle: some legal order runs every op to the end, where a send and its
  receive run together and an allreduce with every member's (E0503: a capture would
  hang);
- the k-th send of a channel meets the k-th receive of its other end, and they move
  the same message (E0504);
- no race on a slot: every read finds the value it names, written by an op that happens
  before it, and every write happens after every read of the slot's previous value and
  after its previous write (E0502). An accumulator's updates are ordered the same way.

"Happens before" is the order that stream order, record/wait pairs, and the meetings of
sends with receives and of allreduce members impose, the order every execution obeys.
It is computed with vector clocks: `Interleaving` runs the ops in one legal order and
gives each op the clock of what must have run before it; `a` happens before `b` exactly
when `b`'s clock has counted `a` on `a`'s stream. That order is the same in every legal
interleaving, so one run decides every race.

Before/after: the checker returns the program unchanged, or raises PipelangError.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipelang.diagnostics import Diagnostic, InternalError, Label, PipelangError
from pipelang.ir.streams import RECORD, WAIT, Interleaving, StreamProgram

if TYPE_CHECKING:
    from pipelang.compiler import Compilation


def check_streams(program: StreamProgram) -> StreamProgram:
    """Raise PipelangError with every problem found (see the module docstring).

    Two iterations run back to back, so that a race between the end of one and the start
    of the next (a receive posted before the previous iteration read its slot) counts.
    """
    events = _event_order(program)
    if events:
        raise PipelangError(events)
    twice = _two_iterations(program)
    order = Interleaving(twice)
    ran = [i for step in order.run() for i in step]
    problems = _fork_join(program) + _races(twice, order, ran)
    if problems:
        raise PipelangError(problems)
    return program


def _two_iterations(program: StreamProgram) -> StreamProgram:
    """`program` then itself again on every process (events of the second renumbered)."""
    offset = 1 + max((op.event for op in program.ops if op.event is not None), default=0)
    ops, spans = [], []
    for rank in range(program.ranks):
        mine = list(program.by_rank(rank))
        for again in (0, offset):
            for i, op in mine:
                event = None if op.event is None else op.event + again
                ops.append(dataclasses.replace(op, event=event))
                spans.append(program.span_of(i))
    return StreamProgram(program.name, program.ranks, tuple(ops), tuple(spans))


def _fork_join(program: StreamProgram) -> list[Diagnostic]:
    """Every stream starts after its process's compute stream starts, and the compute
    stream ends after every stream ends, through record/wait pairs of the process itself
    (E0507): what a CUDA capture requires (a meeting with another rank is no graph edge)."""
    problems = []
    for rank in range(program.ranks):
        mine = [i for i, _ in program.by_rank(rank)]
        if not mine:
            continue
        after = _local_edges(program, mine)
        first: dict[str, int] = {}
        last: dict[str, int] = {}
        for i in mine:
            first.setdefault(program.ops[i].stream, i)
            last[program.ops[i].stream] = i
        forked = _reach(after, [first["compute"]])
        before: dict[int, list[int]] = {b: [] for b in mine}  # `after` reversed, in one pass
        for a, later in after.items():
            for b in later:
                before.setdefault(b, []).append(a)
        joined = _reach(before, [last["compute"]])
        for stream, i in first.items():
            if i not in forked:
                problems.append(
                    _unjoined(program, i, f"r{rank}.{stream} starts", "does not wait for")
                )
            if last[stream] not in joined:
                problems.append(
                    _unjoined(
                        program, last[stream], f"r{rank}.{stream} ends", "is not waited for by"
                    )
                )
    return problems


def _local_edges(program: StreamProgram, mine: list[int]) -> dict[int, list[int]]:
    """Op -> the ops of the same process that must follow it: the next op on its stream,
    and the waits for an event it records."""
    after: dict[int, list[int]] = {i: [] for i in mine}
    previous: dict[str, int] = {}
    records: dict[int | None, int] = {}
    for i in mine:
        op = program.ops[i]
        if op.stream in previous:
            after[previous[op.stream]].append(i)
        previous[op.stream] = i
        if op.what == RECORD:
            records[op.event] = i
        elif op.what == WAIT and op.event in records:
            after[records[op.event]].append(i)
    return after


def _reach(edges: dict[int, list[int]], start: list[int]) -> set[int]:
    seen = set(start)
    todo = list(start)
    while todo:
        for j in edges[todo.pop()]:
            if j not in seen:
                seen.add(j)
                todo.append(j)
    return seen


def _unjoined(program: StreamProgram, at: int, what: str, verb: str) -> Diagnostic:
    op = program.ops[at]
    return Diagnostic(
        "E0507",
        f"{what} here but {verb} r{op.rank}.compute: a captured iteration must fork every "
        "stream from the compute stream and join it back",
        program.span_of(at),
        help="the first op of a stream waits for an event of the compute stream; the "
        "compute stream ends by waiting for an event recorded last on every stream",
    )


def _event_order(program: StreamProgram) -> list[Diagnostic]:
    """Each event recorded once, on the same process, before every wait for it."""
    problems = []
    recorded: dict[tuple[int, int], int] = {}
    for i, op in enumerate(program.ops):
        key = (op.rank, op.event)
        if op.what == RECORD:
            if key in recorded:
                problems.append(
                    Diagnostic(
                        "E0505",
                        f"e{op.event} is recorded twice on rank {op.rank}",
                        program.span_of(i),
                        (Label(program.span_of(recorded[key]), "first recorded here"),),  # type: ignore[index]
                    )
                )
            recorded[key] = i  # type: ignore[index]
        elif op.what == WAIT and key not in recorded:
            problems.append(
                Diagnostic(
                    "E0505",
                    f"{op.stream_name} waits for e{op.event} before rank {op.rank} records it",
                    program.span_of(i),
                    notes=(
                        "a wait issued before its record does not wait at all (CUDA "
                        "treats an unrecorded event as complete)",
                    ),
                    help="issue the `record` earlier, or move the `wait` after it",
                )
            )
    return problems


@dataclass(slots=True)
class _SlotState:
    write: int | None = None
    value: str | None = None
    reads: list[int] | None = None


def _races(program: StreamProgram, order: Interleaving, ran: Sequence[int]) -> list[Diagnostic]:
    """Every read finds its value written before it; every write follows the reads and
    the write before it (module docstring). `ran` is the ops in the order they ran."""
    problems: list[Diagnostic] = []
    state: dict[tuple[int, str], _SlotState] = {}
    writers: dict[tuple[int, str, str], list[int]] = {}
    for i, op in enumerate(program.ops):
        for a in op.writes:
            writers.setdefault((op.rank, a.slot, a.value), []).append(i)
    done: set[int] = set()
    hb = order.happens_before
    ops = program.ops
    for i in ran:
        op = ops[i]
        done.add(i)
        reads = [(a.slot, a.value) for a in op.reads] + [(g, None) for g in op.updates]
        for slot, value in reads:
            s = state.setdefault((op.rank, slot), _SlotState(reads=[]))
            assert s.reads is not None
            s.reads.append(i)
            if value is None and (s.write is None or s.write == i or hb(s.write, i)):
                continue
            if value is not None and s.value == value and s.write is not None and hb(s.write, i):
                continue
            if value is None or s.value == value:
                problems.append(_race(program, i, slot, value, s.write, "read-after-write"))
                continue
            candidates = writers.get((op.rank, slot, value), [])
            if not candidates:
                problems.append(_race(program, i, slot, value, None, "nothing writes it"))
                continue
            pending = [w for w in candidates if w not in done]
            racing = pending[0] if pending else candidates[-1]
            problems.append(_race(program, i, slot, value, racing, "read-after-write"))
        writes = [a.slot for a in op.writes] + list(op.updates)
        values = [a.value for a in op.writes] + [None] * len(op.updates)
        for slot, value in zip(writes, values, strict=True):
            s = state.setdefault((op.rank, slot), _SlotState(reads=[]))
            assert s.reads is not None
            for r in s.reads:
                if r != i and not hb(r, i):
                    problems.append(_race(program, r, slot, None, i, "write-after-read"))
            if not s.reads and s.write is not None and not hb(s.write, i):
                problems.append(_race(program, i, slot, None, s.write, "write-after-write"))
            s.write, s.value, s.reads = i, value, []
    return _first_per_op(problems)


def _race(
    program: StreamProgram, at: int, slot: str, value: str | None, other: int | None, kind: str
) -> Diagnostic:
    op = program.ops[at]
    if kind == "read-after-write":
        message = (
            f"`{op.what}` on {op.stream_name} reads slot {slot} ({value}), but its write "
            "is not ordered before the read: no record/wait chain joins them"
        )
        label = "the write it races with"
    elif kind == "write-after-read":
        message = (
            f"`{op.what}` on {op.stream_name} reads slot {slot}, which is written again "
            "before the read is ordered to finish: no record/wait chain joins them"
        )
        label = "the write it races with"
    elif kind == "write-after-write":
        message = f"two writes of slot {slot} on rank {op.rank} are not ordered"
        label = "the other write"
    else:
        message = f"`{op.what}` on {op.stream_name} reads slot {slot} ({value}), "
        message += "but no op writes it there"
        label = ""
    labels: tuple[Label, ...] = ()
    if other is not None:
        them = program.ops[other]
        labels = (Label(program.span_of(other), f"{label}: `{them.what}` on {them.stream_name}"),)
    return Diagnostic(
        "E0502",
        f"race on slot {slot} of rank {op.rank}: {message}",
        program.span_of(at),
        labels,
        help="add `record` after the first op on its stream and `wait` before the second",
    )


def _first_per_op(problems: list[Diagnostic]) -> list[Diagnostic]:
    """One diagnostic per op line: a missing wait makes one race, reported once."""
    seen: set[tuple[object, str]] = set()
    kept = []
    for d in problems:
        key = (d.span, d.message.split(":")[0])
        if key not in seen:
            seen.add(key)
            kept.append(d)
    return kept


def run(c: Compilation) -> Compilation:
    """The pass: the stream program proven free of races and deadlocks, or E05xx."""
    if c.streams is None:
        raise InternalError("check-streams before streams")
    check_streams(c.streams)
    return c
