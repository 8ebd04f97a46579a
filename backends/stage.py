"""`Stage`: one copy of one stage on a rank, and everything that is the copy's own.

A stage copy owns its module and the parameters it trains (with `--mixed-precision`,
their fp32 masters, which its optimizer updates), its optimizer, what its forwards keep
for their backwards (`saved`), and the arithmetic of its ops:

- `forward` (F) runs the module on its input and keeps input and output; on the last
  stage the output becomes the scaled loss (`Settings.loss`, which the owner binds to
  its targets). The input of a stage after the first is detached and requires grad, so
  each stage owns its autograd graph. With `R` in the program, F keeps only the input
  and `recompute` redoes the forward just before the backward.
- `backward` (B) is the full backward, or, where the program splits off `W`, the input
  gradient alone, keeping for `weight_grad` only what W reads (backends/weight_split.py);
  a W that comes right after its B (`Settings.whole`) runs with it as one backward.
- With sequence chunks, F runs over one span of the micro-batch's tokens, attending
  over the keys and values that the chunks before it made on this stage (kept as leaves
  of its own graph, so that its backward leaves their gradients there), and B hands
  those gradients back into the earlier chunk's graph.
- `flat_gradients`/`set_gradients` are the two halves of reducing its gradients over
  its replicas; `step` and `update` apply the optimizer.

A stage knows nothing of ranks, messages or the order: its owner, a rank's runtime
(backends/runtime.py) or a user's `pipelang.torch.PipelineSchedule`, hands it inputs
and output gradients and publishes what it returns. Sharding, tensor parallelism and
loading a stage alone wrap this object.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from pipelang.backends.builtin_models import SequenceChunk, sequence_chunk
from pipelang.backends.optim import Optimizer
from pipelang.backends.precision import copy_back
from pipelang.backends.stash import Stash
from pipelang.backends.versions import CopyVersions, installed
from pipelang.backends.weight_split import split_backward, weight_pass
from pipelang.diagnostics import InternalError
from pipelang.ir import Action, Kind

if TYPE_CHECKING:
    from pipelang.backends.weight_split import WeightWork
    from pipelang.ir.program import OpKey

Key = tuple[int, int, str, int | None]
"""What a forward saves is filed under (micro-batch, stage, pipeline, chunk); the chunk
is None unless the schedule splits micro-batches into sequence chunks."""

Loss = Callable[[int, torch.Tensor, bool, "int | None"], torch.Tensor]
"""The last stage's loss of micro-batch `mb` from its output, scaled as its gradient
is summed: `loss(mb, output, record, chunk)`; `record` is False when a recompute
repeats a forward (the loss is reported once)."""


@dataclass(slots=True)
class Saved:
    """What a forward keeps for its backward: input, output (or scaled loss), output grad."""

    x: Any
    """The input: a tensor, but on a first stage what its owner feeds the module (a
    `PipelineSchedule` user's batch may be a dict); None once a split B has run."""
    y: torch.Tensor | None
    dy: torch.Tensor | None = None
    params: list[nn.Parameter] | None = None
    """Asynchronous schedules: the weight version the forward read."""
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """Sequence chunks: per attention block (by `id`), the keys and values this chunk
    made, in its graph (outputs of its backward besides `y`)."""
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """Sequence chunks: the same keys and values as leaves, which later chunks read and
    leave their gradients on."""
    work: WeightWork | None = None
    """A split backward: what W does once B has run (`weight_split`); None while B has
    not run, or when the whole graph is kept for W."""


@dataclass(frozen=True, slots=True)
class Settings:
    """How every stage copy of one rank runs its ops (the program's and the run's)."""

    loss: Loss
    split: bool = False
    """The program splits W off B."""
    recomputes: bool = False
    """The program has R: F keeps its input alone."""
    whole: frozenset[OpKey] = frozenset()
    """The backwards run whole although W is split off: those whose W comes right
    after their B (`ir.program.whole_backwards`)."""
    stash: Stash | None = None
    """The rank's saved activations per forward (backends/stash.py), shared by its
    copies: for evictions, the byte count, and a split backward's release after B."""
    counting: bool = False
    """Whether the saved activations' bytes are measured (`Stash.measure`)."""
    chunk_bounds: Sequence[int] | None = None
    """The token boundaries of the sequence chunks; None without chunks."""


@dataclass(slots=True, eq=False)
class Stage:
    """One copy of one stage's weights on this rank, with its optimizer, what its
    forwards keep, and its ops (see the module docstring)."""

    stage: int
    pipeline: str
    layers: range
    """The model's layers this stage holds (empty where its owner does not number
    them)."""
    module: nn.Module
    first: bool
    last: bool
    params: list[nn.Parameter]
    """The parameters the stage computes with (its module's)."""
    optimizer: Optimizer | None
    """None where the owner's own loop steps the parameters (`PipelineSchedule`)."""
    settings: Settings
    masters: list[nn.Parameter] | None = None
    """`--mixed-precision`: the fp32 masters of `params`, which the optimizer updates
    (backends/precision.py); None: the optimizer updates `params` themselves."""
    versions: CopyVersions | None = None
    """Asynchronous schedules: the copy's weight versions (backends/versions.py)."""
    delays: Mapping[int, int] = field(default_factory=dict)
    """`--predict-weights`: per micro-batch, the updates its gradient will meet."""
    saved: dict[Key, Saved] = field(default_factory=dict)
    graph_free: bool = False
    """Whether this copy's last split B kept no graph for W (every weight op W runs is
    a linear layer's product or embedding lookups, `weight_split.Product`, `Lookup`):
    then its forwards need not file
    their saved tensors in the stash, unless someone counts their bytes."""

    @property
    def trained(self) -> list[nn.Parameter]:
        """The parameters the optimizer updates, whose gradients are reduced."""
        return self.masters if self.masters is not None else self.params

    def key(self, mb: int, chunk: int | None = None) -> Key:
        return (mb, self.stage, self.pipeline, chunk)

    # ---- F and R ---------------------------------------------------------------------------

    def forward(self, mb: int, x: Any, chunk: int | None = None) -> torch.Tensor:
        """F: run the stage on `x`; keep input and output. Returns the output (the scaled
        loss on the last stage), which the owner hands on detached."""
        if chunk is not None:
            return self._chunk_forward(mb, x, chunk)
        params = self.params
        on: AbstractContextManager[None] = contextlib.nullcontext()
        if self.delays:  # --predict-weights: run on the weights the gradient will meet
            assert self.versions is not None
            params = self.versions.predicted(self.delays[mb])
            on = installed(self.versions.slots, params, self.params)
        with on:
            if self.settings.recomputes:
                with torch.no_grad():
                    y = self._run(mb, x, record=True)
                saved = self.saved[self.key(mb)] = Saved(x, None)
            else:
                with self._saving(mb):
                    y = self._run(mb, x, record=True)
                saved = self.saved[self.key(mb)] = Saved(x, y)
                self._measure()
        if self.versions is not None:
            saved.params = params
        return y

    def recompute(self, mb: int) -> None:
        """R: redo the forward from the kept input, this time building the graph."""
        saved = self.saved[self.key(mb)]
        versions = self.versions
        if versions is None or not versions.stash or saved.params is None:
            saved.y = self._run(mb, saved.x, record=False)
            return
        with installed(versions.slots, saved.params, self.params):
            saved.y = self._run(mb, saved.x, record=False)

    def _run(
        self, mb: int, x: torch.Tensor, record: bool, chunk: int | None = None
    ) -> torch.Tensor:
        y = self.module(x)
        if self.last:
            return self.settings.loss(mb, y, record, chunk)
        return y

    def _chunk_forward(self, mb: int, x: torch.Tensor, chunk: int) -> torch.Tensor:
        """F of one sequence chunk: the stage over its tokens, attending over the keys and
        values of the chunks before it (their leaves), its own kept as leaves in turn."""
        bounds = self.settings.chunk_bounds
        assert bounds is not None
        past: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for c in range(chunk):
            for block, kv in self.saved[self.key(mb, c)].kept.items():
                past.setdefault(block, []).append(kv)
        with (
            sequence_chunk(SequenceChunk(bounds[chunk], past)) as context,
            self._saving(mb, chunk),
        ):
            y = self._run(mb, x, record=True, chunk=chunk)
        kept = {
            block: (k.detach().requires_grad_(True), v.detach().requires_grad_(True))
            for block, (k, v) in context.made.items()
        }
        self.saved[self.key(mb, chunk)] = Saved(x, y, made=context.made, kept=kept)
        self._measure()
        return y

    # ---- B and W ---------------------------------------------------------------------------

    def backward(
        self, mb: int, dy: torch.Tensor | None, chunk: int | None = None
    ) -> torch.Tensor | None:
        """B: from the output gradient `dy` (None on the last stage: the loss), the input
        gradient (None on the first stage; zeros where the input reached no output),
        plus the weight gradient unless W is split off and does not come right after."""
        key = self.key(mb, chunk)
        saved = self.saved[key]
        if saved.y is None:
            raise InternalError(f"B{mb}@{self.stage}/{self.pipeline} ran before its recompute")
        outputs, grads = _chunk_outputs(saved, dy)
        settings = self.settings
        if not settings.split or key in settings.whole:
            torch.autograd.backward(outputs, grads)
            del self.saved[key]
            self._forget(key)
            if saved.params is not None:
                assert self.versions is not None
                self.versions.collect(saved.params)
                saved.y = saved.params = None  # frees the graph and its version
            return None if self.first else _or_zeros(saved.x.grad, saved.x)
        x = saved.x
        own = [] if self.first else [x]
        earlier = [  # the keys and values of the chunks before it: their gradients, now
            t
            for c in range(chunk or 0)
            for kv in self.saved[self.key(mb, c)].kept.values()
            for t in kv
        ]
        params = saved.params if saved.params is not None else self.params
        needed: set[int] = set()
        stash = settings.stash
        probe = None if stash is None else stash.prober(key, needed)
        unfiled = self.graph_free and not settings.recomputes
        found, saved.work = split_backward(outputs, grads, own + earlier, params, probe, unfiled)
        for leaf, grad in zip(earlier, found[len(own) :], strict=True):
            if grad is not None:
                leaf.grad = grad if leaf.grad is None else leaf.grad + grad
        self.graph_free = saved.work is not None and not saved.work.groups
        if saved.work is None:
            saved.dy = dy  # W differentiates the whole graph again
        else:  # W reads only what B kept for it: drop the stage's own references
            if probe is not None:
                assert stash is not None
                stash.keep(key, needed, saved.work.gradients())
            saved.y = saved.x = None
            self._measure()  # the gradients kept for W can outweigh what was released
        return _or_zeros(found[0], x) if own else None

    def weight_grad(self, mb: int, chunk: int | None = None) -> None:
        """W: accumulate the parameter gradients, from what B kept for it
        (`weight_split`), else from the whole graph B kept; nothing where B ran the
        whole backward (`Settings.whole`)."""
        key = self.key(mb, chunk)
        if key in self.settings.whole:
            return
        saved = self.saved.pop(key)
        params = saved.params if saved.params is not None else self.params
        outputs, grads = ([], []) if saved.y is None else _chunk_outputs(saved, saved.dy)
        weight_pass(saved.work, outputs, grads, params)
        self._forget(key)
        if saved.params is not None:
            assert self.versions is not None
            self.versions.collect(params)
            saved.y = saved.params = None

    # ---- the saved activations' record -----------------------------------------------------

    def _saving(self, mb: int, chunk: int | None = None) -> AbstractContextManager[None]:
        """File the tensors a forward saves in the rank's stash under its key: for
        evictions, the byte count, and a split backward's release after B; nowhere when
        no one counts bytes and nothing is to be released after B: its backward runs
        whole, or B lets the whole graph go (`graph_free`)."""
        settings, key = self.settings, self.key(mb, chunk)
        unread = key in settings.whole or self.graph_free
        if settings.stash is None or (not settings.counting and unread):
            return contextlib.nullcontext()
        name = Action(Kind.F, mb, self.stage, self.pipeline, chunk=chunk).text()
        return settings.stash.recording(key, name, self.module)

    def _measure(self) -> None:
        stash = self.settings.stash
        if stash is not None and self.settings.counting:
            stash.measure(set(stash.entries))

    def _forget(self, key: Key) -> None:
        if self.settings.stash is not None:
            self.settings.stash.forget(key)

    # ---- reduce and update -----------------------------------------------------------------

    def flat_gradients(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The copy's gradients as one flat tensor (zeros where a parameter has none;
        float32 for half dtypes on the CPU, whose collectives lack them), and the list
        it came from: what its replicas sum."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.trained]
        flat = _flatten_dense_tensors(grads)
        if flat.device.type == "cpu" and flat.dtype in (torch.float16, torch.bfloat16):
            flat = flat.float()
        return flat, grads

    def set_gradients(self, flat: torch.Tensor, grads: list[torch.Tensor]) -> None:
        """Give the parameters the gradients in `flat` (laid out as `flat_gradients`
        made it)."""
        for param, grad in zip(self.trained, _unflatten_dense_tensors(flat, grads), strict=True):
            param.grad = grad.to(param.dtype)

    def step(self) -> None:
        """The optimizer step, gradients summed already; then clear them."""
        assert self.optimizer is not None
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.finish_update()

    def finish_update(self) -> None:
        """After the optimizer step: the masters' new values into the computed params."""
        if self.masters is not None:
            copy_back(self.params, self.masters)

    def update(self, version: int) -> None:
        """U: apply the mean of the gradients gathered since the last update and make
        `version` (asynchronous schedules; backends/versions.py)."""
        assert self.versions is not None and self.optimizer is not None
        self.params = self.versions.update(self.optimizer, version)


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


def _or_zeros(grad: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(x) if grad is None else grad
