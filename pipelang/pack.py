"""Dynamic micro-batching (DynaPipe): group a set of sequence lengths into micro-batches
of different shapes, and order them, to minimise the simulated makespan of a schedule
under a cap on the activation tokens any rank holds.

    lengths 900, 40, 35, 2000, 60, ...     (one iteration's samples)
      -> sort longest first; micro-batches are contiguous runs, each padded to its first
         (longest) sample: (samples, length) = (1, 2000), (2, 900), (12, 60), ...
      -> for each bound t_max on one micro-batch's time and each token bound, the
         dynamic program of DynaPipe's optimizer (after TeraPipe) cuts the runs that
         minimise (D - 1) * t_max + sum of the micro-batches' times
      -> every cut is compiled with the schedule, in three orders (longest first,
         shortest first, alternating), and simulated; the fastest whose every rank holds
         at most `max_tokens` activation tokens wins.

Two baselines, both as a padding framework would build them: `fixed_batches` (k samples
per micro-batch in the data's order, padded to their longest) and `packed_sequences`
(samples concatenated into sequences of one length, first fit, one sequence per
micro-batch, attention over the whole packed sequence).

Times come from the cost model (`BatchShapes.work`: tokens, and attention's share `A`
growing with samples x length^2, relative to one sequence of `S` tokens); the memory of a
micro-batch is its tokens. Facts from DynaPipe's code are in reference/seeds_wave2.md,
section 2; pipelang simulates every candidate with the real schedule instead of the
paper's closed form, and orders the micro-batches as well as cutting them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipelang import api
from pipelang.diagnostics import PipelangError
from pipelang.evaluate import MAX_OPS
from pipelang.ir import CostModel, shape_work

Shape = tuple[int, int]
"""(samples, length) of one micro-batch."""

BOUNDS = 12
"""How many bounds on one micro-batch's time the search tries (quantiles of them all)."""


@dataclass(frozen=True)
class Packing:
    """Micro-batches in run order, and what the schedule makes of them."""

    shapes: tuple[Shape, ...]
    makespan: float
    peak_tokens: float
    """The most activation tokens any rank holds at once (simulated)."""
    padding: float
    """The share of the micro-batches' tokens that are padding."""

    def lines(self) -> str:
        """The `--lengths` file: `SAMPLES LENGTH` per micro-batch."""
        return "".join(f"{s} {n}\n" for s, n in self.shapes)


def evaluate(
    sched: str,
    params: Mapping[str, str],
    shapes: Sequence[Shape],
    costs: CostModel,
    real_tokens: int,
    max_ops: int = MAX_OPS,
) -> Packing | None:
    """`shapes` run by the schedule with N = their count, under the schedule's costs with
    `costs` over them: the simulated makespan and peak tokens; None when the schedule
    refuses that many micro-batches (a Chimera needs a multiple of D, say)."""
    try:
        compiled = api.compile_schedule(
            sched,
            {**params, "N": str(len(shapes))},
            shapes=tuple(shapes),
            stop_after="validate",
            max_ops=max_ops,
        )
    except PipelangError:
        return None
    program = compiled.need_program()
    timeline = compiled.timeline(costs)
    assert program.shapes is not None
    reference = program.shapes.reference(program.costs.merged(costs))
    peak = max(timeline.peak_activations(r) for r in range(program.num_ranks)) * reference
    total = sum(s * n for s, n in shapes)
    return Packing(tuple(shapes), timeline.makespan, peak, 1 - real_tokens / total)


def with_reference(costs: CostModel, lengths: Sequence[int]) -> CostModel:
    """`costs` with the reference `S` set (to the longest sequence unless it gives one):
    every packing must be timed against the same reference to compare."""
    if costs.of("S") > 0:
        return costs
    return costs.merged(CostModel((("S", None, float(max(lengths))),)))


def pack(
    lengths: Sequence[int],
    sched: str,
    params: Mapping[str, str],
    costs: CostModel,
    max_tokens: int,
    max_ops: int = MAX_OPS,
) -> Packing:
    """The best packing of `lengths` for the schedule (see the module docstring), with
    `costs` over the schedule's (`with_reference` fixes `S`); ValueError when no packing
    fits `max_tokens` (a sequence longer than it, say). Every candidate is compiled
    within `max_ops` ops (E0106 past it: the candidate is skipped)."""
    if not lengths or min(lengths) < 1:
        raise ValueError("pack needs at least one sequence, each at least one token long")
    if max(lengths) > max_tokens:
        raise ValueError(
            f"a sequence of {max(lengths)} tokens does not fit --max-tokens {max_tokens}"
        )
    costs = with_reference(costs, lengths)
    order = sorted(lengths, reverse=True)
    stages, model = _stages(sched, params, costs)
    best: Packing | None = None
    seen: set[tuple[Shape, ...]] = set()
    for token_bound in sorted({max_tokens // k for k in range(1, stages + 1)}):
        for t_max in _bounds(order, model, token_bound):
            cut = _cut(order, model, t_max, token_bound, stages)
            if cut is None:
                continue
            for ordered in _orders(cut):
                if ordered in seen:
                    continue
                seen.add(ordered)
                found = evaluate(sched, params, ordered, costs, sum(lengths), max_ops)
                if _better(found, best, max_tokens):
                    best = found
    if best is None:
        raise ValueError(f"no packing keeps every rank within --max-tokens {max_tokens}")
    return best


def fixed_batches(lengths: Sequence[int], samples: int) -> tuple[Shape, ...]:
    """`samples` sequences per micro-batch in the data's order, padded to their longest."""
    groups = [lengths[i : i + samples] for i in range(0, len(lengths), samples)]
    return tuple((len(g), max(g)) for g in groups)


def packed_sequences(lengths: Sequence[int], length: int) -> tuple[Shape, ...]:
    """Sequences concatenated into bins of `length` tokens (first fit, longest first), one
    bin per micro-batch; a sequence longer than `length` gets a bin of its own length."""
    used: list[int] = []
    sizes: list[int] = []
    for n in sorted(lengths, reverse=True):
        for i in range(len(used)):
            if used[i] + n <= sizes[i]:
                used[i] += n
                break
        else:
            used.append(n)
            sizes.append(max(length, n))
    return tuple((1, size) for size in sizes)


def best_of(
    lengths: Sequence[int],
    sched: str,
    params: Mapping[str, str],
    costs: CostModel,
    max_tokens: int,
    candidates: Sequence[tuple[Shape, ...]],
    max_ops: int = MAX_OPS,
) -> Packing | None:
    """The fastest of `candidates` (packings of `lengths`) that keeps every rank within
    `max_tokens`; None if none does."""
    costs = with_reference(costs, lengths)
    best = None
    for shapes in candidates:
        found = evaluate(sched, params, shapes, costs, sum(lengths), max_ops)
        if _better(found, best, max_tokens):
            best = found
    return best


def _better(found: Packing | None, best: Packing | None, max_tokens: int) -> bool:
    """Whether `found` fits `max_tokens` (up to the simulator's rounding) and beats `best`."""
    if found is None or found.peak_tokens > max_tokens * (1 + 1e-6):
        return False
    return best is None or found.makespan < best.makespan


# ---- the search ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Model:
    """The search's closed form of one micro-batch's time on one stage, F + B + W of the
    schedule's costs (the simulation decides between the cuts it proposes)."""

    per: float
    attention: float
    reference: float
    fixed: float

    def time(self, samples: int, length: int) -> float:
        return self.per * shape_work(samples, length, self.attention, self.reference, self.fixed)


def _stages(sched: str, params: Mapping[str, str], costs: CostModel) -> tuple[int, _Model]:
    """The schedule's number of stages, and its cost model for the search."""
    for n in ("1", params.get("D", "4")):
        try:
            compiled = api.compile_schedule(sched, {**params, "N": n}, stop_after="expand-orders")
        except PipelangError:
            continue
        program = compiled.need_program()
        merged = program.costs.merged(costs)
        kinds = [k.value for k in program.kinds if k.value in "FBW"]
        per = sum(merged.of(k) for k in kinds)
        model = _Model(per, merged.of("A"), merged.of("S"), merged.of("O"))
        return program.num_stages, model
    raise ValueError(f"cannot compile `{sched}` to learn its stages")


def _bounds(order: Sequence[int], model: _Model, token_bound: int) -> list[float]:
    """Up to BOUNDS bounds on one micro-batch's time: quantiles of the times of the runs
    that fit `token_bound`."""
    times = set()
    for i, length in enumerate(order):
        for count in range(1, len(order) - i + 1):
            if count * length > token_bound:
                break
            times.add(model.time(count, length))
    ranked = sorted(t for t in times if t >= model.time(1, order[0]))
    if len(ranked) <= BOUNDS:
        return ranked
    return [ranked[round(k * (len(ranked) - 1) / (BOUNDS - 1))] for k in range(BOUNDS)]


def _cut(
    order: Sequence[int], model: _Model, t_max: float, token_bound: int, stages: int
) -> tuple[Shape, ...] | None:
    """The contiguous runs of `order` (longest first) that minimise
    (stages - 1) * t_max + the sum of their times, each run at most `t_max` long and
    `token_bound` tokens (padded to its first); None when a sequence alone exceeds them.
    (The first term is fixed by `t_max`; the caller tries several.)"""
    n = len(order)
    inf = float("inf")
    best = [0.0] + [inf] * n
    start = [0] * (n + 1)
    for end in range(1, n + 1):
        for first in range(end - 1, -1, -1):
            count, length = end - first, order[first]
            if count * length > token_bound:
                break
            t = model.time(count, length)
            if t > t_max:
                break
            if best[first] + t < best[end]:
                best[end], start[end] = best[first] + t, first
    if best[n] == inf:
        return None
    runs = []
    end = n
    while end > 0:
        first = start[end]
        runs.append((end - first, order[first]))
        end = first
    return tuple(reversed(runs))


def _orders(runs: tuple[Shape, ...]) -> list[tuple[Shape, ...]]:
    """The run orders tried: longest first, shortest first, and alternating the two."""
    longest = tuple(sorted(runs, key=lambda r: r[0] * r[1], reverse=True))
    alternate = []
    low, high = 0, len(longest) - 1
    while low <= high:
        alternate.append(longest[low])
        if low != high:
            alternate.append(longest[high])
        low, high = low + 1, high - 1
    return [longest, tuple(reversed(longest)), tuple(alternate)]
