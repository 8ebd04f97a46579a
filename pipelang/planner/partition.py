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
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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
    counts: Sequence[int], costs: Sequence[float], micro_batches: int, cut: CutCost | None = None
) -> Partition:
    """The objective J of one partition (see the module docstring)."""
    times, start = [], 0
    for count in counts:
        times.append(sum(costs[start : start + count]))
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
) -> Partition:
    """The partition of `costs` (one per layer) into `stages` non-empty contiguous
    stages that minimises J. `max_caps` bounds the caps tried after the smallest
    feasible one (the answer is exact unless that bound is reached)."""
    layers = len(costs)
    if not 1 <= stages <= layers:
        raise ValueError(f"cannot cut {layers} layers into {stages} non-empty stages")
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    caps = sorted({prefix[j] - prefix[i] for i in range(layers) for j in range(i + 1, layers + 1)})
    first = _smallest_feasible(caps, prefix, stages)
    best: Partition | None = None
    for cap in caps[first : first + max_caps]:
        if best is not None and (micro_batches - 1) * cap + prefix[-1] >= best.objective:
            break
        counts = _cheapest_transfers(prefix, stages, cap, cut)
        if counts is None:
            continue
        found = evaluate(counts, costs, micro_batches, cut)
        if best is None or found.objective < best.objective - 1e-12:
            best = found
        if cut is None:
            break
    assert best is not None
    return best


def _fits(prefix: list[float], stages: int, cap: float) -> bool:
    """Whether a greedy cut (stages as long as the cap allows) needs at most `stages`."""
    used, start, layers = 1, 0, len(prefix) - 1
    for end in range(1, layers + 1):
        if prefix[end] - prefix[start] > cap + 1e-12:
            used, start = used + 1, end - 1
            if prefix[end] - prefix[start] > cap + 1e-12:
                return False
    return used <= stages


def _smallest_feasible(caps: list[float], prefix: list[float], stages: int) -> int:
    lo, hi = 0, len(caps) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits(prefix, stages, caps[mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _cheapest_transfers(
    prefix: list[float], stages: int, cap: float, cut: CutCost | None
) -> tuple[int, ...] | None:
    """Exactly `stages` stages, each at most `cap`, with the least sum of transfers;
    None when impossible. best[s][i]: the first i layers in s + 1 stages."""
    layers = len(prefix) - 1
    inf = float("inf")
    best = [[inf] * (layers + 1) for _ in range(stages)]
    back = [[-1] * (layers + 1) for _ in range(stages)]
    for i in range(1, layers + 1):
        if prefix[i] <= cap + 1e-12:
            best[0][i] = 0.0
    for s in range(1, stages):
        # best[s][i] = min over j of best[s-1][j] + 2 cut(s-1, j), with j < i and the
        # stage j..i within the cap: both ends of j's window only move right with i.
        window: deque[tuple[int, float]] = deque()
        nxt = 1
        for i in range(s + 1, layers + 1):
            while nxt < i:
                value = best[s - 1][nxt]
                if value < inf:
                    value += 2 * cut(s - 1, nxt) if cut is not None else 0.0
                    while window and window[-1][1] >= value:
                        window.pop()
                    window.append((nxt, value))
                nxt += 1
            low = bisect.bisect_left(prefix, prefix[i] - cap - 1e-12)
            while window and window[0][0] < low:
                window.popleft()
            if window:
                best[s][i], back[s][i] = window[0][1], window[0][0]
    if best[stages - 1][layers] == inf:
        return None
    counts, end = [], layers
    for s in range(stages - 1, 0, -1):
        start = back[s][end]
        counts.append(end - start)
        end = start
    counts.append(end)
    return tuple(reversed(counts))
