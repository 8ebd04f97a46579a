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
import math
import numbers
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pipelang.compiler import Compilation
from pipelang.diagnostics import InternalError, PipelangError, clip, fail
from pipelang.evaluate import SYNTHESIS_MAX_OPS
from pipelang.ir import CostModel, Program
from pipelang.parser import keywords
from pipelang.planner.topology import Topology
from pipelang.profile import Profile
from pipelang.sim.timeline import as_number
from pipelang.synthesis.problem import (
    Known,
    Problem,
    amount,
    problem_of,
    profile_costs,
    stages_of,
)
from pipelang.synthesis.solver import EXTRA, Found, scaled, solve, solver_module
from pipelang.synthesis.starts import starting_points
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

MAX_OPS = SYNTHESIS_MAX_OPS


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
    """Whether the solver saw the costs exactly (else each rounded down: the bound is
    still a bound, and `optimal` is claimed only where the makespan meets it)."""
    program: Program = field(repr=False)
    note: str = ""
    """Why the order is not proven optimal where the solver's model is not the written
    file's (overlapped pairs, activations it could not count exactly); '' otherwise."""

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
            "note": self.note,
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
    max_ops: int = MAX_OPS,
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
    profile's costs are summed over and the written file keeps. A placement of more than
    `max_ops` ops to order is refused (E0605); `max_ops` is at most `MAX_OPS`."""
    began = time.monotonic()
    _check_arguments(split, name, workers, partition, max_ops)
    time_limit = _positive("time_limit", time_limit, "seconds")
    if max_activations is not None:
        unit = "micro-batches" if stage_bytes is None else "bytes"
        max_activations = _positive("max_activations", max_activations, unit)
    solver = solver_module()
    if profile is not None:
        measured = profile_costs(sched, params, profile, topology, split, partition)
        costs = measured.merged(costs)
    problem, own = problem_of(sched, params, costs, split, stage_bytes, partition, max_ops)
    least = _least_cap(problem, max_activations)
    known = starting_points(problem, sched, params, own, max_activations)
    stdlib = [k for k in known if k.name.startswith("stdlib ")]
    best_stdlib = min(stdlib, key=lambda k: k.makespan, default=None)
    start = min(known, key=lambda k: (k.timed, k.makespan))
    found = solve(solver, problem, scaled(problem), max_activations, start, time_limit, workers)
    title = name or f"{problem.name}_synth"
    compiled, searched = _written(problem, found, start, max_activations, title)
    program = compiled.need_program()
    makespan = compiled.timeline().makespan
    numbered = problem.numbered(program.ranks)
    if numbered is None:
        raise InternalError("the written order is not the problem's ops")
    exact = found.exact and not found.why
    status = (
        "optimal"
        if makespan <= found.bound + (1e-9 * abs(makespan) if exact else 0.0)
        else "feasible"
        if searched
        else "kept"
    )
    result = Synthesized(
        text="",
        makespan=makespan,
        bound=makespan if status == "optimal" else min(found.bound, makespan),
        status=status,
        seconds=time.monotonic() - began,
        peak=problem.peak(numbered[0]),
        start=start,
        best_stdlib=best_stdlib,
        least_cap=least,
        ops=problem.size,
        exact_times=found.exact,
        program=program,
        note="" if status == "optimal" else found.why,
    )
    top = header(result, problem, sched, params, costs, max_activations, time_limit)
    return dataclasses.replace(result, text=write_pipe(problem, program.ranks, title, top))


def _written(
    problem: Problem, found: Found, start: Known, cap: float | None, title: str
) -> tuple[Compilation, bool]:
    """The written file of the faster of the solver's order and the start (the start
    where they tie, or where the solver's is over the cap), as `pipelang check`
    compiles it, and whether it is the solver's."""
    searched = found.orders is not None and problem.fits(found.orders, cap)
    if searched:
        assert found.orders is not None
        timed = problem.makespan(found.orders)
        searched = timed is not None and timed < start.timed
    if searched:
        assert found.orders is not None
        compiled = check_text(write_pipe(problem, problem.actions(found.orders), title, ""))
        if compiled.timeline().makespan < start.timed:
            return compiled, True
    compiled = check_text(
        write_pipe(problem, problem.actions(start.orders, start.fused), title, "")
    )
    if compiled.timeline().makespan > start.timed * (1 + 1e-9):
        raise InternalError(f"the written order of {start.name} runs slower than it was timed")
    return compiled, False


def _check_arguments(
    split: object, name: object, workers: object, partition: object, max_ops: object
) -> None:
    """The arguments' types and ranges, checked once where every caller comes in (the
    command line's are checked already): a usage error naming the argument otherwise."""
    if not isinstance(max_ops, int) or isinstance(max_ops, bool) or not 1 <= max_ops <= MAX_OPS:
        raise _wrong(
            "max_ops",
            max_ops,
            f"a whole number of ops from 1 to {MAX_OPS:,}, the most `synthesize` orders "
            "(E0605: the solver's memory grows with them)",
        )
    if split is not None and not isinstance(split, bool):
        raise _wrong(
            "split",
            split,
            "True (B and W), False (a whole backward) or None (as the schedule does)",
        )
    if workers is not None and (
        not isinstance(workers, int) or isinstance(workers, bool) or workers < 1
    ):
        raise _wrong("workers", workers, "a whole number of solver threads, 1 or more")
    if partition is not None and (
        isinstance(partition, str)
        or not isinstance(partition, Sequence)
        or not all(isinstance(n, int) and not isinstance(n, bool) for n in partition)
    ):
        raise _wrong(
            "partition", partition, "the layers of each stage, a sequence of whole numbers"
        )
    if name is not None and (
        not isinstance(name, str)
        or not re.fullmatch(r"[A-Za-z_]\w*", name, re.ASCII)
        or name in keywords()
    ):
        raise fail("usage", f"the schedule's name {clip(repr(name))} is not a name a .pipe allows")


def _positive(argument: str, value: object, unit: str) -> float:
    """`value` as a float, where it is a finite number more than 0 (not a bool)."""
    try:
        number = float(value) if _real(value) else math.nan  # type: ignore[arg-type]
    except OverflowError:
        number = math.inf
    if not 0 < number < math.inf:
        bool_ = ", not a bool" if isinstance(value, bool) else ""
        raise _wrong(argument, value, f"a finite number of {unit} more than 0{bool_}")
    return number


def _wrong(argument: str, value: object, rule: str) -> PipelangError:
    return fail("usage", f"{argument}={clip(repr(value))}: expected {rule}")


def _real(value: object) -> bool:
    """A number that is not a bool (an int, a float, a numpy number)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _least_cap(problem: Problem, cap: float | None) -> float:
    """The fewest activations some rank holds under any order; E0601 for a cap below
    the least."""
    least, why = problem.least_cap()
    if cap is not None and cap < least:
        raise fail(
            "E0601",
            f"no order holds at most {amount(cap, problem)} of activations on every rank: {why}",
            help=f"the least cap any order meets here is {amount(least, problem)}",
        )
    return least
