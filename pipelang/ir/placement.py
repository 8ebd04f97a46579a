"""Placement: which rank holds which stage of which pipeline, and every question asked of
it (a rank's stage copies, a stage's replicas, the stages a rank holds of one pipeline,
where micro-batches enter a rank, which stage boundaries cross ranks, and under `--dp`
which processes sum a stage's gradients and which copies `step` sums). `Program`, the
orders' `Layout`, the planner, the stream lowering and the runtime all ask here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pipelang.ir.action import Kind

if TYPE_CHECKING:
    from pipelang.ir.program import Pipeline, Program

_COPIES: OrderedDict[int, tuple[tuple[Pipeline, ...], dict[int, tuple[tuple[int, str], ...]]]]
_COPIES = OrderedDict()
"""The last few `copies_by_rank` answers, by the identity of the pipelines they index."""


def copies_by_rank(
    pipelines: tuple[Pipeline, ...],
) -> dict[int, tuple[tuple[int, str], ...]]:
    """Every rank's (stage, pipeline) copies, in pipeline then stage order: built once
    per Program's pipelines (by identity: hashing a placement of 100,000 ranks at every
    call would cost as much as the scan it saves), so that asking for each rank's copies
    is linear in the ranks, not quadratic."""
    cached = _COPIES.get(id(pipelines))
    if cached is not None and cached[0] is pipelines:
        _COPIES.move_to_end(id(pipelines))
        return cached[1]
    copies: dict[int, list[tuple[int, str]]] = {}
    for p in pipelines:
        for stage, rank in enumerate(p.placement):
            copies.setdefault(rank, []).append((stage, p.name))
    index = {rank: tuple(c) for rank, c in copies.items()}
    _COPIES[id(pipelines)] = (pipelines, index)  # holds `pipelines`: its id stays unique
    if len(_COPIES) > 64:
        _COPIES.popitem(last=False)
    return index


def owners(pipelines: Sequence[Pipeline]) -> dict[tuple[int | None, str | None], int]:
    """(stage, pipeline) -> the rank that runs it; keyed as an `Action` names its stage
    and pipeline, so `owners(...).get((op.stage, op.pipeline))` is the op's rank."""
    return {(s, p.name): r for p in pipelines for s, r in enumerate(p.placement)}


def replicas(pipelines: Sequence[Pipeline], stage: int) -> tuple[int, ...]:
    """Ranks holding a copy of `stage`, one entry per pipeline, in pipeline order."""
    return tuple(p.placement[stage] for p in pipelines)


def local_stages(pipelines: Sequence[Pipeline]) -> dict[tuple[str, int], tuple[int, ...]]:
    """(pipeline, rank) -> the stages of that pipeline the rank holds, ascending."""
    local: dict[tuple[str, int], tuple[int, ...]] = {}
    for p in pipelines:
        for s, r in enumerate(p.placement):
            local[(p.name, r)] = (*local.get((p.name, r), ()), s)
    return local


def entries(
    pipelines: Sequence[Pipeline], num_ranks: int
) -> list[frozenset[tuple[int | None, str | None]]]:
    """Per rank, its first (stage, pipeline) of each pipeline: where micro-batches enter
    it. One pass over the placements (a pass per rank was quadratic in ranks)."""
    first: list[dict[str, int]] = [{} for _ in range(num_ranks)]
    for pipeline in pipelines:
        for stage, rank in enumerate(pipeline.placement):
            first[rank].setdefault(pipeline.name, stage)
    return [frozenset((stage, name) for name, stage in f.items()) for f in first]


def crossing(pipelines: Sequence[Pipeline]) -> list[bool]:
    """Whether each stage boundary joins two ranks in some pipeline (a transfer crosses
    it there)."""
    stages = len(pipelines[0].placement) if pipelines else 0
    return [any(p.placement[b] != p.placement[b + 1] for p in pipelines) for b in range(stages - 1)]


def reduce_ranks(program: Program, stage: int, dp: int) -> list[int]:
    """The processes holding a copy of `stage` under `--dp dp`, sorted: copy k's rank r
    is process k x ranks + r (replica-major)."""
    ranks = sorted(set(program.replicas(stage)))
    return [k * program.num_ranks + r for k in range(dp) for r in ranks]


def reduced_at_step(program: Program, rank: int, dp: int) -> list[tuple[int, str]]:
    """The stage copies of `rank` whose gradients `step` itself sums over the `--dp`
    copies: those with no `allreduce` or `reduce_scatter` (`--shard`) action of their
    own (none without copies)."""
    if dp < 2:
        return []
    sums = (Kind.ALLREDUCE, Kind.REDUCE_SCATTER)
    reduced = {(a.stage, a.pipeline) for a in program.ranks[rank] if a.kind in sums}
    return [copy for copy in program.stage_copies(rank) if copy not in reduced]
