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

The search is bounded by its work (`MAX_CANDIDATES` packings simulated, `MAX_SEARCH_OPS`
ops in them), never by the clock, so one input gives one answer on any machine; a
deadline is only a safety limit, and an answer it cut says so.

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

import itertools
import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from pipelang import api
from pipelang.diagnostics import PipelangError
from pipelang.evaluate import MAX_OPS
from pipelang.ir import CostModel, shape_work

Shape = tuple[int, int]
"""(samples, length) of one micro-batch."""

MAX_SEQUENCES = 2048
"""The most sequences one `pack` takes (one iteration's batch), checked before any work."""

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
    ops: int = 0
    """The ops of the simulated schedule (the search's work)."""
    tried: int = 0
    """How many packings the search simulated to find this one (0: not a search's)."""
    out_of_time: bool = False
    """Whether the search's deadline cut it before its work was done."""

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
    refused: list[tuple[str, str]] | None = None,
) -> Packing | None:
    """`shapes` run by the schedule with N = their count, under the schedule's costs with
    `costs` over them: the simulated makespan and peak tokens; None when the schedule
    refuses that many micro-batches (a Chimera needs a multiple of D, say, or the op
    limit), its reason (code, message) then added to `refused`."""
    try:
        compiled = api.compile_schedule(
            sched,
            {**params, "N": str(len(shapes))},
            shapes=tuple(shapes),
            stop_after="validate",
            max_ops=max_ops,
            costs=costs,  # an order built from the costs (greedy, squeeze) is built under them
        )
    except PipelangError as err:
        if refused is not None:
            refused.append((err.diagnostics[0].code, err.diagnostics[0].message))
        return None
    program = compiled.need_program()
    timeline = compiled.timeline(costs)
    assert program.shapes is not None
    reference = program.shapes.reference(program.costs.merged(costs))
    peak = max(timeline.peak_activations(r) for r in range(program.num_ranks)) * reference
    total = sum(s * n for s, n in shapes)
    ops = sum(len(actions) for actions in program.ranks)
    return Packing(tuple(shapes), timeline.makespan, peak, 1 - real_tokens / total, ops)


def with_reference(costs: CostModel, lengths: Sequence[int]) -> CostModel:
    """`costs` with the reference `S` set (to the longest sequence unless it gives one):
    every packing must be timed against the same reference to compare."""
    if costs.of("S") > 0:
        return costs
    return costs.merged(CostModel((("S", None, float(max(lengths))),)))


MAX_CANDIDATES = 400
"""The most packings `pack` simulates by default: the bound on its search's work, a count,
so that one input gives one answer on any machine, however busy."""

MAX_SEARCH_OPS = 300_000
"""The most ops the packings `pack` simulates hold in all: the bound on its work where
each simulation is big (many sequences, many stages); a count too."""


def pack(
    lengths: Sequence[int],
    sched: str,
    params: Mapping[str, str],
    costs: CostModel,
    max_tokens: int,
    max_ops: int = MAX_OPS,
    deadline: float = math.inf,
    max_candidates: int = MAX_CANDIDATES,
) -> Packing:
    """The best packing of `lengths` for the schedule (see the module docstring), with
    `costs` over the schedule's (`with_reference` fixes `S`); ValueError when no packing
    fits `max_tokens` (a sequence longer than it, say); PipelangError (`usage`) where
    `costs` names a stage the schedule does not have. Every candidate is compiled
    within `max_ops` ops (E0106 past it: the candidate is skipped). One sequence per
    micro-batch, in the file's order and in the search's three, is tried first, before
    any deadline: the packing that holds the fewest tokens at once, so the answer is
    never "nothing fits" when something does; up to `EXACT` sequences, every packing is
    tried. The best is then improved by moving one micro-batch at a time in the run
    order. The search is bounded by its work: at most `max_candidates` packings
    simulated, holding at most `MAX_SEARCH_OPS` ops in all, so its answer does not
    depend on the machine; `deadline` (on `time.perf_counter`) is a safety limit, and
    an answer it cut short says so (`Packing.out_of_time`)."""
    if not lengths or min(lengths) < 1:
        raise ValueError("pack needs at least one sequence, each at least one token long")
    if len(lengths) > MAX_SEQUENCES:
        raise ValueError(
            f"{len(lengths):,} sequences; pack takes at most {MAX_SEQUENCES:,} (one iteration's)"
        )
    if max(lengths) > max_tokens:
        raise ValueError(
            f"a sequence of {max(lengths)} tokens does not fit --max-tokens {max_tokens}"
        )
    costs = with_reference(costs, lengths)
    stages, model = _stages(sched, params, costs)  # refuses a stage it does not have
    search = _Search(lengths, sched, params, costs, max_tokens, max_ops, max_candidates)
    alone = tuple((1, n) for n in lengths)
    try:
        for shapes in (alone, *_orders(alone)):  # before any deadline: what fits if anything
            search.tried(shapes)
        for shapes in _candidates(lengths, model, max_tokens, stages):
            search.tried(shapes, deadline)
        while search.best is not None and any(
            search.tried(moved, deadline) for moved in _moves(search.best.shapes)
        ):
            pass  # the order matters as much as the cut: move a micro-batch while it pays
    except _Stop as stop:
        search.out_of_time = stop.out_of_time
    return search.answer()


def _candidates(
    lengths: Sequence[int], model: _Model, max_tokens: int, stages: int
) -> Iterable[tuple[Shape, ...]]:
    """The packings the search tries after one sequence per micro-batch, in order: up
    to `EXACT` sequences every packing, above the dynamic program's cuts in three orders."""
    order = sorted(lengths, reverse=True)
    if len(lengths) <= EXACT:
        return _every_packing(order)
    return (
        ordered
        for token_bound in sorted({max_tokens // k for k in range(1, stages + 1)})
        for t_max in _bounds(order, model, token_bound)
        if (cut := _cut(order, model, t_max, token_bound, stages)) is not None
        for ordered in _orders(cut)
    )


class _Search:
    """The packings simulated so far, the best that fits, and the work done."""

    def __init__(
        self,
        lengths: Sequence[int],
        sched: str,
        params: Mapping[str, str],
        costs: CostModel,
        max_tokens: int,
        max_ops: int,
        max_candidates: int,
    ) -> None:
        self.lengths, self.sched, self.params, self.costs = lengths, sched, params, costs
        self.max_tokens, self.max_ops = max_tokens, max_ops
        self.max_candidates = max(1, max_candidates)
        self.best: Packing | None = None
        self.seen: set[tuple[Shape, ...]] = set()
        self.refused: list[tuple[int, str, str]] = []
        """(N, code, message) of each packing the schedule refused."""
        self.ops = 0
        self.out_of_time = False

    def tried(self, shapes: tuple[Shape, ...], deadline: float = math.inf) -> bool:
        """Simulate `shapes` unless done before; whether it is the best so far. _Stop when
        the work is done or `deadline` has passed."""
        if shapes in self.seen:
            return False
        if len(self.seen) >= self.max_candidates or self.ops >= MAX_SEARCH_OPS:
            raise _Stop(out_of_time=False)
        if time.perf_counter() > deadline:
            raise _Stop(out_of_time=True)
        self.seen.add(shapes)
        refused: list[tuple[str, str]] = []
        found = evaluate(
            self.sched, self.params, shapes, self.costs, sum(self.lengths), self.max_ops, refused
        )
        if found is None:
            self.refused.append((len(shapes), *refused[0]))
            return False
        self.ops += found.ops
        if found.makespan == 0:
            raise ValueError(
                "every packing takes no time: the schedule's F, B and W cost 0 "
                "(give them times, --cost F=1,B=2)"
            )
        if _better(found, self.best, self.max_tokens):
            self.best = found
            return True
        return False

    def answer(self) -> Packing:
        """The best packing found, with the work done; ValueError naming why none fits."""
        if self.best is not None:
            return replace(self.best, tried=len(self.seen), out_of_time=self.out_of_time)
        over_ops = [(n, message) for n, code, message in self.refused if code == "E0106"]
        if len(self.refused) == len(self.seen):
            n, code, message = self.refused[0]
            hint = " (raise --max-ops)" if code == "E0106" else ""
            raise ValueError(f"the schedule refuses every packing tried: N={n}: {message}{hint}")
        cut = " before the time budget ran out" if self.out_of_time else ""
        if over_ops:
            n, message = over_ops[0]
            raise ValueError(
                f"no packing within the op limit keeps every rank within --max-tokens "
                f"{self.max_tokens}{cut}; those of more micro-batches, which hold fewer "
                f"tokens at once, are over it (N={n}: {message}; raise --max-ops)"
            )
        raise ValueError(f"no packing keeps every rank within --max-tokens {self.max_tokens}{cut}")


EXACT = 5
"""Up to this many sequences `pack` tries every packing of its kind: each contiguous cut
of the lengths sorted longest first, in every order (261 simulations at 5)."""


class _Stop(Exception):
    """The search's work is done (`MAX_CANDIDATES`), or its deadline passed
    (`out_of_time`): the best packing so far is the answer."""

    def __init__(self, out_of_time: bool) -> None:
        super().__init__()
        self.out_of_time = out_of_time


def _every_packing(order: Sequence[int]) -> Iterator[tuple[Shape, ...]]:
    """Every contiguous cut of `order` into runs (each padded to its first), in every
    order of the runs."""
    n = len(order)
    for cuts in itertools.product((False, True), repeat=n - 1):
        starts = [0, *(i + 1 for i, cut in enumerate(cuts) if cut), n]
        runs = [(b - a, order[a]) for a, b in itertools.pairwise(starts)]
        yield from dict.fromkeys(itertools.permutations(runs))


def _moves(shapes: tuple[Shape, ...]) -> Iterator[tuple[Shape, ...]]:
    """`shapes` with one micro-batch moved to another place in the run order, each
    different order once per micro-batch (of equal micro-batches side by side, the
    first moves)."""
    for i, shape in enumerate(shapes):
        if i and shapes[i - 1] == shape:
            continue
        rest = shapes[:i] + shapes[i + 1 :]
        for j in range(len(shapes)):
            moved = (*rest[:j], shape, *rest[j:])
            if j != i and moved != shapes:
                yield moved


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
    deadline: float = math.inf,
) -> tuple[Packing | None, bool]:
    """The fastest of `candidates` (packings of `lengths`) that keeps every rank within
    `max_tokens` (None if none does), and whether `deadline` cut the candidates short."""
    costs = with_reference(costs, lengths)
    best = None
    for shapes in candidates:
        if time.perf_counter() > deadline:
            return best, True
        found = evaluate(sched, params, shapes, costs, sum(lengths), max_ops)
        if _better(found, best, max_tokens):
            best = found
    return best, False


def _better(found: Packing | None, best: Packing | None, max_tokens: int) -> bool:
    """Whether `found` fits `max_tokens` (up to the simulator's rounding) and beats `best`."""
    if found is None or found.peak_tokens > max_tokens * (1 + 1e-6):
        return False
    return best is None or found.makespan < best.makespan


# ---- the search ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Model:
    """The search's closed form of one micro-batch's time on one stage, F + B + W of the
    schedule's costs (the simulation decides between the cuts it proposes). By
    `shape_work`, a run of `count` sequences padded to `length` takes
    `fixed_time + count * per_sequence(length)`: linear in its count, which keeps the
    search's work near linear in the sequences."""

    per: float
    attention: float
    reference: float
    fixed: float

    def time(self, samples: int, length: int) -> float:
        return self.per * shape_work(samples, length, self.attention, self.reference, self.fixed)

    @property
    def fixed_time(self) -> float:
        return self.per * self.fixed

    def per_sequence(self, lengths: np.ndarray) -> np.ndarray:
        """What each more sequence of each length adds to a run's time: one sequence's
        `shape_work` less the fixed share (the formula is `shape_work`'s, on arrays)."""
        one: np.ndarray = shape_work(
            1,
            lengths,  # type: ignore[arg-type]
            self.attention,
            self.reference,
            self.fixed,
        )  # type: ignore[assignment]
        return self.per * (one - self.fixed)

    def most(self, lengths: np.ndarray, t_max: float, token_bound: int) -> np.ndarray:
        """The most sequences a run starting at a sequence of each length can hold
        within `t_max` and `token_bound` (0 where not even one fits)."""
        slope = self.per_sequence(lengths)
        by_time = np.floor((t_max - self.fixed_time) / np.maximum(slope, 1e-300) * (1 + 1e-12))
        by_tokens = token_bound // lengths
        return np.clip(np.minimum(by_time, by_tokens), 0, len(lengths)).astype(np.int64)


def _stages(sched: str, params: Mapping[str, str], costs: CostModel) -> tuple[int, _Model]:
    """The schedule's number of stages, and its cost model for the search."""
    refused: PipelangError | None = None
    for n in ("1", params.get("D", "4")):
        try:
            compiled = api.compile_schedule(
                sched, {**params, "N": n}, stop_after="expand-orders", costs=costs
            )
        except PipelangError as err:
            refused = err
            continue
        program = compiled.need_program()
        merged = program.costs  # the schedule's, `costs` over them
        per = sum(merged.of(k) for k in "FBW")  # a backward is B + W, split or not
        model = _Model(per, merged.of("A"), merged.of("S"), merged.of("O"))
        return program.num_stages, model
    assert refused is not None
    raise refused  # its diagnostics point into the schedule


_COUNTS = np.unique(np.round(1.01 ** np.arange(0, 1200))).astype(np.int64)
"""Run counts whose times `_bounds` takes: every count to 100, then 1% apart."""


def _bounds(order: Sequence[int], model: _Model, token_bound: int) -> list[float]:
    """Up to BOUNDS bounds on one micro-batch's time: quantiles of the times of the runs
    that fit `token_bound` (runs of every length in `order`, counts 1% apart past 100)."""
    lengths = np.unique(np.asarray(order, dtype=np.float64))
    most = np.minimum(token_bound // lengths, len(order))
    counts = _COUNTS[most.max() >= _COUNTS]
    times = model.fixed_time + np.outer(model.per_sequence(lengths), counts)
    times = np.unique(times[counts[None, :] <= most[:, None]])
    ranked = times[times >= model.time(1, order[0]) * (1 - 1e-12)]  # as `most` rounds
    if len(ranked) <= BOUNDS:
        return [float(t) for t in ranked]
    return [float(ranked[round(k * (len(ranked) - 1) / (BOUNDS - 1))]) for k in range(BOUNDS)]


def _cut(
    order: Sequence[int], model: _Model, t_max: float, token_bound: int, stages: int
) -> tuple[Shape, ...] | None:
    """The contiguous runs of `order` (longest first) that minimise
    (stages - 1) * t_max + the sum of their times, each run at most `t_max` long and
    `token_bound` tokens (padded to its first); None when a sequence alone exceeds them.
    (The first term is fixed by `t_max`; the caller tries several.) Each run's start
    relaxes every end it can reach at once: a run's time is linear in its count."""
    n = len(order)
    lengths = np.asarray(order, dtype=np.float64)
    slope = model.per_sequence(lengths)
    most = model.most(lengths, t_max, token_bound)
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    start = np.zeros(n + 1, dtype=np.int64)
    for first in range(n):
        reach = min(int(most[first]), n - first)
        if reach == 0 or best[first] == np.inf:
            continue
        ends = slice(first + 1, first + reach + 1)
        times = best[first] + model.fixed_time + slope[first] * np.arange(1, reach + 1)
        better = times < best[ends]
        best[ends] = np.where(better, times, best[ends])
        start[ends] = np.where(better, first, start[ends])
    if best[n] == np.inf:
        return None
    runs = []
    end = n
    while end > 0:
        first = int(start[end])
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
