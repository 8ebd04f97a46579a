"""The planner's lower bound (`pipelang/planner/bound.py`) and the search it prunes.

Oracles: the simulator (the bound never exceeds the simulated iteration of any stdlib
schedule the planner tries, whatever the stage costs), the 1F1B formula (N + D - 1)(F + B)
(the bound is exact there), and the search without the bound (the same best plan).
"""

from __future__ import annotations

import random

import pytest

from benchmarks.plan_speed import cluster
from pipelang import api
from pipelang.compiler import Options, run_passes
from pipelang.ir import CostModel
from pipelang.passes.layout import schedule_layout
from pipelang.planner.bound import iteration_bound
from pipelang.planner.families import FAMILIES
from pipelang.planner.model import PlanModel, with_costs
from pipelang.planner.plans import Inputs
from pipelang.planner.search import Planner
from pipelang.sim.timeline import simulate
from tests.helpers import make_profile


def layout_of(name: str, params: dict[str, str]):  # type: ignore[no-untyped-def]
    file = api.load_file(name)
    bindings = run_passes(file, Options(params), "resolve-params").params
    assert bindings is not None
    return schedule_layout(file, bindings)


def simulated(name: str, params: dict[str, str], costs: list[tuple[float, float, float]]) -> float:
    entries = []
    for stage, (f, b, w) in enumerate(costs):
        entries += [("F", stage, f), ("B", stage, b), ("W", stage, w), ("R", stage, f)]
    model = CostModel().merged(CostModel(tuple(entries)))
    # A greedy or squeezed order is expanded under the costs it runs with.
    compiled = run_passes(with_costs(api.load_file(name), model), Options(params), "validate")
    assert compiled.graph is not None
    return simulate(compiled.need_program(), compiled.graph, model).makespan


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_bound_never_exceeds_the_simulated_iteration(name: str) -> None:
    rng = random.Random(name)
    checked = 0
    for d in (2, 4):
        for extra, _ in FAMILIES[name](d):
            for n in (d, 2 * d, 2 * d + 1):
                params = {"D": str(d), "N": str(n), **{k: str(v) for k, v in extra}}
                try:
                    layout = layout_of(name, params)
                except Exception:  # a `require` that these sizes fail
                    continue
                split = any(k.name == "W" for k in layout.program.kinds)
                for _ in range(3):
                    costs = [
                        (rng.uniform(0.1, 3), rng.uniform(0.1, 5), rng.uniform(0.1, 3) * split)
                        for _ in range(layout.program.num_stages)
                    ]
                    bound = iteration_bound(layout, costs)
                    assert 0 < bound <= simulated(name, params, costs) + 1e-9, params
                    checked += 1
    assert checked >= 3


@pytest.mark.parametrize(("d", "n"), [(2, 2), (4, 8), (8, 5)])
def test_the_bound_is_the_1f1b_formula_on_equal_stages(d: int, n: int) -> None:
    layout = layout_of("1f1b", {"D": str(d), "N": str(n)})
    assert iteration_bound(layout, [(1.0, 2.0, 0.0)] * d) == pytest.approx((n + d - 1) * 3.0)
    assert simulated("1f1b", {"D": str(d), "N": str(n)}, [(1.0, 2.0, 0.0)] * d) == (
        pytest.approx((n + d - 1) * 3.0)
    )


def without_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PlanModel, "bound", lambda self, candidate: 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_bounded_search_finds_the_plan_of_the_whole_search(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random layer costs and sizes on 8 devices (two nodes): pruning by the bound
    leaves the best plan and its time as they are, and does prune."""
    rng = random.Random(seed)
    forward = [rng.choice([0.5, 1.0, 2.0, 4.0]) for _ in range(rng.randint(8, 14))]
    profile = make_profile(forward, weight=rng.choice([1e6, 1e8]), output=rng.choice([1e5, 1e8]))
    inputs = Inputs(profile, cluster(8), 16, data_parallel=seed != 1)
    bounded = Planner(inputs, time_budget=0).search()
    pruned = [r for r in bounded.rejected if r.reason.startswith("not simulated: it takes")]
    assert pruned
    without_bound(monkeypatch)
    whole = Planner(inputs, time_budget=0).search()
    assert not [r for r in whole.rejected if r.reason.startswith("not simulated: it takes")]
    best, reference = bounded.plans[0], whole.plans[0]
    assert best.candidate == reference.candidate
    assert best.time_ms == pytest.approx(reference.time_ms)
    # A pruned candidate's bound is above the third-fastest plan.
    third = sorted(p.time_ms for p in bounded.plans)[2]
    for rejected in pruned:
        at_least = float(rejected.reason.split("at least ")[1].split(" ms")[0])
        assert at_least > third * (1 - 1e-3)
