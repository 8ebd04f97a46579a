"""`pipelang synthesize`: the fastest order for a placement, a memory cap and costs.

Given a schedule's placement (its `pipeline` and `microbatches` lines; an order it has is
one starting point among others), its op kinds, a cost model and a cap on the
activations any rank holds (in micro-batches, or in bytes from each stage's measured
activations), find each rank's order of compute ops that ends soonest, and
write it as a `.pipe` file with explicit `order rank r` blocks.

The model is the simulator's, so that the order found simulates to the makespan reported:

- every op (micro-batch, stage, kind) runs once on its stage's rank, for the time the
  cost model gives (`CostModel.for_kinds`: a backward that is not split takes B + W);
- an op starts once its inputs have ended (`ir.deps`, the one dependency rule), plus a
  transfer where an input ran on another rank (`CostModel.transfer`: `C`, or `C[b]` per
  stage boundary), and after the schedule's `after` dependencies;
- a rank runs one op at a time;
- a forward holds its activations from its start to its B's end and, where W is split
  off, W's share (`MW`) to W's end (`sim.memory.change`, the one memory rule); every
  rank's total stays within the cap.

The solver is OR-Tools CP-SAT (`pip install pipelang[synth]`): an interval per op, a
no-overlap per rank, precedences with transfer delays, a reservoir per rank for the
activations, the makespan minimized (the model the zero-bubble paper's ILP and the
reference measurements use; docs/synthesize.md). Times are scaled to integers, exactly
where every cost has at most `DIGITS` decimals. The search starts from the fastest known
order that fits the cap (`starting_points`: the schedule's own order, every stdlib
schedule on the same placement, and one micro-batch at a time, which meets the least cap
any order can meet), and the answer is never slower than that order. The solver's bound
holds for every order of these ops on this placement: the first forwards of a pipeline
are taken in micro-batch order, which loses nothing, since its micro-batches are alike.

    synthesize("1f1b", {"D": "4", "N": "8"}, costs=<F=1,B=1,W=1,C=0.5>,
               max_activations=6, split=True)
  =>
    Synthesized(makespan=28.5, bound=28.5, status="optimal", best_stdlib=zb-h1 at 33, ...)
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pipelang.diagnostics import InternalError, clip, fail
from pipelang.ir import CostModel, Program
from pipelang.parser import keywords
from pipelang.planner.profile import Profile
from pipelang.planner.topology import Topology
from pipelang.sim.timeline import as_number
from pipelang.synthesis.problem import (
    Known,
    Problem,
    amount,
    problem_of,
    profile_costs,
    stages_of,
    starting_points,
)
from pipelang.synthesis.solver import EXTRA, scaled, solve, solver_module
from pipelang.synthesis.write import check_text, header, write_pipe

__all__ = [
    "EXTRA",
    "MAX_OPS",
    "Known",
    "Synthesized",
    "problem_of",
    "profile_costs",
    "stages_of",
    "synthesize",
]

MAX_OPS = 8192
"""The most ops the solver takes: D = 16, N = 128 with B and W split (6144 ops) solves
in about 35 s within 650 MB here, and the solver's memory grows with the ops."""


@dataclass(frozen=True)
class Synthesized:
    """What `synthesize` found: the `.pipe` text, its makespan (the simulator's), the
    proven lower bound, and what it was compared with."""

    text: str
    makespan: float
    bound: float
    status: str
    """`optimal` (proven), `feasible` (the time ran out first with a better order than
    the start) or `kept` (the solver found nothing better than the starting order)."""
    seconds: float
    """Wall time of the whole synthesis, the solver's time limit included."""
    peak: float
    """The most activations any rank of the answer holds (micro-batches)."""
    start: Known
    """The order the search started from (the fastest known that fits the cap)."""
    best_stdlib: Known | None
    """The fastest stdlib schedule on this placement that fits the cap, None if none."""
    least_cap: float
    """The fewest activations some rank holds under any order."""
    ops: int
    exact_times: bool
    """Whether the solver saw the costs exactly (else rounded: the bound is approximate)."""
    program: Program = field(repr=False)

    @property
    def gap(self) -> float:
        """How far the makespan may be above the best possible, as a share of it."""
        return 0.0 if self.makespan <= 0 else max(0.0, 1 - self.bound / self.makespan)

    def summary(self) -> dict[str, object]:
        """The numbers `pipelang synthesize --json` prints."""
        stdlib = self.best_stdlib
        return {
            "makespan": as_number(self.makespan),
            "bound": as_number(self.bound),
            "gap": round(self.gap, 6),
            "status": self.status,
            "seconds": round(self.seconds, 3),
            "peak_activations": as_number(self.peak),
            "least_cap": as_number(self.least_cap),
            "ops": self.ops,
            "start": {"name": self.start.name, "makespan": as_number(self.start.makespan)},
            "best_stdlib": None
            if stdlib is None
            else {
                "name": stdlib.name,
                "makespan": as_number(stdlib.makespan),
                "peak_activations": as_number(stdlib.peak),
            },
            "exact_times": self.exact_times,
        }


def synthesize(
    sched: str,
    params: Mapping[str, str] | None = None,
    *,
    costs: CostModel | None = None,
    max_activations: float | None = None,
    split: bool | None = None,
    time_limit: float = 30.0,
    name: str | None = None,
    workers: int | None = None,
    profile: Profile | None = None,
    topology: Topology | None = None,
    stage_bytes: Sequence[tuple[float, float]] | None = None,
    partition: Sequence[int] | None = None,
) -> Synthesized:
    """The fastest order for the placement of `sched` (a path or a stdlib name, with
    `-p`-style `params`) under `costs` (over the schedule's `cost` lines, and over the
    times a `profile` gives its stages, with transfers over `topology`'s links: see
    `profile_costs`), holding at most `max_activations` micro-batches of activations on
    any rank (None: no cap). `split` splits the backward into B and W (None: as the
    schedule does). The solver stops after `time_limit` seconds with the best order it
    has; `name` is the written schedule's (default: the schedule's with `_synth`). With
    `stage_bytes` (per stage, the bytes one forward saves and what W keeps of them after
    B: `backends.measure.stage_activation_bytes`), activations and the cap are in bytes.
    `partition` (layers per stage) replaces the schedule's `partition` line: the cut the
    profile's costs are summed over and the written file keeps."""
    began = time.monotonic()
    _check_name(name)
    solver = solver_module()
    if profile is not None:
        measured = profile_costs(sched, params, profile, topology, split, partition)
        costs = measured.merged(costs)
    problem, own = problem_of(sched, params, costs, split, stage_bytes, partition)
    least = _least_cap(problem, max_activations)
    known = starting_points(problem, sched, params, own, max_activations)
    stdlib = [k for k in known if k.name.startswith("stdlib ")]
    best_stdlib = min(stdlib, key=lambda k: k.makespan, default=None)
    start = min(known, key=lambda k: k.makespan)
    found = solve(solver, problem, scaled(problem), max_activations, start, time_limit, workers)
    title = name or f"{problem.name}_synth"
    compiled = check_text(write_pipe(problem, problem.actions(found.orders), title, ""))
    timeline = compiled.timeline()
    status = found.status
    if status == "kept" or timeline.makespan > start.makespan:
        compiled = check_text(write_pipe(problem, problem.actions(start.orders), title, ""))
        timeline, status = compiled.timeline(), "kept"
    program = compiled.need_program()
    makespan = timeline.makespan
    numbered = problem.numbered(program.ranks)
    if numbered is None:
        raise InternalError("the written order is not the problem's ops")
    peak = problem.peak(numbered)
    result = Synthesized(
        text="",
        makespan=makespan,
        bound=min(found.bound, makespan),
        status=status,
        seconds=time.monotonic() - began,
        peak=peak,
        start=start,
        best_stdlib=best_stdlib,
        least_cap=least,
        ops=problem.size,
        exact_times=found.exact,
        program=program,
    )
    top = header(result, problem, sched, params, costs, max_activations, time_limit)
    return dataclasses.replace(result, text=write_pipe(problem, program.ranks, title, top))


def _check_name(name: str | None) -> None:
    """A name for the written schedule must be one a `.pipe` allows (not a keyword)."""
    if name is not None and (
        not re.fullmatch(r"[A-Za-z_]\w*", name, re.ASCII) or name in keywords()
    ):
        raise fail("usage", f"the schedule's name {clip(repr(name))} is not a name a .pipe allows")


def _least_cap(problem: Problem, cap: float | None) -> float:
    """The fewest activations some rank holds under any order; E0605 for a problem past
    `MAX_OPS`, E0601 for a cap below the least."""
    if problem.size > MAX_OPS:
        raise fail(
            "E0605",
            f"{problem.name} has {problem.size:,} ops here; `synthesize` orders at most "
            f"{MAX_OPS:,}, which keep the solver within about 1 GiB",
            help="synthesize for fewer micro-batches (N) or stages",
        )
    least, why = problem.least_cap()
    if cap is not None and cap < least:
        raise fail(
            "E0601",
            f"no order holds at most {amount(cap, problem)} of activations on every rank: {why}",
            help=f"the least cap any order meets here is {amount(least, problem)}",
        )
    return least
