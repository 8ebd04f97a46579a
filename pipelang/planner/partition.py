"""Cut a model's layers into contiguous stages: an exact dynamic program.

The objective is a pipeline's critical path, not the sum of its costs. With stage times
t_0..t_{S-1} (forward + backward of one micro-batch), N micro-batches and a transfer
time x_b at each of the S-1 stage boundaries, a synchronous pipeline (GPipe, 1F1B)
takes about

    J = (N - 1) * max_s t_s  +  sum_s t_s  +  2 * sum_b x_b

the slowest stage once per micro-batch (the steady state), every stage once (filling
and draining), and every boundary twice (the activation forward, its gradient back).
`sum_s t_s` is the same for every partition; the other two terms pull in different
directions when cutting at a light boundary makes a stage slower.

Exact minimisation: a stage's time only matters through the largest one, so for a cap
M on the largest, the cheapest transfers come from a DP over (stages, layers) whose
windows slide with the layer index (a monotone queue, O(S * L) per cap). The caps are
the distinct sums of contiguous layers, tried from the smallest feasible one upwards
until `(N - 1) * M` alone exceeds the best J found. Without transfer costs the first
feasible cap is the answer and this is the classic min-max (bottleneck) partition.

Devices of different speed (`speeds`, one per stage) divide each stage's time: the caps
are then the contiguous sums over each distinct speed, and since the sum of the stage
times now depends on the cut, the DP minimises it with the transfers (a stage j..i
takes prefix[i]/speed - prefix[j]/speed, which keeps the window's values separable).
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from pipelang.planner import budget

CutCost = Callable[[int, int], float]
"""`cut(b, j)`: time of boundary `b` (between stages b and b+1) when the first j layers
come before it."""


@dataclass(frozen=True, slots=True)
class Partition:
    """Layers per stage, and the objective's terms for them."""

    counts: tuple[int, ...]
    bottleneck: float
    transfers: float
    objective: float


def evaluate(
    counts: Sequence[int],
    costs: Sequence[float],
    micro_batches: int,
    cut: CutCost | None = None,
    speeds: Sequence[float] | None = None,
) -> Partition:
    """The objective J of one partition (see the module docstring); `speeds` divide
    each stage's time (a device `speed` times as fast as the profiled one)."""
    times, start = [], 0
    for stage, count in enumerate(counts):
        speed = speeds[stage] if speeds is not None else 1.0
        times.append(sum(costs[start : start + count]) / speed)
        start += count
    transfers, before = 0.0, 0
    for b, count in enumerate(counts[:-1]):
        before += count
        transfers += 2 * cut(b, before) if cut is not None else 0.0
    bottleneck = max(times)
    objective = (micro_batches - 1) * bottleneck + sum(times) + transfers
    return Partition(tuple(counts), bottleneck, transfers, objective)


def best_partition(
    costs: Sequence[float],
    stages: int,
    micro_batches: int,
    cut: CutCost | None = None,
    max_caps: int = 64,
    speeds: Sequence[float] | None = None,
) -> Partition:
    """The partition of `costs` (one per layer) into `stages` non-empty contiguous
    stages that minimises J. `max_caps` bounds the caps tried after the smallest
    feasible one (the answer is exact unless that bound is reached). `speeds`, one per
    stage: stage s's time is its layers' cost over `speeds[s]` (devices of different
    speed); the caps are then the contiguous sums over each distinct speed."""
    layers = len(costs)
    if not 1 <= stages <= layers:
        raise ValueError(f"cannot cut {layers} layers into {stages} non-empty stages")
    rates = [1.0] * stages if speeds is None else [float(s) for s in speeds]
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    sums = {prefix[j] - prefix[i] for i in range(layers) for j in range(i + 1, layers + 1)}
    caps = sorted({total / rate for total in sums for rate in set(rates)})
    first = _smallest_feasible(caps, prefix, rates)
    least = prefix[-1] / max(rates)  # sum_s t_s can be no smaller
    best: Partition | None = None
    for cap in caps[first : first + max_caps]:
        if best is not None and (micro_batches - 1) * cap + least >= best.objective:
            break
        counts = _cheapest_transfers(prefix, rates, cap, cut)
        if counts is None:
            continue
        found = evaluate(counts, costs, micro_batches, cut, rates)
        if best is None or found.objective < best.objective - 1e-12:
            best = found
        if cut is None and len(set(rates)) == 1:
            break  # the first feasible cap: the bottleneck is all that differs
    assert best is not None
    return best


def _fits(prefix: list[float], rates: list[float], cap: float) -> bool:
    """Whether the layers can be cut into the stages with every stage's time within
    `cap`. At one rate a greedy cut (stages as long as the cap allows) needing at most
    as many stages decides it; at several, the DP itself (O(S L))."""
    if len(set(rates)) > 1:
        return _cheapest_transfers(prefix, rates, cap, None) is not None
    limit = cap * rates[0] + 1e-12
    used, start, layers = 1, 0, len(prefix) - 1
    for end in range(1, layers + 1):
        if prefix[end] - prefix[start] > limit:
            used, start = used + 1, end - 1
            if prefix[end] - prefix[start] > limit:
                return False
    return used <= len(rates)


def _smallest_feasible(caps: list[float], prefix: list[float], rates: list[float]) -> int:
    lo, hi = 0, len(caps) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits(prefix, rates, caps[mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _cheapest_transfers(
    prefix: list[float], rates: list[float], cap: float, cut: CutCost | None
) -> tuple[int, ...] | None:
    """One stage per rate, stage s at most `cap` in time (its layers' cost at most
    cap x rates[s]), with the least sum of stage times and transfers (the stage times'
    sum is the same for every partition when the rates are); None when impossible.
    best[s][i]: the first i layers in s + 1 stages. A stage j..i takes
    prefix[i]/rate - prefix[j]/rate, so the window holds the part that depends on j."""
    stages = len(rates)
    layers = len(prefix) - 1
    inf = float("inf")
    best = [[inf] * (layers + 1) for _ in range(stages)]
    back = [[-1] * (layers + 1) for _ in range(stages)]
    for i in range(1, layers + 1):
        if prefix[i] <= cap * rates[0] + 1e-12:
            best[0][i] = prefix[i] / rates[0]
    for s in range(1, stages):
        budget.check()
        # best[s][i] = min over j of best[s-1][j] + 2 cut(s-1, j), with j < i and the
        # stage j..i within the cap: both ends of j's window only move right with i.
        window: deque[tuple[int, float]] = deque()
        nxt = 1
        for i in range(s + 1, layers + 1):
            while nxt < i:
                value = best[s - 1][nxt]
                if value < inf:
                    value += 2 * cut(s - 1, nxt) if cut is not None else 0.0
                    value -= prefix[nxt] / rates[s]
                    while window and window[-1][1] >= value:
                        window.pop()
                    window.append((nxt, value))
                nxt += 1
            low = bisect.bisect_left(prefix, prefix[i] - cap * rates[s] - 1e-12)
            while window and window[0][0] < low:
                window.popleft()
            if window:
                best[s][i], back[s][i] = window[0][1] + prefix[i] / rates[s], window[0][0]
    if best[stages - 1][layers] == inf:
        return None
    counts, end = [], layers
    for s in range(stages - 1, 0, -1):
        start = back[s][end]
        counts.append(end - start)
        end = start
    counts.append(end)
    return tuple(reversed(counts))


def compositions(layers: int, stages: int) -> Iterable[tuple[int, ...]]:
    """Every way to cut `layers` into `stages` non-empty contiguous stages."""
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        bounds = (0, *cuts, layers)
        yield tuple(b - a for a, b in itertools.pairwise(bounds))


def partition_neighbours(
    counts: tuple[int, ...], loads: Sequence[float]
) -> Iterable[tuple[int, ...]]:
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
