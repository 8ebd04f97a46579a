"""What `synthesize` orders: a placement's ops, numbered, each with its rank, time,
inputs and change of its rank's activations (`Problem`), and the orders known before the
search (`starting_points`)."""

from __future__ import annotations

import graphlib
import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

from pipelang import api, ast
from pipelang.compiler import Compilation, Options, run_passes
from pipelang.diagnostics import InternalError, fail
from pipelang.evaluate import SYNTHESIS_MAX_OPS, Value, nesting_limit, op_limit
from pipelang.features import refuse
from pipelang.ir import Action, CostModel, Kind, deps
from pipelang.ir.placement import crossing, owners
from pipelang.ir.program import even_split
from pipelang.orders import Layout
from pipelang.passes.expand_orders import read_after
from pipelang.passes.layout import read_partition, read_weights, schedule_layout
from pipelang.planner.costs import OpCosts, stage_outputs, stage_w_shares
from pipelang.planner.topology import Topology
from pipelang.profile import Profile
from pipelang.sim.engine import Engine, Input, durations
from pipelang.source import Span

SPLIT = (Kind.F, Kind.B, Kind.W)
WHOLE = (Kind.F, Kind.B)


@dataclass(frozen=True)
class Known:
    """An order known before the search: where it comes from, each rank's op numbers (in
    the problem's numbering), its makespans (its schedule's, and as the written file of
    this order runs), its peak activations, and the ops that start together with the op
    before them (its overlapped pairs and `BW`s, kept in the written file)."""

    name: str
    orders: tuple[tuple[int, ...], ...]
    makespan: float
    """Its makespan as `pipelang simulate` gives it for the schedule it comes from (a
    whole backward one op, its own `after` edges), or `timed` where that is more: the
    number it is named with, which the answer never exceeds."""
    peak: float
    fused: frozenset[int] = field(default=frozenset())
    timed: float = 0.0
    """Its makespan as the file `synthesize` writes of it runs (`Problem.makespan`)."""


Orders = tuple[tuple[int, ...], ...]


def decimal(value: float) -> Fraction:
    """A number as the decimal it prints as (`repr`), exactly: what was written (`MW=0.0015`,
    a cap of 1.0019), not the binary float nearest it."""
    return Fraction(repr(float(value)))


def _placement(
    sched: str,
    params: Mapping[str, str] | None,
    costs: CostModel | None,
    kinds: Callable[[Layout], tuple[Kind, ...]],
    most: int,
) -> tuple[Layout, Compilation | None, ast.File, Mapping[str, Value]]:
    """The schedule's layout under `costs`, its compilation when it has an order (a file
    of `pipeline` and `microbatches` lines alone is a placement too, its `after` lines
    read), the file, and its parameters' values; E0605 before any order is run where the
    ops to order (of `kinds`) are more than `most`."""
    layout, file, bindings = _declarations(sched, params, costs)
    size = len(layout.program.assignment) * layout.program.num_stages * len(kinds(layout))
    if size > most:
        limit = "the most `synthesize` orders, which keep the solver within about 1 GiB"
        raise fail(
            "E0605",
            f"{file.schedule.name} has {size:,} ops to order here, more than {most:,}: "
            + (
                limit
                if most >= SYNTHESIS_MAX_OPS
                else f"`--max-ops` (at most {SYNTHESIS_MAX_OPS:,}: {limit})"
            ),
            help="synthesize for fewer micro-batches (N) or stages",
        )
    orders = (ast.OrderRank, ast.OrderGreedy, ast.OrderRepeat)
    if not any(isinstance(d, orders) for d in file.schedule.body):
        with nesting_limit(file.schedule.span), op_limit(max(most, SYNTHESIS_MAX_OPS)):
            after = read_after(file.schedule, layout)
        return layout.declaring(after=after), None, file, bindings
    compiled = api.compile_schedule(sched, params, costs=costs, stop_after="insert-holds")
    layout = layout.declaring(after=compiled.need_program().after)
    return layout, compiled, file, bindings


def _declarations(
    sched: str, params: Mapping[str, str] | None, costs: CostModel | None
) -> tuple[Layout, ast.File, Mapping[str, Value]]:
    """The schedule's declarations (its order not run): the layout under `costs`, the
    file and its parameters' values; what `synthesize` cannot order (`features.REFUSED`)
    is E0602, at the schedule."""
    file = api.load_file(sched)
    bindings = run_passes(file, Options(dict(params or {}), costs=costs), "resolve-params").params
    assert bindings is not None  # resolve-params ran
    layout = schedule_layout(file, bindings, costs=costs)
    weights = read_weights(file.schedule, layout.scope, layout.env)
    refuse(layout.declaring(weights=weights).program, "synthesize", "E0602", file.schedule.span)
    return layout, file, bindings


def problem_of(
    sched: str,
    params: Mapping[str, str] | None = None,
    costs: CostModel | None = None,
    split: bool | None = None,
    stage_bytes: Sequence[tuple[float, float]] | None = None,
    partition: Sequence[int] | None = None,
    most: int = SYNTHESIS_MAX_OPS,
) -> tuple[Problem, Compilation | None]:
    """The ops to order for the placement of `sched` (see `synthesize`; at most `most`,
    E0605), and the schedule's compilation when it has an order of its own."""
    layout, own, file, bound = _placement(
        sched, params, costs, lambda layout: _kinds(layout, split), most
    )
    if stage_bytes is not None and len(stage_bytes) != layout.program.num_stages:
        raise InternalError(
            f"{len(stage_bytes)} stages' bytes for {layout.program.num_stages} stages"
        )
    values = tuple((p.name, bound[p.name]) for p in file.schedule.params)
    cut = _cut(file, layout, partition)
    problem = Problem(layout, _kinds(layout, split), file.schedule.name, values, stage_bytes, cut)
    _check_acyclic(problem, file.schedule.span)
    return problem, own


def _check_acyclic(problem: Problem, span: Span | None) -> None:
    """E0306 at an `after` of a placement that makes its ops wait on each other in a
    cycle (an order of the schedule's own is refused so when it is compiled): no order
    runs them."""
    graph = {v: [u for u, _ in row] for v, row in enumerate(problem.inputs)}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as err:
        cycle: list[int] = err.args[1]  # each op waits for the one before it
        ops = [problem.ops[i] for i in cycle]
        edges = {
            (deps.op_key(d.earlier), deps.op_key(d.later)): d for d in problem.layout.program.after
        }
        found = [
            edges[key]
            for a, b in itertools.pairwise(ops)
            if (key := (deps.op_key(a), deps.op_key(b))) in edges
        ]
        shown = " -> ".join(f"`{op}`" for op in ops[:8]) + (" -> ..." if len(ops) > 8 else "")
        raise fail(
            "E0306",
            f"no order runs these ops: they wait on each other in a cycle, through this "
            f"`after`: {shown}",
            found[0].span if found and found[0].span is not None else span,
            help="an `after` makes a cycle with the ops' own dependencies (a backward after "
            "its forward, a stage after the one before): drop it or turn it around",
        ) from None


def _cut(file: ast.File, layout: Layout, given: Sequence[int] | None) -> tuple[int, ...] | None:
    """The model's layers per stage: `given` (a `--partition`) where there is one, else
    the schedule's `partition` line; None: the runtime's even split."""
    if given is None:
        return read_partition(file.schedule, layout.scope, layout.env, layout.program.num_stages)
    shown = ", ".join(map(str, given))
    if len(given) != layout.program.num_stages:
        raise fail(
            "usage",
            f"the partition {shown} gives {len(given)} stages; {file.schedule.name}'s "
            f"placement has {layout.program.num_stages}",
        )
    if min(given) < 1:
        raise fail("usage", f"the partition {shown} leaves a stage without layers")
    return tuple(given)


def _kinds(layout: Layout, split: bool | None) -> tuple[Kind, ...]:
    """The op kinds to order: B and W split or not, or as the schedule declares them."""
    return layout.program.kinds if split is None else SPLIT if split else WHOLE


def stages_of(
    sched: str, params: Mapping[str, str] | None = None, partition: Sequence[int] | None = None
) -> tuple[int, tuple[int, ...] | None]:
    """The placement's stage count and its cut (`partition`, else its `partition` line;
    None: even), what measuring a model's bytes per stage needs."""
    layout, file, _ = _declarations(sched, params, None)
    return layout.program.num_stages, _cut(file, layout, partition)


def amount(value: float, problem: Problem) -> str:
    """A number of activations as the problem counts them."""
    if problem.stage_bytes is None:
        return f"{value:.15g} micro-batch{'es' if value != 1 else ''}"
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
    stages, ranks = layout.program.num_stages, layout.program.num_ranks
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
    ops = OpCosts(profile, "sgd")
    crosses = crossing(layout.program.pipelines)
    model = ops.cost_model(counts, Kind.W in _kinds(layout, split), crosses)
    entries = [("MW", s, share) for s, share in enumerate(stage_w_shares(profile, counts))]
    if topology is not None:
        outputs = stage_outputs(profile, counts)
        for b in range(stages - 1):
            pairs = {(p.placement[b], p.placement[b + 1]) for p in layout.program.pipelines}
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
        self.costs = costs = layout.program.costs.for_kinds(self.kinds)
        self.ops = [
            Action(kind, mb, stage, pipe)
            for mb, pipe in enumerate(layout.program.assignment)
            for stage in range(layout.program.num_stages)
            for kind in self.kinds
        ]
        self.index = {deps.op_key(op): i for i, op in enumerate(self.ops)}
        owner = owners(layout.program.pipelines)
        self.ranks = [owner[(op.stage, op.pipeline)] for op in self.ops]
        self.times = [costs.time(op) for op in self.ops]
        extra: dict[int, list[int]] = {}
        for dep in layout.program.after:
            later, earlier = (
                self.index.get(deps.op_key(dep.later)),
                self.index.get(deps.op_key(dep.earlier)),
            )
            if later is not None and earlier is not None:
                extra.setdefault(later, []).append(earlier)
        stages = layout.program.num_stages
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
        sizes = [1.0] * layout.program.num_stages
        if stage_bytes is not None:
            sizes = [saved for saved, _ in stage_bytes]
        self.sizes = sizes
        """What one forward holds on each stage: 1 micro-batch, or its bytes."""
        self.changes = self._changes()
        """How each op changes its rank's activations, exactly (a decimal `MW` as written):
        what the solver counts and `peak` adds up."""

    def _changes(self) -> list[Fraction]:
        """`sim.memory.change` of every op, times its stage's size, in exact numbers."""
        split = Kind.W in self.kinds
        stages: list[tuple[Fraction, Fraction | None]] = []  # (held, what W keeps)
        for stage in range(self.layout.program.num_stages):
            if self.stage_bytes is None:
                kept = decimal(self.costs.of("MW", stage)) if split else None
                stages.append((Fraction(1), kept))
            else:
                saved, kept_bytes = (_exact(v) for v in self.stage_bytes[stage])
                share = (kept_bytes / saved if saved else Fraction(0)) if split else None
                stages.append((saved, share))
        changes = []
        for op in self.ops:
            held, kept = stages[op.stage or 0]
            if op.kind is Kind.F:
                changes.append(held)
            elif op.kind is Kind.B:
                changes.append(-held if kept is None else (kept - 1) * held)
            else:
                changes.append(-held * kept if kept is not None else Fraction(0))
        return changes

    @property
    def size(self) -> int:
        return len(self.ops)

    @property
    def num_ranks(self) -> int:
        return self.layout.program.num_ranks

    def engine(self, times: Sequence[float], transfers: Sequence[float] | None = None) -> Engine:
        """The timing engine over these ops with `times`: each transfer the cost model's
        (`C`, `C[b]`), as `simulate` times it, or op i's `transfers[i]` (the solver's)."""
        costs = self.costs
        if transfers is None:
            return Engine(self.ranks, times, self.inputs, link=costs.link(), actions=self.ops,
                          transfer=costs.of("C"))  # fmt: skip
        index = self.index
        return Engine(
            self.ranks,
            times,
            self.inputs,
            link=lambda op, src, dst: transfers[index[deps.op_key(op)]],
            actions=self.ops,
        )

    def makespan(
        self, orders: Sequence[Sequence[int]], fused: frozenset[int] = frozenset()
    ) -> float | None:
        """When the last op of `orders` ends, as `pipelang simulate` times the written file
        (`sim.timeline.simulate`): each op in `fused` starts together with the op before
        it on its rank, as one compound (an overlapped pair takes `FB`). None when the
        orders wait on each other (an `after` edge they break)."""
        heads = list(range(self.size))
        for row in orders:
            for k in range(1, len(row)):
                if row[k] in fused:
                    heads[row[k]] = heads[row[k - 1]]
        times = durations(self.ops, heads, self.costs.time, self.costs)
        inputs = [list(waits) for waits in self.inputs]
        for v, waits in enumerate(self.inputs):  # a compound waits for all its ops' inputs
            if heads[v] != v:
                inputs[heads[v]] += [
                    (u, True) for u, data in waits if data and heads[u] != heads[v]
                ]
        engine = self.engine(times)
        engine.inputs = inputs
        start, timed = engine.fixed(orders)
        if len(timed) != self.size:
            return None
        return max((s + t for s, t in zip(start, times, strict=True)), default=0.0)

    def peak(self, orders: Sequence[Sequence[int]]) -> float:
        """The most activations a rank holds along `orders`, in micro-batches or bytes
        (`sim.memory.peak`, `peak_bytes`, counted exactly)."""
        return float(self.exact_peak(orders))

    def exact_peak(self, orders: Sequence[Sequence[int]]) -> Fraction:
        """`peak` as an exact number."""
        most = Fraction(0)
        for row in orders:
            held = Fraction(0)
            for i in row:
                held += self.changes[i]
                most = max(most, held)
        return most

    def fits(self, orders: Sequence[Sequence[int]], cap: float | None) -> bool:
        """Whether `orders` hold at most `cap` on every rank (None: no cap), exactly."""
        return cap is None or self.exact_peak(orders) <= decimal(cap)

    def least_cap(self) -> tuple[float, str]:
        """The fewest activations some rank holds under any order, and why: when a
        micro-batch's last forward runs, no backward of it can have run, so every rank
        holds all its stages of that micro-batch's pipeline."""
        most, why = 0.0, ""
        for pipe in self.layout.program.pipelines:
            if pipe.name not in self.layout.program.assignment:
                continue
            held = {
                rank: sum(self.sizes[s] for s in stages)
                for (name, rank), stages in self.layout.local_stages.items()
                if name == pipe.name
            }
            rank = min(held, key=lambda r: (-held[r], r))
            if held[rank] > most:
                most = held[rank]
                stages = len(self.layout.local_stages[(pipe.name, rank)])
                amount = f" ({most:,.0f} bytes)" if self.stage_bytes is not None else ""
                why = (
                    f"rank {rank} holds {stages} stage(s) of pipeline `{pipe.name}`{amount}, "
                    "and a micro-batch's forwards on all of them are held at once, before "
                    "its first backward"
                )
        return most, why

    def numbered(self, ranks: Sequence[Sequence[Action]]) -> tuple[Orders, frozenset[int]] | None:
        """Each rank's op numbers for an order of Actions, and the ops fused to the one
        before them (`Action.fused`); where the order's backward is whole and these ops
        split it, its `B` stands for B then W (W fused to B where B is in a compound:
        `F & BW`). None when the order is not one of these ops, each once on its rank."""
        whole = not any(a.kind is Kind.W for row in ranks for a in row)
        orders: list[tuple[int, ...]] = []
        fused: set[int] = set()
        for rank, actions in enumerate(ranks):
            row: list[int] = []
            computes = [a for a in actions if a.kind.is_compute]
            for k, action in enumerate(computes):
                kinds = [action.kind]
                if whole and action.kind is Kind.B and Kind.W in self.kinds:
                    kinds.append(Kind.W)
                joined = k + 1 < len(computes) and computes[k + 1].fused
                for n, kind in enumerate(kinds):
                    i = self.index.get((kind, action.mb, action.stage, action.pipeline, None))
                    if i is None or self.ranks[i] != rank:
                        return None
                    if (action.fused and n == 0) or (n > 0 and (action.fused or joined)):
                        fused.add(i)
                    row.append(i)
            orders.append(tuple(row))
        if len(orders) != self.num_ranks or sorted(i for r in orders for i in r) != list(
            range(self.size)
        ):
            return None
        return tuple(orders), frozenset(fused)

    def actions(
        self, orders: Sequence[Sequence[int]], fused: frozenset[int] = frozenset()
    ) -> list[list[Action]]:
        """Each rank's ops for their numbers, those in `fused` fused to the op before."""
        return [
            [self.ops[i]._replace(fused=True) if i in fused else self.ops[i] for i in row]
            for row in orders
        ]

    def one_at_a_time(self) -> tuple[tuple[int, ...], ...]:
        """Every micro-batch through all its ops before the next starts (forwards down
        the stages, then each backward followed by its W): the least memory, each rank
        holding one micro-batch's stages at most."""
        orders: list[list[int]] = [[] for _ in range(self.num_ranks)]
        stages = self.layout.program.num_stages
        for mb, pipe in enumerate(self.layout.program.assignment):
            sequence = [(Kind.F, s) for s in range(stages)]
            for s in reversed(range(stages)):
                sequence += [(k, s) for k in self.kinds if k is not Kind.F]
            for kind, stage in sequence:
                i = self.index[(kind, mb, stage, pipe, None)]
                orders[self.ranks[i]].append(i)
        return tuple(map(tuple, orders))


def _exact(value: float) -> Fraction:
    """A byte count exactly (an int as it is, a float as it prints)."""
    return Fraction(value) if isinstance(value, int) else decimal(value)


def timed(
    problem: Problem,
    orders: Sequence[Sequence[int]],
    times: Sequence[float],
    transfers: Sequence[float],
) -> list[float]:
    """Every op's end when each rank runs `orders` as soon as it can (`Engine.fixed`),
    each op taking `times` and each transfer `transfers` (the solver's integers)."""
    start, timed = problem.engine(times, transfers).fixed(orders)
    if len(timed) != problem.size:
        raise InternalError("a starting order that cannot run")
    return [s + t for s, t in zip(start, times, strict=True)]
