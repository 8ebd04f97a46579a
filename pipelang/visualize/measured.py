"""Measured timelines: read what `pipelang run --trace RUN.json` recorded.

The runtime writes a Chrome trace (backends/report.py, `chrome_trace`; the format and
its reading back, `read_actions`, are pipelang/trace.py's): one complete event per action
per step per rank, `ts`/`dur` in microseconds from the run's common start.

One step is drawn (the last by default: the first ones include warm-up). Its times
start at 0 at the step's first action and are in milliseconds. The program comes from
the schedule when the user names it (and the trace must run exactly its compute ops),
else it is rebuilt from the trace: placements, micro-batches and per-rank order.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from pipelang.ir import Action, CostModel, Kind, Pipeline, Program
from pipelang.sim.timeline import Event, Timeline
from pipelang.trace import Traced, TraceError, load, read_actions
from pipelang.visualize.panel import Panel
from pipelang.visualize.style import ALL_KINDS

__all__ = ["Measured", "TraceError", "fitted_costs", "read_trace", "rebuild_program"]


@dataclass(frozen=True, slots=True)
class Measured:
    """One step of a run: compute ops as a Timeline (ms), the other actions beside it."""

    timeline: Timeline
    extra: tuple[Event, ...]
    step: int
    steps: tuple[int, ...]

    def panel(self, overlay: Timeline | None = None) -> Panel:
        note = f"step {self.step} of {_span(self.steps)}"
        return Panel(self.timeline, "measured", "ms", note, self.extra, overlay)


def read_trace(path: Path, program: Program | None = None, step: int | None = None) -> Measured:
    """The measured timeline of `step` (default: the last) of the trace at `path`."""
    by_step = _actions_by_step(read_actions(load(path), str(path)), path)
    steps = tuple(sorted(by_step))
    chosen = steps[-1] if step is None else step
    if chosen not in by_step:
        raise TraceError(f"{path}: no step {chosen}; the trace has steps {_span(steps)}")
    rows = sorted(by_step[chosen], key=lambda r: (r[0], r[3], r[1]))
    origin = min(r[3] for r in rows)
    events = [Event(r, a, (s - origin) / 1000, (t - origin) / 1000) for r, _, a, s, t in rows]
    if program is None:
        program = rebuild_program(events, path.stem)
    else:
        _check_matches(program, events, path)
    compute = tuple(e for e in events if e.action.kind.is_compute)
    extra = tuple(e for e in events if not e.action.kind.is_compute)
    return Measured(Timeline(program, CostModel(), compute), extra, chosen, steps)


Row = tuple[int, int, Action, float, float]
"""(rank, index in the rank's program, action, start us, end us)."""


def _actions_by_step(actions: list[Traced], path: Path) -> dict[int, list[Row]]:
    """The trace's actions grouped by step."""
    by_step: dict[int, list[Row]] = defaultdict(list)
    for t in actions:
        by_step[t.step].append((t.rank, t.index, t.action, t.start, t.end))
    if not by_step:
        raise TraceError(f"{path}: no events named like pipelang actions (`F3@1/main`)")
    return by_step


def fitted_costs(timeline: Timeline) -> CostModel:
    """A cost model from measured durations: the mean time of each kind, overall and per
    stage (no transfer time: the runtime does not record when data arrives)."""
    times: dict[tuple[str, int | None], list[float]] = defaultdict(list)
    for e in timeline.events:
        for stage in (None, e.action.stage):
            times[(e.action.kind.value, stage)].append(e.end - e.start)
    entries = tuple((kind, stage, sum(v) / len(v)) for (kind, stage), v in times.items())
    return CostModel().merged(CostModel((*entries, ("C", None, 0.0))))


def rebuild_program(events: list[Event], name: str) -> Program:
    """The Program a trace ran, from its actions alone (no parameters, no source)."""
    placements: dict[str, dict[int, int]] = defaultdict(dict)
    assignment: dict[int, str] = {}
    kinds: set[Kind] = set()
    ranks: dict[int, list[Action]] = defaultdict(list)
    for e in events:
        a = e.action
        ranks[e.rank].append(a)
        if a.kind.is_compute:
            assert a.pipeline is not None and a.stage is not None and a.mb is not None
            placements[a.pipeline][a.stage] = e.rank
            assignment[a.mb] = a.pipeline
            kinds.add(a.kind)
    if not placements:
        raise TraceError(f"{name}: the trace has no compute ops")
    stages = 1 + max(s for p in placements.values() for s in p)
    for pipe, where in placements.items():
        if len(where) != stages:
            raise TraceError(
                f"{name}: pipeline `{pipe}` misses stages "
                f"{sorted(set(range(stages)) - set(where))} in the trace"
            )
    missing = sorted(set(range(1 + max(assignment))) - set(assignment))
    if missing:
        raise TraceError(f"{name}: micro-batches {missing} never ran in the trace")
    num_ranks = 1 + max(ranks)
    return Program(
        name=name,
        source=name,
        params=(),
        num_ranks=num_ranks,
        num_stages=stages,
        pipelines=tuple(
            Pipeline(p, tuple(where[s] for s in range(stages)))
            for p, where in sorted(placements.items())
        ),
        assignment=tuple(assignment[m] for m in range(len(assignment))),
        kinds=tuple(k for k in ALL_KINDS if k in kinds),
        ranks=tuple(tuple(ranks.get(r, ())) for r in range(num_ranks)),
    )


def _check_matches(program: Program, events: list[Event], path: Path) -> None:
    """Every rank ran exactly the compute ops the program gives it."""
    ran: dict[int, set[Action]] = defaultdict(set)
    for e in events:
        if e.action.kind.is_compute:
            ran[e.rank].add(e.action)
    for rank in sorted(set(ran) | set(range(program.num_ranks))):
        actions = program.ranks[rank] if rank < program.num_ranks else ()
        want = {a for a in actions if a.kind.is_compute}
        got = ran.get(rank, set())
        if want == got:
            continue
        extra, lost = sorted(map(str, got - want)), sorted(map(str, want - got))
        detail = f"ran {', '.join(extra[:3])} that the schedule does not have"
        if not extra:
            detail = f"never ran {', '.join(lost[:3])}"
        params = ", ".join(f"{k}={v}" for k, v in program.params)
        raise TraceError(f"{path} is not a run of {program.name}({params}): rank {rank} {detail}")


def _span(steps: tuple[int, ...]) -> str:
    return f"{steps[0]}..{steps[-1]}" if len(steps) > 1 else str(steps[0])
