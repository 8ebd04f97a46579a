"""What every renderer draws: a `Panel` is one timeline, simulated or measured.

A panel holds a `Timeline` (compute ops with start and end, time 0 at the start of the
iteration), where it came from, the time unit, and for a measured run the actions that
are not compute (send, recv, allreduce, step) with their real times, and optionally the
simulated timeline of the same program to draw beside it (`--overlay`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pipelang.ir import SHARD_KINDS, Action, Kind, deps
from pipelang.sim.timeline import Event, Timeline
from pipelang.visualize.style import ALL_KINDS


class Transfer(NamedTuple):
    """A result moving between ranks: `of` ends on `src` at `sent`; the op on `dst` that
    needs it starts at `used`."""

    src: int
    dst: int
    sent: float
    used: float
    of: Action


@dataclass(frozen=True)
class Panel:
    """One timeline to draw, with what the title says about it."""

    timeline: Timeline
    origin: str = "simulated"
    """`simulated`, or `measured` for a run's trace."""
    unit: str = ""
    """The time unit: empty for the cost model's units, `ms` for a measured run."""
    note: str = ""
    """Said after the numbers in the title: the costs, or which step of the run."""
    extra: tuple[Event, ...] = ()
    """Measured non-compute actions (send, recv, allreduce, step) with their times."""
    overlay: Timeline | None = None
    """The simulated timeline of the same program, drawn under each measured rank."""

    @property
    def name(self) -> str:
        """The schedule and its parameters: `chimera(D=4, N=4, f=1)`."""
        program = self.timeline.program
        params = ", ".join(f"{k}={_param(v)}" for k, v in program.params)
        return f"{program.name}({params})" if params else program.name

    def summary(self) -> str:
        """`simulated · makespan 10 · bubble ratio 0.200`, then the note."""
        timeline = self.timeline
        parts = [
            self.origin,
            f"makespan {number(timeline.makespan)}{_unit(self.unit)}",
            f"bubble ratio {timeline.bubble_ratio:.3f}",
        ]
        if self.overlay is not None:
            events = self.overlay.events
            length = self.overlay.makespan - min((e.start for e in events), default=0.0)
            parts.append(f"model makespan {number(length)}{_unit(self.unit)}")
        if self.note:
            parts.append(self.note)
        return " · ".join(parts)

    @property
    def span(self) -> float:
        """The time the panel covers: the latest end among everything it draws."""
        ends = [self.timeline.makespan, *(e.end for e in self.extra)]
        if self.overlay is not None:
            ends.append(self.overlay.makespan)
        return max(ends)

    def kinds(self) -> tuple[Kind, ...]:
        """The compute kinds of the program, in F, B, W, R, P order."""
        program = self.timeline.program
        present = {*program.kinds, *((Kind.P,) if program.frozen is not None else ())}
        if any(e.action.kind in SHARD_KINDS for e in self.timeline.events):
            present |= SHARD_KINDS
        return tuple(k for k in ALL_KINDS if k in present)


def simulated(timeline: Timeline) -> Panel:
    """The panel of a simulated timeline; the note names the costs it used."""
    return Panel(timeline, note=cost_note(timeline))


def cost_note(timeline: Timeline) -> str:
    """The times of the kinds the program runs, and the transfer time: `F=1 B=2 C=0`
    (and attention's share `A` when micro-batches split into sequence chunks)."""
    costs = timeline.costs
    kinds = [k.value for k in timeline.program.kinds]
    if timeline.program.frozen is not None:
        kinds.append("P")
    kinds.append("C")
    if timeline.program.chunks is not None:
        kinds.append("A")
    if any(e.action.kind in SHARD_KINDS for e in timeline.events):
        kinds += ["AG", "RS"]
    text = " ".join(f"{k}={number(costs.of(k))}" for k in kinds)
    if any(stage is not None for _, stage, _ in costs.entries):
        text += " (some per stage)"
    return f"costs {text}"


def transfers(timeline: Timeline) -> Iterator[Transfer]:
    """Every result an op takes from another rank, with when it was made and used: its
    inputs by the dependency rule (`deps.inputs`) that ran on another rank."""
    ends = {deps.op_key(e.action): e for e in timeline.events}
    program = timeline.program
    chunks = None if program.chunks is None else program.chunks.count
    for e in timeline.events:
        a = e.action
        if a.stage is None or not a.kind.is_compute:
            continue
        for key in deps.inputs(
            a.kind, a.mb, a.stage, a.pipeline, a.chunk, program.num_stages, chunks
        ):
            source = ends.get(key)
            if source is not None and source.rank != e.rank:
                yield Transfer(source.rank, e.rank, source.end, e.start, source.action)


def bands(events: Sequence[Event]) -> list[tuple[int, int]]:
    """(band, bands) of each event: the ops of a compound (an overlapped pair `F & B`, a
    `BW`) share one start and end, so their box is split into one horizontal band per op,
    top to bottom in order; a lone op is (0, 1). Fused ops follow their compound's first
    op in `events` (the simulator's order)."""
    out: list[tuple[int, int]] = []
    start = 0
    for i, event in enumerate(events):
        if i and not event.action.fused:
            out.extend((k, i - start) for k in range(i - start))
            start = i
    out.extend((k, len(events) - start) for k in range(len(events) - start))
    return out


def shared_span(panels: Sequence[Panel]) -> float:
    """The longest time any panel covers (panels drawn together share one time scale)."""
    return max((p.span for p in panels), default=0.0) or 1.0


def short_op(panels: Sequence[Panel]) -> float:
    """A short op's time, to size the picture by: the 10th percentile of the non-zero
    compute op times (the shortest op in a cost model; in a measured run, one odd op
    that took a few microseconds does not blow the picture up). 1 if there is none."""
    times = sorted(e.end - e.start for p in panels for e in p.timeline.events if e.end > e.start)
    return times[len(times) // 10] if times else 1.0


def number(value: float) -> str:
    """A time for people: `33`, `2.5`, `0.125`, `1234.6` (at most 4 significant digits
    after the point, no float noise)."""
    if float(value).is_integer():
        return str(int(value))
    text = f"{value:.4g}" if abs(value) < 1000 else f"{value:.1f}"
    return text if "e" not in text else f"{value:.6f}".rstrip("0")


def _unit(unit: str) -> str:
    return f" {unit}" if unit else ""


def _param(value: int | bool) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
