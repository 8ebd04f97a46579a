"""The search: schedule, parameters, partition and device mapping, by simulation.

For every candidate (a stdlib schedule with D ranks and its other parameters, see
`candidates`), the planner

1. checks the schedule's own `require`s at the requested N (a failure is the reason the
   candidate is left out);
2. cuts the layers into the schedule's S stages with the exact DP of `partition.py`,
   with the transfer times of the links the stage boundaries cross;
3. maps ranks to devices (`mapping.py`) from the traffic of the compiled program, then
   cuts again with the mapped links;
4. predicts the iteration with pipelang's simulator (`simulate`) on the compiled
   program: per-stage F, B, W costs summed from the profile, every transfer timed on
   the link between its two ranks' devices, and the gradient allreduce of replicated
   stages (Chimera, GEMS) added after each stage's last backward on its replicas;
5. computes each device's peak memory: weights (times the optimizer's state factor) of
   the stage copies it holds, plus the activations in flight along its order.

Before any of that, every candidate is bounded from below (`bound.py`: its layout and
its stage costs at the DP's first cut, no compile), and they are screened in the order
of their bounds: when a bound exceeds the time of the `exact_top` best plans found so
far, the candidate cannot enter the top and is not simulated. With copies planned,
they are searched first (the smallest pipelines first, the quickest), so that what they
find bounds the larger pipelines.

Large schedules are first screened on two smaller micro-batch counts and extrapolated
linearly to N (exact for schedules whose time grows by a fixed amount per micro-batch,
as every stdlib schedule does past its warm-up); the best few are then improved by a
local search on the partition, each step judged by the simulator, and simulated at N.
Under a time budget, candidates whose screening would end past it are left out (the
cost is judged from the same schedule at a smaller D), and a shortlisted one whose
simulation at N would is kept extrapolated.

With `Inputs.data_parallel`, each W > 1 dividing the device count and N is also planned
as W copies of a pipeline over devices / W devices (`Planner.with_copies`: the same
search on the first block of devices with N / W micro-batches, and every stage's
allreduce taken over its replicas in all copies).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from pipelang import api, ast
from pipelang.compiler import Compilation, Options, run_passes
from pipelang.diagnostics import PipelangError
from pipelang.ir import Action, CostModel, Kind, Pipeline
from pipelang.orders import Layout
from pipelang.passes.layout import schedule_layout
from pipelang.planner import budget
from pipelang.planner.bound import iteration_bound
from pipelang.planner.costs import (
    OpCosts,
    allreduce_end,
    peak_memory,
    program_traffic,
    stage_outputs,
    stage_weights,
    sums,
)
from pipelang.planner.families import STATE_FACTOR, Params
from pipelang.planner.mapping import map_ranks
from pipelang.planner.partition import best_partition
from pipelang.planner.plans import (
    FULL_OPS,
    Candidate,
    Inputs,
    Leaders,
    Plan,
    Prediction,
    Rejected,
    SearchResult,
    candidates,
    lopsided,
)
from pipelang.planner.topology import Topology
from pipelang.planner.units import format_bytes
from pipelang.simulate import simulate


class Planner:
    """Runs the search; keeps the compiled programs and parsed files it reuses."""

    def __init__(
        self,
        inputs: Inputs,
        exact_top: int = 3,
        refine_steps: int = 24,
        refine_seconds: float = 3.0,
        time_budget: float | None = None,
        dp: int = 1,
        world: Topology | None = None,
        leaders: Leaders | None = None,
    ) -> None:
        """`dp` > 1: plan copies of a pipeline; `inputs` then holds one copy's devices (the
        first of `world`'s, the whole cluster) and micro-batches. `leaders`: the best
        times found so far, shared with the search that plans these copies."""
        self.inputs = inputs
        self.dp = dp
        self.world = world or inputs.topology
        self.exact_top = exact_top
        self.refine_steps = refine_steps
        self.refine_seconds = refine_seconds
        self.time_budget = time_budget
        self._screen_cost: dict[Candidate, list[tuple[float, float]]] = {}
        self.costs = OpCosts(inputs.profile, inputs.optimizer)
        """The cost model the search asks (planner/costs.py)."""
        self._files: dict[str, ast.File] = {}
        self._compiled: dict[Candidate, tuple[CostModel | None, Compilation]] = {}
        """Each candidate's last compilation, and the costs its order was expanded under
        (None when the order does not depend on them)."""
        self._layouts: dict[Candidate, Layout | str] = {}
        self._first_cuts: dict[int, tuple[int, ...]] = {}
        self.leaders = leaders or Leaders(exact_top)

    # ---- the whole search -------------------------------------------------------------

    def search(self, progress: Callable[[str, int, int, str], None] | None = None) -> SearchResult:
        """Screen every candidate that its bound does not leave out, then refine and
        simulate the best at N (see the module docstring); with `data_parallel`, the
        copies first. With a time budget, a candidate whose screening would end past it,
        judged from the same schedule at a smaller D, is left out with that reason, and
        a shortlisted one whose simulation at N would is kept extrapolated."""
        started = time.perf_counter()
        deadline = started + (self.time_budget or math.inf)
        final: list[Plan] = []
        rejected: list[Rejected] = []
        if self.inputs.data_parallel:
            # Copies first, with up to half of the budget: the smallest pipelines are
            # the quickest to search, and their times bound the larger ones.
            half = started + 0.5 * (self.time_budget or math.inf)
            for copies in self._copies(half, progress):
                final.extend(copies.plans)
                rejected.extend(copies.rejected)
        own = self._search_pipelines(progress, deadline)
        final.extend(own.plans)
        rejected.extend(own.rejected)
        final.sort(key=lambda p: p.time_ms)
        return SearchResult(tuple(final), tuple(rejected), time.perf_counter() - started)

    def _search_pipelines(
        self, progress: Callable[[str, int, int, str], None] | None, deadline: float
    ) -> SearchResult:
        """The search over one pipeline on the planner's devices (`search` without the
        copies): every candidate screened, then the best few simulated at N."""
        started = time.perf_counter()
        rejected: list[Rejected] = []
        screened = self._screen_all(progress, deadline, rejected)
        fitting = sorted((p for p in screened if self.fits(p) is None), key=lambda p: p.time_ms)
        for plan in screened:
            reason = self.fits(plan)
            if reason is not None:
                rejected.append(Rejected(plan.candidate, reason, memory=True))
        # Refined and simulated at N: the best few, unless plans found by the searches
        # of copies are already faster.
        top = [p for p in fitting[: self.exact_top] if p.time_ms <= self.leaders.last()]
        final = self._at_n(top, progress, deadline, rejected)
        final.sort(key=lambda p: p.time_ms)
        final.extend(fitting[len(top) :])
        return SearchResult(tuple(final), tuple(rejected), time.perf_counter() - started)

    def _screen_all(
        self,
        progress: Callable[[str, int, int, str], None] | None,
        deadline: float,
        rejected: list[Rejected],
    ) -> list[Plan]:
        """Every candidate's plan at the probe sizes, the most promising first (the
        lowest bound), so that the leaders are soon fast and the bound leaves out more;
        what is left out goes to `rejected`."""
        screened: list[Plan] = []
        costs: dict[tuple[str, Params], list[tuple[float, float]]] = {}
        bounds: dict[Candidate, float] = {}
        for candidate in candidates(self.inputs, self.dp):
            if time.perf_counter() > deadline:
                why = "not searched: the time budget ran out before its bound was taken"
                rejected.append(Rejected(candidate, why, time=True))
            else:
                bounds[candidate] = self.bound(candidate)
        listed = sorted(bounds, key=bounds.__getitem__)
        for done, candidate in enumerate(listed):
            if progress is not None:
                progress("screening", done, len(listed), candidate.label)
            bound = bounds[candidate]
            if bound > self.leaders.last():
                why = (
                    f"not simulated: it takes at least {bound:.4g} ms, more than the "
                    f"{self.leaders.size} fastest plans found"
                )
                rejected.append(Rejected(candidate, why))
                continue
            family = (candidate.schedule, candidate.params[2:])
            ops = self._ops(candidate, sum(self._probe_sizes(candidate)))
            estimate = _scaled(costs.get(family, []), ops)
            if time.perf_counter() + estimate > deadline:
                why = f"not searched: screening would take about {estimate:.0f} s, past the"
                rejected.append(Rejected(candidate, why + " time budget", time=True))
                continue
            begun = time.perf_counter()
            try:
                with budget.until(deadline):
                    outcome = self.screen(candidate)
            except budget.OutOfTime:
                why = "not searched: its screening ran past the time budget"
                rejected.append(Rejected(candidate, why, time=True))
                continue
            costs[family] = [*costs.get(family, [])[-1:], (ops, time.perf_counter() - begun)]
            if isinstance(outcome, Plan):
                screened.append(outcome)
                self._screen_cost[candidate] = costs[family]
                if self.fits(outcome) is None:
                    self.leaders.add(outcome.time_ms)
            else:
                rejected.append(outcome)
        return screened

    def _at_n(
        self,
        shortlist: list[Plan],
        progress: Callable[[str, int, int, str], None] | None,
        deadline: float,
        rejected: list[Rejected],
    ) -> list[Plan]:
        """The shortlisted plans refined and simulated at the run's N micro-batches (as
        screened where there is no time left); those that no longer fit go to `rejected`."""
        final: list[Plan] = []
        for done, plan in enumerate(shortlist):
            if progress is not None:
                progress("simulating at N", done, len(shortlist), plan.candidate.label)
            share = self.refine_seconds / len(shortlist)
            refined = self.refine(plan, min(deadline, time.perf_counter() + share))
            full_ops = self._ops(plan.candidate, self.inputs.micro_batches)
            estimate = _scaled(self._screen_cost.get(plan.candidate, []), full_ops)
            if refined.exact and self._cost_dependent(refined.candidate):
                # The order expanded again under the costs of the plan's own partition
                # and devices, as the written plan's will be (screening reused the
                # order expanded for the first cut).
                refined = self.predict(refined.candidate, refined.partition, refined.devices, True)
            if refined.exact or time.perf_counter() + estimate > deadline:
                final.append(refined)
                continue
            exact = self.predict(refined.candidate, refined.partition, refined.devices, full=True)
            if self.fits(exact) is None:
                final.append(exact)
            else:
                rejected.append(Rejected(exact.candidate, str(self.fits(exact)), memory=True))
        return final

    def _copies(
        self, deadline: float, progress: Callable[[str, int, int, str], None] | None = None
    ) -> Iterable[SearchResult]:
        """The searches with W > 1 data-parallel copies, one per W dividing both the
        device count and N (see `with_copies`), the most copies (the smallest pipelines,
        the quickest to search) first."""
        devices, n = self.inputs.topology.size, self.inputs.micro_batches
        for copies in range(devices, 1, -1):
            if devices % copies or n % copies:
                continue
            left = deadline - time.perf_counter()
            planner = self.with_copies(copies, None if math.isinf(left) else max(left, 0.0))
            if left <= 0:
                why = "not searched: the time budget ran out before copies were planned"
                out = tuple(Rejected(c, why, time=True) for c in candidates(planner.inputs, copies))
                yield SearchResult((), out, 0.0)
                continue
            yield planner.search(progress)

    def with_copies(self, copies: int, time_budget: float | None = None) -> Planner:
        """A planner of `copies` data-parallel copies of a pipeline: on the first devices /
        copies devices, N / copies micro-batches each; copy k runs on the k-th block of
        devices, mapped as the first."""
        devices, n = self.inputs.topology.size, self.inputs.micro_batches
        inputs = replace(
            self.inputs,
            topology=self.inputs.topology.first(devices // copies),
            micro_batches=n // copies,
            data_parallel=False,
        )
        planner = Planner(
            inputs,
            self.exact_top,
            self.refine_steps,
            self.refine_seconds,
            time_budget,
            dp=copies,
            world=self.inputs.topology,
            leaders=self.leaders,
        )
        planner._files = self._files  # the parsed stdlib files
        return planner

    def _ops(self, candidate: Candidate, micro_batches: int) -> float:
        return float(micro_batches * candidate.stages * (3 if self._split_w(candidate) else 2))

    def fits(self, plan: Plan) -> str | None:
        """None when every rank's peak is under its device's cap, else the reason."""
        for rank, peak in enumerate(plan.memory):
            device = plan.devices[rank]
            cap = self.inputs.cap(device)
            if peak > cap:
                return (
                    f"needs {format_bytes(peak)} on rank {rank} "
                    f"({self.inputs.topology.names[device]}), over the cap of {format_bytes(cap)}"
                )
        return None

    # ---- one candidate ----------------------------------------------------------------

    def screen(self, candidate: Candidate) -> Plan | Rejected:
        """Partition, mapping and a first prediction; or why the candidate is out."""
        layers = len(self.costs.layer_time)
        if candidate.stages > layers:
            return Rejected(
                candidate, f"{candidate.stages} stages but the model has only {layers} layers"
            )
        problem = self._require(candidate)
        if problem is not None:
            return Rejected(candidate, problem)
        try:
            # Cut without transfers first: a greedy order needs costs to be expanded, and
            # the mapping needs the expanded program's traffic.
            counts = self._first_cut(candidate.stages)
            n = self._probe_sizes(candidate)[-1]
            costs = self.costs.cost_model(counts, self._split_w(candidate))
            probe = self._compile(candidate.with_n(n), costs, True).need_program()
            traffic = program_traffic(probe, self.inputs.profile, counts, self.inputs.micro_batches)
            topology = self.inputs.topology
            every = self._every_mapping(candidate)
            if every is not None:  # few enough to try each
                layers, stages = len(self.costs.layer_time), candidate.stages
                if len(every) * math.comb(layers - 1, stages - 1) <= EXACT_PLANS:
                    tried = [(c, d) for d in every for c in compositions(layers, stages)]
                else:  # each with its DP cut and the cuts one layer from it
                    tried = [
                        (counts, devices)
                        for devices in every
                        for cut in [self._cut(candidate, probe.pipelines, devices)]
                        for counts in (cut, *_neighbours(cut, sums(self.costs.layer_time, cut)))
                    ]
                plans = [self.predict(candidate, c, d, False, False) for c, d in tried]
                return min(plans, key=lambda plan: (self.fits(plan) is not None, plan.time_ms))
            mappings = {map_ranks(traffic, candidate.ranks, topology)}
            if topology.speeds and candidate.ranks < topology.size:
                # A slower device on a faster link may win: the simulator judges.
                mappings.add(map_ranks(traffic, candidate.ranks, topology, links_first=True))
            plans = [
                self.predict(
                    candidate, self._cut(candidate, probe.pipelines, devices), devices, False, False
                )
                for devices in sorted(mappings)
            ]
            return min(plans, key=lambda plan: (self.fits(plan) is not None, plan.time_ms))
        except PipelangError as err:  # a schedule that does not compile at these sizes
            return Rejected(candidate, err.diagnostics[0].message)

    def _every_mapping(self, candidate: Candidate) -> list[tuple[int, ...]] | None:
        """Every mapping of the candidate's ranks to devices when there are 2 to
        `EXACT_MAPPINGS` unlike ones (mappings that give every rank a device of the same
        speed and memory and every pair of ranks the same link are alike), else None.
        On a few devices the local search can stop where two moves at once would help
        (issue 29: it found the best in 21 of 30 random 3-4 device clusters, 23% off at
        worst)."""
        topology = self.inputs.topology
        if math.perm(topology.size, candidate.ranks) > ENUMERATED:
            return None
        alike: dict[tuple[object, ...], tuple[int, ...]] = {}
        for devices in itertools.permutations(range(topology.size), candidate.ranks):
            speeds = tuple(topology.speed_of(d) for d in devices)
            memory = tuple(topology.memory[d] for d in devices)
            links = tuple(topology.links[a][b] for a, b in itertools.combinations(devices, 2))
            alike.setdefault((speeds, memory, links), devices)
            if len(alike) > EXACT_MAPPINGS:
                return None
            budget.check()
        return list(alike.values()) if len(alike) > 1 else None

    def refine(self, plan: Plan, deadline: float = math.inf) -> Plan:
        """Move single layers across stage boundaries, and on devices of different
        speeds move ranks between devices, while the simulator says the iteration gets
        shorter (at most `refine_steps` tries, and not past `deadline` on
        `time.perf_counter`). Layers leave the slowest stages first."""
        best, tries = plan, 0
        improved = True
        while improved and tries < self.refine_steps:
            improved = False
            for counts, devices in self._neighbours(best):
                if tries >= self.refine_steps or time.perf_counter() > deadline:
                    return best
                tries += 1
                trial = self.predict(plan.candidate, counts, devices, plan.exact, reorder=False)
                if trial.time_ms < best.time_ms - 1e-9 and self.fits(trial) is None:
                    best, improved = trial, True
                    break
        return best

    def _neighbours(self, plan: Plan) -> Iterable[tuple[tuple[int, ...], tuple[int, ...]]]:
        """(partition, devices) one step from the plan's: a layer moved across one
        boundary; then, on devices of different speeds, two ranks' devices swapped or
        one rank moved to a free device (one of each kind of free device), each cut
        again by the DP and then with a layer moved from that cut (the DP's objective is
        1F1B's, so on its own it can hide a better mapping). The mapping's own search
        weighs links only: these moves let the simulator weigh a device's speed against
        its links."""
        loads = sums(self.costs.layer_time, plan.partition)
        for moved in _neighbours(plan.partition, loads):
            yield moved, plan.devices
        topology = self.inputs.topology
        if not topology.speeds:
            return
        pipelines = self._pipelines(plan.candidate)
        for devices in _mapping_moves(plan.devices, topology):
            counts = self._cut(plan.candidate, pipelines, devices)
            yield counts, devices
            for moved in _neighbours(counts, sums(self.costs.layer_time, counts)):
                yield moved, devices

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
        sizes = self._probe_sizes(candidate)
        if full:
            sizes = [self.inputs.micro_batches]
        runs = [(n, self._simulate(candidate.with_n(n), counts, devices, reorder)) for n in sizes]
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
        split_w = self._split_w(candidate)
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

    # ---- helpers ----------------------------------------------------------------------

    def _file(self, name: str) -> ast.File:
        if name not in self._files:
            self._files[name] = api.load_file(name)
        return self._files[name]

    def _split_w(self, candidate: Candidate) -> bool:
        """Whether the schedule splits the weight gradient off the backward (`ops` has W)."""
        body = self._file(candidate.schedule).schedule.body
        return any(isinstance(d, ast.Ops) and "W" in d.kinds for d in body)

    def _cost_dependent(self, candidate: Candidate) -> bool:
        """Whether the schedule's order depends on the costs (greedy, or squeezed)."""
        return any(
            isinstance(d, ast.OrderGreedy) or (isinstance(d, ast.OrderRepeat) and d.squeeze)
            for d in self._file(candidate.schedule).schedule.body
        )

    def _require(self, candidate: Candidate) -> str | None:
        """The message of the first `require` that fails at these parameters (or of the
        first error in the schedule's declarations), if any."""
        layout = self._layout(candidate)
        return layout if isinstance(layout, str) else None

    def _layout(self, candidate: Candidate) -> Layout | str:
        """The candidate's declarations evaluated (its order not run), or why they fail."""
        if candidate not in self._layouts:
            file = self._file(candidate.schedule)
            try:
                params = run_passes(file, _options(candidate), "resolve-params").params
                assert params is not None
                self._layouts[candidate] = schedule_layout(file, params, PLANNER_MAX_OPS)
            except PipelangError as err:
                self._layouts[candidate] = err.diagnostics[0].message
        return self._layouts[candidate]

    def _first_cut(self, stages: int) -> tuple[int, ...]:
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
        layout = self._layout(candidate)
        if isinstance(layout, str) or candidate.stages > len(self.costs.layer_time):
            return 0.0
        topology = self.inputs.topology
        fastest = max(topology.speed_of(d) for d in range(topology.size))
        stage_costs = self.costs.stage_costs(
            self._first_cut(candidate.stages),
            self._split_w(candidate),
            _crossing(layout.pipelines),
            [fastest] * candidate.stages,
        )
        return iteration_bound(layout, stage_costs)

    def _probe_sizes(self, candidate: Candidate) -> list[int]:
        big_n = self.inputs.micro_batches
        if big_n * candidate.stages * 3 <= FULL_OPS:
            return [big_n]
        for base in (candidate.ranks, 2 * candidate.ranks, 4 * candidate.ranks):
            valid = 2 * base < big_n and self._require(candidate.with_n(base)) is None
            if valid and self._require(candidate.with_n(2 * base)) is None:
                return [base, 2 * base]
        return [big_n]

    def _compile(
        self, candidate: Candidate, costs: CostModel | None = None, reorder: bool = False
    ) -> Compilation:
        """The schedule expanded and validated at these parameters (its program and op
        graph), kept for reuse. A greedy or squeezed order depends on the costs: with
        `reorder` it is expanded again under `costs` unless it already was (the local
        search reuses the order found for the partition it starts from)."""
        file = self._file(candidate.schedule)
        depends = self._cost_dependent(candidate)
        if candidate in self._compiled:
            under, compiled = self._compiled[candidate]
            if not (depends and reorder) or under == costs:
                return compiled
        if depends and costs is not None:
            file = _with_costs(file, costs)
        compiled = run_passes(file, _options(candidate), "validate")
        self._compiled[candidate] = (costs if depends else None, compiled)
        return compiled

    def _cut(
        self, candidate: Candidate, pipelines: Sequence[Pipeline], devices: Sequence[int]
    ) -> tuple[int, ...]:
        """The DP partition, each boundary timed on the link between the devices of the
        ranks that hold its two stages in the first pipeline."""
        placement = pipelines[0].placement
        topology = self.inputs.topology
        outputs = [c.output_bytes for c in self.inputs.profile.layers]

        host = self.costs.runtime
        per_message = 0.0
        if host is not None:
            per_message = host.message_ms + host.send_ms + host.recv_ms + 2 * host.action_ms

        def cut(boundary: int, before: int) -> float:
            a, b = devices[placement[boundary]], devices[placement[boundary + 1]]
            if a == b:
                return 0.0
            return topology.link(a, b).seconds(outputs[before - 1]) * 1e3 + per_message

        split = best_partition(
            self.costs.layer_time,
            candidate.stages,
            self.inputs.micro_batches,
            cut,
            speeds=self._stage_speeds(pipelines, devices),
        )
        return split.counts

    def plan_speeds(self, plan: Plan) -> list[float] | None:
        """Each stage's device speed in `plan` (`_stage_speeds`); None on a topology of
        one speed."""
        return self._stage_speeds(self._pipelines(plan.candidate), plan.devices)

    def _pipelines(self, candidate: Candidate) -> tuple[Pipeline, ...]:
        """The candidate's pipelines (which rank holds each stage), from its layout."""
        layout = self._layout(candidate)
        assert not isinstance(layout, str), layout
        return layout.pipelines

    def _stage_speeds(
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

    def _simulate(
        self, candidate: Candidate, counts: Sequence[int], devices: Sequence[int], reorder: bool
    ) -> Prediction:
        split_w = self._split_w(candidate)
        pipelines = self._pipelines(candidate)
        speeds = self._stage_speeds(pipelines, devices)
        costs = self.costs.cost_model(counts, split_w, _crossing(pipelines), speeds)
        # A greedy order is expanded under the costs simulated: device speeds, host costs.
        compiled = self._compile(candidate, costs, reorder)
        program, graph = compiled.need_program(), compiled.graph
        assert graph is not None
        topology = self.inputs.topology
        outputs = stage_outputs(self.inputs.profile, counts)
        cache: dict[tuple[Kind, int, int, int], float] = {}
        transfers: list[float] = []
        message = self.costs.runtime.message_ms if self.costs.runtime is not None else 0.0

        def link(op: Action, src: int, dst: int) -> float:
            key = (op.kind, op.stage or 0, src, dst)
            if key not in cache:
                boundary = op.stage if op.kind is Kind.F else (op.stage or 0) - 1
                size = outputs[boundary] if boundary is not None and boundary >= 0 else 0.0
                seconds = topology.link(devices[src], devices[dst]).seconds(size)
                cache[key] = seconds * 1e3 + message
                transfers.append(cache[key])
            return cache[key]

        timeline = simulate(program, graph, costs, link)
        weights = stage_weights(self.inputs.profile, counts)
        synced = allreduce_end(
            program, timeline.events, weights, devices, self.world, copies=self.dp
        )
        busy = sum(timeline.busy(r) for r in range(program.num_ranks))
        factor = STATE_FACTOR[self.inputs.optimizer]
        memory = peak_memory(program, self.inputs.profile, counts, factor)
        # Each rank's optimizer step runs after its last op and after the allreduces.
        ends = [0.0] * program.num_ranks
        for event in timeline.events:
            ends[event.rank] = max(ends[event.rank], event.end)
        speeds = [topology.speed_of(devices[rank]) for rank in range(program.num_ranks)]
        steps = self.costs.step_ms(counts, program, speeds)
        end = max(max(e, synced) + t for e, t in zip(ends, steps, strict=True))
        return Prediction(end, busy, memory, transfers)


def _scaled(seen: list[tuple[float, float]], ops: float) -> float:
    """Seconds to handle `ops` ops, from the (ops, seconds) of the last one or two
    screenings of the same schedule: grown as ops^p, p fitted to the two (between 1 and
    3), else 1.5 (compile and simulation grow a little faster than linearly)."""
    if not seen or seen[-1][0] <= 0:
        return 0.0
    power = 1.5
    if len(seen) == 2 and seen[1][0] > seen[0][0] and min(seen[0][1], seen[1][1]) > 0.05:
        power = math.log(seen[1][1] / seen[0][1]) / math.log(seen[1][0] / seen[0][0])
        power = min(3.0, max(1.0, power))
    return seen[-1][1] * (ops / seen[-1][0]) ** power


PLANNER_MAX_OPS = 4_000_000
"""The op limit of the schedules the planner compiles. The user's `--max-ops` guards
against a mistyped parameter; the planner picks its own sizes, and its time budget (not
the op count) bounds its search: a 1024-device plan simulates 262,144-op Chimeras."""


def _options(candidate: Candidate) -> Options:
    return Options({k: str(v) for k, v in candidate.params}, max_ops=PLANNER_MAX_OPS)


def _with_costs(file: ast.File, costs: CostModel) -> ast.File:
    """The file with `costs` appended as a `cost` line (greedy orders replay them)."""
    span = file.schedule.span
    items = tuple(
        ast.CostItem(span, kind, None if stage is None else ast.IntLit(span, stage), value)
        for kind, stage, value in costs.entries
    )
    schedule = replace(file.schedule, body=(*file.schedule.body, ast.Cost(span, items)))
    return replace(file, schedule=schedule)


def _crossing(pipelines: Sequence[Pipeline]) -> list[bool]:
    """Whether each stage boundary of the first pipeline joins two ranks."""
    placement = pipelines[0].placement
    return [placement[s] != placement[s + 1] for s in range(len(placement) - 1)]


def _mapping_moves(devices: tuple[int, ...], topology: Topology) -> Iterable[tuple[int, ...]]:
    """Mappings one step away: two ranks' devices swapped, or one rank on a free device
    (of the free devices alike in speed and in their links to the used ones, only the
    first)."""
    for a in range(len(devices)):
        for b in range(a + 1, len(devices)):
            swapped = list(devices)
            swapped[a], swapped[b] = devices[b], devices[a]
            yield tuple(swapped)
    used = set(devices)
    kinds: dict[tuple[object, ...], int] = {}
    for device in range(topology.size):
        if device not in used:
            links = tuple(topology.links[device][u] for u in devices)
            kinds.setdefault((topology.speed_of(device), links), device)
    for rank in range(len(devices)):
        for device in kinds.values():
            yield (*devices[:rank], device, *devices[rank + 1 :])


EXACT_MAPPINGS = 64
"""The most unlike mappings a candidate's screening tries one by one, each with its DP
cut and the cuts one layer from it (`Planner._every_mapping`)."""
ENUMERATED = 5040
"""The most rank-to-device mappings looked through for unlike ones (7 ranks on 7
devices, 4 on 8)."""
EXACT_PLANS = 1000
"""The most (partition, mapping) pairs screening simulates to try every partition of
every unlike mapping (4 devices and 8 layers: 24 x 35)."""


def compositions(layers: int, stages: int) -> Iterable[tuple[int, ...]]:
    """Every way to cut `layers` into `stages` non-empty contiguous stages."""
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        bounds = (0, *cuts, layers)
        yield tuple(b - a for a, b in itertools.pairwise(bounds))


def _neighbours(counts: tuple[int, ...], loads: Sequence[float]) -> Iterable[tuple[int, ...]]:
    """Partitions one layer away (a layer moved across one boundary), the moves that
    take a layer from the most loaded stages first."""
    moves = []
    for b in range(len(counts) - 1):
        for donor, delta in ((b, 1), (b + 1, -1)):
            left, right = counts[b] - delta, counts[b + 1] + delta
            if left >= 1 and right >= 1:
                moves.append((-loads[donor], b, delta))
    for _, b, delta in sorted(moves):
        yield (*counts[:b], counts[b] - delta, counts[b + 1] + delta, *counts[b + 2 :])
