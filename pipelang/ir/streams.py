"""The stream program: what every rank issues, on which stream, into which buffer slot.

A `StreamProgram` lowers a Program (comms and sync inserted) one level further, to what
a GPU runs (docs/runtime.md, "Stream programs"). Each process has

- one compute stream, `r0.compute`, for F, B, W, R, U and `step`;
- one stream per directed channel end: `r0.send1` issues rank 0's sends to rank 1 and
  `r1.recv0` rank 1's receives from rank 0 (`signal`/`wait` of `after` edges included);
- one stream per reduce group, `r0.reduce3` for stage 3's gradient allreduce;

and every value an op reads or writes lives in a static slot of its process:
`d3` holds activations and gradients that cross a stage boundary (data), `s1` what a
forward saves for its backward, `g2/down` the gradient accumulator of stage 2 of `down`.
Slots are reused by liveness, so a rank needs as many as it holds values at once.

One line per op, in the order its process issues them; streams order only their own ops,
and `record eN` / `wait eN` order ops across the streams of one process:

    r1.recv0     recv:F0@0/main<0   writes d0=F0@0/main
    r1.recv0     record e2
    r1.compute   wait e2
    r1.compute   F0@1/main          reads d0=F0@0/main  writes s0=F0@1/main d1=F0@1/main

`slot=value` names the value a read expects or a write leaves: for data, the compute op
that made it (`F0@0/main` is its output, `B0@2/main` its input gradient); for saved
slots, the forward (or recompute) whose activations they are. An accumulator is
`updates g0/main` (read, add, write back). The k-th send on a channel meets the k-th
receive of the other end; the n-th `allreduce` on `reduce{s}` meets every other member's
n-th. `StreamProgram.parse(program.dump())` gives the program back.

`Interleaving` runs a stream program's ops in one legal order (a send with its receive,
an allreduce with its members'), first-ready or adversarial by seed (`random_choice`):
`check-streams` proves races and hangs absent with it, and the CPU executor
(backends/stream_executor.py) runs programs in its order.
"""

from __future__ import annotations

import functools
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

from pipelang.diagnostics import Diagnostic, Label, PipelangError
from pipelang.ir import Action, Kind, deps
from pipelang.source import SourceFile, Span

RECORD, WAIT = "record", "wait"
"""The two event ops: `record eN` marks a point of its stream; `wait eN` holds its stream
until that point is reached."""


class Access(NamedTuple):
    """A slot an op reads or writes, with the value it expects there (or leaves)."""

    slot: str
    value: str

    def text(self) -> str:
        return f"{self.slot}={self.value}"


@dataclass(frozen=True, slots=True)
class StreamOp:
    """One line of a stream program: an op issued on one stream of one process."""

    rank: int
    stream: str
    """`compute`, `send{peer}`, `recv{peer}` or `reduce{stage}`."""
    what: str
    """`record`, `wait`, or the token of the IR action it performs (`F0@1/main`,
    `send:F0@1/main>2`, `allreduce@1/main`, `step`, ...)."""
    event: int | None = None
    reads: tuple[Access, ...] = ()
    writes: tuple[Access, ...] = ()
    updates: tuple[str, ...] = ()
    """Accumulator slots the op reads, adds to and writes back."""

    @property
    def stream_name(self) -> str:
        return f"r{self.rank}.{self.stream}"

    @property
    def is_event(self) -> bool:
        return self.what in (RECORD, WAIT)

    def action(self) -> Action:
        """The IR action this op performs; not for `record`/`wait`."""
        return Action.parse(self.what)

    def text(self, width: int = 0, what_width: int = 0) -> str:
        """The op's line of the dump (`width`, `what_width`: column widths)."""
        what = self.what if self.event is None else f"{self.what} e{self.event}"
        parts = [f"{self.stream_name:<{width}}", f"{what:<{what_width}}"]
        if self.reads:
            parts.append("reads " + " ".join(a.text() for a in self.reads))
        if self.writes:
            parts.append("writes " + " ".join(a.text() for a in self.writes))
        if self.updates:
            parts.append("updates " + " ".join(self.updates))
        return "  ".join(parts).rstrip()


@dataclass(frozen=True, slots=True)
class StreamProgram:
    """Every process's ops in issue order (processes `0..ranks-1`, replica-major with
    `--dp`: the process of program rank r in copy k is `k * R + r`)."""

    name: str
    ranks: int
    ops: tuple[StreamOp, ...]
    """Rank-major; within a rank, in issue order."""
    spans: tuple[Span, ...] | None = field(default=None, compare=False, repr=False)
    """Where each op's line is in the text it was read from (`parse`), else None."""

    def by_rank(self, rank: int) -> Iterator[tuple[int, StreamOp]]:
        """(index, op) of every op of `rank`, in issue order."""
        for i, op in enumerate(self.ops):
            if op.rank == rank:
                yield i, op

    def host_ops(self, rank: int) -> Iterator[tuple[int, StreamOp]]:
        """`by_rank` less what is a no-op where the host itself is the compute stream (a
        CPU process): a `record` on compute, and a `wait` on any other stream."""
        for i, op in self.by_rank(rank):
            if op.what == RECORD and op.stream == "compute":
                continue
            if op.what == WAIT and op.stream != "compute":
                continue
            yield i, op

    def streams(self) -> list[tuple[int, str]]:
        """Every (rank, stream) with an op, in order of first use."""
        return list(dict.fromkeys((op.rank, op.stream) for op in self.ops))

    def slots(self, rank: int) -> dict[str, list[str]]:
        """Slots of `rank` by class (`data`, `saved`, `grads`), each sorted by number."""
        names: dict[str, set[str]] = {"data": set(), "saved": set(), "grads": set()}
        for _, op in self.by_rank(rank):
            for access in (*op.reads, *op.writes):
                names[slot_class(access.slot)].add(access.slot)
            names["grads"].update(op.updates)
        return {k: sorted(v, key=_slot_order) for k, v in names.items()}

    def dump(self) -> str:
        """The text form; `StreamProgram.parse` reads it back."""
        lines = [f"# stream program of {self.name}: {self.ranks} processes"]
        width = max((len(op.stream_name) for op in self.ops), default=0)
        what_width = max((len(op.what) for op in self.ops if not op.is_event), default=0)
        for rank in range(self.ranks):
            counts = ", ".join(f"{k} {len(v)}" for k, v in self.slots(rank).items())
            lines.append(f"# rank {rank}: slots {counts}")
            lines.extend(op.text(width, what_width) for _, op in self.by_rank(rank))
        return "\n".join(lines) + "\n"

    def span_of(self, index: int) -> Span:
        """The line of op `index`: where it was read from, or where `dump` puts it."""
        if self.spans is not None:
            return self.spans[index]
        spans = _spans_of(SourceFile.of("<stream program>", self.dump()))
        object.__setattr__(self, "spans", tuple(spans))
        return spans[index]

    @staticmethod
    def parse(text: str, path: str = "<stream program>") -> StreamProgram:
        """Read `dump()` back. Raises StreamSyntaxError at the first line it cannot read."""
        source = SourceFile.of(path, text)
        name, ranks = _header(text)
        ops = []
        for number, line in enumerate(text.split("\n"), 1):
            if line.strip() and not line.lstrip().startswith("#"):
                ops.append(_parse_line(line, source, number))
        if not ops:
            raise StreamSyntaxError("no ops: not a stream program", _line_span(source, 1))
        ranks = max(ranks, 1 + max(op.rank for op in ops))
        return StreamProgram(name, ranks, tuple(ops), tuple(_spans_of(source)))


class StreamSyntaxError(Exception):
    """A line of a stream program dump that does not read; carries its span."""

    def __init__(self, message: str, span: Span) -> None:
        super().__init__(message)
        self.span = span


def slot_class(slot: str) -> str:
    """`data` (d3), `saved` (s1) or `grads` (g2/down)."""
    return {"d": "data", "s": "saved", "g": "grads"}[slot[0]]


def _slot_order(slot: str) -> tuple[int, str]:
    digits = re.match(r"[dsg](\d+)", slot)
    return (int(digits.group(1)) if digits else 0, slot)


_LINE = re.compile(
    r"\s*r(?P<rank>\d+)\.(?P<stream>compute|send\d+|recv\d+|reduce\d+)\s+(?P<what>\S+)"
    r"(?:\s+e(?P<event>\d+))?(?P<rest>.*)"
)
_ACCESS = re.compile(r"[ds]\d+=\S+")
_ACCUMULATOR = re.compile(r"g\d+/[A-Za-z_][A-Za-z0-9_]*")


def _header(text: str) -> tuple[str, int]:
    match = re.match(r"# stream program of (.+): (\d+) processes", text)
    return (match.group(1), int(match.group(2))) if match else ("<stream program>", 0)


def _line_span(source: SourceFile, number: int) -> Span:
    start = source._line_starts[number - 1]
    text = source.line_text(number)
    indent = len(text) - len(text.lstrip())
    return Span(source, start + indent, start + len(text.rstrip()))


def _spans_of(source: SourceFile) -> list[Span]:
    """The span of every op line of `source`, in order."""
    return [
        _line_span(source, n)
        for n, line in enumerate(source.text.split("\n"), 1)
        if line.strip() and not line.lstrip().startswith("#")
    ]


def _parse_line(line: str, source: SourceFile, number: int) -> StreamOp:
    span = _line_span(source, number)
    match = _LINE.fullmatch(line.rstrip())
    if match is None:
        raise StreamSyntaxError(
            "expected `rR.STREAM OP [reads ...] [writes ...] [updates ...]`", span
        )
    what, event = match["what"], match["event"]
    if (what in (RECORD, WAIT)) != (event is not None):
        raise StreamSyntaxError("`record` and `wait` (and only they) take an event `eN`", span)
    if what not in (RECORD, WAIT):
        try:
            Action.parse(what)
        except ValueError as err:
            raise StreamSyntaxError(str(err), span) from None
    groups: dict[str, list[str]] = {"reads": [], "writes": [], "updates": []}
    current: list[str] | None = None
    for word in match["rest"].split():
        if word in groups:
            current = groups[word]
            continue
        pattern = _ACCUMULATOR if current is groups["updates"] else _ACCESS
        if current is None or not pattern.fullmatch(word):
            raise StreamSyntaxError(f"cannot read `{word}`", span)
        current.append(word)
    return StreamOp(
        int(match["rank"]),
        match["stream"],
        what,
        None if event is None else int(event),
        tuple(Access(*w.split("=", 1)) for w in groups["reads"]),
        tuple(Access(*w.split("=", 1)) for w in groups["writes"]),
        tuple(groups["updates"]),
    )


@functools.cache
def value_boundary(value: str) -> int:
    """The stage boundary whose tensor a data value is (its shape is the runtime's
    `shapes[boundary]`): `F3@1/p` is stage 1's output (1), `B3@1/p` the gradient of stage
    1's input (0), `P3@0/p` the frozen part's output, stage 0's input (-1)."""
    action = Action.parse(value)
    return deps.boundary(action.kind, action.stage or 0)


def value_key(value: str) -> tuple[str, int, int, str, int | None]:
    """The runtime's key of a data value: `F0@1/main` -> ("F", 0, 1, "main", None), and
    `F0.2@1/main` (chunk 2) -> ("F", 0, 1, "main", 2)."""
    action = Action.parse(value)
    assert action.mb is not None and action.stage is not None and action.pipeline is not None
    return (action.kind.value, action.mb, action.stage, action.pipeline, action.chunk)


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
