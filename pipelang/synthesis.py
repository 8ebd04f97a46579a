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
import graphlib
import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pipelang import api, ast
from pipelang.compiler import Compilation, Options, run_passes
from pipelang.diagnostics import InternalError, PipelangError, clip, fail
from pipelang.evaluate import Value
from pipelang.import_torch import check_pipe, placement_expr
from pipelang.ir import Action, CostModel, Kind, Pipeline, Program, deps, stage_problem
from pipelang.orders import Layout
from pipelang.parser import keywords
from pipelang.passes.layout import read_partition, read_weights, schedule_layout
from pipelang.planner.costs import OpCosts, stage_outputs, stage_w_shares
from pipelang.planner.partition import even_split
from pipelang.planner.profile import Profile
from pipelang.planner.topology import Topology
from pipelang.sim import memory
from pipelang.sim.engine import Engine, Input
from pipelang.sim.timeline import as_number
from pipelang.source import one_line

EXTRA = "synth"
"""The install extra that brings the solver: `pip install 'pipelang[synth]'`."""

DIGITS = 3
"""Costs with at most this many decimals are scaled to integers exactly; other costs are
rounded to `ROUNDED_STEPS` steps of the largest (the header says so)."""

ROUNDED_STEPS = 100_000

MAX_OPS = 8192
"""The most ops the solver takes: D = 16, N = 128 with B and W split (6144 ops) solves
in about 35 s within 650 MB here, and the solver's memory grows with the ops."""

MEMORY_SCALE = 1000
"""Activations are counted in thousandths of a micro-batch inside the solver."""

SPLIT = (Kind.F, Kind.B, Kind.W)
WHOLE = (Kind.F, Kind.B)


@dataclass(frozen=True)
class Known:
    """An order known before the search: where it comes from, each rank's op numbers (in
    the problem's numbering), its makespan and peak activations as the simulator gives
    them for the schedule it comes from."""

    name: str
    orders: tuple[tuple[int, ...], ...]
    makespan: float
    peak: float


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
) -> Synthesized:
    """The fastest order for the placement of `sched` (a path or a stdlib name, with
    `-p`-style `params`) under `costs` (over the schedule's `cost` lines, and over the
    times a `profile` gives its stages, with transfers over `topology`'s links: see
    `profile_costs`), holding at most `max_activations` micro-batches of activations on
    any rank (None: no cap). `split` splits the backward into B and W (None: as the
    schedule does). The solver stops after `time_limit` seconds with the best order it
    has; `name` is the written schedule's (default: the schedule's with `_synth`). With
    `stage_bytes` (per stage, the bytes one forward saves and what W keeps of them after
    B: `backends.measure.stage_activation_bytes`), activations and the cap are in bytes."""
    began = time.monotonic()
    if name is not None and (
        not re.fullmatch(r"[A-Za-z_]\w*", name, re.ASCII) or name in keywords()
    ):
        raise fail("usage", f"the schedule's name {clip(repr(name))} is not a name a .pipe allows")
    solver = _solver_module()
    if profile is not None:
        measured = profile_costs(sched, params, profile, topology, split)
        costs = measured.merged(costs)
    problem, own = problem_of(sched, params, costs, split, stage_bytes)
    if problem.size > MAX_OPS:
        raise fail(
            "E0605",
            f"{problem.name} has {problem.size:,} ops here; `synthesize` orders at most "
            f"{MAX_OPS:,}, which keep the solver within about 1 GiB",
            help="synthesize for fewer micro-batches (N) or stages",
        )
    least, why = problem.least_cap()
    if max_activations is not None and max_activations < least:
        raise fail(
            "E0601",
            f"no order holds at most {_amount(max_activations, problem)} of activations on "
            f"every rank: {why}",
            help=f"the least cap any order meets here is {_amount(least, problem)}",
        )
    known = starting_points(problem, sched, params, own, max_activations)
    stdlib = [k for k in known if k.name.startswith("stdlib ")]
    best_stdlib = min(stdlib, key=lambda k: k.makespan, default=None)
    start = min(known, key=lambda k: k.makespan)
    found = _solve(solver, problem, _scaled(problem), max_activations, start, time_limit, workers)
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
    header = _header(result, problem, sched, params, costs, max_activations, time_limit)
    return dataclasses.replace(result, text=write_pipe(problem, program.ranks, title, header))


def _solver_module():  # type: ignore[no-untyped-def]
    """OR-Tools' CP-SAT, or the error that names the extra that installs it."""
    try:
        from ortools.sat.python import cp_model
    except ImportError:
        raise fail(
            "E0603",
            "`synthesize` needs OR-Tools' CP-SAT solver, which is not installed",
            help=f"pip install 'pipelang[{EXTRA}]'",
        ) from None
    return cp_model


# ---- the placement --------------------------------------------------------------------------


def _placement(
    sched: str, params: Mapping[str, str] | None, costs: CostModel | None
) -> tuple[Layout, Compilation | None, ast.File, Mapping[str, Value]]:
    """The schedule's layout under `costs`, its compilation when it has an order (a file
    of `pipeline` and `microbatches` lines alone is a placement too), the file, and its
    parameters' values."""
    layout, file, bindings = _declarations(sched, params, costs)
    orders = (ast.OrderRank, ast.OrderGreedy, ast.OrderRepeat)
    if not any(isinstance(d, orders) for d in file.schedule.body):
        return layout, None, file, bindings
    compiled = api.compile_schedule(sched, params, costs=costs, stop_after="insert-holds")
    layout = dataclasses.replace(layout, after=compiled.need_program().after)
    return layout, compiled, file, bindings


def _declarations(
    sched: str, params: Mapping[str, str] | None, costs: CostModel | None
) -> tuple[Layout, ast.File, Mapping[str, Value]]:
    """The schedule's declarations (its order not run): the layout under `costs`, the
    file and its parameters' values; what `synthesize` cannot order is E0602."""
    file = api.load_file(sched)
    bindings = run_passes(file, Options(dict(params or {}), costs=costs), "resolve-params").params
    assert bindings is not None  # resolve-params ran
    layout = schedule_layout(file, bindings)
    schedule = file.schedule
    unsupported = [
        (layout.frozen is not None, "a frozen part (`frozen on`)"),
        (layout.chunks is not None, "sequence chunks (`chunks`)"),
        (layout.shapes is not None, "micro-batches of different shapes"),
        (Kind.R in layout.kinds, "recomputation (`ops ..., R`)"),
        (read_weights(schedule, layout.scope, layout.env) is not None, "asynchronous weights"),
    ]
    for found, what in unsupported:
        if found:
            raise fail(
                "E0602",
                f"`synthesize` does not order schedules with {what}: it orders the F, B and "
                "W ops of synchronous schedules",
                schedule.span,
            )
    for kind, stage, _ in () if costs is None else costs.entries:
        problem = None if stage is None else stage_problem(kind, stage, layout.num_stages)
        if problem is not None:
            raise fail("E0209", f"`{kind}[{stage}]` for {schedule.name}: {problem}", schedule.span)
    return dataclasses.replace(layout, costs=layout.costs.merged(costs)), file, bindings


def problem_of(
    sched: str,
    params: Mapping[str, str] | None = None,
    costs: CostModel | None = None,
    split: bool | None = None,
    stage_bytes: Sequence[tuple[float, float]] | None = None,
) -> tuple[Problem, Compilation | None]:
    """The ops to order for the placement of `sched` (see `synthesize`), and the
    schedule's compilation when it has an order of its own."""
    layout, own, file, bound = _placement(sched, params, costs)
    if stage_bytes is not None and len(stage_bytes) != layout.num_stages:
        raise InternalError(f"{len(stage_bytes)} stages' bytes for {layout.num_stages} stages")
    values = tuple((p.name, bound[p.name]) for p in file.schedule.params)
    problem = Problem(layout, _kinds(layout, split), file.schedule.name, values, stage_bytes)
    return problem, own


def _kinds(layout: Layout, split: bool | None) -> tuple[Kind, ...]:
    """The op kinds to order: B and W split or not, or as the schedule declares them."""
    return layout.kinds if split is None else SPLIT if split else WHOLE


def stages_of(
    sched: str, params: Mapping[str, str] | None = None
) -> tuple[int, tuple[int, ...] | None]:
    """The placement's stage count and its `partition` line (None: even), what measuring a
    model's bytes per stage needs."""
    layout, file, _ = _declarations(sched, params, None)
    partition = read_partition(file.schedule, layout.scope, layout.env, layout.num_stages)
    return layout.num_stages, partition


def _amount(value: float, problem: Problem) -> str:
    """A number of activations as the problem counts them."""
    if problem.stage_bytes is None:
        return f"{value:g} micro-batch{'es' if value != 1 else ''}"
    return f"{value:,.0f} bytes"


def profile_costs(
    sched: str,
    params: Mapping[str, str] | None,
    profile: Profile,
    topology: Topology | None,
    split: bool | None,
) -> CostModel:
    """Per-stage costs in milliseconds from a profile: each stage's F, B and W summed over
    its layers (the schedule's `partition`, else the runtime's even split; with the
    profile's runtime calibration, as the planner counts them, `OpCosts`), W's share of
    the activations (`MW`), and with a topology, rank r on its device r, each stage
    boundary's transfer of the stage's output over the link between the two ranks
    (`C[b]`; the slowest, where pipelines cross a boundary between other ranks).
    A profile or topology that does not fit the placement is E0604."""
    layout, file, _ = _declarations(sched, params, None)
    stages, ranks = layout.num_stages, layout.num_ranks
    layers = len(profile.layers)
    counts = read_partition(file.schedule, layout.scope, layout.env, stages)
    if counts is None:
        if layers < stages:
            raise fail(
                "E0604",
                f"the profile of {profile.model} has {layers} layers, and {file.schedule.name}'s "
                f"placement has {stages} stages: every stage needs a layer",
                file.schedule.span,
            )
        counts = even_split(layers, stages)
    elif sum(counts) != layers:
        raise fail(
            "E0604",
            f"{file.schedule.name}'s `partition` gives {sum(counts)} layers, and the profile "
            f"of {profile.model} has {layers}",
            file.schedule.span,
        )
    if topology is not None and topology.size < ranks:
        raise fail(
            "E0604",
            f"the topology has {topology.size} devices, and {file.schedule.name}'s placement has "
            f"{ranks} ranks",
        )
    crossing = [
        any(p.placement[b] != p.placement[b + 1] for p in layout.pipelines)
        for b in range(stages - 1)
    ]
    ops = OpCosts(profile, "sgd")
    model = ops.cost_model(counts, Kind.W in _kinds(layout, split), crossing)
    entries = [("MW", s, share) for s, share in enumerate(stage_w_shares(profile, counts))]
    if topology is not None:
        outputs = stage_outputs(profile, counts)
        for b in range(stages - 1):
            pairs = {(p.placement[b], p.placement[b + 1]) for p in layout.pipelines}
            times = [ops.boundary_ms(topology, x, y, outputs[b]) for x, y in pairs]
            entries.append(("C", b, max(times, default=0.0)))
    return model.merged(CostModel(tuple(entries)))


class Problem:
    """The ops to order, numbered: each with its rank, time and inputs, and how it
    changes the activations its rank holds."""

    def __init__(
        self,
        layout: Layout,
        kinds: Sequence[Kind],
        name: str = "placement",
        params: tuple[tuple[str, Value], ...] = (),
        stage_bytes: Sequence[tuple[float, float]] | None = None,
    ) -> None:
        self.layout, self.kinds, self.name = layout, tuple(kinds), name
        self.params = params
        """The schedule's parameters and their values: the written file declares them,
        each required to be what the order was found for."""
        self.stage_bytes = stage_bytes
        """Per stage, the bytes one forward saves and what W keeps of them after B: then
        activations are counted in bytes, else in micro-batches."""
        self.costs = costs = layout.costs.for_kinds(self.kinds)
        self.ops = [
            Action(kind, mb, stage, pipe)
            for mb, pipe in enumerate(layout.assignment)
            for stage in range(layout.num_stages)
            for kind in self.kinds
        ]
        self.index = {deps.op_key(op): i for i, op in enumerate(self.ops)}
        placements = {p.name: p.placement for p in layout.pipelines}
        self.ranks = [placements[op.pipeline][op.stage] for op in self.ops]  # type: ignore[index]
        self.times = [costs.time(op) for op in self.ops]
        extra: dict[int, list[int]] = {}
        for dep in layout.after:
            later, earlier = (
                self.index.get(deps.op_key(dep.later)),
                self.index.get(deps.op_key(dep.earlier)),
            )
            if later is not None and earlier is not None:
                extra.setdefault(later, []).append(earlier)
        stages = layout.num_stages
        self.inputs: list[list[Input]] = [
            [
                (self.index[key], True)
                for key in deps.inputs(
                    op.kind, op.mb, op.stage or 0, op.pipeline, None, stages, None
                )
                if key in self.index
            ]
            + [(u, False) for u in extra.get(i, ())]
            for i, op in enumerate(self.ops)
        ]
        self.w = memory.kinds_w_share(self.kinds, costs)
        sizes = [1.0] * layout.num_stages
        if stage_bytes is not None:
            sizes = [saved for saved, _ in stage_bytes]
            shares = [kept / saved if saved else 0.0 for saved, kept in stage_bytes]
            self.w = None if Kind.W not in self.kinds else (lambda stage: shares[stage or 0])
        self.sizes = sizes
        """What one forward holds on each stage: 1 micro-batch, or its bytes."""
        self.changes = [
            memory.change(op.kind, None if self.w is None else self.w(op.stage))
            * sizes[op.stage or 0]
            for op in self.ops
        ]
        self.memory_scale = MEMORY_SCALE if stage_bytes is None else 1.0
        """The solver counts activations in these integer units per micro-batch (bytes
        are integers already)."""

    @property
    def size(self) -> int:
        return len(self.ops)

    @property
    def num_ranks(self) -> int:
        return self.layout.num_ranks

    def engine(self, times: Sequence[float], scale: float | None = None) -> Engine:
        """The timing engine over these ops with `times`; with `scale`, every transfer is
        scaled by it and rounded, as the solver sees it."""
        costs = self.costs
        if scale is None:
            return Engine(self.ranks, times, self.inputs, link=costs.link(), actions=self.ops,
                          transfer=costs.of("C"))  # fmt: skip
        return Engine(
            self.ranks,
            times,
            self.inputs,
            link=lambda op, src, dst: round(costs.transfer(op) * scale),
            actions=self.ops,
        )

    def peak(self, orders: Sequence[Sequence[int]]) -> float:
        """The most activations a rank holds along `orders`, in micro-batches or bytes
        (`sim.memory.peak`, `peak_bytes`)."""
        if self.stage_bytes is None:
            rows = (memory.peak((self.ops[i] for i in row), self.w) for row in orders)
        else:
            rows = (
                memory.peak_bytes((self.ops[i] for i in row), self.w, self.sizes) for row in orders
            )
        return max(rows, default=0.0)

    def least_cap(self) -> tuple[float, str]:
        """The fewest activations some rank holds under any order, and why: when a
        micro-batch's last forward runs, no backward of it can have run, so every rank
        holds all its stages of that micro-batch's pipeline."""
        most, why = 0.0, ""
        for pipe in self.layout.pipelines:
            if pipe.name not in self.layout.assignment:
                continue
            held: dict[int, float] = {}
            for stage, rank in enumerate(pipe.placement):
                held[rank] = held.get(rank, 0.0) + self.sizes[stage]
            rank = min(held, key=lambda r: (-held[r], r))
            if held[rank] > most:
                most = held[rank]
                stages = pipe.placement.count(rank)
                amount = f" ({most:,.0f} bytes)" if self.stage_bytes is not None else ""
                why = (
                    f"rank {rank} holds {stages} stage(s) of pipeline `{pipe.name}`{amount}, "
                    "and a micro-batch's forwards on all of them are held at once, before "
                    "its first backward"
                )
        return most, why

    def numbered(self, ranks: Sequence[Sequence[Action]]) -> tuple[tuple[int, ...], ...] | None:
        """Each rank's op numbers for an order of Actions; where the order's backward is
        whole and these ops split it, its `B` stands for B then W. None when the order
        is not one of these ops, each once on its rank."""
        whole = not any(a.kind is Kind.W for row in ranks for a in row)
        orders: list[tuple[int, ...]] = []
        for rank, actions in enumerate(ranks):
            row: list[int] = []
            for action in actions:
                if not action.kind.is_compute:
                    continue
                kinds = [action.kind]
                if whole and action.kind is Kind.B and Kind.W in self.kinds:
                    kinds.append(Kind.W)
                for kind in kinds:
                    i = self.index.get((kind, action.mb, action.stage, action.pipeline, None))
                    if i is None or self.ranks[i] != rank:
                        return None
                    row.append(i)
            orders.append(tuple(row))
        if len(orders) != self.num_ranks or sorted(i for r in orders for i in r) != list(
            range(self.size)
        ):
            return None
        return tuple(orders)

    def actions(self, orders: Sequence[Sequence[int]]) -> list[list[Action]]:
        """Each rank's ops for their numbers."""
        return [[self.ops[i] for i in row] for row in orders]

    def one_at_a_time(self) -> tuple[tuple[int, ...], ...]:
        """Every micro-batch through all its ops before the next starts (forwards down
        the stages, then each backward followed by its W): the least memory, each rank
        holding one micro-batch's stages at most."""
        orders: list[list[int]] = [[] for _ in range(self.num_ranks)]
        stages = self.layout.num_stages
        for mb, pipe in enumerate(self.layout.assignment):
            sequence = [(Kind.F, s) for s in range(stages)]
            for s in reversed(range(stages)):
                sequence += [(k, s) for k in self.kinds if k is not Kind.F]
            for kind, stage in sequence:
                i = self.index[(kind, mb, stage, pipe, None)]
                orders[self.ranks[i]].append(i)
        return tuple(map(tuple, orders))


def starting_points(
    problem: Problem,
    sched: str,
    params: Mapping[str, str] | None,
    own: Compilation | None,
    cap: float | None,
) -> list[Known]:
    """The known orders that fit the cap: the schedule's own, every stdlib schedule on the
    same placement (compiled with D and N), and one micro-batch at a time (which always
    fits a cap the least cap allows). Each is timed as `pipelang simulate` times the
    schedule it comes from, under the problem's costs."""
    costs = problem.layout.costs
    found: list[Known] = []

    def add(name: str, compiled: Compilation) -> None:
        numbered = problem.numbered(compiled.need_program().ranks)
        if numbered is None:
            return
        peak = problem.peak(numbered)
        if cap is None or peak <= cap + 1e-9:
            found.append(Known(name, numbered, compiled.timeline(costs).makespan, peak))

    path, shown = api.find_schedule(sched)
    if own is not None:
        add(f"stdlib {sched}" if shown.startswith("<stdlib>") else f"the order of {sched}", own)
    layout = problem.layout
    shape = _shape(layout.pipelines, layout.assignment)
    values = {"D": str(layout.num_ranks), "N": str(len(layout.assignment))}
    for stdlib in api.stdlib_names():
        if own is not None and path == api.find_schedule(stdlib)[0]:
            continue
        try:
            file = api.load_file(stdlib)
            given = {k: v for k, v in values.items() if k in {p.name for p in file.schedule.params}}
            bound = run_passes(file, Options(given, costs=costs), "resolve-params")
            assert bound.params is not None
            other = schedule_layout(file, bound.params)
            if _shape(other.pipelines, other.assignment) != shape:
                continue
            if other.frozen or other.chunks or Kind.R in other.kinds:
                continue
            if read_weights(file.schedule, other.scope, other.env) is not None:
                continue
            compiled = api.compile_schedule(stdlib, given, costs=costs, stop_after="insert-holds")
        except PipelangError:
            continue  # its `require`s rule these sizes out
        if compiled.need_program().first_eviction() is None:
            add(f"stdlib {stdlib}", compiled)
    orders = problem.one_at_a_time()
    timed = _timed(problem, orders, problem.times, None)
    found.append(Known("one micro-batch at a time", orders, max(timed), problem.peak(orders)))
    return found


def _shape(pipelines: Sequence[Pipeline], assignment: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Each micro-batch's placement: what two schedules must share to swap orders."""
    placements = {p.name: p.placement for p in pipelines}
    return tuple(placements[name] for name in assignment)


def _timed(
    problem: Problem, orders: Sequence[Sequence[int]], times: Sequence[float], scale: float | None
) -> list[float]:
    """Every op's end when each rank runs `orders` as soon as it can (`Engine.fixed`)."""
    start, timed = problem.engine(times, scale).fixed(orders)
    if len(timed) != problem.size:
        raise AssertionError("a starting order that cannot run")
    return [s + t for s, t in zip(start, times, strict=True)]


# ---- the solver -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Found:
    orders: tuple[tuple[int, ...], ...]
    status: str
    bound: float
    exact: bool


def _scale(values: Sequence[float]) -> tuple[float, bool]:
    """A factor that makes every value an integer, and whether it does so exactly (at
    most `DIGITS` decimals); else one that rounds them to `ROUNDED_STEPS` of the largest."""
    for digits in range(DIGITS + 1):
        scale = 10.0**digits
        if all(abs(v * scale - round(v * scale)) <= 1e-9 * max(1.0, v * scale) for v in values):
            return scale, True
    return ROUNDED_STEPS / max(values), False


@dataclass(frozen=True)
class _Scaled:
    """The problem's times in the solver's integers: every op's time and, per op, its
    inputs with the delay after their end (a transfer where they ran on another rank)."""

    scale: float
    exact: bool
    times: list[int]
    inputs: list[list[tuple[int, int]]]


def _scaled(problem: Problem) -> _Scaled:
    transfers = [problem.costs.transfer(op) for op in problem.ops]
    scale, exact = _scale([t for t in (*problem.times, *transfers) if t > 0] or [1.0])
    inputs = [
        [
            (
                u,
                round(transfers[u] * scale)
                if delayed and problem.ranks[u] != problem.ranks[v]
                else 0,
            )
            for u, delayed in row
        ]
        for v, row in enumerate(problem.inputs)
    ]
    return _Scaled(scale, exact, [round(t * scale) for t in problem.times], inputs)


def _solve(
    cp_model,  # type: ignore[no-untyped-def]
    problem: Problem,
    scaled: _Scaled,
    cap: float | None,
    start: Known,
    time_limit: float,
    workers: int | None,
) -> _Found:
    """CP-SAT's best order within `time_limit` seconds, starting from `start`."""
    scale, exact, times = scaled.scale, scaled.exact, scaled.times
    hint_ends = _timed(problem, start.orders, times, scale)
    horizon = max(hint_ends, default=0)
    least = _rank_bound(problem, scaled)
    if least >= horizon:  # the start is as fast as any order can be
        return _Found(start.orders, "optimal", least / scale, exact)
    model = cp_model.CpModel()
    starts = [model.NewIntVar(0, max(0, round(horizon) - d), f"s{i}") for i, d in enumerate(times)]
    by_rank: list[list[object]] = [[] for _ in range(problem.num_ranks)]
    for i, d in enumerate(times):
        if d > 0:
            by_rank[problem.ranks[i]].append(model.NewFixedSizeIntervalVar(starts[i], d, f"o{i}"))
    for intervals in by_rank:
        model.AddNoOverlap(intervals)
    consumed = [False] * problem.size
    for v, inputs in enumerate(scaled.inputs):
        for u, delay in inputs:
            consumed[u] = True
            model.Add(starts[v] >= starts[u] + times[u] + delay)
    makespan = model.NewIntVar(0, round(horizon), "makespan")
    for i, d in enumerate(times):
        if not consumed[i]:
            model.Add(makespan >= starts[i] + d)
    model.Add(makespan >= least)
    if cap is not None:
        _reservoirs(model, problem, starts, times, cap)
    if not problem.layout.after:
        _first_forwards_in_order(model, problem, starts)
    for i, end in enumerate(hint_ends):
        model.AddHint(starts[i], round(end) - times[i])
    model.AddHint(makespan, round(horizon))
    model.Minimize(makespan)
    solver = _solver(cp_model, time_limit, workers)
    result = solver.Solve(model)
    if result not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return _Found(start.orders, "kept", least / scale, exact)
    bound = max(least, solver.BestObjectiveBound()) / scale
    if solver.ObjectiveValue() >= horizon and result != cp_model.OPTIMAL:
        return _Found(start.orders, "kept", bound, exact)
    orders = _orders(problem, [solver.Value(s) for s in starts], times)
    status = "optimal" if result == cp_model.OPTIMAL else "feasible"
    return _Found(orders, status, bound, exact)


def _solver(cp_model, seconds: float, workers: int | None):  # type: ignore[no-untyped-def]
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.01, seconds)
    solver.parameters.num_workers = workers or min(8, os.cpu_count() or 1)
    solver.parameters.expand_reservoir_constraints = False
    return solver


def _rank_bound(problem: Problem, scaled: _Scaled) -> int:
    """A makespan no order beats: for each rank, the earliest any of its ops can start,
    then all of its work, then the least time any of its ops needs after it ends (the
    longest chain of inputs before an op, and of consumers after it, with delays)."""
    times, delays = scaled.times, scaled.inputs
    order = _topological(problem)
    head = [0] * problem.size
    for v in order:
        for u, delay in delays[v]:
            head[v] = max(head[v], head[u] + times[u] + delay)
    tail = [0] * problem.size
    for v in reversed(order):
        for u, delay in delays[v]:
            tail[u] = max(tail[u], delay + times[v] + tail[v])
    best = 0
    for rank in range(problem.num_ranks):
        mine = [i for i in range(problem.size) if problem.ranks[i] == rank]
        if mine:
            work = sum(times[i] for i in mine)
            best = max(best, min(head[i] for i in mine) + work + min(tail[i] for i in mine))
    return best


def _reservoirs(model, problem: Problem, starts, times: Sequence[int], cap: float) -> None:  # type: ignore[no-untyped-def]
    """Each rank's activations within the cap: a forward adds its activations at its
    start, a B and a W take theirs away at their ends (`sim.memory.change`)."""
    scale = problem.memory_scale
    limit = math.floor(cap * scale + 1e-6)
    events: list[tuple[list[object], list[int]]] = [([], []) for _ in range(problem.num_ranks)]
    for i, change in enumerate(problem.changes):
        amount = round(change * scale)
        if amount == 0:
            continue
        at = starts[i] if amount > 0 else starts[i] + times[i]
        events[problem.ranks[i]][0].append(at)
        events[problem.ranks[i]][1].append(amount)
    for at, amounts in events:
        if sum(a for a in amounts if a > 0) > limit:
            model.AddReservoirConstraint(at, amounts, 0, limit)


def _first_forwards_in_order(model, problem: Problem, starts) -> None:  # type: ignore[no-untyped-def]
    """A pipeline's micro-batches enter it in their order: their first forwards start in
    micro-batch order. Alike micro-batches can be renamed, so no order is lost."""
    last: dict[str, int] = {}
    for mb, pipe in enumerate(problem.layout.assignment):
        i = problem.index[(Kind.F, mb, 0, pipe, None)]
        if pipe in last:
            model.Add(starts[i] >= starts[last[pipe]])
        last[pipe] = i


def _orders(
    problem: Problem, starts: Sequence[int], times: Sequence[int]
) -> tuple[tuple[int, ...], ...]:
    """Each rank's ops by start time; among ops that start together, those that take
    no time first (a W that frees memory before a forward takes it), then in a
    topological order of the inputs."""
    depth = [0] * problem.size
    for v in _topological(problem):
        for u, _ in problem.inputs[v]:
            depth[v] = max(depth[v], depth[u] + 1)
    rows: list[list[int]] = [[] for _ in range(problem.num_ranks)]
    for i in sorted(range(problem.size), key=lambda i: (starts[i], times[i] > 0, depth[i])):
        rows[problem.ranks[i]].append(i)
    return tuple(map(tuple, rows))


def _topological(problem: Problem) -> list[int]:
    """The ops in an order that puts every op after its inputs."""
    graph = {v: [u for u, _ in inputs] for v, inputs in enumerate(problem.inputs)}
    return list(graphlib.TopologicalSorter(graph).static_order())


# ---- the written schedule -------------------------------------------------------------------

OPS_PER_LINE = 6


def write_pipe(problem: Problem, orders: Sequence[Sequence[Action]], name: str, header: str) -> str:
    """The `.pipe` text of the placement with each rank's compute ops in `orders`, under
    `cost` lines that give the problem's costs."""
    layout = problem.layout
    lines = [header.rstrip("\n")] if header else []
    declared = ", ".join(
        f"{key}: {'bool' if isinstance(v, bool) else 'int'} = {_value(v)}"
        for key, v in problem.params
    )
    lines.append(f"schedule {name}({declared}) {{")
    for key, v in problem.params:
        lines.append(
            f'    require {key} == {_value(v)} : "this order was synthesized for '
            f'{key} = {_value(v)}: synthesize again for another"'
        )
    lines.append("    ops " + ", ".join(k.value for k in problem.kinds))
    lines += [f"    cost {item}" for item in _cost_items(layout.costs, layout.num_stages)]
    used = set(layout.assignment)
    for pipe in layout.pipelines:
        if pipe.name in used:
            expr, _ = placement_expr(pipe.placement, layout.num_ranks)
            stages = len(pipe.placement)
            lines.append(f"    pipeline {pipe.name}: stage s in 0..{stages} -> rank {expr}")
    runs: list[tuple[int, int, str]] = []
    for mb, pipe_name in enumerate(layout.assignment):
        if runs and runs[-1][2] == pipe_name:
            runs[-1] = (runs[-1][0], mb + 1, pipe_name)
        else:
            runs.append((mb, mb + 1, pipe_name))
    lines.append("    microbatches " + ", ".join(f"m in {a}..{b} -> {p}" for a, b, p in runs))
    lines.append("    order rank r {")
    for rank, row in enumerate(orders):
        head = "if" if rank == 0 else "} else if"
        lines.append(f"        {head} r == {rank} {{")
        texts = [
            f"{op.kind.value}(mb={op.mb}, stage={op.stage})" for op in row if op.kind.is_compute
        ]
        for k in range(0, len(texts), OPS_PER_LINE):
            lines.append("            " + " ".join(texts[k : k + OPS_PER_LINE]))
    lines += ["        }", "    }", "}", ""]
    return "\n".join(lines)


def _cost_items(costs: CostModel, stages: int) -> list[str]:
    """The `cost` lines' items for the times and the W share the order was found for:
    every kind's value on one line, then a line per kind that differs on some stage."""
    kinds = ("F", "B", "W", "C", "MW")
    items = [", ".join(f"{kind} = {_number(costs.of(kind))}" for kind in kinds)]
    for kind in kinds:
        base = costs.of(kind)
        differ = [s for s in range(stages) if costs.of(kind, s) != base]
        if differ:
            items.append(", ".join(f"{kind}[{s}] = {_number(costs.of(kind, s))}" for s in differ))
    return items


def _value(value: Value) -> str:
    """A parameter's value as a `.pipe` literal."""
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _number(value: float) -> str:
    """A cost as the grammar's NUMBER writes it: digits and a decimal point, no exponent."""
    text = f"{value:.15f}".rstrip("0").rstrip(".")
    return text or "0"


def check_text(text: str) -> Compilation:
    """The written text compiled and checked, as `pipelang check` would (an error here is
    a bug of the writer, and shows as one)."""
    return check_pipe(text, "<synthesized>")


def _header(
    result: Synthesized,
    problem: Problem,
    sched: str,
    params: Mapping[str, str] | None,
    costs: CostModel | None,
    cap: float | None,
    time_limit: float,
) -> str:
    """The comment block at the top of the written file: inputs and results."""
    given = " ".join(f"-p {k}={v}" for k, v in (params or {}).items())
    stdlib = result.best_stdlib
    rows = [
        f"Synthesized by `pipelang synthesize` from the placement of {sched} {given}".rstrip(),
        f"ops {', '.join(k.value for k in problem.kinds)}; costs on the `cost` lines below; "
        + (
            "no cap on activations"
            if cap is None
            else f"at most {_amount(cap, problem)} of activations per rank"
        ),
        f"makespan {as_number(result.makespan)}; lower bound {as_number(result.bound)} "
        f"(gap {result.gap:.1%}); solver: {result.status} in {result.seconds:.1f} s "
        f"(limit {time_limit:g} s), {result.ops} ops",
        f"started from {result.start.name} (makespan {as_number(result.start.makespan)})",
        "best stdlib schedule on this placement within the cap: "
        + (
            "none"
            if stdlib is None
            else f"{stdlib.name.removeprefix('stdlib ')} (makespan {as_number(stdlib.makespan)})"
        ),
        f"peak activations {_amount(result.peak, problem)} on a rank (least possible "
        f"{_amount(result.least_cap, problem)})",
    ]
    if not result.exact_times:
        rows.append("the solver saw the times rounded; the bound is for the rounded times")
    if costs is not None and costs.link() is not None:
        rows.append("C[b] is the link between stages b and b + 1")
    return "".join(f"# {one_line(row)}\n" for row in rows) + "\n"
