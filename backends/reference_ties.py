"""Weights tied across stages in the `--check` reference, summed as a run sums them.

A run keeps a tied weight (GPT-2's embedding and head, a user model's ties) as a separate
tensor in each stage copy that uses it (`RankRuntime._stage_copy`), each stage computing
its use's gradient alone; at `step`, once the stages' replicas have summed theirs,
`rank_sync.TiedGrads` gives every use the sum of all uses: each process adds the uses it
counts (each stage's copy on its lowest rank, in data-parallel copy 0) into a float32
zero tensor, in the order of the tie's uses, and `world_sum` adds the processes' parts
by `summation.tree_sum`. The norm of `--clip-grad` then counts the weight once (its
first use).

One process holding the weight as one tensor would add the uses' gradients per
micro-batch instead, another grouping, equal only up to rounding. So the reference
unties the weight as the run does (`untied_stages`: each stage's layers a copy, a tie
within one stage still one tensor), sums each stage's gradients as the run does
(`reference._Grouping`), and then replays the tie's sum (`TiedSums.apply`): bit for
bit the run's, on a CPU.
"""

from __future__ import annotations

import copy as copying
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pipelang.backends.models import LayeredModel
from pipelang.backends.summation import tree_sum
from pipelang.ir import Program


def untied_stages(model: LayeredModel, bounds: Sequence[range]) -> list[nn.Sequential]:
    """Each stage's layers as a copy of its own (`RankRuntime._stage_copy` with ties):
    a weight tied across stages is a tensor per stage, one tied inside a stage stays one."""
    return [copying.deepcopy(model.stage_module(b)) for b in bounds]


@dataclass(frozen=True, slots=True)
class _Use:
    tie: int
    stage: int
    index: int
    """The use's place in the stage's trained parameters (`Stage.trained`' order)."""


class TiedSums:
    """The sums of a run's ties across stages (see the module docstring), over the
    stages' parameter lists as `reference._Grouping` holds them."""

    def __init__(
        self,
        model: LayeredModel,
        bounds: Sequence[range],
        stages: Sequence[nn.Sequential],
        program: Program,
        dp: int,
    ) -> None:
        def stage_of(layer: int) -> int:
            return next(s for s, b in enumerate(bounds) if layer in b)

        self.uses: list[_Use] = []
        """Every use, a stage's first use of each tie once, in the ties' order."""
        self.repeated: set[tuple[int, int]] = set()
        """(stage, index) of the uses the norm skips: all but each tie's first."""
        self.sizes: list[int] = []
        for tie in model.ties:
            held = [stage_of(layer) for layer, _ in tie]
            if len(set(held)) < 2:
                continue  # within one stage: one tensor already
            number = len(self.sizes)
            for k, ((layer, name), stage) in enumerate(zip(tie, held, strict=True)):
                if stage in held[:k]:
                    continue
                names = [n for n, p in stages[stage].named_parameters() if p.requires_grad]
                index = names.index(f"{layer - bounds[stage].start}.{name}")
                self.uses.append(_Use(number, stage, index))
                if (layer, name) != tie[0]:
                    self.repeated.add((stage, index))
            self.sizes.append(model.layers[tie[0][0]].get_parameter(tie[0][1]).numel())
        self.counted = [
            [u for u in self.uses if _counts(program, rank, u.stage)] if replica == 0 else []
            for replica in range(dp)
            for rank in range(program.num_ranks)
        ]
        """Per process (`replica * R + rank`), the uses whose gradients its part adds, in
        its order (`TiedGrads.uses`: the ties', each tie's uses in its order)."""

    def __bool__(self) -> bool:
        return bool(self.sizes)

    def repeats(self, stage: int, index: int) -> bool:
        """Whether the norm skips this parameter (a tie's use other than its first)."""
        return (stage, index) in self.repeated

    def apply(self, params: Sequence[Sequence[nn.Parameter]], device: torch.device) -> None:
        """Give every use the tie's sum, added as the run adds it (`TiedGrads`)."""
        for tie, size in enumerate(self.sizes):
            parts = []
            for uses in self.counted:
                part = torch.zeros(size, dtype=torch.float32, device=device)
                for use in uses:
                    grad = params[use.stage][use.index].grad
                    if use.tie == tie and grad is not None:
                        part += grad.detach().reshape(-1).float()
                parts.append(part)
            total = tree_sum(parts)
            for use in self.uses:
                if use.tie == tie:
                    param = params[use.stage][use.index]
                    param.grad = total.view(param.shape).to(param.dtype).clone()


def _counts(program: Program, rank: int, stage: int) -> bool:
    """Whether `rank` holds `stage` and stands for it in a sum over the whole run
    (`RankRuntime.counts`, data-parallel copy 0)."""
    held = {s for s, _ in program.stage_copies(rank)}
    return stage in held and min(program.replicas(stage)) == rank
