"""The simulator: replay a Program under a cost model and measure its timeline.

Every compute op starts as soon as the op before it on its rank has ended and every op
it depends on has ended, plus one transfer time `C` for each result that comes from
another rank (`after` dependencies cost nothing). A compound (`F3@0/main &B0@7/main`, see
`ir.Action`) starts once the inputs of all its ops are ready; it takes the `FB` cost when
the model gives one and the compound holds a forward and a backward (the forward's stage
picks it), else the sum of its ops' costs, and all its ops end together. Comm, allreduce
and step actions in the program are not replayed: transfers are charged on the edges
instead. The one timing engine times them (`sim.engine`: `durations`, `Engine.fixed`),
linear in the number of ops and dependencies.

    rank 0: F0@0/main B0@0/main          costs F=1, B=2, C=0
    rank 1: F0@1/main B0@1/main
  =>
    rank 0 | F0 .  .  .  B0 -
    rank 1 | .  F0 B0 -  .  .
    makespan 6, bubble_ratio 0.5 (6 busy time units out of 2 ranks x 6)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

from pipelang.bulk import bulk
from pipelang.diagnostics import InternalError, fail
from pipelang.grid import op_labeler, render_rows
from pipelang.ir import MAX_TIME, Action, CostModel, Kind, Program
from pipelang.ir.graph import OpGraph
from pipelang.sim import memory
from pipelang.sim.engine import Engine, Input, Link, durations
from pipelang.weights import WeightVersions, weight_versions


class RankStats(NamedTuple):
    """One rank's share of a Timeline (`Timeline.ranks[r]`)."""

    rank: int
    busy: float
    idle: float
    peak_activations: int | float
    weight_copies: int


class Event(NamedTuple):
    """One op run: on `rank`, from `start` to `end`. (A NamedTuple: there is one per op
    of the schedule, and they are cheap to make.)"""

    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """When every compute op of `program` runs under `costs`, and what that adds up to.

    `events` are ordered by rank, then in each rank's order. The bubble ratio is ours:
    the idle share of all ranks over the iteration, `1 - sum(busy) / (R * makespan)`.
    """

    program: Program
    costs: CostModel
    events: tuple[Event, ...]

    @cached_property
    def _by_rank(self) -> tuple[tuple[Event, ...], ...]:
        rows: list[list[Event]] = [[] for _ in range(self.program.num_ranks)]
        for event in self.events:
            rows[event.rank].append(event)
        return tuple(map(tuple, rows))

    @cached_property
    def makespan(self) -> float:
        """When the last op ends (the iteration starts at 0)."""
        return max((e.end for e in self.events), default=0.0)

    @property
    def bubble_ratio(self) -> float:
        """The idle share of the iteration over all ranks: 1 - busy / (R * makespan)."""
        total = self.program.num_ranks * self.makespan
        if total <= 0:
            return 0.0
        return 1.0 - sum(self.busy(r) for r in range(self.program.num_ranks)) / total

    @property
    def ranks(self) -> list[RankStats]:
        """Per rank: busy and idle time, peak activations, weight copies."""
        return [
            RankStats(
                r, self.busy(r), self.idle(r), self.peak_activations(r), self.weight_copies(r)
            )
            for r in range(self.program.num_ranks)
        ]

    def busy(self, rank: int) -> float:
        """Time `rank` spends running ops (a compound counts once)."""
        return self._busy[rank]

    @cached_property
    def _busy(self) -> list[float]:
        return [sum(e.end - e.start for e in row if not e.action.fused) for row in self._by_rank]

    def idle(self, rank: int) -> float:
        """Time `rank` waits within the iteration: makespan - busy."""
        return self.makespan - self.busy(rank)

    def peak_activations(self, rank: int) -> int | float:
        """The most forwards whose backward has not run yet, along `rank`'s order; with
        evictions, over time, less those evicted and plus those held for a partner
        (`memory.peak_over_time`); with sequence chunks, in micro-batches, each
        chunk its share of the tokens (`memory.shares`)."""
        if self._stash_peaks is not None:
            return as_number(self._stash_peaks[rank])
        return as_number(memory.peak(self.program.ranks[rank], self._w, self._share))

    @cached_property
    def _share(self) -> memory.Share | None:
        return memory.shares(self.program, self.costs)

    @cached_property
    def _w(self) -> memory.WShare | None:
        return memory.w_share(self.program, self.costs)

    @cached_property
    def _stash_peaks(self) -> list[float] | None:
        return memory.peak_over_time(self.program, self.events, self._w, self._share)

    def weight_copies(self, rank: int) -> int:
        """How many stage copies (weights) `rank` holds."""
        return len(self.program.stage_copies(rank))

    @cached_property
    def _versions(self) -> WeightVersions:
        return weight_versions(self.program)

    def peak_weight_versions(self, rank: int) -> int:
        """The most versions of stage weights `rank` keeps at once, over all its copies
        (`weight_copies` in a synchronous schedule; see `pipelang.weights`)."""
        return self._versions.peak[rank]

    def weight_delay(self, rank: int) -> int:
        """The most updates by which a gradient `rank` applies lags the weights it
        updates (0 in a synchronous schedule; see `pipelang.weights`)."""
        return self._versions.delay[rank]

    def metrics(self) -> dict[str, object]:
        """The numbers `pipelang simulate --json` prints, in that shape."""
        return {
            "schedule": self.program.name,
            "params": dict(self.program.params),
            "makespan": as_number(self.makespan),
            "bubble_ratio": as_number(self.bubble_ratio),
            "ranks": [
                {
                    "rank": r,
                    "busy": as_number(self.busy(r)),
                    "idle": as_number(self.idle(r)),
                    "peak_activations": self.peak_activations(r),
                    "weight_copies": self.weight_copies(r),
                    "peak_weight_versions": self.peak_weight_versions(r),
                    "weight_delay": self.weight_delay(r),
                }
                for r in range(self.program.num_ranks)
            ],
        }

    def text_grid(self, width_limit: int | None = None) -> str:
        """One row per rank; one cell per unit of time (the smallest op time, else 1).

        An op of time c fills c cells: its short label (`F3`, see `grid.op_labeler`),
        then `-`; idle cells are `.`. Start and end times round to the nearest cell, so
        ops of time 0 do not show. Rows are cut at `width_limit` characters.

        The grid is at most `GRID_CELLS` cells wide and `GRID_RANKS` ranks tall: past
        that a cell is made longer (ops shorter than it may not show; a last line says
        how long a cell is) and the ranks after the first `GRID_RANKS` are counted.
        """
        shortest = min((e.end - e.start for e in self.events if e.end > e.start), default=1.0)
        unit = max(shortest, self.makespan / GRID_CELLS)
        width = min(round(self.makespan / unit), GRID_CELLS)
        label = op_labeler(self.program)
        rows = []
        for rank, events in enumerate(self._by_rank[:GRID_RANKS]):
            cells = ["."] * width
            for event in events:
                if event.action.fused:
                    continue  # its compound's first op labels the cells
                first, last = round(event.start / unit), min(round(event.end / unit), width)
                for cell in range(first, last):
                    cells[cell] = label(rank, event.action) if cell == first else "-"
            rows.append((f"rank {rank}", cells))
        notes = []
        if len(self._by_rank) > GRID_RANKS:
            notes.append(f"... and {len(self._by_rank) - GRID_RANKS} more ranks")
        if unit > shortest:
            notes.append(
                f"(one cell = {as_number(unit)} time units, to keep the grid within "
                f"{GRID_CELLS} cells; ops shorter than a cell may not show)"
            )
        return "\n".join([render_rows(rows, width_limit), *notes])


def as_number(value: float) -> int | float:
    """JSON-friendly: 33 rather than 33.0, and no float noise past 6 decimals."""
    rounded = round(value, 6)
    return int(rounded) if float(rounded).is_integer() else rounded


GRID_CELLS = 5000
"""The widest `Timeline.text_grid`, in cells (costs of 1e-6 and 1e6 would otherwise ask
for a grid of 10^12 cells)."""
GRID_RANKS = 512
"""The most ranks `Timeline.text_grid` draws."""


@bulk
def simulate(
    program: Program, graph: OpGraph, costs: CostModel, link: Link | None = None
) -> Timeline:
    """Replay `program`'s compute ops under `costs` (see the module docstring); `graph`
    is its op graph, validated (`Compilation.timeline` hands both on).

    `link`, when given, times each transfer instead of the cost model's (`C`, or `C[b]`
    per stage boundary, `CostModel.transfer`): the planner gives every stage boundary the
    time of the link between its two ranks' devices.
    """
    time = costs.timer(program.chunks, program.shapes)
    times = durations(graph.ops, graph.heads, time, costs)
    longest = max(times, default=0.0)
    if not longest <= MAX_TIME:  # inf and NaN too: say so, never print them
        slowest = graph.ops[times.index(longest)]
        raise fail(
            "E0209",
            f"`{slowest}` takes {longest:g} under these costs and shapes, past the 10^15 an op "
            "may take: smaller costs, or micro-batch shapes nearer the reference `S`",
        )
    inputs: list[list[Input]] = [[] for _ in graph.ops]
    for delayed, edges in ((False, graph.after), (True, graph.data)):
        for u, v in edges:
            inputs[v].append((u, delayed))
    link = stash_link(program, graph, costs, link or costs.link())
    engine = Engine(graph.ranks, times, inputs, costs.of("C"), link, graph.ops)
    # Ops are numbered in rank order, then in each rank's order; none is listed twice.
    orders: list[list[int]] = [[] for _ in range(program.num_ranks)]
    for op, rank in enumerate(graph.ranks):
        orders[rank].append(op)
    start, timed = engine.fixed(orders)
    if len(timed) < graph.listed:
        raise InternalError("simulated an op graph with a cycle: `validate` did not run")
    ends = [s + t for s, t in zip(start, times, strict=True)]
    heads = graph.heads
    for op, head in enumerate(heads):
        if head != op:
            # Fused ops were timed to start as their compound ends, taking no time.
            start[op] = start[head]
            ends[op] = ends[head]
    events = map(Event, graph.ranks, graph.ops, start, ends)
    return Timeline(program, costs, tuple(events))


def stash_link(
    program: Program, graph: OpGraph, costs: CostModel, link: Link | None
) -> Link | None:
    """`link`, except that an evicted activation takes `E` to reach the partner (the hop
    E -> H) and `L` to come back (H -> L). `link` itself when nothing is evicted."""
    required = program.num_microbatches * program.num_stages * len(program.kinds)
    if len(graph.ops) == required or not any(op.kind is Kind.E for op in graph.ops):
        return link
    transfer = costs.of("C")

    def timed(op: Action, src: int, dst: int) -> float:
        if op.kind is Kind.E:
            return costs.of("E", op.stage)
        if op.kind is Kind.H:
            return costs.of("L", op.stage)
        return transfer if link is None else link(op, src, dst)

    return timed
