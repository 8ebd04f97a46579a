"""Synchronisation: the replicas' allreduce, the optimizer step, tied weights,
gradient clipping, and a checkpoint's state."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from pipelang.backends.checkpoint import Held, held_by_model, load
from pipelang.backends.metrics import tensor_bytes
from pipelang.backends.models import (
    LayeredModel,
)
from pipelang.backends.rank_base import _action, _comm
from pipelang.backends.stage import Stage
from pipelang.backends.transport import peer_failures

if TYPE_CHECKING:
    from pipelang.backends.runtime import RankRuntime


class SyncActions:
    """Synchronisation: the replicas' allreduce, the optimizer step, tied weights,
    gradient clipping, and a checkpoint's state."""

    grad_norm: torch.Tensor | None = None
    """The global gradient norm before clipping that the last `step` took (0-d, float32,
    on the device): with `--clip-grad`, or where the metrics ask for it
    (`RunConfig.logs_metrics`); None where no step took it (the worker clears it)."""

    @_comm
    def allreduce(self: RankRuntime, stage: int, pipeline: str) -> None:
        """allreduce: start summing this copy's gradients with the stage's other replicas."""
        if self.group_sizes[stage] < 2:
            return
        self._start_allreduce(self.copies[(stage, pipeline)])

    def _start_allreduce(self: RankRuntime, copy: Stage) -> None:
        """Start summing a copy's gradients with its replicas'; a stage without weights
        (an activation alone, on every replica alike) has nothing to sum."""
        if not copy.trained:
            return
        flat, grads = copy.flat_gradients()
        handle = self.transport.allreduce(copy.stage, flat)
        self.reducing.append((copy, flat, grads, handle))

    @_action
    def step(self: RankRuntime) -> None:
        """step: finish the allreduces, update every stage copy, clear the gradients.

        With `--dp K`, a copy whose stage has no replica in the schedule (so no
        `allreduce` action) sums its gradients with the other K - 1 copies here."""
        with peer_failures():
            for copy in self.reduced_at_step:
                self._start_allreduce(copy)
            # in stage order on every rank: a sum over more than two copies runs here
            for copy, flat, grads, handle in sorted(self.reducing, key=lambda r: r[0].stage):
                handle.wait()
                copy.set_gradients(flat, grads)
        self.reducing.clear()
        self.update_copies()

    def held(self: RankRuntime) -> list[Held]:
        """Every stage copy's trained parameters and optimizer, named for a checkpoint."""
        return [
            held_by_model(c.module, c.optimizer, c.layers.start, c.masters)
            for c in self.copies.values()
        ]

    def load_checkpoint(self: RankRuntime, path: str) -> None:
        """Every stage copy's parameters and optimizer state from checkpoint `path`."""
        load(self.held(), path)
        for copy in self.copies.values():
            copy.finish_update()

    def update_copies(self: RankRuntime) -> None:
        """The optimizer step of every copy, gradients summed already; then clear them.
        First a tied weight's copies get the sum of its gradients, and with `--clip-grad`
        the gradients are clipped by the global norm (each a collective over every rank
        of the run). The norm is taken (`grad_norm`) with `--clip-grad` or where the
        metrics ask for it, never else: it costs a collective."""
        if self.tied:
            with peer_failures():
                self.tied.set(self.transport.world_sum(self.tied.contribution()))
        if self.config.clip_grad is not None or self.config.logs_metrics:
            with peer_failures():
                total = self.transport.world_sum(self.grad_square_sum())
            self.grad_norm = total.sqrt()
            if self.config.clip_grad is not None:
                self.scale_grads(clip_coefficient(total, self.config.clip_grad))
        self.apply_updates()

    def note_grad_bytes(self: RankRuntime) -> None:
        """Count the bytes of the gradients this rank holds now, before an optimizer step
        or update clears them, into `grad_bytes` (the most so far)."""
        grads = [  # `params`: a --tp copy's local tensors, which hold its gradients
            p.grad
            for c in self.copies.values()
            for p in (*c.module.parameters(), *(c.masters or ()), *c.params)
        ]
        self.grad_bytes = max(self.grad_bytes, tensor_bytes(grads))

    def grad_square_sum(self: RankRuntime) -> torch.Tensor:
        """The squared norm of the gradients this rank counts towards the global norm,
        in float32: each stage is counted once in the whole run, by its copy on the
        lowest rank that holds it, in data-parallel copy 0 (replicas hold equal
        gradients once their allreduce is done); with --tp each tensor rank counts its
        parts, and the tensors every tensor rank holds whole (`repeated`) count on
        tensor rank 0."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for copy in self.copies.values():
            if self.counts(copy):
                for index, param in enumerate(copy.trained):
                    if param.grad is None or self.tied.repeats(copy, index):
                        continue
                    if self.tensor == 0 or id(param) not in self.repeated:  # --tp: once
                        total += param.grad.detach().float().square().sum()
        return total

    def counts(self: RankRuntime, copy: Stage) -> bool:
        """Whether `copy` stands for its stage in a sum over the whole run: the copy on
        the lowest rank that holds the stage, in data-parallel copy 0 (the others hold
        the same gradients once the stage's allreduce is done); a sharded copy
        (`--shard`) in every data-parallel copy, each holding its own shard's sums."""
        first = min(self.program.replicas(copy.stage)) == self.rank
        return first and (self.replica == 0 or self.config.shard)

    @torch.no_grad()
    def scale_grads(self: RankRuntime, coefficient: torch.Tensor) -> None:
        """Multiply every gradient of every copy by `coefficient` (a 0-d tensor: no host
        sync, so a CUDA graph can capture it)."""
        for copy in self.copies.values():
            for param in copy.trained:
                if param.grad is not None:
                    param.grad.mul_(coefficient.to(param.grad.dtype))

    def apply_updates(self: RankRuntime) -> None:
        """The optimizer step of every copy; then clear the gradients."""
        self.note_grad_bytes()
        for copy in self.copies.values():
            copy.step()
        self.stepped = True


class TiedGrads:
    """The uses of tied weights on one rank, and the sum that keeps their copies equal.

    A weight shared by layers of different stages (a user model's tied embedding) is a
    separate tensor in each stage copy. At `step`, once the stages' allreduces are done,
    every copy holding a use gets the sum of all uses' gradients: each stage's counting
    copy (`RankRuntime.counts`) adds its gradient into one flat tensor per run, which
    one allreduce over every process sums. Same start, same gradient, same optimizer:
    the copies stay equal, bit for bit.
    """

    def __init__(
        self,
        model: LayeredModel,
        bounds: Sequence[range],
        copies: Sequence[Stage],
        counts: Callable[[Stage], bool],
        device: torch.device,
    ) -> None:
        self.device = device
        self.uses: list[tuple[int, Stage, int, bool]] = []
        """(offset in the flat sum, copy, index in `copy.trained`, counts)."""
        self.repeated: set[tuple[int, int]] = set()
        """(id of the copy, index) of the uses a norm skips: all but each tie's first."""
        self.size = 0

        def stage_of(layer: int) -> int:
            return next(s for s, b in enumerate(bounds) if layer in b)

        for tie in model.ties:
            stages = [stage_of(layer) for layer, _ in tie]
            if len(set(stages)) < 2:
                continue  # one stage: its copies hold one tensor for all uses already
            for (layer, name), stage in zip(tie, stages, strict=True):
                if stage in stages[: stages.index(stage)]:
                    continue  # the stage's earlier use is the same tensor
                for copy in (c for c in copies if c.stage == stage):
                    index = _trained_index(copy, layer, name)
                    self.uses.append((self.size, copy, index, counts(copy)))
                    if (layer, name) != tie[0]:
                        self.repeated.add((id(copy), index))
            self.size += model.layers[tie[0][0]].get_parameter(tie[0][1]).numel()

    def __bool__(self) -> bool:
        """Whether the run has tied weights across stages (the same on every rank: each
        takes part in the sum, holding a use or not)."""
        return self.size > 0

    def repeats(self, copy: Stage, index: int) -> bool:
        """Whether `copy.trained[index]` is a tied weight's use other than its first (a
        norm counts the weight once)."""
        return (id(copy), index) in self.repeated

    def contribution(self) -> torch.Tensor:
        """This rank's part of the sum: the gradients of the uses it counts."""
        flat = torch.zeros(self.size, dtype=torch.float32, device=self.device)
        for offset, copy, index, counts in self.uses:
            grad = copy.trained[index].grad
            if counts and grad is not None:
                flat[offset : offset + grad.numel()] += grad.detach().reshape(-1).float()
        return flat

    def set(self, total: torch.Tensor) -> None:
        """Give every use on this rank the summed gradient: into the one it holds, in
        place (a view into its stage's allreduced flat tensor with --dp: a new tensor
        would keep that tensor's slot alive beside it), else as a new one."""
        for offset, copy, index, _ in self.uses:
            param = copy.trained[index]
            part = total[offset : offset + param.numel()].view(param.shape)
            grad = param.grad
            if grad is not None and grad.shape == param.shape and grad.dtype == param.dtype:
                grad.copy_(part)
            else:
                param.grad = part.to(param.dtype).clone()


def _trained_index(copy: Stage, layer: int, name: str) -> int:
    """Where the parameter `name` of model layer `layer` is in `copy.trained`."""
    names = [n for n, p in copy.module.named_parameters() if p.requires_grad]
    return names.index(f"{layer - copy.layers.start}.{name}")


def clip_coefficient(square_sum: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What `torch.nn.utils.clip_grad_norm_` multiplies gradients by, given their squared
    global norm: max_norm / (norm + 1e-6), at most 1."""
    return (max_norm / (square_sum.sqrt() + 1e-6)).clamp(max=1.0)
