"""streams: lower each rank's actions to a stream program with static buffer slots.

Needs: a Program after `insert-sync` (sends, receives, allreduces and `step` placed), and
the number of data-parallel copies `dp`. Guarantees: a `StreamProgram`
(pipelang/ir/streams.py) over `dp x R` processes in which

- compute ops run on `compute`, in the rank's order; each transfer runs on the stream of
  its channel end (`send{peer}`, `recv{peer}`), each allreduce on `reduce{stage}`;
- every op that needs a value made on another stream waits for it: a `record` right
  after the producer, a `wait` right before the consumer (read-after-write);
- every value lives in a slot, and a slot is reused once its value is dead; a receive
  that reuses a slot waits until the compute stream has read the slot's previous value
  (write-after-read); other slots are reused only where that order already holds;
- every stream starts by waiting for the compute stream (its first op is a wait; the
  start event `e0` where it would not otherwise be), and at the end the compute stream
  waits for every stream, so iterations never overlap and a CUDA capture forks from and
  joins its capture stream.

It is built in three steps: lower with one slot per value; compute the happens-before
order of that program (`check_streams.Interleaving`); then allocate slots per rank by
liveness, in issue order, like a linear-scan register allocator. The result passes
`check_streams`, which the compiler runs right after.

Before (rank 1 of 1F1B, D=2, N=2, after insert-sync):

    recv:F0@0/main<0 F0@1/main B0@1/main send:B0@1/main>0 recv:F1@0/main<0 ... step

After (the first ops of rank 1; `pipelang compile 1f1b -p D=2 -p N=2 --dump-after streams`):

    r1.compute  record e0
    r1.recv0    wait e0
    r1.recv0    recv:F0@0/main<0  writes d0=F0@0/main
    r1.recv0    record e1
    r1.compute  wait e1
    r1.compute  F0@1/main         reads d0=F0@0/main  writes s0=F0@1/main
    r1.compute  B0@1/main         reads s0=F0@1/main  writes d0=B0@1/main  updates g1/main
    r1.compute  record e2
    r1.send0    wait e2
    r1.send0    send:B0@1/main>0  reads d0=B0@1/main
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pipelang.diagnostics import fail
from pipelang.features import refuse
from pipelang.ir import Action, Kind, Program, deps, placement
from pipelang.ir.streams import RECORD, WAIT, Access, Interleaving, StreamOp, StreamProgram

if TYPE_CHECKING:
    from pipelang.compiler import Compilation


def streams(program: Program, dp: int = 1) -> StreamProgram:
    """The stream program of `program` run as `dp` data-parallel copies; what stream
    programs cannot run (`features.REFUSED`) is E0506."""
    refuse(program, "stream programs", "E0506")
    first = [_Lowering(program, process, dp).lower() for process in range(program.num_ranks * dp)]
    virtual = StreamProgram(program.name, program.num_ranks * dp, tuple(itertools.chain(*first)))
    order = Interleaving(virtual)
    for _ in order.run():
        pass
    ops: list[StreamOp] = []
    start = 0
    for process_ops in first:
        ops.extend(_post_early(_allocate(virtual, order, start, len(process_ops))))
        start += len(process_ops)
    return StreamProgram(_title(program, dp), program.num_ranks * dp, tuple(ops))


def _title(program: Program, dp: int) -> str:
    params = ", ".join(f"{k}={v}" for k, v in program.params)
    copies = f", --dp {dp}" if dp > 1 else ""
    return f"{program.name}({params}){copies}"


@dataclass
class _Lowering:
    """The first step for one process: its ops in issue order, one slot per value."""

    program: Program
    process: int
    dp: int
    ops: list[StreamOp] = field(default_factory=list)
    length: Counter[str] = field(default_factory=Counter)
    records: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    """Per stream: (its op count at the record, event) of every record so far."""
    waited: dict[tuple[str, str], int] = field(default_factory=dict)
    where: dict[str, tuple[str, str, int]] = field(default_factory=dict)
    """Data and saved values: (slot, stream that wrote it, its op count after the write)."""
    events: itertools.count[int] = field(default_factory=itertools.count)
    slots: itertools.count[int] = field(default_factory=itertools.count)
    base: int = 0
    """The process of program rank 0 in this process's data-parallel copy."""
    fork: int = 0
    """The event at the start of the compute stream that every other stream waits for."""
    sync_grads: bool = True
    """Whether B/W accumulate into gradient slots (not in asynchronous schedules)."""

    def lower(self) -> list[StreamOp]:
        program = self.program
        world = program.num_ranks
        rank = self.process % world
        self.base = self.process - rank
        self.sync_grads = program.weights is None  # asynchronous: U applies, no `step`
        at_step = placement.reduced_at_step(program, rank, self.dp)
        self.fork = self._record("compute")
        for action in program.ranks[rank]:
            if action.kind is Kind.STEP:
                for stage, pipe in at_step:
                    self._allreduce(Action(Kind.ALLREDUCE, None, stage, pipe))
            self._lower(action)
        for stream in [s for s in self.length if s != "compute"]:
            self._sync("compute", stream, self.length[stream])  # join
        return self.ops

    # ---- one action -----------------------------------------------------------------------

    def _lower(self, action: Action) -> None:
        kind = action.kind
        if kind.is_compute:
            self._compute(action)
        elif kind in (Kind.SEND, Kind.SIGNAL):
            self._send(action)
        elif kind in (Kind.RECV, Kind.WAIT):
            self._recv(action)
        elif kind is Kind.ALLREDUCE:
            self._allreduce(action)
        elif kind is Kind.STEP:
            for stream in [s for s in self.length if s.startswith("reduce")]:
                self._sync("compute", stream, self.length[stream])
            copies = self.program.stage_copies(self.process % self.program.num_ranks)
            self._emit("compute", "step", updates=tuple(f"g{s}/{p}" for s, p in copies))
        else:  # U: an asynchronous schedule's update, all on the compute stream
            self._emit("compute", action.text())

    def _compute(self, action: Action) -> None:
        program, kind = self.program, action.kind
        mb, stage, pipe, chunk = action.mb, action.stage, action.pipeline, action.chunk
        assert stage is not None
        last = stage == program.num_stages - 1
        saved_by = Kind.R if Kind.R in program.kinds and kind is not Kind.R else Kind.F
        reads: list[tuple[str, str]] = []
        writes: list[tuple[str, str]] = []
        # A chunk's forward reads the keys and values the chunks before it saved, and
        # its backward leaves their gradients there (on the compute stream, in order).
        earlier = [("s", _token(saved_by, mb, stage, pipe, c)) for c in range(chunk or 0)]
        if kind is Kind.P:  # the frozen part's output: stage 0's input, saved by its F
            writes.append(("d", _token(Kind.P, mb, stage, pipe)))
        elif kind is Kind.F:
            if stage > 0 or program.frozen is not None:
                reads.append(("d", _token(*deps.forward_input(mb, stage, pipe, chunk))))
            reads.extend(earlier)
            writes.append(("s", _token(Kind.F, mb, stage, pipe, chunk)))
            if not last:
                writes.append(("d", _token(Kind.F, mb, stage, pipe, chunk)))
        elif kind is Kind.R:
            reads.append(("s", _token(Kind.F, mb, stage, pipe, chunk)))
            writes.append(("s", _token(Kind.R, mb, stage, pipe, chunk)))
        else:  # B, W
            if kind is Kind.B and not last:
                reads.append(("d", _token(*deps.gradient_input(mb, stage, pipe, chunk))))
            reads.append(("s", _token(saved_by, mb, stage, pipe, chunk)))
            if kind is Kind.B:
                reads.extend(earlier)
            if kind is Kind.B and stage > 0:
                writes.append(("d", _token(Kind.B, mb, stage, pipe, chunk)))
        accumulates = kind is Kind.W or (kind is Kind.B and Kind.W not in program.kinds)
        updates = (f"g{stage}/{pipe}",) if accumulates and self.sync_grads else ()
        for cls, value in reads:
            self._need("compute", cls, value)
        self._emit(
            "compute",
            action.unfused().text(),
            reads=tuple(self._read(cls, v) for cls, v in reads),
            writes=tuple(self._write("compute", cls, v) for cls, v in writes),
            updates=updates,
        )

    def _send(self, action: Action) -> None:
        stream = self._stream_of(action)
        if action.kind is Kind.SIGNAL:
            self._sync(stream, "compute", self.length["compute"])
            self._emit(stream, self._peered(action))
            return
        value = action.op().text()
        self._need(stream, "d", value)
        self._emit(stream, self._peered(action), reads=(self._read("d", value),))

    def _recv(self, action: Action) -> None:
        stream = self._stream_of(action)
        if action.kind is Kind.WAIT:  # an `after` edge: the op right after depends on it
            self._emit(stream, self._peered(action))
            self._sync("compute", stream, self.length[stream])
            return
        value = action.op().text()
        self._emit(stream, self._peered(action), writes=(self._write(stream, "d", value),))
        self._record(stream)  # the consumer waits for exactly this receive

    def _allreduce(self, action: Action) -> None:
        stream = f"reduce{action.stage}"
        self._sync(stream, "compute", self.length["compute"])
        self._emit(stream, action.text(), updates=(f"g{action.stage}/{action.pipeline}",))

    # ---- streams, events, values ----------------------------------------------------------

    def _stream_of(self, action: Action) -> str:
        if action.kind in (Kind.SEND, Kind.SIGNAL):
            return f"send{self.base + action.peer}"  # type: ignore[operator]
        if action.kind in (Kind.RECV, Kind.WAIT):
            return f"recv{self.base + action.peer}"  # type: ignore[operator]
        if action.kind is Kind.ALLREDUCE:
            return f"reduce{action.stage}"
        return "compute"

    def _peered(self, action: Action) -> str:
        """The action's token with its peer as a process (copy k's rank r is k*R + r)."""
        assert action.peer is not None
        return action._replace(peer=self.base + action.peer).text()

    def _emit(
        self,
        stream: str,
        what: str,
        reads: tuple[Access, ...] = (),
        writes: tuple[Access, ...] = (),
        updates: tuple[str, ...] = (),
        event: int | None = None,
    ) -> None:
        if stream != "compute" and not self.length[stream] and what != WAIT:
            self._emit(stream, WAIT, event=self.fork)  # fork from the compute stream
            self.waited[(stream, "compute")] = 1
        self.ops.append(StreamOp(self.process, stream, what, event, reads, writes, updates))
        self.length[stream] += 1

    def _record(self, stream: str) -> int:
        """An event recorded after every op issued on `stream` so far."""
        marks = self.records.setdefault(stream, [])
        if marks and marks[-1][0] == self.length[stream]:
            return marks[-1][1]
        event = next(self.events)
        self._emit(stream, RECORD, event=event)
        marks.append((self.length[stream], event))
        return event

    def _sync(self, waiter: str, source: str, upto: int) -> None:
        """Make `waiter` wait until `source` has run its first `upto` ops."""
        if waiter == source or upto == 0 or self.waited.get((waiter, source), 0) >= upto:
            return
        marks = self.records.get(source, [])
        found = next(((n, e) for n, e in marks if n >= upto), None)
        if found is None:
            found = (self.length[source] + 1, self._record(source))
        self._emit(waiter, WAIT, event=found[1])
        self.waited[(waiter, source)] = found[0]

    def _need(self, stream: str, cls: str, value: str) -> None:
        """Wait for the write of `value` if it happened on another stream."""
        _, writer, upto = self._located(cls, value)
        self._sync(stream, writer, upto)

    def _located(self, cls: str, value: str) -> tuple[str, str, int]:
        found = self.where.get(f"{cls}:{value}")
        if found is None:
            raise fail(
                "E0506",
                f"rank {self.process} reads `{value}` but never receives or computes it; "
                "the program cannot be lowered to streams",
            )
        return found

    def _read(self, cls: str, value: str) -> Access:
        return Access(self._located(cls, value)[0], value)

    def _write(self, stream: str, cls: str, value: str) -> Access:
        slot = f"{cls}{next(self.slots)}"
        # the record right after a data write lets its reader on another stream wait for
        # exactly this op (waiting later could wait for a message not yet sendable)
        self.where[f"{cls}:{value}"] = (slot, stream, self.length[stream] + 1)
        return Access(slot, value)


def _token(
    kind: Kind, mb: int | None, stage: int | None, pipe: str | None, chunk: int | None = None
) -> str:
    return Action(kind, mb, stage, pipe, chunk=chunk).text()


# ---- slot allocation ------------------------------------------------------------------------


@dataclass
class _Free:
    slot: str
    reader: int
    """The op (index in the virtual program) that read the slot's value last."""


def _allocate(
    virtual: StreamProgram, order: Interleaving, start: int, count: int
) -> list[StreamOp]:
    """Rename one process's one-slot-per-value ops to reused slots, adding the waits a
    reused slot needs (module docstring); events renumbered in issue order."""
    ops = virtual.ops
    reads_left = Counter((a.slot) for op in ops[start : start + count] for a in op.reads)
    rename: dict[str, str] = {}
    free: dict[str, list[_Free]] = {"d": [], "s": []}
    numbers = {"d": itertools.count(), "s": itertools.count()}
    war: dict[int, int] = {}
    """Op index -> the read it must wait for before it writes (a reused slot)."""
    for i in range(start, start + count):
        op = ops[i]
        for access in op.reads:
            reads_left[access.slot] -= 1
            if reads_left[access.slot] == 0:
                free[access.slot[0]].append(_Free(rename[access.slot], i))
        for access in op.writes:
            cls = access.slot[0]
            chosen = _choose(free[cls], i, op, ops, order.happens_before)
            if chosen is None:
                rename[access.slot] = f"{cls}{next(numbers[cls])}"
            else:
                free[cls].remove(chosen)
                rename[access.slot] = chosen.slot
                if ops[chosen.reader].stream != op.stream and not order.happens_before(
                    chosen.reader, i
                ):
                    war[i] = chosen.reader
            if reads_left[access.slot] == 0:  # written, never read here
                free[cls].append(_Free(rename[access.slot], i))
    return _rewrite(ops[start : start + count], start, rename, war)


def _choose(
    free: list[_Free],
    i: int,
    op: StreamOp,
    ops: tuple[StreamOp, ...],
    hb: Callable[[int, int], bool],
) -> _Free | None:
    """A free slot for op `i`'s write: one whose last read is already ordered before it,
    else (for a receive) one the compute stream read, the earliest freed; else None."""
    for candidate in free:
        reader = ops[candidate.reader]
        if candidate.reader == i or reader.stream == op.stream or hb(candidate.reader, i):
            return candidate
    if op.stream.startswith("recv"):
        for candidate in free:
            if ops[candidate.reader].stream == "compute":
                return candidate
    return None


def _post_early(ops: list[StreamOp]) -> list[StreamOp]:
    """Issue every op of a receive stream as early as its process can: right after the
    op before it on its stream, or after the `record` its `wait` needs, whichever comes
    later. Receives are then posted as soon as their slot is free, not just before their
    consumer; nothing else moves, and no happens-before edge changes."""
    keys: list[tuple[int, int, int]] = []
    last: dict[str, tuple[int, int, int]] = {}
    recorded: dict[int | None, tuple[int, int, int]] = {}
    counter = itertools.count()
    for i, op in enumerate(ops):
        key = (i, 0, 0)
        if op.stream.startswith("recv"):
            anchor = max(last.get(op.stream, (-1, 0, 0)), recorded.get(op.event, (-1, 0, 0)))
            key = (anchor[0], 1, next(counter)) if op.what == WAIT or op.stream in last else key
        if op.what == RECORD:
            recorded[op.event] = key
        last[op.stream] = key
        keys.append(key)
    order = sorted(range(len(ops)), key=keys.__getitem__)
    return [ops[i] for i in order]


def _rewrite(
    ops: tuple[StreamOp, ...], start: int, rename: dict[str, str], war: dict[int, int]
) -> list[StreamOp]:
    """The ops with slots renamed, a record after each read a later write waits for and
    that wait before the write; events numbered anew in order of their records."""
    marks: dict[int, str] = {}  # read -> "new:N" or "old:N", the record right after it
    for reader in set(war.values()):
        nxt = next(
            (
                j
                for j in range(reader + 1 - start, len(ops))
                if ops[j].stream == ops[reader - start].stream
            ),
            None,
        )
        if nxt is not None and ops[nxt].what == RECORD:
            marks[reader] = f"old:{ops[nxt].event}"
        else:
            marks[reader] = f"new:{reader}"
    number: dict[str, int] = {}
    counter = itertools.count()

    def event(key: str) -> int:
        if key not in number:
            number[key] = next(counter)
        return number[key]

    out: list[StreamOp] = []
    waited: set[tuple[str, str]] = set()
    for offset, op in enumerate(ops):
        i = start + offset
        if i in war and (op.stream, marks[war[i]]) not in waited:
            waited.add((op.stream, marks[war[i]]))
            out.append(StreamOp(op.rank, op.stream, WAIT, event(marks[war[i]])))
        if op.is_event:
            out.append(StreamOp(op.rank, op.stream, op.what, event(f"old:{op.event}")))
        else:
            out.append(
                StreamOp(
                    op.rank,
                    op.stream,
                    op.what,
                    None,
                    tuple(Access(rename[a.slot], a.value) for a in op.reads),
                    tuple(Access(rename[a.slot], a.value) for a in op.writes),
                    op.updates,
                )
            )
        if marks.get(i, "").startswith("new:"):
            out.append(StreamOp(op.rank, op.stream, RECORD, event(marks[i])))
    return out


def run(c: Compilation) -> Compilation:
    """The pass: the stream program (`--dp` copies of it in the world)."""
    return dataclasses.replace(c, streams=streams(c.need_program(), c.options.dp))
