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

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import replace

from pipelang.diagnostics import PipelangError
from pipelang.planner import budget
from pipelang.planner.costs import program_traffic, sums
from pipelang.planner.families import Params
from pipelang.planner.mapping import map_ranks, mapping_moves, unlike_mappings
from pipelang.planner.model import PlanModel
from pipelang.planner.partition import compositions, partition_neighbours
from pipelang.planner.plans import (
    Candidate,
    Inputs,
    Leaders,
    Plan,
    Rejected,
    SearchResult,
    candidates,
)
from pipelang.planner.topology import Topology


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
        self.model = PlanModel(inputs, dp, self.world)
        """What the simulator says of a plan (planner/model.py)."""
        self.costs = self.model.costs
        self.predict = self.model.predict
        self.bound = self.model.bound
        self.plan_speeds = self.model.plan_speeds
        self.boundary_transfers = self.model.boundary_transfers
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
        fitting = sorted(
            (p for p in screened if self.inputs.over_cap(p) is None), key=lambda p: p.time_ms
        )
        for plan in screened:
            reason = self.inputs.over_cap(plan)
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
                bounds[candidate] = self.model.bound(candidate)
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
            ops = self._ops(candidate, sum(self.model.probe_sizes(candidate)))
            estimate = budget.scaled(costs.get(family, []), ops)
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
                if self.inputs.over_cap(outcome) is None:
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
            estimate = budget.scaled(self._screen_cost.get(plan.candidate, []), full_ops)
            if refined.exact and self.model.cost_dependent(refined.candidate):
                # The order expanded again under the costs of the plan's own partition
                # and devices, as the written plan's will be (screening reused the
                # order expanded for the first cut).
                refined = self.model.predict(
                    refined.candidate, refined.partition, refined.devices, True
                )
            if refined.exact or time.perf_counter() + estimate > deadline:
                final.append(refined)
                continue
            exact = self.model.predict(
                refined.candidate, refined.partition, refined.devices, full=True
            )
            if self.inputs.over_cap(exact) is None:
                final.append(exact)
            else:
                rejected.append(
                    Rejected(exact.candidate, str(self.inputs.over_cap(exact)), memory=True)
                )
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
        planner.model.files = self.model.files  # the parsed stdlib files
        return planner

    def _ops(self, candidate: Candidate, micro_batches: int) -> float:
        return float(micro_batches * candidate.stages * (3 if self.model.split_w(candidate) else 2))

    # ---- one candidate ----------------------------------------------------------------

    def screen(self, candidate: Candidate) -> Plan | Rejected:
        """Partition, mapping and a first prediction; or why the candidate is out."""
        layers = len(self.costs.layer_time)
        if candidate.stages > layers:
            return Rejected(
                candidate, f"{candidate.stages} stages but the model has only {layers} layers"
            )
        problem = self.model.require(candidate)
        if problem is not None:
            return Rejected(candidate, problem)
        try:
            # Cut without transfers first: a greedy order needs costs to be expanded, and
            # the mapping needs the expanded program's traffic.
            counts = self.model.first_cut(candidate.stages)
            n = self.model.probe_sizes(candidate)[-1]
            costs = self.costs.cost_model(counts, self.model.split_w(candidate))
            probe = self.model.compiled(candidate.with_n(n), costs, True).need_program()
            traffic = program_traffic(probe, self.inputs.profile, counts, self.inputs.micro_batches)
            topology = self.inputs.topology
            every = unlike_mappings(self.inputs.topology, candidate.ranks)
            if every is not None:  # few enough to try each
                layers, stages = len(self.costs.layer_time), candidate.stages
                if len(every) * math.comb(layers - 1, stages - 1) <= EXACT_PLANS:
                    tried = [(c, d) for d in every for c in compositions(layers, stages)]
                else:  # each with its DP cut and the cuts one layer from it
                    tried = [
                        (counts, devices)
                        for devices in every
                        for cut in [self.model.cut(candidate, probe.pipelines, devices)]
                        for counts in (
                            cut,
                            *partition_neighbours(cut, sums(self.costs.layer_time, cut)),
                        )
                    ]
                plans = [self.model.predict(candidate, c, d, False, False) for c, d in tried]
                return self.inputs.best(plans)
            mappings = {map_ranks(traffic, candidate.ranks, topology)}
            if topology.speeds and candidate.ranks < topology.size:
                # A slower device on a faster link may win: the simulator judges.
                mappings.add(map_ranks(traffic, candidate.ranks, topology, links_first=True))
            plans = [
                self.model.predict(
                    candidate,
                    self.model.cut(candidate, probe.pipelines, devices),
                    devices,
                    False,
                    False,
                )
                for devices in sorted(mappings)
            ]
            return self.inputs.best(plans)
        except PipelangError as err:  # a schedule that does not compile at these sizes
            return Rejected(candidate, err.diagnostics[0].message)

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
                trial = self.model.predict(
                    plan.candidate, counts, devices, plan.exact, reorder=False
                )
                if trial.time_ms < best.time_ms - 1e-9 and self.inputs.over_cap(trial) is None:
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
        for moved in partition_neighbours(plan.partition, loads):
            yield moved, plan.devices
        topology = self.inputs.topology
        if not topology.speeds:
            return
        pipelines = self.model.pipelines(plan.candidate)
        for devices in mapping_moves(plan.devices, topology):
            counts = self.model.cut(plan.candidate, pipelines, devices)
            yield counts, devices
            for moved in partition_neighbours(counts, sums(self.costs.layer_time, counts)):
                yield moved, devices


EXACT_PLANS = 1000
"""The most (partition, mapping) pairs screening simulates to try every partition of
every unlike mapping (4 devices and 8 layers: 24 x 35)."""
