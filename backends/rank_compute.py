"""A rank's compute actions: F, P, R, B, W and U on its stage copies, with the inputs
and targets of its micro-batches."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pipelang.backends.rank_base import Value, _action, _compute, value_of
from pipelang.backends.stage import Stage
from pipelang.ir import deps

if TYPE_CHECKING:
    from pipelang.backends.runtime import RankRuntime


class ComputeActions:
    """A rank's compute actions: F, P, R, B, W and U on its stage copies, with the inputs
    and targets of its micro-batches."""

    def _batch(
        self: RankRuntime, mb: int, chunk: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Input ids and targets of micro-batch `mb` (of its sequence chunk `chunk`): from
        the static buffers when a driver loads them (`load_inputs`, graph mode), else made
        now."""
        if self.inputs:
            ids, targets = self.inputs[mb]
        else:
            ids, targets = self.model.batch(self.step_index, self.first_mb + mb, self.device)
        if chunk is None or self.chunk_bounds is None:
            return ids, targets
        start, end = self.chunk_bounds[chunk], self.chunk_bounds[chunk + 1]
        return ids[:, start:end], targets[:, start:end]

    def load_inputs(self: RankRuntime, step: int) -> None:
        """Copy step `step`'s ids and targets into static buffers, one pair per
        micro-batch, allocated once: a captured iteration reads its inputs from fixed
        addresses, and only this copy changes between replays."""
        if self.frozen is None and not any(c.first or c.last for c in self.copies.values()):
            return
        for mb in range(self.program.num_microbatches):
            ids, targets = self.model.batch(step, self.first_mb + mb, self.device)
            if mb not in self.inputs:
                self.inputs[mb] = (ids.clone(), targets.clone())
            else:
                self.inputs[mb][0].copy_(ids)
                self.inputs[mb][1].copy_(targets)

    def input_key(
        self: RankRuntime, mb: int, stage: int, pipeline: str, chunk: int | None = None
    ) -> Value:
        """The value a forward of `stage` reads (`deps.forward_input`): the stage before's
        output, or for stage 0 of a schedule with a frozen part, the frozen part's."""
        return value_of(deps.forward_input(mb, stage, pipeline, chunk))

    def _stage_input(self: RankRuntime, mb: int, copy: Stage, chunk: int | None) -> torch.Tensor:
        if copy.first and self.program.frozen is None:
            return self._batch(mb, chunk)[0]
        value = self.values.pop(self.input_key(mb, copy.stage, copy.pipeline, chunk))
        if copy.first:  # the frozen part's output: no gradient flows back into it
            return value
        return value.detach().requires_grad_(True)

    def _scaled_loss(
        self: RankRuntime, mb: int, logits: torch.Tensor, record: bool, chunk: int | None = None
    ) -> torch.Tensor:
        """The loss of one micro-batch scaled by 1/(N*K) (K = `--dp`): the one place the
        loss is scaled. The allreduce then sums the K data-parallel copies' gradients.
        A sequence chunk's loss is weighted by its share of the tokens."""
        loss = self.model.loss(logits, self._batch(mb, chunk)[1])
        if chunk is not None and self.chunk_bounds is not None:
            bounds = self.chunk_bounds
            loss = loss * ((bounds[chunk + 1] - bounds[chunk]) / bounds[-1])
        if record:
            self.losses.append((self.first_mb + mb, loss.detach()))
        return loss * self.scale

    @_compute
    def forward(
        self: RankRuntime, mb: int, stage: int, pipeline: str, chunk: int | None = None
    ) -> None:
        """F: run the stage (`Stage.forward`); publish its output."""
        copy = self.copies[(stage, pipeline)]
        y = copy.forward(mb, self._stage_input(mb, copy, chunk), chunk)
        if not copy.last:
            self.values[("F", mb, stage, pipeline, chunk)] = y.detach()

    @_compute
    def frozen_forward(self: RankRuntime, mb: int, stage: int, pipeline: str) -> None:
        """P: run the frozen part on the micro-batch's ids, without autograd; its output
        is the input of F(mb, 0)."""
        assert self.frozen is not None, "P on a rank without the frozen part"
        with torch.no_grad():
            self.values[("P", mb, stage, pipeline, None)] = self.frozen(self._batch(mb)[0])

    @_compute
    def recompute(self: RankRuntime, mb: int, stage: int, pipeline: str) -> None:
        """R: redo the forward from the kept input (`Stage.recompute`)."""
        self.copies[(stage, pipeline)].recompute(mb)

    @_compute
    def backward(
        self: RankRuntime, mb: int, stage: int, pipeline: str, chunk: int | None = None
    ) -> None:
        """B: from the output gradient received, the input gradient, published
        (`Stage.backward`)."""
        copy = self.copies[(stage, pipeline)]
        gradient = value_of(deps.gradient_input(mb, stage, pipeline, chunk))
        dx = copy.backward(mb, None if copy.last else self.values.pop(gradient), chunk)
        if dx is not None:
            self.values[("B", mb, stage, pipeline, chunk)] = dx

    @_compute
    def weight_grad(
        self: RankRuntime, mb: int, stage: int, pipeline: str, chunk: int | None = None
    ) -> None:
        """W: the parameter gradients (`Stage.weight_grad`)."""
        self.copies[(stage, pipeline)].weight_grad(mb, chunk)

    @_action
    def update(self: RankRuntime, stage: int, pipeline: str, version: int) -> None:
        """U: apply the mean of the gradients this copy gathered since its last update
        and make `version` (counted from 1 in each iteration); see backends/versions.py."""
        self.note_grad_bytes()
        self.copies[(stage, pipeline)].update(version)
        # only an update adds a version: the peak is right after one
        live = sum(v.live() for v in self.versions.values())
        self.peak_versions = max(self.peak_versions, live)
