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
"""

from __future__ import annotations

import functools
import os
import resource
import time
from collections.abc import Callable, MutableSequence, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from pipelang.backends.models import LayeredModel, ModelSpec, Shapes, plan_stages
from pipelang.backends.optim import SGD, Adam, Optimizer
from pipelang.backends.transport import Handle, PeerFailure, Transport
from pipelang.diagnostics import InternalError
from pipelang.ir import Kind, Program

OPTIMIZERS = ("sgd", "adam")
DEFAULT_LR = {"sgd": 0.05, "adam": 3e-3}
SGD_MOMENTUM = 0.9


@dataclass(frozen=True, slots=True)
class RunConfig:
    """Everything a rank needs to know about a run besides the Program; picklable."""

    model: str = "gpt:tiny"
    backend: str = "gloo"
    steps: int = 3
    check: bool = False
    optimizer: str = "adam"
    lr: float | None = None
    micro_batch_size: int = 4
    seq_len: int | None = None
    dtype: str = "float32"
    timeout: float = 60.0
    trace: str | None = None
    seed: int = 0
    debug: bool = False
    partition: tuple[int, ...] | None = None

    @property
    def spec(self) -> ModelSpec:
        return ModelSpec(self.model, self.seq_len, self.micro_batch_size, self.dtype, self.seed)

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[self.optimizer]


def make_optimizer(params: Sequence[nn.Parameter], config: RunConfig) -> Optimizer:
    """The optimizer of one stage copy, and of the `--check` reference: same settings."""
    if config.optimizer == "sgd":
        return SGD(params, config.learning_rate, SGD_MOMENTUM)
    if config.optimizer == "adam":
        return Adam(params, config.learning_rate)
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
    optimizer: Optimizer


@dataclass(slots=True)
class Saved:
    """What a forward keeps for its backward: input, output (or scaled loss), output grad."""

    x: torch.Tensor
    y: torch.Tensor | None
    dy: torch.Tensor | None = None


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
    """(step, action index, start ns, end ns), times relative to the run's common start."""
    peak_memory: int = 0
    copy_weights: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Final parameters of every copy (with `--check`), named as in the whole model."""


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
    """Count the action, publish where the rank is, time it, and fire an injected fault."""

    @functools.wraps(method)
    def run(self: RankRuntime, *args: Any, **kwargs: Any) -> None:
        index = self.action_index
        self.action_index = index + 1
        self.status[self.status_slot + 2] = index
        fault = self.fault
        if fault is not None and fault.step == self.step_index and fault.action == index:
            fault.trigger()
        if self.gpu_events is not None:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            method(self, *args, **kwargs)
            end.record()
            self.gpu_events.append((self.step_index, index, begin, end))
            return
        start = time.perf_counter_ns()
        method(self, *args, **kwargs)
        self.events.append(
            (self.step_index, index, start - self.t0, time.perf_counter_ns() - self.t0)
        )

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
    ) -> None:
        self.program = program
        self.rank = rank
        self.config = config
        self.transport = transport
        self.device = device
        self.status: MutableSequence[int] = status if status is not None else [0] * (3 * (rank + 1))
        self.status_slot = 3 * rank
        self.fault = Fault.from_env(rank)
        self.split_backward = Kind.W in program.kinds
        self.recomputes = Kind.R in program.kinds
        self.scale = 1.0 / program.num_microbatches
        self.model = config.spec.build()
        bounds = self.model.stage_bounds(program.num_stages, config.partition)
        if shapes is None:
            shapes = plan_stages(config.spec, program.num_stages, config.partition).shapes
        self.shapes = shapes
        self.copies = {
            (s, p): self._stage_copy(s, p, bounds[s]) for s, p in program.stage_copies(rank)
        }
        self.model.layers = []  # keep only this rank's stages alive
        self.saved: dict[tuple[int, int, str], Saved] = {}
        self.values: dict[tuple[str, int, int, str], torch.Tensor] = {}
        self.reducing: list[tuple[StageCopy, torch.Tensor, list[torch.Tensor], Handle]] = []
        self.losses: list[tuple[int, torch.Tensor]] = []
        self.events: list[tuple[int, int, int, int]] = []
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

    def _stage_copy(self, stage: int, pipeline: str, layers: range) -> StageCopy:
        module = self.model.stage_module(layers).to(self.device)
        params = [p for p in module.parameters() if p.requires_grad]
        return StageCopy(
            stage,
            pipeline,
            layers,
            module,
            stage == 0,
            stage == self.program.num_stages - 1,
            params,
            make_optimizer(params, self.config),
        )

    # ---- bookkeeping ----------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        """Start iteration `step`: reset the action counter."""
        self.step_index = step
        self.action_index = 0
        self.stepped = False
        self.status[self.status_slot + 1] = step

    def end_step(self) -> dict[int, float]:
        """Finish the iteration: wait for sends, check nothing is left; losses by mb."""
        try:
            self.transport.end_step()
        except RuntimeError as err:
            raise PeerFailure(str(err)) from err
        left = [f"{k[0]}{k[1]}@{k[2]}/{k[3]}" for k in self.values] + [
            f"F{mb}@{s}/{p}" for mb, s, p in self.saved
        ]
        if left or self.reducing or not self.stepped:
            what = ", ".join(left) if left else "no `step` action ran"
            raise InternalError(f"rank {self.rank} ended step {self.step_index} unfinished: {what}")
        losses = {mb: float(loss) for mb, loss in self.losses}
        self.losses.clear()
        return losses

    def result(self, with_weights: bool) -> RankResult:
        """The report of this rank after the last step."""
        if self.gpu_events is not None and self.t0_event is not None:
            torch.cuda.synchronize(self.device)
            zero = self.t0_event
            self.events = [
                (step, index, int(zero.elapsed_time(b) * 1e6), int(zero.elapsed_time(e) * 1e6))
                for step, index, b, e in self.gpu_events
            ]
        result = RankResult(
            self.rank,
            [(c.stage, c.pipeline, c.layers.start) for c in self.copies.values()],
            events=self.events,
            peak_memory=peak_memory(self.device),
        )
        if with_weights:
            for c in self.copies.values():
                result.copy_weights.append(_full_names(c))
        return result

    # ---- compute --------------------------------------------------------------------------

    def _stage_input(self, mb: int, copy: StageCopy) -> torch.Tensor:
        if copy.first:
            ids, _ = self.model.batch(self.step_index, mb, self.device)
            return ids
        value = self.values.pop(("F", mb, copy.stage - 1, copy.pipeline))
        return value.detach().requires_grad_(True)

    def _scaled_loss(self, mb: int, logits: torch.Tensor, record: bool) -> torch.Tensor:
        """The loss of one micro-batch scaled by 1/N: the one place the loss is scaled."""
        _, targets = self.model.batch(self.step_index, mb, self.device)
        loss = self.model.loss(logits, targets)
        if record:
            self.losses.append((mb, loss.detach()))
        return loss * self.scale

    def _run_stage(self, mb: int, copy: StageCopy, x: torch.Tensor, record: bool) -> torch.Tensor:
        y = copy.module(x)
        if copy.last:
            return self._scaled_loss(mb, y, record)
        return y

    @_action
    def forward(self, mb: int, stage: int, pipeline: str) -> None:
        """F: run the stage; keep its input and output; publish the output."""
        copy = self.copies[(stage, pipeline)]
        x = self._stage_input(mb, copy)
        if self.recomputes:
            with torch.no_grad():
                y = self._run_stage(mb, copy, x, record=True)
            self.saved[(mb, stage, pipeline)] = Saved(x, None)
        else:
            y = self._run_stage(mb, copy, x, record=True)
            self.saved[(mb, stage, pipeline)] = Saved(x, y)
        if not copy.last:
            self.values[("F", mb, stage, pipeline)] = y.detach()

    @_action
    def recompute(self, mb: int, stage: int, pipeline: str) -> None:
        """R: redo the forward from the kept input, this time building the graph."""
        copy = self.copies[(stage, pipeline)]
        saved = self.saved[(mb, stage, pipeline)]
        saved.y = self._run_stage(mb, copy, saved.x, record=False)

    @_action
    def backward(self, mb: int, stage: int, pipeline: str) -> None:
        """B: input gradient, plus the weight gradient unless the program splits off W."""
        copy = self.copies[(stage, pipeline)]
        key = (mb, stage, pipeline)
        saved = self.saved[key]
        if saved.y is None:
            raise InternalError(f"B{mb}@{stage}/{pipeline} ran before its recompute")
        dy = None if copy.last else self.values.pop(("B", mb, stage + 1, pipeline))
        if not self.split_backward:
            torch.autograd.backward(saved.y, dy)
            del self.saved[key]
            if not copy.first:
                assert saved.x.grad is not None
                self.values[("B", mb, stage, pipeline)] = saved.x.grad
            return
        if not copy.first:
            (dx,) = torch.autograd.grad(saved.y, [saved.x], dy, retain_graph=True)
            self.values[("B", mb, stage, pipeline)] = dx
        saved.dy = dy

    @_action
    def weight_grad(self, mb: int, stage: int, pipeline: str) -> None:
        """W: accumulate the parameter gradients from the graph B kept."""
        copy = self.copies[(stage, pipeline)]
        saved = self.saved.pop((mb, stage, pipeline))
        assert saved.y is not None
        torch.autograd.backward(saved.y, saved.dy, inputs=copy.params)

    # ---- communication --------------------------------------------------------------------

    def _shape(self, stage: int) -> tuple[tuple[int, ...], torch.dtype]:
        return self.shapes[stage]

    def _send(self, key: tuple[str, int, int, str], peer: int) -> None:
        tensor = self.values.pop(key)
        try:
            self.transport.send(tensor, peer)
        except RuntimeError as err:
            raise PeerFailure(str(err)) from err

    def _recv(self, key: tuple[str, int, int, str], stage_output: int, peer: int) -> None:
        shape, dtype = self._shape(stage_output)
        try:
            self.values[key] = self.transport.recv(shape, dtype, peer)
        except RuntimeError as err:
            raise PeerFailure(str(err)) from err

    @_action
    def send_activation(self, mb: int, stage: int, pipeline: str, to: int) -> None:
        """send:F: send the output of F(mb, stage) to the rank of stage + 1."""
        self._send(("F", mb, stage, pipeline), to)

    @_action
    def recv_activation(self, mb: int, stage: int, pipeline: str, src: int) -> None:
        """recv:F: receive the output of F(mb, stage), the input of stage + 1."""
        self._recv(("F", mb, stage, pipeline), stage, src)

    @_action
    def send_grad(self, mb: int, stage: int, pipeline: str, to: int) -> None:
        """send:B: send the input gradient B(mb, stage) made to the rank of stage - 1."""
        self._send(("B", mb, stage, pipeline), to)

    @_action
    def recv_grad(self, mb: int, stage: int, pipeline: str, src: int) -> None:
        """recv:B: receive the gradient of stage - 1's output, made by B(mb, stage)."""
        self._recv(("B", mb, stage, pipeline), stage - 1, src)

    @_action
    def signal(self, op: str, mb: int, stage: int, pipeline: str, to: int) -> None:
        """signal: tell rank `to` that an op finished (an `after` dependency); no data."""
        try:
            self.transport.send(torch.ones(1, device=self.device), to)
        except RuntimeError as err:
            raise PeerFailure(str(err)) from err

    @_action
    def wait(self, op: str, mb: int, stage: int, pipeline: str, src: int) -> None:
        """wait: block until rank `src` signals that an op finished."""
        try:
            self.transport.recv((1,), torch.float32, src)
        except RuntimeError as err:
            raise PeerFailure(str(err)) from err

    # ---- synchronisation ------------------------------------------------------------------

    @_action
    def allreduce(self, stage: int, pipeline: str) -> None:
        """allreduce: start summing this copy's gradients with the stage's other replicas."""
        copy = self.copies[(stage, pipeline)]
        if len(set(self.program.replicas(stage))) < 2:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in copy.params]
        flat = _flatten_dense_tensors(grads)
        if flat.device.type == "cpu" and flat.dtype in (torch.float16, torch.bfloat16):
            flat = flat.float()
        try:
            handle = self.transport.allreduce(stage, flat)
        except RuntimeError as err:
            raise PeerFailure(str(err)) from err
        self.reducing.append((copy, flat, grads, handle))

    @_action
    def step(self) -> None:
        """step: finish the allreduces, update every stage copy, clear the gradients."""
        for copy, flat, grads, handle in self.reducing:
            try:
                handle.wait()
            except RuntimeError as err:
                raise PeerFailure(str(err)) from err
            for param, grad in zip(copy.params, _unflatten_dense_tensors(flat, grads), strict=True):
                param.grad = grad.to(param.dtype)
        self.reducing.clear()
        for copy in self.copies.values():
            copy.optimizer.step()
            copy.optimizer.zero_grad()
        self.stepped = True


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
