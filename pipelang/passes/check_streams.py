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
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipelang.diagnostics import Diagnostic, InternalError, Label, PipelangError
from pipelang.ir import Kind
from pipelang.streams import RECORD, WAIT, StreamProgram

if TYPE_CHECKING:
    from pipelang.compiler import Compilation

Step = tuple[int, ...]
"""Ops that run together: one op, a send with its receive, or an allreduce's members."""


class Interleaving:
    """The ops of a stream program, run in a legal order; see the module docstring.

    `choose` picks which runnable step goes next (by default the first, in stream
    order); `clocks` keeps every op's vector clock for `happens_before`.
    """

    def __init__(self, program: StreamProgram, clocks: bool = True) -> None:
        self.program = program
        self.names = program.streams()
        self.index = {name: i for i, name in enumerate(self.names)}
        self.queues: list[list[int]] = [[] for _ in self.names]
        self.stream_of: list[int] = []
        self.seq_of: list[int] = []
        for i, op in enumerate(program.ops):
            s = self.index[(op.rank, op.stream)]
            self.stream_of.append(s)
            self.seq_of.append(len(self.queues[s]))
            self.queues[s].append(i)
        self.members: dict[str, list[int]] = {}
        for s, (_, stream) in enumerate(self.names):
            if stream.startswith("reduce"):
                self.members.setdefault(stream, []).append(s)
        self.clocks: list[tuple[int, ...]] | None = [()] * len(program.ops) if clocks else None

    def happens_before(self, a: int, b: int) -> bool:
        """Whether op `a` is ordered before op `b` in every execution."""
        assert self.clocks is not None
        return a != b and self.clocks[b][self.stream_of[a]] > self.seq_of[a]

    def run(self, choose: Callable[[list[Step]], int] | None = None) -> Iterator[Step]:
        """Yield steps in a legal order; raise PipelangError (E0503, E0504) when stuck."""
        head = [0] * len(self.names)
        recorded: dict[tuple[int, int], tuple[int, ...]] = {}
        width = len(self.names)
        vc = [[0] * width for _ in self.names]
        left = len(self.program.ops)
        while left:
            steps = self._runnable(head, recorded)
            if not steps:
                raise PipelangError([self._deadlock(head)])
            step = steps[0] if choose is None else steps[choose(steps)]
            self._meet(step)
            streams = [self.stream_of[i] for i in step]
            if self.clocks is not None:
                clock = [max(c) for c in zip(*(vc[s] for s in streams), strict=True)]
                for i in step:
                    op = self.program.ops[i]
                    if op.what == WAIT:
                        seen = recorded[(op.rank, op.event)]  # type: ignore[index]
                        clock = [max(x, y) for x, y in zip(clock, seen, strict=True)]
                for s in streams:
                    clock[s] += 1
                for s in streams:
                    vc[s] = list(clock)
                for i in step:
                    self.clocks[i] = tuple(clock)
            for i, s in zip(step, streams, strict=True):
                op = self.program.ops[i]
                if op.what == RECORD:
                    recorded[(op.rank, op.event)] = tuple(vc[s]) if self.clocks else ()  # type: ignore[index]
                head[s] += 1
            left -= len(step)
            yield step

    def _head(self, s: int, head: list[int]) -> int | None:
        queue = self.queues[s]
        return queue[head[s]] if head[s] < len(queue) else None

    def _runnable(
        self, head: list[int], recorded: dict[tuple[int, int], tuple[int, ...]]
    ) -> list[Step]:
        steps: list[Step] = []
        for s, (rank, stream) in enumerate(self.names):
            i = self._head(s, head)
            if i is None:
                continue
            op = self.program.ops[i]
            if op.what == WAIT:
                if (rank, op.event) in recorded:
                    steps.append((i,))
            elif op.what == RECORD:
                steps.append((i,))
            elif stream.startswith("send"):
                partner = self.index.get((int(stream[4:]), f"recv{rank}"))
                j = None if partner is None else self._head(partner, head)
                if j is not None and not self.program.ops[j].is_event:
                    steps.append((i, j))
            elif stream.startswith("reduce"):
                group = self.members[stream]
                if s == group[0]:
                    heads = [self._head(m, head) for m in group]
                    if all(h is not None and not self.program.ops[h].is_event for h in heads):
                        steps.append(tuple(h for h in heads if h is not None))
            elif not stream.startswith("recv"):
                steps.append((i,))
        return steps

    def _meet(self, step: Step) -> None:
        """A send and the receive it meets must move the same message (E0504)."""
        ops = [self.program.ops[i] for i in step]
        if len(ops) != 2 or not ops[0].stream.startswith("send"):
            return
        send, recv = ops
        a, b = send.action(), recv.action()
        same = a.op() == b.op() and (a.kind is Kind.SEND) == (b.kind is Kind.RECV)
        sending = a.kind in (Kind.SEND, Kind.SIGNAL) and b.kind in (Kind.RECV, Kind.WAIT)
        if not (same and sending) or a.peer != recv.rank or b.peer != send.rank:
            raise PipelangError([self._mismatch(step, "the same message")])

    def _mismatch(self, step: Step, wanted: str) -> Diagnostic:
        first, *others = step
        ops = self.program.ops
        return Diagnostic(
            "E0504",
            f"`{ops[first].what}` on {ops[first].stream_name} meets "
            + ", ".join(f"`{ops[j].what}` on {ops[j].stream_name}" for j in others)
            + f", which is not {wanted}: a channel delivers in order, so the k-th send "
            "must meet the k-th receive of the same message",
            self.program.span_of(first),
            tuple(Label(self.program.span_of(j), "met here") for j in others),
        )

    def _deadlock(self, head: list[int]) -> Diagnostic:
        stuck = [i for s in range(len(self.names)) if (i := self._head(s, head)) is not None]
        ops = self.program.ops

        def why(i: int) -> str:
            op = ops[i]
            if op.what == WAIT:
                return f"waits for e{op.event}, not recorded yet"
            if op.stream.startswith("reduce"):
                return "waits for the other members of its allreduce"
            return "waits for the other end of its channel"

        first, *others = stuck
        return Diagnostic(
            "E0503",
            f"the stream program deadlocks: {len(stuck)} streams wait and none can move",
            self.program.span_of(first),
            tuple(Label(self.program.span_of(i), f"{ops[i].stream_name} {why(i)}") for i in others),
            notes=(f"{ops[first].stream_name} {why(first)}",),
        )


def random_choice(seed: int, order: Interleaving) -> Callable[[list[Step]], int]:
    """A `choose` for `order.run` that is adversarial and reproducible by `seed`: every
    stream gets a random priority, and the step of the highest-priority stream that can
    move runs, except one time in four, a uniformly random step. Starving some streams
    while others race ahead is what exposes a missing wait; uniform choice rarely does."""
    rng = random.Random(seed)
    priority = [rng.random() for _ in order.names]

    def choose(steps: list[Step]) -> int:
        if rng.random() < 0.25:
            return rng.randrange(len(steps))
        return max(range(len(steps)), key=lambda k: priority[order.stream_of[steps[k][0]]])

    return choose


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
