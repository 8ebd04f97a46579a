"""How the `--check` reference computes the gradients of one backward (a `summation.Unit`).

- `WholeModel`: the whole model as one nn.Sequential, a micro-batch's forward and
  backward at once (every schedule without sequence chunks).
- `ChunkedModel`: for a schedule with sequence chunks, the runtime itself
  (`RankRuntime`) on a program of one stage that holds the whole model: a micro-batch's
  chunks forward in order over the cached keys and values, then each chunk's backward,
  the last first. So each chunk's gradient, and its loss weighted by its share of the
  tokens, is the computation a pipelined run makes, and the reference can add them in
  the run's order (a whole sequence's gradient is another computation, equal only up
  to rounding, which Adam amplifies over a long run).

Both hold the model, its trained parameters (fp32 masters with `--mixed-precision`) and
the optimizer, and record each micro-batch's loss.

`added_by_backward` asks the runtime which parameters a split backward's B adds itself
(the rest W adds), for a run whose W's run in another order than its B's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from pipelang.backends.config import RunConfig
from pipelang.backends.precision import master_weights
from pipelang.backends.rank_base import make_optimizer
from pipelang.backends.reference_ties import untied_stages
from pipelang.backends.runtime import RankRuntime, copy_names, full_model_names
from pipelang.backends.summation import Unit
from pipelang.ir import Kind, Pipeline, Program


class WholeModel:
    """The whole model in one process, a micro-batch's backward at once; with `untie`,
    the run's (stages, partition), a weight tied across its stages is a tensor per stage,
    as in the run (`reference_ties.untied_stages`)."""

    def __init__(
        self,
        config: RunConfig,
        device: torch.device,
        scale: float,
        untie: tuple[int, Sequence[int] | None] | None = None,
    ) -> None:
        self.model = config.spec.build()
        self.bounds = None
        """The stages' layers where the weights are untied (`untie`, a model with ties)."""
        self.stages: list[nn.Sequential] | None = None
        layers = self.model.layers
        if untie is not None and self.model.ties:
            self.bounds = self.model.stage_bounds(*untie)
            self.stages = untied_stages(self.model, self.bounds)
            first = self.bounds[0].start  # a frozen part before it: one tensor, as in a run
            layers = [*layers[:first], *(layer for m in self.stages for layer in m)]
        self.full = nn.Sequential(*layers).to(device)
        self.params = [p for p in self.full.parameters() if p.requires_grad]
        self.masters = master_weights(self.params) if config.mixed_precision else None
        self.optimizer = make_optimizer(self.masters or self.params, config)
        self.device = device
        self.scale = scale
        self.losses: dict[int, float] = {}
        """This step's loss of every micro-batch run so far."""

    def begin_step(self, step: int) -> None:
        self.step = step
        self.losses = {}

    def backward(self, unit: Unit) -> None:
        """Add the gradient of micro-batch `unit[0]`'s scaled loss to `.grad`."""
        mb, _ = unit
        ids, targets = self.model.batch(self.step, mb, self.device)
        loss = self.model.loss(self.full(ids), targets)
        (loss * self.scale).backward()
        self.losses[mb] = loss.item()

    def stage_params(
        self, stages: int, partition: tuple[int, ...] | None
    ) -> list[list[nn.Parameter]]:
        """Per stage, the parameters its copies hold, in their order (`StageCopy.params`)."""
        if self.stages is not None:
            return [[p for p in m.parameters() if p.requires_grad] for m in self.stages]
        return [
            [p for p in self.model.stage_module(bounds).parameters() if p.requires_grad]
            for bounds in self.model.stage_bounds(stages, partition)
        ]

    def weights(self) -> dict[str, torch.Tensor]:
        """The parameters by whole-model name (each use of an untied weight its own)."""
        if self.stages is not None:
            return {k: v.detach().cpu().clone() for k, v in self.full.state_dict().items()}
        return full_model_names(self.model)


class _Silent:
    """The transport of a one-rank program: nothing to send."""

    def end_step(self) -> None: ...


class ChunkedModel(WholeModel):
    """The whole model as the one stage of a one-rank program with `program`'s chunks,
    run by the runtime (see the module docstring)."""

    def __init__(
        self, config: RunConfig, device: torch.device, scale: float, program: Program, n: int
    ) -> None:
        one = Program(
            name="reference",
            source="<--check reference>",
            params=(),
            num_ranks=1,
            num_stages=1,
            pipelines=(Pipeline("main", (0,)),),
            assignment=("main",) * n,
            kinds=(Kind.F, Kind.B),
            ranks=((),),
            costs=program.costs,
            chunks=program.chunks,
        )
        self.runtime = RankRuntime(
            one,
            0,
            replace(config, dp=1, tp=1, partition=None),
            _Silent(),
            device,  # type: ignore[arg-type]
        )
        self.copy = self.runtime.copies[(0, "main")]
        self.model = self.runtime.model
        self.bounds, self.stages = None, None
        self.full = self.copy.module
        self.params = self.copy.params
        self.masters = self.copy.masters
        self.optimizer = self.copy.optimizer
        self.config = config
        self.device = device
        self.scale = scale
        self.count = program.chunks.count if program.chunks is not None else 1
        self.losses = {}

    def backward(self, unit: Unit) -> None:
        """The backward of chunk `unit[1]` of micro-batch `unit[0]` (its chunks' forwards
        first, once): its gradient added to `.grad`, its earlier chunks' keys and values
        given theirs, as on a stage."""
        mb, chunk = unit
        where = {"mb": mb, "stage": 0, "pipeline": "main"}
        if mb not in self.losses:
            self.runtime.begin_step(self.step)
            for c in range(self.count):
                self.runtime.forward(**where, chunk=c)  # type: ignore[arg-type]
            total = 0.0
            for _, loss in self.runtime.losses:  # as `end_step`: the chunks' sum
                total += float(loss)
            self.runtime.losses.clear()
            self.losses[mb] = total
        self.runtime.backward(**where, chunk=chunk)  # type: ignore[arg-type]

    def stage_params(
        self, stages: int, partition: tuple[int, ...] | None
    ) -> list[list[nn.Parameter]]:
        """Per stage, the parameters its copies hold: the one module's, cut as the run's
        stages are (its layers are the model's, in order)."""
        layers = list(self.full)
        with torch.device("meta"):  # the runtime kept only the module: cut as a model is
            bounds = self.config.spec.build().stage_bounds(stages, partition)
        return [[p for i in b for p in layers[i].parameters() if p.requires_grad] for b in bounds]

    def weights(self) -> dict[str, torch.Tensor]:
        return copy_names(self.copy)


def added_by_backward(
    config: RunConfig, program: Program, device: torch.device
) -> list[frozenset[int]]:
    """Per stage, the indices (in `StageCopy.params`' order) of the parameters whose
    gradient B adds in a run of `program`, which splits off W (`weight_split`: a norm's,
    a bias alone; none where the graph is not split): the runtime itself on a one-rank
    program holding every stage, one micro-batch's forwards, then its backwards, asked
    before any W runs."""
    stages = program.num_stages
    one = Program(
        name="reference",
        source="<--check reference>",
        params=(),
        num_ranks=1,
        num_stages=stages,
        pipelines=(Pipeline("main", (0,) * stages),),
        assignment=("main",) * program.num_microbatches,
        kinds=program.kinds,
        ranks=((),),
        costs=program.costs,
        partition=program.partition,
        frozen=None if program.frozen is None else (0,),
        chunks=program.chunks,
        shapes=program.shapes,
    )
    runtime = RankRuntime(one, 0, replace(config, dp=1, tp=1), _Silent(), device)  # type: ignore[arg-type]
    runtime.fault = None  # an injected fault is the run's, not this question's
    runtime.begin_step(config.first_step)
    chunks: list[int | None] = [None] if one.chunks is None else [*range(one.chunks.count)]
    if one.frozen is not None:
        runtime.frozen_forward(mb=0, stage=0, pipeline="main")
    for chunk in chunks:
        for stage in range(stages):
            runtime.forward(mb=0, stage=stage, pipeline="main", chunk=chunk)
    for chunk in reversed(chunks):
        for stage in reversed(range(stages)):
            if runtime.recomputes:
                runtime.recompute(mb=0, stage=stage, pipeline="main")
            runtime.backward(mb=0, stage=stage, pipeline="main", chunk=chunk)
    added = []
    for stage in range(stages):
        copy = runtime.copies[(stage, "main")]
        masters = copy.masters or [None] * len(copy.params)
        added.append(
            frozenset(
                k
                for k, (param, master) in enumerate(zip(copy.params, masters, strict=True))
                if param.grad is not None or (master is not None and master.grad is not None)
            )
        )
    return added
