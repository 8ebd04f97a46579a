"""The three ways to write the per-rank order: `rank` loops, `greedy` policy, `repeat` block.

Each module turns one kind of `order` declaration into per-rank lists of compute
`Action`s; `passes/expand_orders.py` picks the module by the declaration's type.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipelang import ast
from pipelang.diagnostics import fail
from pipelang.evaluate import Env, Scope
from pipelang.ir import Action, CostModel, Dependency, Kind, Pipeline


@dataclass(frozen=True)
class Layout:
    """What an order needs to know about the schedule: placement and micro-batches."""

    scope: Scope
    env: Env
    num_ranks: int
    num_stages: int
    pipelines: tuple[Pipeline, ...]
    assignment: tuple[str, ...]
    kinds: tuple[Kind, ...]
    costs: CostModel
    after: tuple[Dependency, ...]
    local_stages: dict[tuple[str, int], tuple[int, ...]]
    """(pipeline, rank) -> the stages of that pipeline the rank holds, ascending."""

    def op(self, call: ast.OpCall, mb: int | None, stage: int | None, rank: int | None) -> Action:
        """The Action an op statement names; `rank` picks the stage when it is left out."""
        if mb is None:
            raise fail("E0103", f"`{call.kind}` needs a micro-batch here", call.span,
                       help=f"write `{call.kind}(mb)` or `{call.kind}(mb, stage)`")
        if not 0 <= mb < len(self.assignment):
            raise fail("E0103", f"micro-batch {mb} does not exist", call.span,
                       notes=(f"micro-batches are 0..{len(self.assignment)}",))
        pipeline = self.assignment[mb]
        if stage is None:
            stage = self.only_stage(call, pipeline, rank)
        elif not 0 <= stage < self.num_stages:
            raise fail("E0103", f"stage {stage} does not exist", call.span,
                       notes=(f"stages are 0..{self.num_stages}",))
        return Action(Kind(call.kind), mb, stage, pipeline, span=call.span)

    def only_stage(self, call: ast.OpCall, pipeline: str, rank: int | None) -> int:
        stages = self.local_stages.get((pipeline, rank), ()) if rank is not None else ()
        if len(stages) == 1:
            return stages[0]
        if not stages:
            raise fail("E0301", f"rank {rank} holds no stage of pipeline `{pipeline}`",
                       call.span, help="name the stage, or check the placement")
        listed = ", ".join(map(str, stages))
        raise fail("E0103", f"`{call.kind}` needs a stage: rank {rank} holds stages {listed} "
                   f"of pipeline `{pipeline}`", call.span,
                   help=f"write `{call.kind}(mb, stage)`")
