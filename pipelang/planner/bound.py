"""A lower bound on a candidate's iteration, from its layout and stage costs alone.

Compiling and simulating a candidate is the costly part of a search over hundreds of
ranks; bounding it needs only the schedule's declarations (which stage each rank holds
in each pipeline, how many micro-batches each pipeline takes, the op kinds) and the
stage costs. A candidate whose bound exceeds the plans already found cannot enter the
ranking's top, so the search does not simulate it (`Planner.search`).

Every op of rank r runs on r, one at a time. Group r's ops into classes, one per
(pipeline, stage, kind): all the forwards of stage s in pipeline p, and so on. No op of
a class can start before its release, the chain of ops every schedule must run before
it (a micro-batch's forwards through the stages before s, for a forward), and after it
ends its tail must still run (the forwards of the later stages and every backward, after
a forward). For any set C of r's classes the iteration takes at least

    min_{c in C} release_c + sum_{c in C} work_c + min_{c in C} tail_c

(the one-machine bound with release and delivery times: C's ops start no earlier than
the smallest release, run one at a time, and the last of them to end has at least the
smallest tail after it). The best C for given thresholds (a, b) holds every class with
release >= a and tail >= b, so the bound is the largest over ranks and threshold pairs.

Transfers, the runtime's host costs and the optimizer step are left out, so the bound
stays below the simulator's time at the same stage costs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from pipelang.ir import Kind
from pipelang.orders import Layout


def iteration_bound(layout: Layout, stage_costs: Sequence[tuple[float, float, float]]) -> float:
    """The bound, in the unit of `stage_costs`: (F, B, W) of every stage; W counts
    only when the schedule has `W` ops, and an `R` (recompute) costs a forward."""
    forward = [f for f, _, _ in stage_costs]
    backward = [b for _, b, _ in stage_costs]
    weight = [w if Kind.W in layout.program.kinds else 0.0 for _, _, w in stage_costs]
    before_f = _prefix(forward)  # before_f[s]: the forwards of stages 0..s-1
    before_b = _prefix(backward)
    all_f, all_b = before_f[-1], before_b[-1]
    counts = Counter(layout.program.assignment)
    best = 0.0
    for rank in range(layout.program.num_ranks):
        classes: list[tuple[float, float, float]] = []  # (release, work, tail)
        for pipeline in layout.program.pipelines:
            count = counts[pipeline.name]
            held = layout.local_stages.get((pipeline.name, rank), ()) if count else ()
            for s in held:
                b_tail = max(weight[s], before_b[s] + weight[0])
                classes.append((before_f[s], count * forward[s], all_f - before_f[s + 1] + all_b))
                classes.append((all_f + all_b - before_b[s + 1], count * backward[s], b_tail))
                if Kind.W in layout.program.kinds:
                    classes.append((all_f + all_b - before_b[s], count * weight[s], 0.0))
                if Kind.R in layout.program.kinds:
                    classes.append((before_f[s], count * forward[s], 0.0))
        best = max(best, _one_machine(classes))
    return best


def _prefix(values: Sequence[float]) -> list[float]:
    out = [0.0]
    for value in values:
        out.append(out[-1] + value)
    return out


def _one_machine(classes: Sequence[tuple[float, float, float]]) -> float:
    """max over thresholds (a, b) of a + the work of the classes released at a or later
    with a tail of b or more + b."""
    best = 0.0
    for a in {release for release, _, _ in classes}:
        for b in {tail for _, _, tail in classes}:
            work = sum(w for release, w, tail in classes if release >= a and tail >= b)
            if work > 0:
                best = max(best, a + work + b)
    return best
