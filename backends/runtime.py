"""`RankRuntime`: what a generated rank program calls, one method per action.

A rank holds the stage copies `program.stage_copies(rank)`. Every rank builds the whole
model from the seed and keeps only those stages, so the replicas of a stage (Chimera's
`down` and `up` copies) start identical.

- `forward` runs a stage on its input and keeps input and output for the backward. The
  input of stage s > 0 is detached and requires grad, so each stage owns its autograd
  graph. The last stage turns its logits into the loss, scaled by 1/N here and nowhere
  else (`_scaled_loss`). With `R` in the program's kinds, `forward` keeps only the input
  and `recompute` redoes the forward just before the backward.
- `backward` is the full backward, or, when the program splits off `W`, the input
  gradient only (`autograd.grad(..., inputs=[x], retain_graph=True)`); `weight_grad` then
  accumulates the parameter gradients from the same graph. Together they equal the full
  backward.
- `send_*`/`recv_*` move a stage's output (activation) or its input gradient; `signal`
  and `wait` carry no data. `allreduce` starts summing one stage's gradients over its
  replicas; `step` waits for those sums, runs the optimizer and clears the gradients.
- `update` (asynchronous schedules only, which have no `step`) applies one stage copy's
  gathered gradients and makes a new version of its weights (backends/versions.py).
- With sequence chunks (`chunks C`, Seq1F1B), the compute and transfer actions name a
  chunk, and a forward runs the stage over that span of the micro-batch's tokens
  (`models.sequence_chunk`): its attention reads the keys and values the chunks before
  it made on this stage, as leaves of its own graph, so that its backward leaves their
  gradients there; the backward of the earlier chunk (which runs later) feeds them into
  its graph together with its output gradient. Each chunk's loss is scaled by its share
  of the tokens, so the chunks' gradients sum to the micro-batch's.
"""

from __future__ import annotations

import contextlib
import copy as copying
import functools
import os
import resource
import time
from collections.abc import Callable, MutableSequence, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from time import perf_counter_ns
from typing import Any, TypeVar, cast

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from pipelang.backends.checkpoint import Held, held_by_model, load
from pipelang.backends.config import SGD_MOMENTUM, RunConfig
from pipelang.backends.models import (
    LayeredModel,
    SequenceChunk,
    Shapes,
    plan_stages,
    sequence_chunk,
)
from pipelang.backends.optim import SGD, Adam, CapturableAdam, CapturableSGD, Optimizer
from pipelang.backends.precision import copy_back, master_weights
from pipelang.backends.stash import Stash
from pipelang.backends.transport import Handle, Transport, peer_failures
from pipelang.backends.versions import CopyVersions, installed
from pipelang.diagnostics import InternalError
from pipelang.ir import Action, Kind, Program
from pipelang.weights import weight_versions


def make_optimizer(params: Sequence[nn.Parameter], config: RunConfig) -> Optimizer:
    """The optimizer of one stage copy, and of the `--check` reference: same settings
    (under `--graphs`, the capturable ones, which equal torch's `capturable=True`)."""
    if config.optimizer == "sgd":
        sgd = CapturableSGD if config.graphs else SGD
        return sgd(params, config.learning_rate, SGD_MOMENTUM)
    if config.optimizer == "adam":
        adam = CapturableAdam if config.graphs else Adam
        return adam(params, config.learning_rate)
    raise InternalError(f"unknown optimizer {config.optimizer!r}")


@dataclass(slots=True)
class StageCopy:
    """One copy of one stage's weights on this rank, with its own optimizer."""

    stage: int
    pipeline: str
    layers: range
    module: nn.Sequential
    first: bool
    last: bool
    params: list[nn.Parameter]
    """The parameters the stage computes with (its module's)."""
    optimizer: Optimizer
    masters: list[nn.Parameter] | None = None
    """`--mixed-precision`: the fp32 masters of `params`, which the optimizer updates
    (backends/precision.py); None: the optimizer updates `params` themselves."""

    @property
    def trained(self) -> list[nn.Parameter]:
        """The parameters the optimizer updates, whose gradients are reduced."""
        return self.masters if self.masters is not None else self.params

    def finish_update(self) -> None:
        """After the optimizer step: the masters' new values into the computed params."""
        if self.masters is not None:
            copy_back(self.params, self.masters)


Key = tuple[int, int, str, int | None]
"""What a forward saves is filed under (micro-batch, stage, pipeline, chunk); the chunk
is None unless the schedule splits micro-batches into sequence chunks."""

Value = tuple[str, int, int, str, int | None]
"""A value in flight between actions: (kind of the op that made it, micro-batch, stage,
pipeline, chunk), `("F", 3, 1, "main", None)` is the output of F3@1/main."""


@dataclass(slots=True)
class Saved:
    """What a forward keeps for its backward: input, output (or scaled loss), output grad."""

    x: torch.Tensor
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


@dataclass(slots=True)
class RankResult:
    """What one rank reports when it finishes: losses, action times, memory, weights."""

    rank: int
    copies: list[tuple[int, str, int]]
    """(stage, pipeline, index of the stage's first layer) of every copy held."""
    losses: list[dict[int, float]] = field(default_factory=list)
    """Per step: the (unscaled) loss of every micro-batch whose last stage ran here."""
    step_seconds: list[float] = field(default_factory=list)
    events: list[tuple[int, int, int, int]] = field(default_factory=list)
    """(step, action index, start ns, end ns), times relative to the run's common start;
    recorded only with `--trace` (and always on CUDA)."""
    busy_ns: int = 0
    """Time in compute actions (F, B, W, R) over all steps."""
    span_ns: tuple[int, int] = (0, 0)
    """(start of the first step, end of the last), relative to the run's common start."""
    peak_memory: int = 0
    peak_activation_bytes: int = 0
    """The most bytes of saved activations resident at once, held-for-partner buffers
    included (backends/stash.py); counted with evictions or `count_activations`."""
    copy_weights: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Final parameters of every copy (with `--check`), named as in the whole model."""
    peak_weight_versions: int = 0
    """The most weight versions in memory at once over this rank's copies (counted in
    asynchronous schedules only; compare `pipelang simulate`'s peak_weight_versions)."""
    slot_bytes: int = 0
    """The bytes of this rank's data slots: a stream program's static buffers (what
    `pipelang simulate --model` plans); 0 for an action list."""


@dataclass(frozen=True, slots=True)
class Fault:
    """A failure injected for tests: `PIPELANG_FAULT=RANK:STEP:ACTION:raise|exit|hang`."""

    rank: int
    step: int
    action: int
    mode: str

    @staticmethod
    def from_env(rank: int) -> Fault | None:
        text = os.environ.get("PIPELANG_FAULT")
        if not text:
            return None
        r, s, a, mode = text.split(":")
        return Fault(int(r), int(s), int(a), mode) if int(r) == rank else None

    def trigger(self) -> None:
        if self.mode == "exit":
            os._exit(3)
        if self.mode == "hang":
            while True:
                time.sleep(1)
        raise RuntimeError(f"injected fault (PIPELANG_FAULT={self.rank}:{self.step}:{self.action})")


T = TypeVar("T", bound=Callable[..., None])


def _action(method: T) -> T:
    """Count the action, publish where the rank is, fire an injected fault, and time the
    action when a trace records it (`RankRuntime.timed`)."""
    return _wrapped(method, busy=False)


def _compute(method: T) -> T:
    """`_action`, and add the action's time to the rank's busy time even without a trace."""
    return _wrapped(method, busy=True)


def _comm(method: T) -> T:
    """`_action` for an action that talks to other ranks: the transport's RuntimeError
    (a peer that stopped, a closed connection) becomes PeerFailure, a consequence."""

    @functools.wraps(method)
    def talk(*args: Any, **kwargs: Any) -> None:
        with peer_failures():
            method(*args, **kwargs)

    return _wrapped(cast(T, talk), busy=False)


def _wrapped(method: T, busy: bool) -> T:
    @functools.wraps(method)
    def run(self: RankRuntime, *args: Any, **kwargs: Any) -> None:
        index = self.action_index
        self.action_index = index + 1
        self.status[self.action_slot] = index
        if self.fault is not None:
            self.fault_check(index)
        if self.timed:
            self.timed_call(index, method, args, kwargs)
        elif busy:
            start = perf_counter_ns()
            method(self, *args, **kwargs)
            self.busy_ns += perf_counter_ns() - start
        else:
            method(self, *args, **kwargs)

    return run  # type: ignore[return-value]


class RankRuntime:
    """The `rt` of one rank: its stage copies, their saved activations, and the actions."""

    def __init__(
        self,
        program: Program,
        rank: int,
        config: RunConfig,
        transport: Transport,
        device: torch.device,
        status: MutableSequence[int] | None = None,
        shapes: Shapes | None = None,
        replica: int = 0,
    ) -> None:
        self.program = program
        self.rank = rank
        self.replica = replica
        self.world_rank = replica * program.num_ranks + rank
        """This process's rank in the whole run: replica-major, `replica * R + rank`."""
        self.config = config
        self.transport = transport
        self.device = device
        slot = 3 * self.world_rank
        self.status: MutableSequence[int] = status if status is not None else [0] * (slot + 3)
        self.step_slot, self.action_slot = slot + 1, slot + 2
        self.fault = Fault.from_env(self.world_rank)
        self.split_backward = Kind.W in program.kinds
        self.recomputes = Kind.R in program.kinds
        self.scale = 1.0 / (program.num_microbatches * config.dp)
        if program.weights is not None:
            self.scale = 1.0  # each update averages the gradients it applies instead
        self.first_mb = replica * program.num_microbatches
        """This replica's micro-batch `mb` is micro-batch `first_mb + mb` of the step."""
        self.model = config.spec.build()
        bounds = self.model.stage_bounds(program.num_stages, config.partition)
        if shapes is None:
            shapes = plan_stages(config.spec, program.num_stages, config.partition).shapes
        self.shapes = shapes
        self.copies = {
            (s, p): self._stage_copy(s, p, bounds[s]) for s, p in program.stage_copies(rank)
        }
        copies = list(self.copies.values())
        self.tied = TiedGrads(self.model, bounds, copies, self.counts, device)
        self.frozen: nn.Module | None = None
        """The model's frozen part, on a rank that holds it (runs `P`)."""
        if rank in (program.frozen or ()):
            self.frozen = self.model.stage_module(self.model.frozen_bounds).to(device)
        self.model.layers = []  # keep only this rank's stages (and frozen part) alive
        self.versions: dict[tuple[int, str], CopyVersions] = {}
        self.delays: dict[tuple[int, int, str], int] = {}
        """With --predict-weights: each forward's gradient delay (weights.py)."""
        if program.weights is not None:
            predict = config.predict_weights
            self.versions = {
                key: CopyVersions(c.module, c.params, program.weights.stashes, predict)
                for key, c in self.copies.items()
            }
            if predict:
                self.delays = weight_versions(program).gradient_delays()
        self.peak_versions = len(self.versions)
        self.reduced_at_step = [
            self.copies[key]
            for key in _reduced_at_step(program, rank, config.dp, list(self.copies))
        ]
        self.group_sizes = {
            stage: len(set(program.replicas(stage))) * config.dp for stage, _ in self.copies
        }
        self.saved: dict[Key, Saved] = {}
        self.chunk_bounds: tuple[int, ...] | None = None
        """The token boundaries of the sequence chunks (`Chunks.token_bounds`); None
        without chunks."""
        if program.chunks is not None:
            self.chunk_bounds = program.chunks.token_bounds(
                self.model.seq_len, program.costs.of("A")
            )
        counts = config.count_activations or program.first_eviction() is not None
        self.stash = Stash() if counts else None
        """Saved activations per forward, for evictions and their byte count."""
        self.values: dict[Value, torch.Tensor] = {}
        self.reducing: list[tuple[StageCopy, torch.Tensor, list[torch.Tensor], Handle]] = []
        self.losses: list[tuple[int, torch.Tensor]] = []
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """Static ids and targets per micro-batch (`load_inputs`); empty: made per use."""
        self.events: list[tuple[int, int, int, int]] = []
        self.timed = config.trace is not None
        """Time every action for the trace (CUDA: always, with events)."""
        self.busy_ns = 0
        self.span_ns: tuple[int, int] | None = None
        self.step_index = 0
        self.action_index = 0
        self.stepped = False
        self.t0 = time.perf_counter_ns()
        self.t0_event: torch.cuda.Event | None = None
        self.gpu_events: list[tuple[int, int, torch.cuda.Event, torch.cuda.Event]] | None = None

    def start_clock(self, t0: int | None = None, t0_event: torch.cuda.Event | None = None) -> None:
        """Action times count from now (or from `t0`, a perf_counter_ns shared by ranks).

        On CUDA an action's time is its GPU time, measured with events from `t0_event`
        (recorded now on this rank's stream unless given).
        """
        self.t0 = time.perf_counter_ns() if t0 is None else t0
        if self.device.type == "cuda":
            if t0_event is None:
                t0_event = torch.cuda.Event(enable_timing=True)
                t0_event.record()
            self.t0_event = t0_event
            self.gpu_events = []
            self.timed = True

    def fault_check(self, index: int) -> None:
        """Fire the injected fault if this is its step and action."""
        fault = self.fault
        if fault is not None and fault.step == self.step_index and fault.action == index:
            fault.trigger()

    def timed_call(
        self, index: int, method: Callable[..., None], args: Any, kwargs: dict[str, Any]
    ) -> None:
        """Run one action and record its start and end (CUDA events on a GPU)."""
        if self.gpu_events is not None:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            method(self, *args, **kwargs)
            end.record()
            self.gpu_events.append((self.step_index, index, begin, end))
            return
        start = perf_counter_ns()
        method(self, *args, **kwargs)
        end_ns = perf_counter_ns()
        self.events.append((self.step_index, index, start - self.t0, end_ns - self.t0))
        if self.program.ranks[self.rank][index].kind.is_compute:
            self.busy_ns += end_ns - start

    def _stage_copy(self, stage: int, pipeline: str, layers: range) -> StageCopy:
        module = self.model.stage_module(layers)
        if self.model.ties:  # a tied weight: each copy its own, kept equal by `step`
            module = copying.deepcopy(module)  # shared inside the stage stay shared
        module = module.to(self.device)
        params = [p for p in module.parameters() if p.requires_grad]
        masters = master_weights(params) if self.config.mixed_precision else None
        return StageCopy(
            stage,
            pipeline,
            layers,
            module,
            stage == 0,
            stage == self.program.num_stages - 1,
            params,
            make_optimizer(masters or params, self.config),
            masters,
        )

    # ---- bookkeeping ----------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        """Start iteration `step`: reset the action counter."""
        self.step_index = step
        self.action_index = 0
        self.stepped = False
        self.status[self.step_slot] = step
        if self.span_ns is None:
            start = perf_counter_ns() - self.t0
            self.span_ns = (start, start)

    def end_step(self) -> dict[int, float]:
        """Finish the iteration: wait for sends, check nothing is left; losses by mb."""
        with peer_failures():
            self.transport.end_step()
        left = [Action(Kind(k[0]), k[1], k[2], k[3], chunk=k[4]).text() for k in self.values] + [
            Action(Kind.F, mb, s, p, chunk=c).text() for mb, s, p, c in self.saved
        ]
        if self.stash is not None:
            left += [f"H{mb}@{s}/{p}" for mb, s, p, _ in self.stash.held]
        for versions in self.versions.values():
            versions.end_iteration()
        if left or self.reducing or not (self.stepped or self.versions):
            what = ", ".join(left) if left else "no `step` action ran"
            raise InternalError(f"rank {self.rank} ended step {self.step_index} unfinished: {what}")
        losses: dict[int, float] = {}
        for mb, loss in self.losses:  # a chunked micro-batch's loss is its chunks' sum
            losses[mb] = losses.get(mb, 0.0) + float(loss)
        self.losses.clear()
        if self.span_ns is not None:
            self.span_ns = (self.span_ns[0], perf_counter_ns() - self.t0)
        return losses

    def close(self) -> None:
        """Release what must go before the process groups (a captured graph)."""

    def result(self, with_weights: bool) -> RankResult:
        """The report of this rank after the last step."""
        if self.gpu_events is not None and self.t0_event is not None:
            torch.cuda.synchronize(self.device)
            zero = self.t0_event
            self.events = [
                (step, index, int(zero.elapsed_time(b) * 1e6), int(zero.elapsed_time(e) * 1e6))
                for step, index, b, e in self.gpu_events
            ]
            actions = self.program.ranks[self.rank]
            self.busy_ns = sum(e - b for _, i, b, e in self.events if actions[i].kind.is_compute)
            if self.events:
                self.span_ns = (self.events[0][2], self.events[-1][3])
        result = RankResult(
            self.world_rank,
            [(c.stage, c.pipeline, c.layers.start) for c in self.copies.values()],
            events=self.events,
            peak_memory=peak_memory(self.device),
            busy_ns=self.busy_ns,
            span_ns=self.span_ns or (0, 0),
            peak_weight_versions=self.peak_versions,
            peak_activation_bytes=self.stash.peak_bytes if self.stash is not None else 0,
        )
        if with_weights:
            for c in self.copies.values():
                result.copy_weights.append(_full_names(c))
        return result

    # ---- compute --------------------------------------------------------------------------

    def _batch(self, mb: int, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
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

    def load_inputs(self, step: int) -> None:
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

    def input_key(self, mb: int, stage: int, pipeline: str, chunk: int | None = None) -> Value:
        """The value a forward of `stage` reads: the stage before's output, or for stage
        0 of a schedule with a frozen part, the frozen part's (`P`)."""
        if stage == 0 and self.program.frozen is not None:
            return ("P", mb, 0, pipeline, None)
        return ("F", mb, stage - 1, pipeline, chunk)

    def _stage_input(self, mb: int, copy: StageCopy, chunk: int | None) -> torch.Tensor:
        if copy.first and self.program.frozen is None:
            return self._batch(mb, chunk)[0]
        value = self.values.pop(self.input_key(mb, copy.stage, copy.pipeline, chunk))
        if copy.first:  # the frozen part's output: no gradient flows back into it
            return value
        return value.detach().requires_grad_(True)

    def _scaled_loss(
        self, mb: int, logits: torch.Tensor, record: bool, chunk: int | None = None
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
        self, mb: int, copy: StageCopy, x: torch.Tensor, record: bool, chunk: int | None = None
    ) -> torch.Tensor:
        y = copy.module(x)
        if copy.last:
            return self._scaled_loss(mb, y, record, chunk)
        return y

    def _chunk_forward(self, mb: int, copy: StageCopy, x: torch.Tensor, chunk: int) -> None:
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
            self._recording(mb, copy, chunk),
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
    def forward(self, mb: int, stage: int, pipeline: str, chunk: int | None = None) -> None:
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
                with self._recording(mb, copy):
                    y = self._run_stage(mb, copy, x, record=True)
                saved = self.saved[(mb, stage, pipeline, None)] = Saved(x, y)
                self._measure()
        if self.versions:
            saved.params = params
        if not copy.last:
            self.values[("F", mb, stage, pipeline, None)] = y.detach()

    @_compute
    def frozen_forward(self, mb: int, stage: int, pipeline: str) -> None:
        """P: run the frozen part on the micro-batch's ids, without autograd; its output
        is the input of F(mb, 0)."""
        assert self.frozen is not None, "P on a rank without the frozen part"
        with torch.no_grad():
            self.values[("P", mb, stage, pipeline, None)] = self.frozen(self._batch(mb)[0])

    @_compute
    def recompute(self, mb: int, stage: int, pipeline: str) -> None:
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
    def backward(self, mb: int, stage: int, pipeline: str, chunk: int | None = None) -> None:
        """B: input gradient, plus the weight gradient unless the program splits off W."""
        copy = self.copies[(stage, pipeline)]
        key = (mb, stage, pipeline, chunk)
        saved = self.saved[key]
        if saved.y is None:
            raise InternalError(f"B{mb}@{stage}/{pipeline} ran before its recompute")
        dy = None if copy.last else self.values.pop(("B", mb, stage + 1, pipeline, chunk))
        outputs, grads = _chunk_outputs(saved, dy)
        if not self.split_backward:
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
        if own or earlier:
            found = torch.autograd.grad(
                outputs, own + earlier, grads, retain_graph=True, allow_unused=True
            )
            if own:
                self.values[("B", mb, stage, pipeline, chunk)] = found[0]
            for leaf, grad in zip(earlier, found[len(own) :], strict=True):
                if grad is not None:
                    leaf.grad = grad if leaf.grad is None else leaf.grad + grad
        saved.dy = dy

    @_compute
    def weight_grad(self, mb: int, stage: int, pipeline: str, chunk: int | None = None) -> None:
        """W: accumulate the parameter gradients from the graph B kept."""
        copy = self.copies[(stage, pipeline)]
        saved = self.saved.pop((mb, stage, pipeline, chunk))
        self._forget((mb, stage, pipeline, chunk))
        assert saved.y is not None
        params = saved.params if saved.params is not None else copy.params
        if params:  # a stage without weights (an activation alone) has no W to do
            outputs, grads = _chunk_outputs(saved, saved.dy)
            torch.autograd.backward(outputs, grads, inputs=params)
        if saved.params is not None:
            self.versions[(stage, pipeline)].collect(params)
            saved.y = saved.params = None

    @_action
    def update(self, stage: int, pipeline: str, version: int) -> None:
        """U: apply the mean of the gradients this copy gathered since its last update
        and make `version` (counted from 1 in each iteration); see backends/versions.py."""
        copy = self.copies[(stage, pipeline)]
        copy.params = self.versions[(stage, pipeline)].update(copy.optimizer, version)
        # only an update adds a version: the peak is right after one
        live = sum(v.live() for v in self.versions.values())
        self.peak_versions = max(self.peak_versions, live)

    # ---- communication --------------------------------------------------------------------

    def shape_of(
        self, stage: int, chunk: int | None = None, mb: int | None = None
    ) -> tuple[tuple[int, ...], torch.dtype]:
        """The shape of stage `stage`'s output (-1: stage 0's input): of micro-batch `mb`'s
        samples and tokens where micro-batches differ (`ModelSpec.shapes`), of one
        sequence chunk's tokens when `chunk` is given (batch and sequence are the first
        two dimensions)."""
        shape, dtype = self.shapes[stage]
        if mb is not None and self.config.batch_shapes is not None:
            shape = (*self.model.shape(mb), *shape[2:])
        if chunk is None or self.chunk_bounds is None:
            return shape, dtype
        length = self.chunk_bounds[chunk + 1] - self.chunk_bounds[chunk]
        return (shape[0], length, *shape[2:]), dtype

    def _send(self, key: Value, peer: int) -> None:
        tensor = self.values.pop(key)
        self.transport.send(tensor, peer)

    def _recv(self, key: Value, stage_output: int, peer: int) -> None:
        shape, dtype = self.shape_of(stage_output, key[4], key[1])
        self.values[key] = self.transport.recv(shape, dtype, peer)

    @_comm
    def send_activation(
        self, mb: int, stage: int, pipeline: str, to: int, chunk: int | None = None
    ) -> None:
        """send:F: send the output of F(mb, stage) to the rank of stage + 1."""
        self._send(("F", mb, stage, pipeline, chunk), to)

    @_comm
    def recv_activation(
        self, mb: int, stage: int, pipeline: str, src: int, chunk: int | None = None
    ) -> None:
        """recv:F: receive the output of F(mb, stage), the input of stage + 1."""
        self._recv(("F", mb, stage, pipeline, chunk), stage, src)

    @_comm
    def send_frozen(self, mb: int, stage: int, pipeline: str, to: int) -> None:
        """send:P: send the frozen part's output for micro-batch `mb` to stage 0's rank."""
        self._send(("P", mb, stage, pipeline, None), to)

    @_comm
    def recv_frozen(self, mb: int, stage: int, pipeline: str, src: int) -> None:
        """recv:P: receive the frozen part's output, the input of F(mb, 0)."""
        self._recv(("P", mb, stage, pipeline, None), -1, src)

    @_comm
    def send_grad(
        self, mb: int, stage: int, pipeline: str, to: int, chunk: int | None = None
    ) -> None:
        """send:B: send the input gradient B(mb, stage) made to the rank of stage - 1."""
        self._send(("B", mb, stage, pipeline, chunk), to)

    @_comm
    def recv_grad(
        self, mb: int, stage: int, pipeline: str, src: int, chunk: int | None = None
    ) -> None:
        """recv:B: receive the gradient of stage - 1's output, made by B(mb, stage)."""
        self._recv(("B", mb, stage, pipeline, chunk), stage - 1, src)

    @_comm
    def signal(self, op: str, mb: int, stage: int, pipeline: str, to: int) -> None:
        """signal: tell rank `to` that an op finished (an `after` dependency); no data."""
        self.transport.send(torch.ones(1, device=self.device), to)

    @_comm
    def wait(self, op: str, mb: int, stage: int, pipeline: str, src: int) -> None:
        """wait: block until rank `src` signals that an op finished."""
        self.transport.recv((1,), torch.float32, src)

    # ---- evicted activations (BPipe; backends/stash.py) -------------------------------------

    def _recording(
        self, mb: int, copy: StageCopy, chunk: int | None = None
    ) -> AbstractContextManager[None]:
        """File the tensors a forward saves under (mb, stage, pipeline, chunk) when
        counting."""
        if self.stash is None:
            return contextlib.nullcontext()
        key: Key = (mb, copy.stage, copy.pipeline, chunk)
        name = Action(Kind.F, *key[:3], chunk=chunk).text()
        return self.stash.recording(key, name, copy.module)

    def _measure(self) -> None:
        if self.stash is not None:
            self.stash.measure(set(self.saved))

    def _forget(self, key: Key) -> None:
        if self.stash is not None:
            self.stash.entries.pop(key, None)

    def _stash(self) -> Stash:
        if self.stash is None:
            raise InternalError("an eviction action ran, but the runtime keeps no stash")
        return self.stash

    def _send_bytes(self, buffer: torch.Tensor, peer: int) -> None:
        """An eviction's bytes go as two messages: their count (int64), then the bytes."""
        size = torch.tensor([buffer.numel()], dtype=torch.int64, device=self.device)
        self.transport.send(size, peer)
        self.transport.send(buffer, peer)

    def _recv_bytes(self, peer: int) -> torch.Tensor:
        size = self.transport.recv((1,), torch.int64, peer)
        return self.transport.recv((int(size.item()),), torch.uint8, peer)

    @_action
    def evict(self, mb: int, stage: int, pipeline: str, to: int) -> None:
        """E: copy the forward's activations into one buffer and free their storages."""
        key: Key = (mb, stage, pipeline, None)
        saved = self.saved[key]
        keep = None if self.copies[(stage, pipeline)].last else saved.y
        self.values[("E", *key)] = self._stash().evict(key, keep)

    @_comm
    def send_evicted(self, mb: int, stage: int, pipeline: str, to: int) -> None:
        """send:E: send the evicted activations to the partner."""
        self._send_bytes(self.values.pop(("E", mb, stage, pipeline, None)), to)

    @_comm
    def recv_evicted(self, mb: int, stage: int, pipeline: str, src: int) -> None:
        """recv:E: on the partner, receive activations another rank evicts."""
        self.values[("E", mb, stage, pipeline, None)] = self._recv_bytes(src)

    @_action
    def hold(self, mb: int, stage: int, pipeline: str) -> None:
        """H: keep the received activations until the owner loads them back."""
        stash = self._stash()
        key: Key = (mb, stage, pipeline, None)
        stash.held[key] = self.values.pop(("E", *key))
        self._measure()

    @_comm
    def send_held(self, mb: int, stage: int, pipeline: str, to: int) -> None:
        """send:H: send the held activations back to their owner; stop holding them."""
        self._send_bytes(self._stash().held.pop((mb, stage, pipeline, None)), to)

    @_comm
    def recv_held(self, mb: int, stage: int, pipeline: str, src: int) -> None:
        """recv:H: on the owner, receive its activations back from the partner."""
        self.values[("H", mb, stage, pipeline, None)] = self._recv_bytes(src)

    @_action
    def load(self, mb: int, stage: int, pipeline: str) -> None:
        """L: give the forward's storages their bytes back, for the backward."""
        key: Key = (mb, stage, pipeline, None)
        self._stash().load(key, self.values.pop(("H", *key)))
        self._measure()

    # ---- synchronisation ------------------------------------------------------------------

    @_comm
    def allreduce(self, stage: int, pipeline: str) -> None:
        """allreduce: start summing this copy's gradients with the stage's other replicas."""
        if self.group_sizes[stage] < 2:
            return
        self._start_allreduce(self.copies[(stage, pipeline)])

    def _start_allreduce(self, copy: StageCopy) -> None:
        """Start summing a copy's gradients with its replicas'; a stage without weights
        (an activation alone, on every replica alike) has nothing to sum."""
        if not copy.trained:
            return
        flat, grads = copy_grads(copy)
        handle = self.transport.allreduce(copy.stage, flat)
        self.reducing.append((copy, flat, grads, handle))

    @_action
    def step(self) -> None:
        """step: finish the allreduces, update every stage copy, clear the gradients.

        With `--dp K`, a copy whose stage has no replica in the schedule (so no
        `allreduce` action) sums its gradients with the other K - 1 copies here."""
        with peer_failures():
            for copy in self.reduced_at_step:
                self._start_allreduce(copy)
            for copy, flat, grads, handle in self.reducing:
                handle.wait()
                set_grads(copy, flat, grads)
        self.reducing.clear()
        self.update_copies()

    def held(self) -> list[Held]:
        """Every stage copy's trained parameters and optimizer, named for a checkpoint."""
        return [
            held_by_model(c.module, c.optimizer, c.layers.start, c.masters)
            for c in self.copies.values()
        ]

    def load_checkpoint(self, path: str) -> None:
        """Every stage copy's parameters and optimizer state from checkpoint `path`."""
        load(self.held(), path)
        for copy in self.copies.values():
            copy.finish_update()

    def update_copies(self) -> None:
        """The optimizer step of every copy, gradients summed already; then clear them.
        First a tied weight's copies get the sum of its gradients, and with `--clip-grad`
        the gradients are clipped by the global norm (each a collective over every rank
        of the run)."""
        if self.tied:
            with peer_failures():
                self.tied.set(self.transport.world_sum(self.tied.contribution()))
        if self.config.clip_grad is not None:
            with peer_failures():
                total = self.transport.world_sum(self.grad_square_sum())
            self.scale_grads(clip_coefficient(total, self.config.clip_grad))
        self.apply_updates()

    def grad_square_sum(self) -> torch.Tensor:
        """The squared norm of the gradients this rank counts towards the global norm,
        in float32: each stage is counted once in the whole run, by its copy on the
        lowest rank that holds it, in data-parallel copy 0 (replicas hold equal
        gradients once their allreduce is done)."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        for copy in self.copies.values():
            if self.counts(copy):
                for index, param in enumerate(copy.trained):
                    if param.grad is not None and not self.tied.repeats(copy, index):
                        total += param.grad.detach().float().square().sum()
        return total

    def counts(self, copy: StageCopy) -> bool:
        """Whether `copy` stands for its stage in a sum over the whole run: the copy on
        the lowest rank that holds the stage, in data-parallel copy 0 (the others hold
        the same gradients once the stage's allreduce is done)."""
        return self.replica == 0 and min(self.program.replicas(copy.stage)) == self.rank

    @torch.no_grad()
    def scale_grads(self, coefficient: torch.Tensor) -> None:
        """Multiply every gradient of every copy by `coefficient` (a 0-d tensor: no host
        sync, so a CUDA graph can capture it)."""
        for copy in self.copies.values():
            for param in copy.trained:
                if param.grad is not None:
                    param.grad.mul_(coefficient.to(param.grad.dtype))

    def apply_updates(self) -> None:
        """The optimizer step of every copy; then clear the gradients."""
        for copy in self.copies.values():
            copy.optimizer.step()
            copy.optimizer.zero_grad()
            copy.finish_update()
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
        copies: Sequence[StageCopy],
        counts: Callable[[StageCopy], bool],
        device: torch.device,
    ) -> None:
        self.device = device
        self.uses: list[tuple[int, StageCopy, int, bool]] = []
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

    def repeats(self, copy: StageCopy, index: int) -> bool:
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
        """Give every use on this rank the summed gradient."""
        for offset, copy, index, _ in self.uses:
            param = copy.trained[index]
            part = total[offset : offset + param.numel()].view(param.shape)
            param.grad = part.to(param.dtype).clone()


def _trained_index(copy: StageCopy, layer: int, name: str) -> int:
    """Where the parameter `name` of model layer `layer` is in `copy.trained`."""
    names = [n for n, p in copy.module.named_parameters() if p.requires_grad]
    return names.index(f"{layer - copy.layers.start}.{name}")


def clip_coefficient(square_sum: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What `torch.nn.utils.clip_grad_norm_` multiplies gradients by, given their squared
    global norm: max_norm / (norm + 1e-6), at most 1."""
    return (max_norm / (square_sum.sqrt() + 1e-6)).clamp(max=1.0)


def copy_grads(copy: StageCopy) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A copy's gradients as one flat tensor (zeros where a parameter has none; float32
    for half dtypes on the CPU, whose collectives lack them), and the list it came from."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in copy.trained]
    flat = _flatten_dense_tensors(grads)
    if flat.device.type == "cpu" and flat.dtype in (torch.float16, torch.bfloat16):
        flat = flat.float()
    return flat, grads


def set_grads(copy: StageCopy, flat: torch.Tensor, grads: list[torch.Tensor]) -> None:
    """Give a copy's parameters the gradients in `flat` (laid out as `copy_grads` made it)."""
    for param, grad in zip(copy.trained, _unflatten_dense_tensors(flat, grads), strict=True):
        param.grad = grad.to(param.dtype)


def _reduced_at_step(
    program: Program, rank: int, dp: int, copies: list[tuple[int, str]]
) -> list[tuple[int, str]]:
    """The copies `step` itself reduces under `--dp`: those with no `allreduce` action."""
    if dp < 2:
        return []
    actions = program.ranks[rank]
    reduced = {(a.stage, a.pipeline) for a in actions if a.kind is Kind.ALLREDUCE}
    return [copy for copy in copies if copy not in reduced]


def _full_names(copy: StageCopy) -> dict[str, torch.Tensor]:
    """A stage copy's parameters named as in the whole model (`{layer}.{name}`)."""
    out = {}
    for name, tensor in copy.module.state_dict().items():
        local, _, rest = name.partition(".")
        out[f"{copy.layers.start + int(local)}.{rest}"] = tensor.detach().cpu().clone()
    return out


def peak_memory(device: torch.device) -> int:
    """Peak memory of this rank in bytes: allocated on the GPU, resident on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def full_model_names(model: LayeredModel) -> dict[str, torch.Tensor]:
    """The whole model's parameters named like `_full_names`."""
    return {
        k: v.detach().cpu().clone() for k, v in nn.Sequential(*model.layers).state_dict().items()
    }


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
