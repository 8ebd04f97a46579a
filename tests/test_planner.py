"""The planner: partition DP, device mapping, memory cap, the written plan, the CLI.

Oracles: brute force over every partition (the objective computed here from its
definition, and the real simulator's makespan), memory sums taken straight from the
profile, torch's own parameter counts, and the compiler's check of the written file.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import re
import sys
from pathlib import Path

import pytest

from pipelang.api import compile_schedule
from pipelang.backends.calibrate import WARMUP_STEPS, TraceEvent, combined, runtime_costs
from pipelang.diagnostics import PipelangError
from pipelang.ir import CostModel, Program
from pipelang.planner.mapping import map_ranks
from pipelang.planner.partition import best_partition
from pipelang.planner.plans import Candidate, Inputs, Plan, candidates, lopsided
from pipelang.planner.search import Planner
from pipelang.planner.topology import Link, Topology, load_topology
from pipelang.planner.units import parse_bandwidth, parse_bytes, parse_seconds
from pipelang.planner.write import plan_source
from pipelang.profile import (
    Profile,
    RuntimeCosts,
    load_profile,
    profile_from_dict,
)
from tests.helpers import make_profile, pipelang_here, replay, run_in_process, two_nodes

MiB = 2**20


def compositions(layers: int, stages: int) -> list[tuple[int, ...]]:
    """Every way to cut `layers` into `stages` non-empty contiguous stages."""
    found = []
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        bounds = (0, *cuts, layers)
        found.append(tuple(bounds[i + 1] - bounds[i] for i in range(stages)))
    return found


def uniform_topology(size: int, memory: float = 1e12, link: Link | None = None) -> Topology:
    link = link or Link(1e12, 0.0)
    return Topology(
        tuple(f"d{i}" for i in range(size)),
        (memory,) * size,
        tuple(tuple(None if a == b else link for b in range(size)) for a in range(size)),
    )


# ---- the DP ----------------------------------------------------------------------------------


def objective(
    counts: tuple[int, ...],
    costs: list[float],
    n: int,
    boundary: list[list[float]] | None,
    speeds: list[float] | None = None,
) -> float:
    """J from its definition: (N-1) x slowest stage + every stage + each boundary twice;
    a stage's time is its layers' cost over its device's speed."""
    times, edges, start = [], 0.0, 0
    for b, count in enumerate(counts):
        times.append(sum(costs[start : start + count]) / (speeds[b] if speeds else 1.0))
        start += count
        if boundary is not None and b < len(counts) - 1:
            edges += 2 * boundary[b][start]
    return (n - 1) * max(times) + sum(times) + edges


@pytest.mark.parametrize("with_speeds", [False, True])
def test_dp_partition_is_optimal_against_brute_force(with_speeds: bool) -> None:
    """Over every composition, with and without transfers; `with_speeds`: stage s on a
    device `speeds[s]` times as fast as the profiled one (a mixed cluster)."""
    rng = random.Random(11 if with_speeds else 7)
    for _ in range(200):
        layers = rng.randint(1, 9)
        stages = rng.randint(1, layers)
        n = rng.randint(1, 16)
        costs = [rng.choice([0.1, 0.5, 1.0, 2.0, 4.0, 3.3]) for _ in range(layers)]
        table = [[rng.random() * 3 for _ in range(layers + 1)] for _ in range(stages)]
        boundary = table if rng.random() < 0.5 else None
        cut = (lambda b, j, t=table: t[b][j]) if boundary is not None else None
        speeds = [rng.choice([0.5, 1.0, 1.5, 2.0, 3.0]) for _ in range(stages)]
        speeds = speeds if with_speeds else None
        found = best_partition(costs, stages, n, cut, speeds=speeds)
        assert sum(found.counts) == layers and min(found.counts) >= 1
        best = min(objective(c, costs, n, boundary, speeds) for c in compositions(layers, stages))
        assert objective(found.counts, costs, n, boundary, speeds) == pytest.approx(best, abs=1e-9)


def test_dp_without_transfers_minimises_the_slowest_stage() -> None:
    costs = [1, 1, 1, 8, 1, 1, 1, 1]
    found = best_partition(costs, 3, 64)
    assert (found.counts, found.bottleneck) == ((3, 1, 4), 8)


def makespan(
    program: Program, counts: tuple[int, ...], forward: list[float], backward: list[float]
) -> float:
    """The simulator's makespan with each stage's F and B summed over its layers."""
    entries, start = [], 0
    for stage, count in enumerate(counts):
        entries.append(("F", stage, sum(forward[start : start + count])))
        entries.append(("B", stage, sum(backward[start : start + count])))
        start += count
    return replay(program, CostModel(tuple(entries))).makespan


def test_planned_partition_is_the_simulators_optimum_on_small_cases() -> None:
    """DP then the simulator-guided local search: the 1F1B makespan of the planner's
    partition equals the best over every partition, each simulated."""
    rng = random.Random(3)
    for _ in range(25):
        layers = rng.randint(3, 8)
        stages = rng.randint(2, min(4, layers))
        n = rng.randint(stages, 8)
        forward = [rng.choice([0.5, 1.0, 2.0, 4.0]) for _ in range(layers)]
        backward = [2 * f for f in forward]
        inputs = Inputs(make_profile(forward, backward, output=0), uniform_topology(stages), n)
        planner = Planner(inputs)
        screened = planner.screen(Candidate("1f1b", (("D", stages), ("N", n)), 1))
        assert isinstance(screened, Plan)
        plan = planner.refine(screened)
        program = compile_schedule(
            "1f1b", {"D": str(stages), "N": str(n)}, stop_after="expand-orders"
        ).need_program()

        best = min(makespan(program, c, forward, backward) for c in compositions(layers, stages))
        assert makespan(program, plan.partition, forward, backward) == pytest.approx(best)
        assert plan.time_ms == pytest.approx(best)


def test_unbalanced_layer_plan_beats_the_even_split_in_simulation() -> None:
    # The demo model's shape: embedding, one block 4x the others, seven blocks, head.
    forward = [0.05, 4.0, *[1.0] * 7, 0.3]
    inputs = Inputs(make_profile(forward), uniform_topology(2), 8, schedules=("1f1b",))
    planner = Planner(inputs)
    result = planner.search()
    best = result.plans[0]
    even = planner.predict(best.candidate, (5, 5), best.devices, full=True)
    # Even: stage 0 = 0.05 + 4 + 3 = 7.05 units of forward. Best: 4 layers (6.05) and 6
    # (5.3); 3 and 7 would give 5.05 and 6.3.
    assert best.partition == (4, 6)
    assert best.time_ms < 0.95 * even.time_ms


@pytest.mark.parametrize("heavy", [2.5, 3.5, 4.0, 5.0, 6.0])
def test_short_demo_plan_does_not_hinge_on_the_heavy_ratio(heavy: float) -> None:
    # `demo:unbalanced_short`: embedding, the heavy block, three light blocks, head. A
    # profile may weigh the heavy block anywhere from about 3x to 6x a light one on a
    # noisy machine; the planner's split must be the same (benchmarks/plan_vs_measured.py
    # relies on it), and the even split (3, 3) must stay well behind from 3.5x up (at
    # 2.5x both splits are near balance).
    forward = [0.05, heavy, 1.0, 1.0, 1.0, 0.3]
    inputs = Inputs(make_profile(forward), uniform_topology(2), 8, schedules=("1f1b",))
    planner = Planner(inputs)
    best = planner.search().plans[0]
    assert best.partition == (2, 4)
    even = planner.predict(best.candidate, (3, 3), best.devices, full=True)
    if heavy >= 3.5:
        assert even.time_ms > 1.1 * best.time_ms


# ---- mapping ---------------------------------------------------------------------------------


def test_mapping_keeps_heavy_edges_on_fast_links(tmp_path: Path) -> None:
    # Fast pairs a-c and b-d (as if the devices were listed out of node order).
    (tmp_path / "t.yaml").write_text(
        "devices:\n" + "".join(f"  - {{name: {n}, memory: 1GiB}}\n" for n in "abcd") + "links:\n"
        "  - {between: [a, c], bandwidth: 300GB/s, latency: 1us}\n"
        "  - {between: [b, d], bandwidth: 300GB/s, latency: 1us}\n"
        "default_link: {bandwidth: 1GB/s, latency: 100us}\n"
    )
    topology = load_topology(tmp_path / "t.yaml")
    traffic = {(0, 1): (1e8, 16), (1, 2): (1e8, 16), (2, 3): (1e8, 16)}
    devices = map_ranks(traffic, 4, topology)
    fast = {frozenset("ac"), frozenset("bd")}
    names = [topology.names[d] for d in devices]
    on_fast = [frozenset((names[a], names[a + 1])) in fast for a in range(3)]
    assert on_fast.count(True) == 2  # the best possible: the chain crosses once
    # The planner itself, on a 1F1B over the same cluster, does the same.
    inputs = Inputs(make_profile([1.0] * 8, output=1e8), topology, 8, schedules=("1f1b",))
    plan = next(p for p in Planner(inputs).search().plans if p.candidate.ranks == 4)
    names = [topology.names[d] for d in plan.devices]
    assert sum(frozenset((names[a], names[a + 1])) in fast for a in range(3)) == 2


def test_data_parallel_copies_add_the_allreduce_over_every_copy() -> None:
    # Four equal layers (F 1, B 2 ms, 1 MB of weights each), 1F1B, N = 8, four devices
    # joined by 1 GB/s links without latency; stage outputs of 0 bytes, so only the
    # gradient allreduce crosses links: 2 (r - 1) / r x bytes / bandwidth over r copies.
    inputs = Inputs(
        make_profile([1.0] * 4, output=0.0),
        uniform_topology(4, link=Link(1e9, 0.0)),
        8,
        schedules=("1f1b",),
        data_parallel=True,
    )
    ranked = Planner(inputs).search().plans
    plans = {(p.candidate.ranks, p.candidate.dp): p for p in ranked}
    # One pipeline over 4 ranks: (N + D - 1) x (F + B) of a one-layer stage.
    assert plans[(4, 1)].time_ms == pytest.approx(11 * 3)
    # Two copies of a 2-rank 1F1B, N = 4 each: (4 + 1) x 6, then each stage's 2 MB summed
    # over the two copies: 2 x 1/2 x 2e6 B / 1e9 B/s = 2 ms.
    assert plans[(2, 2)].time_ms == pytest.approx(5 * 6 + 2)
    # Four copies of the whole model, N = 2 each: 2 x 12, then 4 MB over four: 6 ms.
    assert plans[(1, 4)].time_ms == pytest.approx(2 * 12 + 6)
    best = ranked[0]
    assert (best.candidate.ranks, best.candidate.dp) == (1, 4)
    assert best.candidate.label == "1f1b D=1 N=2 dp=4"


def test_the_copies_allreduce_takes_the_slow_link_between_nodes() -> None:
    # Two nodes of two devices: 1 TB/s inside a node, 1 GB/s between, no latency. Copy k
    # of a pipeline runs on the k-th block of devices, so two copies of a 2-rank 1F1B
    # sit one per node and every stage's replicas sum their gradients across the slow
    # link; four one-rank copies form one ring whose slowest hop crosses it.
    topology = two_nodes()
    inputs = Inputs(
        make_profile([1.0] * 4, output=0.0), topology, 8, schedules=("1f1b",), data_parallel=True
    )
    plans = {(p.candidate.ranks, p.candidate.dp): p for p in Planner(inputs).search().plans}
    # (4 + 1) x 6 ms of 1F1B, then 2 MB per stage over two replicas at 1 GB/s: 2 ms
    # (at the in-node 1 TB/s it would be 0.002 ms).
    assert plans[(2, 2)].time_ms == pytest.approx(5 * 6 + 2)
    assert {plans[(2, 2)].devices[0] // 2} == {0}  # copy 0 on node 0, copy 1 on node 1
    # 2 x 12 ms, then 4 MB over a ring of four whose hop between nodes is 1 GB/s: 6 ms.
    assert plans[(1, 4)].time_ms == pytest.approx(2 * 12 + 6)


def test_copies_left_out_by_the_time_budget_are_listed() -> None:
    inputs = Inputs(
        make_profile([1.0] * 4), uniform_topology(4), 8, schedules=("1f1b",), data_parallel=True
    )
    result = Planner(inputs, time_budget=1e-9).search()
    assert not result.plans
    reasons = {r.candidate.label: r.reason for r in result.rejected}
    assert reasons["1f1b D=2 N=4 dp=2"].startswith("not searched: the time budget ran out")
    assert reasons["1f1b D=1 N=2 dp=4"].startswith("not searched: the time budget ran out")


def test_the_search_reports_its_progress_over_every_candidate() -> None:
    """What `pipelang plan`'s bar shows: each candidate screened (the lowest bound
    first), then each shortlisted plan simulated at N."""
    inputs = Inputs(make_profile([1.0] * 4), uniform_topology(4), 8, schedules=("1f1b", "gpipe"))
    calls: list[tuple[str, int, int, str]] = []
    planner = Planner(inputs)
    result = planner.search(lambda *call: calls.append(call))
    screened = [c for c in calls if c[0] == "screening"]
    listed = candidates(inputs)
    assert [(done, total) for _, done, total, _ in screened] == [
        (i, len(listed)) for i in range(len(listed))
    ]
    by_label = {c.label: c for c in listed}
    assert sorted(what for *_, what in screened) == sorted(by_label)
    bounds = [planner.bound(by_label[what]) for *_, what in screened]
    assert bounds == sorted(bounds)
    simulated = [c for c in calls if c[0] == "simulating at N"]
    assert simulated and {what for *_, what in simulated} <= {
        p.candidate.label for p in result.plans
    }


@pytest.mark.slow
def test_written_data_parallel_plan_runs_with_its_dp(tmp_path: Path) -> None:
    forward = [0.05, 4.0, *[1.0] * 7, 0.3]
    profile = make_profile(forward, activation=2e5, weight=5e5, output=65536)
    topology = uniform_topology(2, memory=1e10, link=Link(2e9, 5e-5))
    inputs = Inputs(profile, topology, 4, schedules=("1f1b",), data_parallel=True)
    planner = Planner(inputs)
    plan = next(p for p in planner.search().plans if p.candidate.dp == 2)
    path = tmp_path / "dp.pipe"
    path.write_text(plan_source(plan, planner, "p.json", "t.yaml"))
    assert "run with `pipelang run THIS.pipe --dp 2`" in path.read_text()
    proc = pipelang_here(
        "run", str(path), "--model", "pipelang.planner.demo:unbalanced", "--backend", "gloo",
        "--dp", "2", "--steps", "1", "--check", cwd=tmp_path, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr + proc.stdout


# ---- memory --------------------------------------------------------------------------------


def test_gpipe_is_excluded_by_a_memory_cap_with_the_reason() -> None:
    act, weight, n = 10 * MiB, 1 * MiB, 8
    profile = make_profile([1.0] * 4, activation=act, weight=weight)
    # Two stages of two layers: GPipe's rank 0 holds all N activations of stage 0, 1F1B's
    # at most D = 2; weights, gradients and Adam's two moments are 4x the weights.
    gpipe_peak = 4 * 2 * weight + n * 2 * act
    one_f_one_b_peak = 4 * 2 * weight + 2 * 2 * act
    cap = (gpipe_peak + one_f_one_b_peak) / 2
    topology = uniform_topology(2, memory=1e12)
    inputs = Inputs(profile, topology, n, max_memory=cap, schedules=("gpipe", "1f1b"))
    planner = Planner(inputs)
    result = planner.search()
    out = {r.candidate.label: r for r in result.rejected}
    assert out["gpipe D=2 N=8"].memory
    assert "over the cap of" in out["gpipe D=2 N=8"].reason
    assert "168.00 MiB" in out["gpipe D=2 N=8"].reason  # 4 x 2 MiB + 8 x 20 MiB
    labels = [p.candidate.label for p in result.plans]
    assert labels[0] == "1f1b D=2 N=8" and not any("gpipe" in label for label in labels)
    assert result.plans[0].memory[0] == pytest.approx(one_f_one_b_peak)
    even = planner.predict(Candidate("gpipe", (("D", 2), ("N", n)), 1), (2, 2), (0, 1), True)
    assert even.memory[0] == pytest.approx(gpipe_peak)


def test_chimera_variants_for_n_over_d_hold_what_the_runtime_holds() -> None:
    # D = 2, N = 4, two equal layers per stage. Rank 0's order in both variants:
    #   F0&F1 (down, stage 0)  F2&F3 (up, stage 1)  then B2u B0d B3u B1d,
    # forward doubling with R before each B. Without recompute (backward halving at the
    # profile's micro-batch size) all four forwards' activations are held at once:
    # 4 x 2 layers x 10 MiB. With it, a forward keeps its stage's input only (stage 0:
    # token ids, counted 0; stage 1: stage 0's output, 1 MiB), and the first recompute
    # adds one stage's activations on top of the two up inputs: 2 x 1 + 20 MiB.
    profile = make_profile([1.0] * 4, activation=10 * MiB, weight=1 * MiB, output=1 * MiB)
    schedules = ("chimera-fwd-double", "chimera-bwd-half")
    inputs = Inputs(profile, uniform_topology(2), 4, optimizer="sgd", schedules=schedules)
    planner = Planner(inputs)
    found = {p.candidate.schedule: p for p in planner.search().plans}
    double, half = (
        planner.predict(found[name].candidate, (2, 2), found[name].devices, full=True)
        for name in schedules
    )
    state = 3 * 4 * MiB  # a two-layer stage of each direction, SGD's 3 x the weights
    assert double.memory == pytest.approx((state + 22 * MiB,) * 2)
    assert half.memory == pytest.approx((state + 80 * MiB,) * 2)
    # The recompute costs a forward per backward.
    assert half.time_ms < double.time_ms


# ---- the written plan ------------------------------------------------------------------------


def plan_for_demo(tmp_path: Path, schedules: tuple[str, ...] = ("1f1b", "zb-h1")) -> Path:
    forward = [0.05, 4.0, *[1.0] * 7, 0.3]
    profile = make_profile(forward, activation=2e5, weight=5e5, output=65536)
    topology = uniform_topology(2, memory=1e10, link=Link(2e9, 5e-5))
    planner = Planner(Inputs(profile, topology, 4, schedules=schedules))
    plan = planner.search().plans[0]
    path = tmp_path / "best.pipe"
    path.write_text(plan_source(plan, planner, "p.json", "t.yaml"))
    program = compile_schedule(str(path)).need_program()
    assert program.partition == plan.partition
    assert Program.from_json(program.to_json()).partition == plan.partition
    # One link kind and one activation size: the file's `cost C` is every transfer's time,
    # so simulating the written file gives the plan's prediction (costs rounded to 1e-4).
    timeline = replay(program, program.costs)
    assert timeline.makespan == pytest.approx(plan.time_ms, abs=1e-3 * len(plan.partition) * 8)
    return path


def test_a_written_plan_times_each_boundary_on_its_own_link(tmp_path: Path) -> None:
    """Two nodes of two devices, 1 TB/s inside a node and 1 GB/s between: the boundary
    that crosses nodes gets its own `C[b]`, so simulating the written file gives the
    plan's prediction (a mean `C` for every transfer did not)."""
    topology, node = two_nodes(), [0, 0, 1, 1]
    profile = make_profile([1.0] * 8, output=4e6)
    planner = Planner(Inputs(profile, topology, 8, schedules=("1f1b",)))
    plan = next(p for p in planner.search().plans if p.candidate.ranks == 4)
    text = plan_source(plan, planner, "p.json", "t.yaml")
    assert "differ slightly" not in text
    path = tmp_path / "best.pipe"
    path.write_text(text)
    program = compile_schedule(str(path)).need_program()
    crossing = [node[plan.devices[b]] != node[plan.devices[b + 1]] for b in range(3)]
    # 4 MB at 1 GB/s between the nodes, at 1 TB/s inside one
    assert [program.costs.of("C", b) for b in range(3)] == [4 if c else 0.004 for c in crossing]
    assert any(crossing)
    timeline = replay(program, program.costs)
    assert timeline.makespan == pytest.approx(plan.time_ms, abs=1e-3 * 4 * 8)


def test_a_written_split_plan_keeps_what_w_holds(tmp_path: Path) -> None:
    """A plan that splits W off B writes each stage's `MW`, the share of its activations
    W keeps after B as the plan's memory counted it (the profile's `w_activation_bytes`),
    so `check --max-activations`, `simulate` and `synthesize` on the file count as the
    plan did."""
    base = make_profile([1.0] * 8, activation=1e6)
    layers = tuple(
        dataclasses.replace(layer, w_activation_bytes=(0.25 if i % 2 else 0.5) * 1e6)
        for i, layer in enumerate(base.layers)
    )
    profile = dataclasses.replace(base, layers=layers)
    planner = Planner(Inputs(profile, uniform_topology(4), 8, schedules=("zb-h1",)))
    plan = next(p for p in planner.search().plans if p.candidate.ranks == 4)
    path = tmp_path / "best.pipe"
    path.write_text(plan_source(plan, planner, "p.json", "t.yaml"))
    program = compile_schedule(str(path)).need_program()
    start = 0
    for stage, count in enumerate(plan.partition):
        shares = [0.25 if i % 2 else 0.5 for i in range(start, start + count)]
        assert program.costs.of("MW", stage) == pytest.approx(sum(shares) / count, abs=1e-4)
        start += count


@pytest.mark.slow
def test_written_plan_passes_check_and_round_trips(tmp_path: Path) -> None:
    path = plan_for_demo(tmp_path)
    text = path.read_text()
    assert text.startswith("# Plan from `pipelang plan`")
    assert "partition " in text and "cost F[0] = " in text
    proc = pipelang_here("check", str(path), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    proc = pipelang_here("viz", str(path), "-o", str(tmp_path / "t.txt"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_run_takes_the_partition_from_the_schedule(tmp_path: Path) -> None:
    path = tmp_path / "p.pipe"
    path.write_text(
        "schedule p(D: int = 2, N: int = 2) {\n    partition 3, 3\n"
        "    pipeline main: stage s in 0..D -> rank s\n    microbatches 0..N -> main\n"
        "    order rank r {\n        for i in 0..N { F(i) }\n        for i in 0..N { B(i) }\n"
        "    }\n}\n"
    )
    status, _, err = run_in_process(
        ["run", str(path), "--model", "pipelang.planner.demo:unbalanced"]
    )
    assert status == 1
    assert "--partition 3,3 must give every stage at least one layer and add up to the 10" in err


@pytest.mark.slow
def test_written_plan_runs_with_gloo(tmp_path: Path) -> None:
    path = plan_for_demo(tmp_path, schedules=("1f1b",))
    proc = pipelang_here(
        "run",
        str(path),
        "--model",
        "pipelang.planner.demo:unbalanced",
        "--backend",
        "gloo",
        "--steps",
        "1",
        "--check",
        cwd=tmp_path,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    header = re.search(r"predicted iteration ([0-9.]+) ms", path.read_text())
    assert header is not None
    line = re.search(
        r"plan: predicted ([0-9.]+) ms per step \((\S+) profiled on (.+?)\); "
        r"measured ([0-9.]+) ms per step here, ([0-9.]+)x",
        proc.stdout,
    )
    assert line is not None, proc.stdout
    assert float(line.group(1)) == pytest.approx(float(header.group(1)), abs=1e-3)
    assumed = re.search(r"^#   assumes (.+)$", path.read_text(), re.MULTILINE)
    assert assumed is not None and f"the plan assumed {assumed.group(1)}" in proc.stdout
    ratio = float(line.group(4)) / float(line.group(1))
    assert float(line.group(5)) == pytest.approx(ratio, abs=0.01)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("partition 3, 3, 3", "`partition` gives 3 layer counts but the schedule has 2 stages"),
        ("partition 3, 0", "a stage of `partition` holds 0 layers"),
        ("partition 3, 3\n    partition 3, 3", "two `partition` declarations"),
    ],
)
def test_bad_partition_statement(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "p.pipe"
    path.write_text(
        f"schedule p(D: int = 2, N: int = 2) {{\n    {text}\n"
        "    pipeline main: stage s in 0..D -> rank s\n    microbatches 0..N -> main\n"
        "    order rank r { for i in 0..N { F(i) B(i) } }\n}\n"
    )
    with pytest.raises(PipelangError) as err:
        compile_schedule(str(path))
    diagnostic = err.value.diagnostics[0]
    assert message in diagnostic.message
    assert diagnostic.span is not None and diagnostic.span.line == 2 + ("two" in message)


# ---- profile, topology, units ---------------------------------------------------------------


@pytest.mark.slow
def test_profile_command_measures_every_layer(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    proc = pipelang_here(
        "profile",
        "--model",
        "gpt:tiny",
        "-o",
        str(out),
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--threads",
        "1",
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    profile = load_profile(out)
    from pipelang.backends.builtin_models import GPT_SIZES
    from pipelang.backends.models import ModelSpec

    model = ModelSpec("gpt:tiny").build()
    assert [c.name for c in profile.layers] == [type(m).__name__ for m in model.layers]
    for cost, layer in zip(profile.layers, model.layers, strict=True):
        params = sum(p.numel() * p.element_size() for p in layer.parameters())
        assert cost.weight_bytes == params
        assert cost.forward_ms > 0 and cost.backward_input_ms + cost.backward_weight_ms > 0
    cfg = GPT_SIZES["tiny"]
    assert profile.layers[1].output_bytes == 4 * cfg.seq_len * cfg.width * 4  # fp32 hidden
    assert profile.layers[1].activation_bytes > profile.layers[1].output_bytes
    # what a split backward keeps for W: measured for every layer, all but nothing of a
    # block's (its GEMMs' inputs and output gradients), more than the embedding saved
    # (the gradient its W starts from; token ids have no gradient of their own)
    kept = [c.w_activation_bytes for c in profile.layers]
    assert all(k is not None and k > 0 for k in kept)
    assert kept[1] <= profile.layers[1].activation_bytes  # type: ignore[operator]
    assert kept[0] > profile.layers[0].activation_bytes  # type: ignore[operator]


@pytest.mark.slow
def test_profile_calibrate_runs_the_model_and_reads_its_trace(tmp_path: Path) -> None:
    """`--calibrate gloo` end to end: a real 2-rank run of the model, its trace read back."""
    out = tmp_path / "p.json"
    proc = pipelang_here(
        "profile", "--model", "gpt:tiny", "-o", str(out), "--repeats", "2", "--threads", "1",
        "--calibrate", "gloo", "--calibrate-rounds", "1", cwd=tmp_path, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "calibrating: 2 ranks on gloo" in proc.stderr
    profile = load_profile(out)
    runtime = profile.runtime
    assert runtime is not None and (runtime.backend, runtime.ranks) == ("gloo", 2)
    assert runtime.rounds == 1  # several: test_calibration_runs_combine_into_medians_...
    # Host costs of a Python runtime on a CPU: more than nothing, less than a layer's
    # forward of a model this small would make of them if they were compute.
    assert 0 < runtime.action_ms < 20 and 0 < runtime.send_ms < 50 and runtime.recv_ms >= 0
    # Two ranks on two cores: a layer runs at most a few times slower than alone.
    assert 0.3 < runtime.compute_scale < 5
    assert runtime.message_bytes == max(c.output_bytes for c in profile.layers[:-1])


def test_topology_shorthand_and_units(tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text(
        "nodes: 2\ngpus_per_node: 2\nmemory: 80GiB\n"
        "intra_node: {bandwidth: 300GB/s, latency: 2us}\n"
        "inter_node: {bandwidth: 100Gbit/s, latency: 10us}\n"
    )
    topology = load_topology(tmp_path / "t.yaml")
    assert topology.names == ("node0.gpu0", "node0.gpu1", "node1.gpu0", "node1.gpu1")
    assert topology.memory == (80 * 2**30,) * 4
    assert topology.link(0, 1) == Link(300e9, 2e-6)
    assert topology.link(1, 2) == Link(12.5e9, 10e-6)
    assert parse_bytes("1.5KiB") == 1536 and parse_bandwidth("8bit/s") == 1
    assert parse_seconds("250ns") == pytest.approx(2.5e-7)


def test_profile_reader_rejects_missing_keys() -> None:
    with pytest.raises(PipelangError) as err:
        profile_from_dict({"format": "pipelang-profile/1", "layers": [{"forward_ms": 1}]})
    assert err.value.diagnostics[0].code == "E0401"
    assert "layer 0 has no `backward_input_ms`" in err.value.diagnostics[0].message


# ---- the CLI ---------------------------------------------------------------------------------


def write_inputs(tmp_path: Path) -> tuple[Path, Path]:
    profile = make_profile([1.0, 2.0, 1.0, 1.0], activation=4 * MiB, weight=MiB)
    doc = json.loads(profile.to_json())
    (tmp_path / "p.json").write_text(json.dumps(doc))
    (tmp_path / "t.yaml").write_text(
        "nodes: 1\ngpus_per_node: 2\nmemory: 1GiB\nintra_node: {bandwidth: 10GB/s}\n"
    )
    return tmp_path / "p.json", tmp_path / "t.yaml"


def plan_cmd(tmp_path: Path, *extra: str) -> object:
    return pipelang_here(
        "plan",
        "--profile",
        "p.json",
        "--topology",
        "t.yaml",
        "--micro-batches",
        "8",
        "-o",
        "best.pipe",
        *extra,
        cwd=tmp_path,
        timeout=120,
    )


@pytest.mark.slow
def test_plan_command_prints_the_ranking_and_the_reason_gpipe_is_out(tmp_path: Path) -> None:
    write_inputs(tmp_path)
    # GPipe's rank 0 at D = 2: 4 x 2 MiB of weight state + 8 x 8 MiB of activations.
    proc = plan_cmd(tmp_path, "--max-memory", "64MiB", "--schedules", "gpipe,1f1b")
    assert proc.returncode == 0, proc.stderr  # type: ignore[attr-defined]
    out = proc.stdout  # type: ignore[attr-defined]
    assert "1f1b D=2 N=8" in out and "wrote best.pipe" in out
    assert "gpipe D=2 N=8" in out and "needs 72.00 MiB on rank 0" in out
    assert run_in_process(["check", str(tmp_path / "best.pipe")])[0] == 0
    proc = plan_cmd(tmp_path, "--json")
    doc = json.loads(proc.stdout)  # type: ignore[attr-defined]
    times = [p["iteration_ms"] for p in doc["plans"]]
    assert times[:3] == sorted(times[:3])
    assert {p["dp"] for p in doc["plans"]} == {1}
    doc = json.loads(plan_cmd(tmp_path, "--json", "--data-parallel").stdout)  # type: ignore[attr-defined]
    assert {p["dp"] for p in doc["plans"]} == {1, 2}


@pytest.mark.slow
def test_plan_command_says_why_candidates_were_left_out(tmp_path: Path) -> None:
    """Under the table, the candidates left out by the lower bound and by `require`
    are counted; `--all` lists each with its reason."""
    _, topology = write_inputs(tmp_path)
    topology.write_text(
        "nodes: 2\ngpus_per_node: 4\nmemory: 1GiB\nintra_node: {bandwidth: 10GB/s}\n"
        "inter_node: {bandwidth: 1GB/s}\n"
    )
    proc = plan_cmd(tmp_path, "--data-parallel", "--micro-batches", "16")
    assert proc.returncode == 0, proc.stderr  # type: ignore[attr-defined]
    found = re.search(
        r"(\d+) more left out: (\d+) by the lower bound \(slower than the fastest plans "
        r"found\), (\d+) by their schedule's `require` or the model's size",
        proc.stdout,  # type: ignore[attr-defined]
    )
    assert found and int(found[1]) == int(found[2]) + int(found[3]) and int(found[2]) > 0
    proc = plan_cmd(tmp_path, "--data-parallel", "--micro-batches", "16", "--all")
    out = proc.stdout  # type: ignore[attr-defined]
    assert "not simulated: it takes at least" in out and "more left out" not in out


@pytest.mark.slow
def test_plan_command_on_idle_devices_and_data_parallel_copies(tmp_path: Path) -> None:
    _, topology = write_inputs(tmp_path)
    # Four devices, four layers, 1F1B only, N = 8: over a 1 MB/s link every transfer of
    # 100 KB costs 100 ms against 1-2 ms of compute, so D = 1 wins and 3 devices idle.
    topology.write_text(
        "nodes: 1\ngpus_per_node: 4\nmemory: 1GiB\nintra_node: {bandwidth: 1MB/s}\n"
    )
    proc = plan_cmd(tmp_path, "--schedules", "1f1b")
    assert proc.returncode == 0, proc.stderr  # type: ignore[attr-defined]
    out = " ".join(proc.stdout.split())  # type: ignore[attr-defined]
    assert "wrote best.pipe: 1f1b D=1 N=8" in out
    assert "note: the plan uses 1 of the 4 devices; `--data-parallel` plans copies" in out
    # Copies of the whole model: 1 MiB of weights per layer take seconds to sum over this
    # link, so they lose and the note stays; with 1 KB per layer, the one allreduce per
    # iteration costs less than a transfer per micro-batch and stage boundary: they win.
    proc = plan_cmd(tmp_path, "--schedules", "1f1b", "--data-parallel")
    out = " ".join(proc.stdout.split())  # type: ignore[attr-defined]
    assert "wrote best.pipe: 1f1b D=1 N=8," in out
    assert "note: the plan uses 1 of the 4 devices; copies on the rest were slower" in out
    light = make_profile([1.0, 2.0, 1.0, 1.0], weight=1e3)
    (tmp_path / "p.json").write_text(light.to_json())
    proc = plan_cmd(tmp_path, "--schedules", "1f1b", "--data-parallel")
    out = " ".join(proc.stdout.split())  # type: ignore[attr-defined]
    assert "wrote best.pipe: 1f1b D=1 N=2 dp=4" in out
    assert "run it with `pipelang run best.pipe --dp 4`: 4 copies of the pipeline" in out
    assert "note: the plan uses" not in out
    topology.write_text(
        "nodes: 1\ngpus_per_node: 2\nmemory: 1GiB\nintra_node: {bandwidth: 1TB/s}\n"
    )
    proc = plan_cmd(tmp_path, "--schedules", "1f1b")
    assert "wrote best.pipe: 1f1b D=2" in proc.stdout  # type: ignore[attr-defined]
    assert "note: the plan uses" not in proc.stdout  # type: ignore[attr-defined]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("setup", "extra", "status", "expected"),
    [
        ("yaml", (), 1, "error[E0402]: the topology is not valid YAML"),
        ("class", (), 1, "error[E0402]: unknown link class `ib`; the classes are nvlink"),
        ("key", (), 1, "error[E0401]: `p.json`: layer 0 has no `weight_bytes`"),
        ("cap", ("--max-memory", "1KiB"), 1, "error[E0403]: no plan fits"),
        ("none", ("--max-memory", "12 parsecs"), 2, "--max-memory: unknown size unit"),
        ("none", ("--schedules", "pipedream"), 2, "--schedules: cannot plan with `pipedream`"),
        ("missing", (), 1, "error[E0401]: cannot read `p.json`"),
    ],
)
def test_plan_command_errors_are_clean(
    tmp_path: Path, setup: str, extra: tuple[str, ...], status: int, expected: str
) -> None:
    profile, topology = write_inputs(tmp_path)
    if setup == "yaml":
        topology.write_text("nodes: [1,\n")
    elif setup == "class":
        topology.write_text(
            "link_classes:\n  nvlink: {bandwidth: 300GB/s}\nnodes: 1\ngpus_per_node: 2\n"
            "memory: 1GiB\nintra_node: ib\n"
        )
    elif setup == "key":
        doc = json.loads(profile.read_text())
        del doc["layers"][0]["weight_bytes"]
        profile.write_text(json.dumps(doc))
    elif setup == "missing":
        profile.unlink()
    proc = plan_cmd(tmp_path, *extra)
    assert proc.returncode == status  # type: ignore[attr-defined]
    assert expected in proc.stderr  # type: ignore[attr-defined]
    if setup == "class":  # the line of the YAML file
        assert "t.yaml:6:" in proc.stderr  # type: ignore[attr-defined]
    assert not (tmp_path / "best.pipe").exists()


def test_explain_knows_the_planner_codes() -> None:
    for code in ("E0208", "E0401", "E0402", "E0403", "E0404"):
        status, out, _ = run_in_process(["explain", code])
        assert status == 0 and code in out


# ---- runtime costs: calibration, optimizer step -----------------------------------------------


def host(
    action: float = 0.0, send: float = 0.0, recv: float = 0.0, scale: float = 1.0
) -> RuntimeCosts:
    return RuntimeCosts("gloo", 2, action, send, recv, 0.0, 1e5, scale)


def with_costs(profile: Profile, runtime: RuntimeCosts | None, step: float = 0.0) -> Profile:
    from dataclasses import replace

    layers = tuple(replace(c, sgd_step_ms=step, adam_step_ms=2 * step) for c in profile.layers)
    return replace(profile, layers=layers, runtime=runtime)


def predicted(
    profile: Profile, schedule: str, params: dict[str, int], counts: tuple[int, ...]
) -> float:
    ranks = params["D"]
    planner = Planner(Inputs(profile, uniform_topology(ranks), params["N"], optimizer="sgd"))
    per_rank = len(counts) // ranks
    candidate = Candidate(schedule, tuple(params.items()), per_rank)
    return planner.predict(candidate, counts, tuple(range(ranks)), full=True).time_ms


def test_profile_runtime_fields_round_trip_and_old_profiles_load_with_notes() -> None:
    base = make_profile([1.0, 2.0])
    costs = RuntimeCosts("gloo", 2, 0.02, 0.2, 0.3, 0.05, 131072.0, 1.25)
    full = with_costs(base, costs, step=0.1)
    again = profile_from_dict(json.loads(full.to_json()))
    assert again == full and again.notes() == []
    assert again.layers[0].step_ms("sgd") == 0.1 and again.layers[0].step_ms("adam") == 0.2
    old = json.loads(base.to_json())  # as written before these fields existed
    assert "runtime" not in old and "sgd_step_ms" in old["layers"][0]
    for layer in old["layers"]:
        del layer["sgd_step_ms"], layer["adam_step_ms"]
    loaded = profile_from_dict(old)
    assert loaded.runtime is None and loaded.layers[0].step_ms("adam") == 0.0
    notes = loaded.notes()
    assert len(notes) == 2 and "optimizer step" in notes[0] and "--calibrate gloo" in notes[1]


def test_calibration_runs_combine_into_medians_with_their_spread() -> None:
    """One run on a busy machine measured a send 10x slower: the median of three keeps
    the steady value, the spread shows the outlier, and both survive the profile file."""
    runs = [
        RuntimeCosts("gloo", 2, 0.02, 2.185, 0.3, 0.05, 131072.0, 1.25),
        RuntimeCosts("gloo", 2, 0.03, 0.188, 0.2, 0.04, 131072.0, 1.10),
        RuntimeCosts("gloo", 2, 0.01, 0.190, 0.4, 0.06, 131072.0, 1.20),
    ]
    costs = combined(runs)
    assert (costs.action_ms, costs.send_ms, costs.recv_ms) == (0.02, 0.19, 0.3)
    assert costs.compute_scale == 1.2 and costs.rounds == 3
    assert costs.spread["send_ms"] == (0.188, 2.185)
    assert "message_bytes" not in costs.spread
    text = costs.described()
    assert "median of 3 runs" in text and "send 0.190 ms (0.188-2.185)" in text
    assert "compute x1.20 (x1.10-x1.25)" in text
    again = profile_from_dict(json.loads(with_costs(make_profile([1.0]), costs).to_json()))
    assert again.runtime == costs
    assert combined(runs[:1]) == runs[0] and runs[0].described().startswith(
        "runtime (gloo, 2 ranks): 0.020 ms per action, send 2.185 ms,"
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"runtime": {"spread": {"send_ms": [1]}}}, "`runtime.spread.send_ms` must be [least"),
        ({"runtime": {"spread": {"speed": [1, 2]}}}, "of a runtime field"),
        ({"runtime": [1]}, "`runtime` must be an object"),
        ({"runtime": {"send_ms": -1}}, "`runtime.send_ms` must be between 0 and 1e+09, not -1"),
        ({"runtime": {"compute_scale": 0}}, "`runtime.compute_scale` must be more than 0"),
        ({"layer": {"adam_step_ms": "fast"}}, "layer 0 `adam_step_ms` must be a number"),
    ],
)
def test_profile_reader_rejects_bad_runtime_fields(change: dict[str, object], message: str) -> None:
    doc = json.loads(make_profile([1.0]).to_json())
    if "layer" in change:
        doc["layers"][0].update(change["layer"])  # type: ignore[arg-type]
    else:
        doc.update(change)
    with pytest.raises(PipelangError) as err:
        profile_from_dict(doc, "p.json")
    assert err.value.diagnostics[0].code == "E0401" and message in err.value.diagnostics[0].message


def test_per_action_host_cost_follows_the_pipeline_formula() -> None:
    """Equal stages, no transfer time: 1F1B takes (N + D - 1)(F + B) (the fill-drain
    count of GPipe/1F1B, reference/papers.md). A host cost `a` per action: every F and
    B on two ranks is one action and has one transfer action beside it (stage 0's F
    sends, its B receives; stage 1's F receives, its B sends), so each is 2a longer; the
    last rank to finish (rank 0, its last B) then runs its step, one more action."""
    f, a, step, n, d = 1.0, 0.25, 0.125, 6, 2
    base = make_profile([f] * 4, output=0.0)  # B = 2F per layer; two layers a stage
    stage_f, stage_b = 2 * f, 4 * f
    assert predicted(base, "1f1b", {"D": d, "N": n}, (2, 2)) == pytest.approx(
        (n + d - 1) * (stage_f + stage_b)
    )
    costly = with_costs(base, host(action=a), step=step)
    expected = (n + d - 1) * (stage_f + stage_b + 4 * a) + 2 * step + a
    assert predicted(costly, "1f1b", {"D": d, "N": n}, (2, 2)) == pytest.approx(expected)


def test_schedules_with_more_actions_pay_more_host_time() -> None:
    """Interleaving (v = 2) has twice the actions of 1F1B: a per-action cost lengthens
    it more; with sends and receives, a stage boundary that crosses ranks costs too."""
    base = make_profile([1.0] * 8)
    costly = with_costs(base, host(action=0.5))
    plain = {"D": 2, "N": 4}
    grow_1f1b = predicted(costly, "1f1b", plain, (4, 4)) - predicted(base, "1f1b", plain, (4, 4))
    inter = {"D": 2, "N": 4, "v": 2}
    grow_inter = predicted(costly, "interleaved-1f1b", inter, (2,) * 4) - predicted(
        base, "interleaved-1f1b", inter, (2,) * 4
    )
    assert grow_1f1b > 0 and grow_inter > 1.5 * grow_1f1b
    messages = with_costs(base, host(send=0.5, recv=0.5))
    assert predicted(messages, "1f1b", plain, (4, 4)) > predicted(base, "1f1b", plain, (4, 4)) + 1


def test_compute_scale_scales_the_compute() -> None:
    base = make_profile([1.0, 3.0, 1.0, 1.0], output=0.0)
    plain = {"D": 2, "N": 4}
    slower = with_costs(base, host(scale=1.5))
    assert predicted(slower, "gpipe", plain, (2, 2)) == pytest.approx(
        1.5 * predicted(base, "gpipe", plain, (2, 2))
    )


def trace(events: list[tuple[int, str, float, float]], offset: float = 0.0) -> list[TraceEvent]:
    """Trace events of the first step after the calibration's warm-up (rank, name, start,
    end); rank 1's clock `offset` ahead."""
    return [
        TraceEvent(
            rank,
            WARMUP_STEPS,
            i,
            name,
            name.split(":")[0] if ":" in name else name[0],
            start + offset * rank,
            end + offset * rank,
        )
        for i, (rank, name, start, end) in enumerate(events)
    ]


@pytest.mark.parametrize("offset", [0.0, 7.5])
def test_calibration_reads_host_costs_from_a_trace(offset: float) -> None:
    """A hand-made trace of 1F1B on two ranks with known costs: sends take 0.2, a
    receive whose message is there 0.3, a message arrives 0.1 after its send ends, every
    gap between actions is 0.05; rank 1's clock may start `offset` later."""
    profile = make_profile([1.0, 1.0])  # F = 1, B = 2 per stage, one layer per stage
    events = [
        (0, "F0@0/main", 0.0, 1.0),
        (0, "send:F0@0/main>1", 1.05, 1.25),
        (1, "recv:F0@0/main<0", 0.0, 1.35),  # waits: ends 0.1 after the send
        (1, "F0@1/main", 1.4, 2.4),
        (1, "B0@1/main", 2.45, 4.45),
        (1, "send:B0@1/main>0", 4.5, 4.7),
        (0, "F1@0/main", 1.3, 2.3),
        (0, "send:F1@0/main>1", 2.35, 2.55),
        (0, "recv:B0@1/main<1", 2.6, 4.8),  # waits
        (0, "B0@0/main", 4.85, 6.85),
        (1, "recv:F1@0/main<0", 4.75, 5.05),  # the message was there: 0.3
        (1, "F1@1/main", 5.1, 6.1),
        (1, "B1@1/main", 6.15, 8.15),
        (1, "send:B1@1/main>0", 8.2, 8.4),
        (0, "recv:B1@1/main<1", 9.0, 9.3),  # there: 0.3
        (0, "B1@0/main", 9.35, 11.35),
    ]
    costs = runtime_costs(trace(events, offset), profile, (1, 1), "gloo", 2)
    assert costs.action_ms == pytest.approx(0.05)
    assert costs.send_ms == pytest.approx(0.2)
    assert costs.recv_ms == pytest.approx(0.3)
    # waited: 0.1 after the send ends, of which the receive's own 0.3 is not message time
    assert costs.message_ms == 0.0
    assert costs.compute_scale == pytest.approx(1.0)


def test_calibration_message_time_and_compute_scale() -> None:
    profile = make_profile([1.0, 1.0])
    events = [
        (0, "F0@0/main", 0.0, 1.5),
        (0, "send:F0@0/main>1", 1.5, 1.7),
        (1, "recv:F0@0/main<0", 0.0, 2.7),  # waited: 1.0 after the send's end
        (1, "F0@1/main", 2.7, 4.2),
        (1, "B0@1/main", 4.2, 7.2),
        (1, "send:B0@1/main>0", 7.2, 7.4),
        (0, "recv:B0@1/main<1", 1.7, 8.4),  # waited: 1.0
        (0, "B0@0/main", 8.4, 11.4),
        (1, "recv:F9@0/main<0", 9.0, 9.5),  # there (its send below ended before): 0.5
        (0, "send:F9@0/main>1", 8.0, 8.2),
    ]
    costs = runtime_costs(trace(events), profile, (1, 1), "gloo", 2)
    assert costs.recv_ms == pytest.approx(0.5)
    assert costs.message_ms == pytest.approx(0.5)  # 1.0 less the receive's own 0.5
    assert costs.compute_scale == pytest.approx(1.5)  # 9 ms of compute for 6 profiled


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


# ---- honest output: device kinds, lopsided plans -----------------------------------------------


@pytest.mark.parametrize(
    ("text", "kinds"),
    [
        (
            "nodes: 1\ngpus_per_node: 2\nmemory: 1GiB\nkind: H100\n"
            "intra_node: {bandwidth: 10GB/s}\n",
            ("H100", "H100"),
        ),
        (
            "devices:\n  - {name: a, memory: 1GiB, kind: A100}\n  - {name: b, memory: 1GiB}\n"
            "default_link: {bandwidth: 1GB/s}\n",
            ("A100", ""),
        ),
        ("nodes: 1\ngpus_per_node: 2\nmemory: 1GiB\nintra_node: {bandwidth: 10GB/s}\n", ()),
    ],
)
def test_topology_device_kinds(tmp_path: Path, text: str, kinds: tuple[str, ...]) -> None:
    (tmp_path / "t.yaml").write_text(text)
    assert load_topology(tmp_path / "t.yaml").kinds == kinds


def test_a_profile_from_another_device_kind_is_noted() -> None:
    profile = make_profile([1.0, 1.0])
    h100 = dataclasses.replace(uniform_topology(2), kinds=("H100", "H100"))
    cpus = dataclasses.replace(uniform_topology(2), kinds=("cpu", ""))
    gpu_profile = dataclasses.replace(profile, device="cuda:0", device_name="NVIDIA H100 80GB HBM3")
    [note] = [n for n in Inputs(profile, h100, 4).notes() if "another kind" in n]
    assert "measured on cpu" in note and "`H100` devices (d0 and 1 more)" in note
    assert not [n for n in Inputs(gpu_profile, h100, 4).notes() if "another kind" in n]
    assert not [n for n in Inputs(profile, cpus, 4).notes() if "another kind" in n]
    assert not [n for n in Inputs(profile, uniform_topology(2), 4).notes() if "another kind" in n]


def test_lopsided_partitions_are_flagged() -> None:
    assert lopsided([(1.0, 2.0, 0.0), (1.2, 2.0, 0.0)]) is None
    one = lopsided([(10.0, 20.0, 0.0), (0.1, 0.2, 0.0), (0.2, 0.1, 0.0)])
    assert one is not None and "in effect one device per pipeline" in one
    some = lopsided([(10.0, 20.0, 0.0), (9.0, 20.0, 0.0), (0.1, 0.2, 0.0)])
    assert some is not None and some.startswith("lopsided: stage 2 does 1% of the work of stage 0")


@pytest.mark.slow
def test_the_plan_command_marks_a_lopsided_plan(tmp_path: Path) -> None:
    """Two layers, the first 100x the second: on two devices the only D=2 partition is
    1,1, whose second device waits nearly all the time."""
    profile = make_profile([100.0, 1.0])
    (tmp_path / "p.json").write_text(profile.to_json())
    (tmp_path / "t.yaml").write_text(
        "nodes: 1\ngpus_per_node: 2\nmemory: 1GiB\nkind: H100\nintra_node: {bandwidth: 10GB/s}\n"
    )
    proc = plan_cmd(tmp_path, "--schedules", "1f1b")
    out, err = proc.stdout, proc.stderr  # type: ignore[attr-defined]
    assert proc.returncode == 0, err  # type: ignore[attr-defined]
    assert re.search(r"\d!: lopsided: the stages but stage 0 do 1% of the work", out), out
    assert "another kind" in err and "`H100`" in err
    doc = json.loads(plan_cmd(tmp_path, "--schedules", "1f1b", "--json").stdout)  # type: ignore[attr-defined]
    flags = {p["params"]["D"]: p["lopsided"] for p in doc["plans"]}
    assert flags[1] is None and "in effect one device" in flags[2]


# ---- devices of different speed ----------------------------------------------------------------


MIXED = """\
devices:
  - {name: new0, memory: 80GiB, kind: H100, speed: 2}
  - {name: new1, memory: 80GiB, kind: H100, speed: 2}
  - {name: old0, memory: 40GiB, kind: A100}
  - {name: old1, memory: 40GiB, kind: A100}
default_link: {bandwidth: 100GB/s, latency: 5us}
"""


CLASSES = """\
link_classes:
  nvlink: {bandwidth: 300GB/s, latency: 2us}
  wan: {bandwidth: 1GB/s, latency: 20ms}
devices:
  - {name: a0, memory: 80GiB, kind: H100, speed: 2, node: a, datacenter: east}
  - {name: a1, memory: 80GiB, kind: H100, speed: 2, node: a, datacenter: east}
  - {name: b0, memory: 40GiB, kind: A100, node: b, datacenter: east}
  - {name: c0, memory: 40GiB, kind: A100, node: c, datacenter: west}
  - {name: c1, memory: 40GiB, kind: A100, node: c, datacenter: west}
  - {name: x, memory: 16GiB}
intra_node: nvlink
inter_node: {bandwidth: 25GB/s, latency: 10us}
inter_datacenter: wan
default_link: {bandwidth: 10GB/s}
links:
  - {between: [b0, c0], class: nvlink}
"""


def test_mixed_devices_get_layers_in_proportion_to_speed(tmp_path: Path) -> None:
    """Two devices twice as fast as two others, 12 equal layers: 4, 4, 2, 2, every stage
    equally long; the even split (3 each) leaves the slow devices the bottleneck, and
    the simulator says so (1F1B, N = 16: 114 ms against 162 ms)."""
    (tmp_path / "t.yaml").write_text(MIXED)
    topology = load_topology(tmp_path / "t.yaml")
    assert topology.speeds == (2.0, 2.0, 1.0, 1.0)
    planner = Planner(Inputs(make_profile([1.0] * 12), topology, 16, schedules=("1f1b",)))
    result = planner.search()
    best = result.plans[0]
    assert (best.candidate.ranks, best.partition) == (4, (4, 4, 2, 2))
    even = planner.predict(best.candidate, (3, 3, 3, 3), best.devices, full=True)
    assert best.time_ms == pytest.approx(19 * 6, rel=1e-2)  # (N + D - 1)(F + B), balanced
    assert even.time_ms > 1.4 * best.time_ms  # the slow stages' 9 ms set the pace
    source = plan_source(best, planner, "p.json", "t.yaml")
    assert "cost F[0] = 2, B[0] = 4" in source and "cost F[3] = 2, B[3] = 4" in source


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        (MIXED.replace("speed: 2}", "speed: -2}", 1), 2, "cannot read `-2`"),
        (MIXED.replace("speed: 2}", "speed: 0}", 1), 2, "is between 0.001 and 1000, not `0`"),
        (MIXED.replace("speed: 2}", "speed: 2x}", 1), 2, "a speed has no unit"),
        (
            MIXED.replace("memory: 40GiB, kind: A100}", "memory: 0GiB}", 1),
            4,
            "memory is more than 0",
        ),
        (MIXED.replace("100GB/s", "0GB/s"), 6, "a bandwidth must be positive"),
        (MIXED.replace("kind: A100}", "kind: A100, color: red}", 1), 4, "unknown key `color`"),
        (MIXED.replace("name: old1", "name: old0"), 5, "device `old0` is listed twice"),
        (CLASSES.replace("inter_datacenter: wan", "inter_datacenter: satellite"), 13,
         "unknown link class `satellite`; the classes are nvlink, wan"),
        (CLASSES.replace("class: nvlink}", "class: nvlink, bandwidth: 1GB/s}"), 16,
         "a link names a `class` or gives its bandwidth, not both"),
        (CLASSES.replace("  wan: {bandwidth: 1GB/s, latency: 20ms}", "  wan: {bandwidth: 0GB/s}"),
         3, "a bandwidth must be positive"),
        (CLASSES.replace("inter_datacenter: wan\n", "").replace("default_link:", "# "), 1,
         "no link between `a0` and `c0` (two datacenters)"),
        (CLASSES.replace("node: b,", "node: b, rack: 3,"), 7, "unknown key `rack`"),
    ],
)  # fmt: skip
def test_bad_device_entries_name_their_line(
    tmp_path: Path, text: str, line: int, message: str
) -> None:
    (tmp_path / "t.yaml").write_text(text)
    with pytest.raises(PipelangError) as err:
        load_topology(tmp_path / "t.yaml")
    diag = err.value.diagnostics[0]
    assert diag.code == "E0402" and message in diag.message, diag.message
    assert diag.span is not None and diag.span.line == line


TWO_SITES = """\
nodes: 2
gpus_per_node: 4
memory: 80GiB
intra_node: {bandwidth: 300GB/s, latency: 2us}
datacenters: 2
inter_datacenter: {bandwidth: 1GB/s, latency: 20ms}
"""


def test_datacenters_in_the_shorthand(tmp_path: Path) -> None:
    (tmp_path / "t.yaml").write_text(
        TWO_SITES.replace("nodes: 2", "nodes: 4")
        + "inter_node: {bandwidth: 25GB/s, latency: 10us}\n"
    )
    topology = load_topology(tmp_path / "t.yaml")
    # nodes 0-1 in the first datacenter, 2-3 in the second
    assert topology.link(0, 1) == Link(300e9, 2e-6)
    assert topology.link(0, 4) == Link(25e9, 10e-6)
    assert topology.link(4, 8) == Link(1e9, 20e-3)
    for text, message in [
        (TWO_SITES.replace("nodes: 2", "nodes: 3"), "3 nodes do not split evenly"),
        (TWO_SITES.replace("inter_datacenter", "inter_site"), "unknown key `inter_site`"),
        ("\n".join(TWO_SITES.splitlines()[:-1]), "missing `inter_datacenter`"),
    ]:
        (tmp_path / "t.yaml").write_text(text)
        with pytest.raises(PipelangError) as err:
            load_topology(tmp_path / "t.yaml")
        assert message in err.value.diagnostics[0].message


def test_link_classes_in_the_full_form(tmp_path: Path) -> None:
    """Devices that name their node and datacenter take the class of link between them;
    a listed pair keeps its own link, a device without a node the default."""
    (tmp_path / "t.yaml").write_text(CLASSES)
    topology = load_topology(tmp_path / "t.yaml")
    index = topology.names.index
    nvlink, network, wan = Link(300e9, 2e-6), Link(25e9, 10e-6), Link(1e9, 20e-3)
    assert topology.link(index("a0"), index("a1")) == nvlink  # one node
    assert topology.link(index("a0"), index("b0")) == network  # two nodes of `east`
    assert topology.link(index("a1"), index("c1")) == wan  # two datacenters
    assert topology.link(index("b0"), index("c0")) == nvlink  # listed under `links`
    assert topology.link(index("c0"), index("x")) == Link(10e9, 0.0)  # no node: the default
    assert topology.speeds == (2.0, 2.0, 1.0, 1.0, 1.0, 1.0)


@pytest.mark.slow
def test_two_datacenters_keep_the_slow_link_off_the_critical_path(tmp_path: Path) -> None:
    """Two sites of 4 GPUs joined by 1 GB/s and 20 ms: the plan for them is far faster
    there than the plan made as if every link were NVLink (Chimera's cross-site
    transfers and allreduces then sit on the critical path)."""
    from benchmarks.plan_speed import synthetic_profile

    (tmp_path / "real.yaml").write_text(TWO_SITES)
    flat = TWO_SITES.replace("datacenters: 2\n", "").replace(
        "inter_datacenter: {bandwidth: 1GB/s, latency: 20ms}", "inter_node: {bandwidth: 300GB/s}"
    )
    (tmp_path / "flat.yaml").write_text(flat)
    profile = synthetic_profile(blocks=30)
    real = Planner(Inputs(profile, load_topology(tmp_path / "real.yaml"), 32), time_budget=0)
    best = real.search().plans[0]
    naive = Planner(Inputs(profile, load_topology(tmp_path / "flat.yaml"), 32), time_budget=0)
    assumed = naive.search().plans[0]
    there = real.predict(assumed.candidate, assumed.partition, assumed.devices, full=True)
    assert there.time_ms > 2 * best.time_ms


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zb-h2", "v-half"])
def test_cost_dependent_orders_follow_the_device_speeds(tmp_path: Path, schedule: str) -> None:
    """A greedy (zb-h2) or squeezed (v-half) order depends on the costs: the planner
    expands it under the costs it simulates, each stage's time over its device's speed,
    so simulating the written plan gives the plan's prediction. (Expanded under the
    profile's unscaled costs, zb-h2 was predicted at 98.5 ms against its file's 93.8,
    v-half at 120.3 against 118.3.)"""
    (tmp_path / "t.yaml").write_text(MIXED)
    inputs = Inputs(
        make_profile([1.0, 3.0, 1.0, 0.5] * 3), load_topology(tmp_path / "t.yaml"), 8,
        schedules=(schedule,),
    )  # fmt: skip
    planner = Planner(inputs, time_budget=0)
    plan = next(p for p in planner.search().plans if p.candidate.ranks == 4)
    assert plan.exact and len(set(planner.plan_speeds(plan) or [])) == 2
    path = tmp_path / "best.pipe"
    path.write_text(plan_source(plan, planner, "p.json", "t.yaml"))
    program = compile_schedule(str(path)).need_program()
    assert replay(program, program.costs).makespan == pytest.approx(plan.time_ms, abs=1e-6)


def test_fewer_ranks_than_devices_run_on_the_fastest(tmp_path: Path) -> None:
    """The slow devices listed first: a two-rank plan still lands on the two fast ones."""
    lines = MIXED.splitlines()
    (tmp_path / "t.yaml").write_text("\n".join([lines[0], *lines[3:5], *lines[1:3], lines[5]]))
    topology = load_topology(tmp_path / "t.yaml")
    assert topology.speeds == (1.0, 1.0, 2.0, 2.0)
    planner = Planner(Inputs(make_profile([1.0] * 12), topology, 16, schedules=("1f1b",)))
    two = next(p for p in planner.search().plans if p.candidate.ranks == 2)
    assert sorted(two.devices) == [2, 3]


TRADE = """\
link_classes:
  nvlink: {bandwidth: 300GB/s, latency: 2us}
devices:
  - {name: east.new, memory: 80GiB, kind: H100, speed: 2, node: e, datacenter: east}
  - {name: west.new, memory: 80GiB, kind: H100, speed: 2, node: w, datacenter: west}
  - {name: east.old, memory: 40GiB, kind: A100, node: e, datacenter: east}
  - {name: west.old, memory: 40GiB, kind: A100, node: w, datacenter: west}
intra_node: nvlink
inter_datacenter: {bandwidth: 1GB/s, latency: 20ms}
"""


def test_a_slower_device_on_a_fast_link_beats_a_fast_one_across_datacenters(
    tmp_path: Path,
) -> None:
    """Two sites, each a new and an old GPU on NVLink: a two-rank 1F1B whose boundary
    sends 50 MB runs on one site, a new and an old GPU, rather than on the two new GPUs
    across the 1 GB/s link, which the mapping's start (the fastest devices) would pick."""
    (tmp_path / "t.yaml").write_text(TRADE)
    topology = load_topology(tmp_path / "t.yaml")
    profile = make_profile([1.0] * 12, output=50e6)
    planner = Planner(Inputs(profile, topology, 8, schedules=("1f1b",)), time_budget=0)
    two = next(p for p in planner.search().plans if p.candidate.ranks == 2)
    assert {topology.names[d] for d in two.devices} in ({"east.new", "east.old"}, {
        "west.new", "west.old"})  # fmt: skip
    # The layers follow the speeds: 8 on the new GPU, 4 on the old one.
    assert sorted(two.partition) == [4, 8]
    fastest = planner.predict(two.candidate, (6, 6), (0, 1), full=True)
    assert fastest.time_ms > 1.5 * two.time_ms


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_partition_and_mapping_on_mixed_devices_against_brute_force(schedule: str) -> None:
    """Random 4-device clusters (speeds 1-3, each link fast or slow), a 2-rank plan:
    against every (mapping, partition) simulated, the plan is the best in most cases and
    never far from it (a local search can stop where two moves, not one, would help)."""
    fast, slow = Link(100e9, 5e-6), Link(0.5e9, 1e-4)
    ratios = []
    for seed in range(12):
        rng = random.Random(f"{schedule}{seed}")
        links: list[list[Link | None]] = [[None] * 4 for _ in range(4)]
        for a, b in itertools.combinations(range(4), 2):
            links[a][b] = links[b][a] = rng.choice([fast, slow])
        topology = Topology(
            ("d0", "d1", "d2", "d3"), (1e12,) * 4, tuple(map(tuple, links)), (),
            tuple(rng.choice([1.0, 2.0, 3.0]) for _ in range(4)),
        )  # fmt: skip
        layers = rng.randint(4, 7)
        profile = make_profile(
            [rng.choice([0.5, 1.0, 2.0]) for _ in range(layers)], output=rng.choice([1e6, 3e7])
        )
        n = rng.choice([2, 4, 8])
        planner = Planner(Inputs(profile, topology, n, schedules=(schedule,)), time_budget=0)
        plan = next(p for p in planner.search().plans if p.candidate.ranks == 2)
        best = min(
            planner.predict(plan.candidate, (k, layers - k), devices, full=True).time_ms
            for devices in itertools.permutations(range(4), 2)
            for k in range(1, layers)
        )
        ratios.append(plan.time_ms / best)
    assert max(ratios) < 1.05, ratios
    assert sum(r < 1 + 1e-9 for r in ratios) >= 10, ratios


@pytest.mark.slow
def test_every_rank_of_a_small_cluster_against_brute_force() -> None:
    """Issue 29 item 12: random 3-4 device clusters (speeds 1 and 2, each link fast, mid
    or slow, 6-8 layers), 1F1B on every device: against every (mapping, partition)
    simulated at N, the plan is within 5% everywhere and the best in at least 9 of 10
    (the planner tries them all when there are few; its local search alone found the
    best in 21 of 30 such clusters, 23% off at worst)."""
    fast, mid, slow = Link(100e9, 5e-6), Link(10e9, 2e-5), Link(0.5e9, 1e-4)
    ratios = []
    for seed in range(10):
        rng = random.Random(seed)
        size = rng.choice([3, 4])
        links: list[list[Link | None]] = [[None] * size for _ in range(size)]
        for a, b in itertools.combinations(range(size), 2):
            links[a][b] = links[b][a] = rng.choice([fast, mid, slow])
        topology = Topology(
            tuple(f"d{i}" for i in range(size)), (1e12,) * size, tuple(map(tuple, links)), (),
            tuple(rng.choice([1.0, 2.0]) for _ in range(size)),
        )  # fmt: skip
        layers = rng.randint(6, 8)
        profile = make_profile(
            [rng.choice([0.5, 1.0, 2.0]) for _ in range(layers)], output=rng.choice([1e6, 3e7])
        )
        planner = Planner(Inputs(profile, topology, 8, schedules=("1f1b",)), time_budget=0)
        plan = next(p for p in planner.search().plans if p.candidate.ranks == size)
        mine = planner.predict(plan.candidate, plan.partition, plan.devices, full=True).time_ms
        best = min(
            planner.predict(plan.candidate, counts, devices, full=True).time_ms
            for devices in itertools.permutations(range(size))
            for counts in compositions(layers, size)
        )
        ratios.append(mine / best)
    assert max(ratios) < 1.05, ratios
    assert sum(r < 1 + 1e-9 for r in ratios) >= 9, ratios


NODE_CLASSES = """\
nodes:
  - {count: 2, gpus_per_node: 4, memory: 80GiB, kind: H100, speed: 2, datacenter: east}
  - {count: 1, memory: 40GiB, kind: A100, datacenter: west}
gpus_per_node: 8
intra_node: {bandwidth: 300GB/s}
inter_node: {bandwidth: 25GB/s}
inter_datacenter: {bandwidth: 1GB/s, latency: 20ms}
"""


def test_classes_of_nodes_in_the_shorthand(tmp_path: Path) -> None:
    """`nodes` as a list of node classes, each with its count, GPUs, memory, kind, speed
    and datacenter (the top level's `gpus_per_node` and the rest as defaults)."""
    (tmp_path / "t.yaml").write_text(NODE_CLASSES)
    topology = load_topology(tmp_path / "t.yaml")
    assert topology.names[:5] == (*(f"node0.gpu{g}" for g in range(4)), "node1.gpu0")
    assert topology.names[-1] == "node2.gpu7" and topology.size == 16
    assert topology.speeds == (2.0,) * 8 + (1.0,) * 8
    assert topology.kinds == ("H100",) * 8 + ("A100",) * 8
    assert topology.memory == (80 * 2**30,) * 8 + (40 * 2**30,) * 8
    assert topology.link(0, 1) == Link(300e9, 0.0)  # one node
    assert topology.link(0, 4) == Link(25e9, 0.0)  # two nodes of `east`
    assert topology.link(4, 8) == Link(1e9, 20e-3)  # east and west
    assert topology.link(8, 15) == Link(300e9, 0.0)
    for change, message in [
        (("nodes:\n", "datacenters: 2\nnodes:\n"), "each class names its `datacenter`"),
        (("{count: 1, ", "{"), "missing `count`"),
        (("datacenter: west}", "site: west}"), "unknown key `site`"),
        (("gpus_per_node: 8\n", ""), "missing `gpus_per_node`"),
    ]:
        (tmp_path / "t.yaml").write_text(NODE_CLASSES.replace(*change))
        with pytest.raises(PipelangError) as err:
            load_topology(tmp_path / "t.yaml")
        assert message in err.value.diagnostics[0].message, err.value.diagnostics[0].message


@pytest.mark.slow
def test_text_from_the_inputs_cannot_add_lines_to_the_written_plan(tmp_path: Path) -> None:
    """A newline (or a carriage return, which the compiler reads as one) in the profile's
    model or a device's name stays inside its comment line: the plan passes `check` and
    holds no `fn` the inputs smuggled in."""
    profile = dataclasses.replace(make_profile([1.0, 1.0]), model="m\nfn evil() = 1\r# x")
    (tmp_path / "p.json").write_text(profile.to_json())
    (tmp_path / "t.yaml").write_text(
        'devices:\n  - {name: "a\\nfn bad() = 2", memory: 1GiB}\n'
        '  - {name: "b\\u2028c", memory: 1GiB}\n'
        "default_link: {bandwidth: 10GB/s}\n"
    )
    proc = plan_cmd(tmp_path, "--schedules", "1f1b")
    assert proc.returncode == 0, proc.stderr  # type: ignore[attr-defined]
    text = (tmp_path / "best.pipe").read_text()
    assert "m\\nfn evil() = 1\\r# x" in text and "a\\nfn bad() = 2" in text
    assert not [line for line in text.splitlines() if line.lstrip().startswith("fn")]
    assert pipelang_here("check", "best.pipe", cwd=tmp_path).returncode == 0
