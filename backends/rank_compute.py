"""A rank's compute actions: F, P, R, B, W and U on its stage copies, with the inputs
and targets of its micro-batches."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from pipelang.backends.models import (
    SequenceChunk,
    sequence_chunk,
)
from pipelang.backends.rank_base import Saved, StageCopy, Value, _action, _compute, value_of
from pipelang.backends.versions import installed
from pipelang.backends.weight_split import split_backward, weight_pass
from pipelang.diagnostics import InternalError
from pipelang.ir import deps
from pipelang.ir.program import OpKey, whole_backwards

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

    @cached_property
    def whole(self: RankRuntime) -> frozenset[OpKey]:
        """The backwards this rank runs whole although W is split off: those whose W
        comes right after their B (`whole_backwards`). B runs one `backward` and W
        nothing, without the split's walk, probe and kept gradients; the weight
        gradients are added where the W would add them, so `--check` stays bitwise."""
        if not self.split_backward:
            return frozenset()
        return whole_backwards(self.program.ranks[self.rank])

    def _saving(
        self: RankRuntime, mb: int, copy: StageCopy, chunk: int | None = None
    ) -> AbstractContextManager[None]:
        """Where a forward files what it saves (`_recording`): nowhere when its backward
        runs whole (nothing to release after B) and no one counts the bytes."""
        if not self.counting and (mb, copy.stage, copy.pipeline, chunk) in self.whole:
            return contextlib.nullcontext()
        return self._recording(mb, copy, chunk)

    def input_key(
        self: RankRuntime, mb: int, stage: int, pipeline: str, chunk: int | None = None
    ) -> Value:
        """The value a forward of `stage` reads (`deps.forward_input`): the stage before's
        output, or for stage 0 of a schedule with a frozen part, the frozen part's."""
        return value_of(deps.forward_input(mb, stage, pipeline, chunk))

    def _stage_input(
        self: RankRuntime, mb: int, copy: StageCopy, chunk: int | None
    ) -> torch.Tensor:
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

    def _run_stage(
        self: RankRuntime,
        mb: int,
        copy: StageCopy,
        x: torch.Tensor,
        record: bool,
        chunk: int | None = None,
    ) -> torch.Tensor:
        y = copy.module(x)
        if copy.last:
            return self._scaled_loss(mb, y, record, chunk)
        return y

    def _chunk_forward(
        self: RankRuntime, mb: int, copy: StageCopy, x: torch.Tensor, chunk: int
    ) -> None:
        """F of one sequence chunk: the stage over its tokens, attending over the keys and
        values of the chunks before it (their leaves), its own kept as leaves in turn."""
        assert self.chunk_bounds is not None
        stage, pipeline = copy.stage, copy.pipeline
        past: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for c in range(chunk):
            for block, kv in self.saved[(mb, stage, pipeline, c)].kept.items():
                past.setdefault(block, []).append(kv)
        start = self.chunk_bounds[chunk]
        with (
            sequence_chunk(SequenceChunk(start, past)) as context,
            self._saving(mb, copy, chunk),
        ):
            y = self._run_stage(mb, copy, x, record=True, chunk=chunk)
        kept = {
            block: (k.detach().requires_grad_(True), v.detach().requires_grad_(True))
            for block, (k, v) in context.made.items()
        }
        self.saved[(mb, stage, pipeline, chunk)] = Saved(x, y, made=context.made, kept=kept)
        self._measure()
        if not copy.last:
            self.values[("F", mb, stage, pipeline, chunk)] = y.detach()

    @_compute
    def forward(
        self: RankRuntime, mb: int, stage: int, pipeline: str, chunk: int | None = None
    ) -> None:
        """F: run the stage; keep its input and output; publish the output."""
        copy = self.copies[(stage, pipeline)]
        x = self._stage_input(mb, copy, chunk)
        if chunk is not None:
            self._chunk_forward(mb, copy, x, chunk)
            return
        params = copy.params
        on: AbstractContextManager[None] = contextlib.nullcontext()
        if self.delays:  # --predict-weights: run on the weights the gradient will meet
            versions = self.versions[(stage, pipeline)]
            params = versions.predicted(self.delays[(mb, stage, pipeline)])
            on = installed(versions.slots, params, copy.params)
        with on:
            if self.recomputes:
                with torch.no_grad():
                    y = self._run_stage(mb, copy, x, record=True)
                saved = self.saved[(mb, stage, pipeline, None)] = Saved(x, None)
            else:
                with self._saving(mb, copy):
                    y = self._run_stage(mb, copy, x, record=True)
                saved = self.saved[(mb, stage, pipeline, None)] = Saved(x, y)
                self._measure()
        if self.versions:
            saved.params = params
        if not copy.last:
            self.values[("F", mb, stage, pipeline, None)] = y.detach()

    @_compute
    def frozen_forward(self: RankRuntime, mb: int, stage: int, pipeline: str) -> None:
        """P: run the frozen part on the micro-batch's ids, without autograd; its output
        is the input of F(mb, 0)."""
        assert self.frozen is not None, "P on a rank without the frozen part"
        with torch.no_grad():
            self.values[("P", mb, stage, pipeline, None)] = self.frozen(self._batch(mb)[0])

    @_compute
    def recompute(self: RankRuntime, mb: int, stage: int, pipeline: str) -> None:
        """R: redo the forward from the kept input, this time building the graph."""
        copy = self.copies[(stage, pipeline)]
        saved = self.saved[(mb, stage, pipeline, None)]
        versions = self.versions.get((stage, pipeline))
        if versions is None or not versions.stash or saved.params is None:
            saved.y = self._run_stage(mb, copy, saved.x, record=False)
            return
        with installed(versions.slots, saved.params, copy.params):
            saved.y = self._run_stage(mb, copy, saved.x, record=False)

    @_compute
    def backward(
        self: RankRuntime, mb: int, stage: int, pipeline: str, chunk: int | None = None
    ) -> None:
        """B: input gradient, plus the weight gradient unless the program splits off W
        or this W comes right after it (`whole`)."""
        copy = self.copies[(stage, pipeline)]
        key = (mb, stage, pipeline, chunk)
        saved = self.saved[key]
        if saved.y is None:
            raise InternalError(f"B{mb}@{stage}/{pipeline} ran before its recompute")
        gradient = value_of(deps.gradient_input(mb, stage, pipeline, chunk))
        dy = None if copy.last else self.values.pop(gradient)
        outputs, grads = _chunk_outputs(saved, dy)
        if not self.split_backward or key in self.whole:
            torch.autograd.backward(outputs, grads)
            del self.saved[key]
            self._forget(key)
            if not copy.first:
                assert saved.x.grad is not None
                self.values[("B", mb, stage, pipeline, chunk)] = saved.x.grad
            if saved.params is not None:
                self.versions[(stage, pipeline)].collect(saved.params)
                saved.y = saved.params = None  # frees the graph and its version
            return
        own = [] if copy.first else [saved.x]
        earlier = [  # the keys and values of the chunks before it: their gradients, now
            t
            for c in range(chunk or 0)
            for kv in self.saved[(mb, stage, pipeline, c)].kept.values()
            for t in kv
        ]
        params = saved.params if saved.params is not None else copy.params
        needed: set[int] = set()
        probe = None if self.stash is None else self.stash.prober(key, needed)
        found, saved.work = split_backward(outputs, grads, own + earlier, params, probe)
        if own:
            self.values[("B", mb, stage, pipeline, chunk)] = found[0]
        for leaf, grad in zip(earlier, found[len(own) :], strict=True):
            if grad is not None:
                leaf.grad = grad if leaf.grad is None else leaf.grad + grad
        if saved.work is None:
            saved.dy = dy  # W differentiates the whole graph again
        else:  # W reads only what the stash kept: drop the runtime's own references
            assert self.stash is not None
            self.stash.keep(key, needed, saved.work.gradients())
            saved.y, saved.x = None, saved.x.new_empty(0)
            self._measure()  # the gradients kept for W can outweigh what was released

    @_compute
    def weight_grad(
        self: RankRuntime, mb: int, stage: int, pipeline: str, chunk: int | None = None
    ) -> None:
        """W: accumulate the parameter gradients, from what B kept for it
        (`weight_split`), else from the whole graph B kept; nothing where B ran the
        whole backward (`whole`)."""
        if (mb, stage, pipeline, chunk) in self.whole:
            return
        copy = self.copies[(stage, pipeline)]
        saved = self.saved.pop((mb, stage, pipeline, chunk))
        params = saved.params if saved.params is not None else copy.params
        outputs, grads = ([], []) if saved.y is None else _chunk_outputs(saved, saved.dy)
        weight_pass(saved.work, outputs, grads, params)
        self._forget((mb, stage, pipeline, chunk))
        if saved.params is not None:
            self.versions[(stage, pipeline)].collect(params)
            saved.y = saved.params = None

    @_action
    def update(self: RankRuntime, stage: int, pipeline: str, version: int) -> None:
        """U: apply the mean of the gradients this copy gathered since its last update
        and make `version` (counted from 1 in each iteration); see backends/versions.py."""
        copy = self.copies[(stage, pipeline)]
        copy.params = self.versions[(stage, pipeline)].update(copy.optimizer, version)
        # only an update adds a version: the peak is right after one
        live = sum(v.live() for v in self.versions.values())
        self.peak_versions = max(self.peak_versions, live)


def _chunk_outputs(
    saved: Saved, dy: torch.Tensor | None
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """What a backward differentiates: the forward's output with its gradient (None: the
    loss), and for a sequence chunk also the keys and values it made, with the gradients
    the later chunks left on their leaves (those no later chunk read have none)."""
    assert saved.y is not None
    outputs, grads = [saved.y], [dy]
    for block, made in saved.made.items():
        for tensor, leaf in zip(made, saved.kept[block], strict=True):
            if leaf.grad is not None:
                outputs.append(tensor)
                grads.append(leaf.grad)
    return outputs, grads
