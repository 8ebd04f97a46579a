"""The planner's model of one plan: a candidate's schedule compiled and simulated with
per-stage costs from the profile and every transfer timed on its link (`PlanModel`); what
`search.py` judges each partition and mapping by."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pipelang import api, ast
from pipelang.compiler import Compilation, Options, run_passes
from pipelang.diagnostics import PipelangError
from pipelang.ir import Action, CostModel, Kind, Pipeline, placement
from pipelang.orders import Layout
from pipelang.passes.layout import schedule_layout
from pipelang.planner.bound import iteration_bound
from pipelang.planner.costs import (
    OpCosts,
    allreduce_end,
    peak_memory,
    stage_outputs,
    stage_weights,
)
from pipelang.planner.families import STATE_FACTOR
from pipelang.planner.partition import best_partition
from pipelang.planner.plans import (
    FULL_OPS,
    Candidate,
    Inputs,
    Plan,
    Prediction,
    lopsided,
)
from pipelang.planner.topology import Topology
from pipelang.sim.timeline import simulate

PLANNER_MAX_OPS = 4_000_000
"""The op limit of the schedules the planner compiles. The user's `--max-ops` guards
against a mistyped parameter; the planner picks its own sizes, and its time budget (not
the op count) bounds its search: a 1024-device plan simulates 262,144-op Chimeras."""


def options(candidate: Candidate) -> Options:
    return Options({k: str(v) for k, v in candidate.params}, max_ops=PLANNER_MAX_OPS)


def with_costs(file: ast.File, costs: CostModel) -> ast.File:
    """The file with `costs` appended as a `cost` line (greedy orders replay them)."""
    span = file.schedule.span
    items = tuple(
        ast.CostItem(span, kind, None if stage is None else ast.IntLit(span, stage), value)
        for kind, stage, value in costs.entries
    )
    schedule = replace(file.schedule, body=(*file.schedule.body, ast.Cost(span, items)))
    return replace(file, schedule=schedule)


class PlanModel:
    """What the simulator says of one candidate's plan: its declarations (`layout`) and
    the bound they give, its compiled program, the DP's cut for a mapping, and the
    simulated iteration and memory of a partition on devices (`predict`); the parsed
    files, compiled programs and layouts it reuses."""

    def __init__(self, inputs: Inputs, dp: int = 1, world: Topology | None = None) -> None:
        self.inputs = inputs
        self.dp = dp
        self.world = world or inputs.topology
        self.costs = OpCosts(inputs.profile, inputs.optimizer)
        """The cost model of the layers and the runtime (planner/costs.py)."""
        self.files: dict[str, ast.File] = {}
        self._compiled: dict[Candidate, tuple[CostModel | None, Compilation]] = {}
        """Each candidate's last compilation, and the costs its order was expanded under
        (None when the order does not depend on them)."""
        self._layouts: dict[Candidate, Layout | str] = {}
        self._first_cuts: dict[int, tuple[int, ...]] = {}

    def predict(
        self,
        candidate: Candidate,
        counts: Sequence[int],
        devices: Sequence[int],
        full: bool,
        reorder: bool = True,
    ) -> Plan:
        """What the simulator says of this partition and mapping: at N when `full` or
        small enough, else extrapolated from the two probe sizes."""
        sizes = self.probe_sizes(candidate)
        if full:
            sizes = [self.inputs.micro_batches]
        runs = [(n, self.simulate_at(candidate.with_n(n), counts, devices, reorder)) for n in sizes]
        n_b, last = runs[-1]
        big_n = self.inputs.micro_batches
        if len(runs) == 1:
            time_ms, memory = last.time_ms, last.memory
        else:
            n_a, first = runs[0]
            slope = (last.time_ms - first.time_ms) / (n_b - n_a)
            time_ms = last.time_ms + (big_n - n_b) * slope
            memory = [
                max(b, b + (big_n - n_b) * (b - a) / (n_b - n_a))
                for a, b in zip(first.memory, last.memory, strict=True)
            ]
        busy = last.busy_ms * big_n / n_b
        bubble = 1 - busy / (candidate.ranks * time_ms) if time_ms > 0 else 0.0
        mean = sum(last.transfers) / len(last.transfers) if last.transfers else 0.0
        split_w = self.split_w(candidate)
        return Plan(
            candidate,
            tuple(counts),
            tuple(devices),
            time_ms,
            bubble,
            tuple(memory),
            exact=len(runs) == 1,
            split_w=split_w,
            transfer_ms=mean,
            lopsided=lopsided(self.costs.stage_costs(counts, split_w)),
        )

    def file(self, name: str) -> ast.File:
        if name not in self.files:
            self.files[name] = api.load_file(name)
        return self.files[name]

    def split_w(self, candidate: Candidate) -> bool:
        """Whether the schedule splits the weight gradient off the backward (`ops` has W)."""
        body = self.file(candidate.schedule).schedule.body
        return any(isinstance(d, ast.Ops) and "W" in d.kinds for d in body)

    def cost_dependent(self, candidate: Candidate) -> bool:
        """Whether the schedule's order depends on the costs (greedy, or squeezed)."""
        return any(
            isinstance(d, ast.OrderGreedy) or (isinstance(d, ast.OrderRepeat) and d.squeeze)
            for d in self.file(candidate.schedule).schedule.body
        )

    def require(self, candidate: Candidate) -> str | None:
        """The message of the first `require` that fails at these parameters (or of the
        first error in the schedule's declarations), if any."""
        layout = self.layout(candidate)
        return layout if isinstance(layout, str) else None

    def layout(self, candidate: Candidate) -> Layout | str:
        """The candidate's declarations evaluated (its order not run), or why they fail."""
        if candidate not in self._layouts:
            file = self.file(candidate.schedule)
            try:
                params = run_passes(file, options(candidate), "resolve-params").params
                assert params is not None
                self._layouts[candidate] = schedule_layout(file, params, PLANNER_MAX_OPS)
            except PipelangError as err:
                self._layouts[candidate] = err.diagnostics[0].message
        return self._layouts[candidate]

    def first_cut(self, stages: int) -> tuple[int, ...]:
        """The DP's partition without transfers (at every device's speed 1)."""
        if stages not in self._first_cuts:
            layers = self.costs.layer_time
            self._first_cuts[stages] = best_partition(
                layers, stages, self.inputs.micro_batches
            ).counts
        return self._first_cuts[stages]

    def bound(self, candidate: Candidate) -> float:
        """A lower bound on the candidate's iteration (`bound.py`) at the DP's first
        cut, every stage at the fastest device's speed, transfers free; 0 when its
        declarations fail (`screen` then says why)."""
        layout = self.layout(candidate)
        if isinstance(layout, str) or candidate.stages > len(self.costs.layer_time):
            return 0.0
        topology = self.inputs.topology
        fastest = max(topology.speed_of(d) for d in range(topology.size))
        stage_costs = self.costs.stage_costs(
            self.first_cut(candidate.stages),
            self.split_w(candidate),
            placement.crossing(layout.program.pipelines),
            [fastest] * candidate.stages,
        )
        return iteration_bound(layout, stage_costs)

    def probe_sizes(self, candidate: Candidate) -> list[int]:
        big_n = self.inputs.micro_batches
        if big_n * candidate.stages * 3 <= FULL_OPS:
            return [big_n]
        for base in (candidate.ranks, 2 * candidate.ranks, 4 * candidate.ranks):
            valid = 2 * base < big_n and self.require(candidate.with_n(base)) is None
            if valid and self.require(candidate.with_n(2 * base)) is None:
                return [base, 2 * base]
        return [big_n]

    def compiled(
        self, candidate: Candidate, costs: CostModel | None = None, reorder: bool = False
    ) -> Compilation:
        """The schedule expanded and validated at these parameters (its program and op
        graph), kept for reuse. A greedy or squeezed order depends on the costs: with
        `reorder` it is expanded again under `costs` unless it already was (the local
        search reuses the order found for the partition it starts from)."""
        file = self.file(candidate.schedule)
        depends = self.cost_dependent(candidate)
        if candidate in self._compiled:
            under, compiled = self._compiled[candidate]
            if not (depends and reorder) or under == costs:
                return compiled
        if depends and costs is not None:
            file = with_costs(file, costs)
        compiled = run_passes(file, options(candidate), "validate")
        self._compiled[candidate] = (costs if depends else None, compiled)
        return compiled

    def cut(
        self, candidate: Candidate, pipelines: Sequence[Pipeline], devices: Sequence[int]
    ) -> tuple[int, ...]:
        """The DP partition, each boundary timed on the link between the devices of the
        ranks that hold its two stages in the first pipeline."""
        placement = pipelines[0].placement
        topology = self.inputs.topology
        outputs = [c.output_bytes for c in self.inputs.profile.layers]

        def cut(boundary: int, before: int) -> float:
            a, b = devices[placement[boundary]], devices[placement[boundary + 1]]
            return self.costs.boundary_ms(topology, a, b, outputs[before - 1])

        split = best_partition(
            self.costs.layer_time,
            candidate.stages,
            self.inputs.micro_batches,
            cut,
            speeds=self.stage_speeds(pipelines, devices),
        )
        return split.counts

    def plan_speeds(self, plan: Plan) -> list[float] | None:
        """Each stage's device speed in `plan` (`_stage_speeds`); None on a topology of
        one speed."""
        return self.stage_speeds(self.pipelines(plan.candidate), plan.devices)

    def pipelines(self, candidate: Candidate) -> tuple[Pipeline, ...]:
        """The candidate's pipelines (which rank holds each stage), from its layout."""
        layout = self.layout(candidate)
        assert not isinstance(layout, str), layout
        return layout.program.pipelines

    def boundary_transfers(self, plan: Plan) -> list[float | None]:
        """Per stage boundary of `plan`, the time of a transfer across it as the prediction
        timed it (`OpCosts.links`: the stage's output over the link between the two ranks'
        devices; 0 where one rank holds both stages), or None where its pipelines cross it
        between ranks whose links take different times."""
        outputs = stage_outputs(self.inputs.profile, plan.partition)
        link, _ = self.costs.links(self.inputs.topology, plan.devices, outputs)
        pipelines = self.pipelines(plan.candidate)
        found: list[float | None] = []
        for b in range(plan.candidate.stages - 1):
            times = {
                0.0 if x == y else link(Action(Kind.F, 0, b, p.name), x, y)
                for p in pipelines
                for x, y in [(p.placement[b], p.placement[b + 1])]
            }
            found.append(times.pop() if len(times) == 1 else None)
        return found

    def stage_speeds(
        self, pipelines: Sequence[Pipeline], devices: Sequence[int]
    ) -> list[float] | None:
        """Each stage's speed: that of the slowest device holding a copy of it (a stage's
        cost is one per stage, for all its replicas); None on a topology of one speed."""
        topology = self.inputs.topology
        if not topology.speeds:
            return None
        return [
            min(topology.speed_of(devices[p.placement[stage]]) for p in pipelines)
            for stage in range(len(pipelines[0].placement))
        ]

    def simulate_at(
        self, candidate: Candidate, counts: Sequence[int], devices: Sequence[int], reorder: bool
    ) -> Prediction:
        split_w = self.split_w(candidate)
        pipelines = self.pipelines(candidate)
        speeds = self.stage_speeds(pipelines, devices)
        costs = self.costs.cost_model(counts, split_w, placement.crossing(pipelines), speeds)
        # A greedy order is expanded under the costs simulated: device speeds, host costs.
        compiled = self.compiled(candidate, costs, reorder)
        program, graph = compiled.need_program(), compiled.graph
        assert graph is not None
        topology = self.inputs.topology
        outputs = stage_outputs(self.inputs.profile, counts)
        link, transfers = self.costs.links(topology, devices, outputs)
        timeline = simulate(program, graph, costs, link)
        weights = stage_weights(self.inputs.profile, counts)
        synced = allreduce_end(
            program, timeline.events, weights, devices, self.world, copies=self.dp
        )
        busy = sum(timeline.busy(r) for r in range(program.num_ranks))
        factor = STATE_FACTOR[self.inputs.optimizer]
        memory = peak_memory(program, self.inputs.profile, counts, factor)
        speeds = [topology.speed_of(devices[rank]) for rank in range(program.num_ranks)]
        end = self.costs.iteration_ms(counts, program, timeline.events, speeds, synced)
        return Prediction(end, busy, memory, transfers)
