"""What `synthesize` orders: a placement's ops, numbered, each with its rank, time,
inputs and change of its rank's activations (`Problem`), and the orders known before the
search (`starting_points`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipelang import api, ast
from pipelang.compiler import Compilation, Options, run_passes
from pipelang.diagnostics import InternalError, PipelangError, fail
from pipelang.evaluate import Value
from pipelang.ir import Action, CostModel, Kind, Pipeline, deps, stage_problem
from pipelang.orders import Layout
from pipelang.passes.layout import read_partition, read_weights, schedule_layout
from pipelang.planner.costs import OpCosts, stage_outputs, stage_w_shares
from pipelang.planner.partition import even_split
from pipelang.planner.profile import Profile
from pipelang.planner.topology import Topology
from pipelang.sim import memory
from pipelang.sim.engine import Engine, Input

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
    partition: Sequence[int] | None = None,
) -> tuple[Problem, Compilation | None]:
    """The ops to order for the placement of `sched` (see `synthesize`), and the
    schedule's compilation when it has an order of its own."""
    layout, own, file, bound = _placement(sched, params, costs)
    if stage_bytes is not None and len(stage_bytes) != layout.num_stages:
        raise InternalError(f"{len(stage_bytes)} stages' bytes for {layout.num_stages} stages")
    values = tuple((p.name, bound[p.name]) for p in file.schedule.params)
    cut = _cut(file, layout, partition)
    problem = Problem(layout, _kinds(layout, split), file.schedule.name, values, stage_bytes, cut)
    return problem, own


def _cut(file: ast.File, layout: Layout, given: Sequence[int] | None) -> tuple[int, ...] | None:
    """The model's layers per stage: `given` (a `--partition`) where there is one, else
    the schedule's `partition` line; None: the runtime's even split."""
    if given is None:
        return read_partition(file.schedule, layout.scope, layout.env, layout.num_stages)
    shown = ", ".join(map(str, given))
    if len(given) != layout.num_stages:
        raise fail(
            "usage",
            f"the partition {shown} gives {len(given)} stages; {file.schedule.name}'s "
            f"placement has {layout.num_stages}",
        )
    if min(given) < 1:
        raise fail("usage", f"the partition {shown} leaves a stage without layers")
    return tuple(given)


def _kinds(layout: Layout, split: bool | None) -> tuple[Kind, ...]:
    """The op kinds to order: B and W split or not, or as the schedule declares them."""
    return layout.kinds if split is None else SPLIT if split else WHOLE


def stages_of(
    sched: str, params: Mapping[str, str] | None = None, partition: Sequence[int] | None = None
) -> tuple[int, tuple[int, ...] | None]:
    """The placement's stage count and its cut (`partition`, else its `partition` line;
    None: even), what measuring a model's bytes per stage needs."""
    layout, file, _ = _declarations(sched, params, None)
    return layout.num_stages, _cut(file, layout, partition)


def amount(value: float, problem: Problem) -> str:
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
    partition: Sequence[int] | None = None,
) -> CostModel:
    """Per-stage costs in milliseconds from a profile: each stage's F, B and W summed over
    its layers (`partition`, else the schedule's `partition` line, else the runtime's
    even split; with the profile's runtime calibration, as the planner counts them,
    `OpCosts`), W's share of the activations (`MW`), and with a topology, rank r on its
    device r, each stage boundary's transfer of the stage's output over the link between
    the two ranks (`C[b]`; the slowest, where pipelines cross a boundary between other
    ranks). A profile or topology that does not fit the placement is E0604."""
    layout, file, _ = _declarations(sched, params, None)
    stages, ranks = layout.num_stages, layout.num_ranks
    layers = len(profile.layers)
    counts = _cut(file, layout, partition)
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
        partition: tuple[int, ...] | None = None,
    ) -> None:
        self.layout, self.kinds, self.name = layout, tuple(kinds), name
        self.params = params
        """The schedule's parameters and their values: the written file declares them,
        each required to be what the order was found for."""
        self.partition = partition
        """The cut (a given partition, else the schedule's `partition` line; None: the
        even split): what its costs and bytes are for, which the written file keeps, so
        that `pipelang run` cuts the model so."""
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
    ends = timed(problem, orders, problem.times, None)
    found.append(Known("one micro-batch at a time", orders, max(ends), problem.peak(orders)))
    return found


def _shape(pipelines: Sequence[Pipeline], assignment: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Each micro-batch's placement: what two schedules must share to swap orders."""
    placements = {p.name: p.placement for p in pipelines}
    return tuple(placements[name] for name in assignment)


def timed(
    problem: Problem, orders: Sequence[Sequence[int]], times: Sequence[float], scale: float | None
) -> list[float]:
    """Every op's end when each rank runs `orders` as soon as it can (`Engine.fixed`)."""
    start, timed = problem.engine(times, scale).fixed(orders)
    if len(timed) != problem.size:
        raise AssertionError("a starting order that cannot run")
    return [s + t for s, t in zip(start, times, strict=True)]
