"""`--check` for asynchronous schedules: replay their weight versions in one process.

A synchronous schedule is checked against plain training (reference.py). An
asynchronous one (`weights ...`, `U`) trains differently by design: micro-batches read
different versions of the weights. Its reference replays, in one process and without
ranks, what pipelang.weights says the schedule means:

- `reads`: the version every F, B, W, R of every stage reads (versions counted from
  the iteration's start; each iteration begins from the last one's newest weights);
- `applies`: which micro-batches' gradients each update `U` of a stage applies, and in
  which order they were summed;
- the policy: under `stash` and `K` a backward reads the version its forward read; under
  `latest` the backward's weights are the version it reads while every activation the
  forward saved keeps the forward's values.

Every micro-batch's forward on stage s runs on its own leaf copy of the version it
reads (`torch.func.functional_call`); a backward that reads another version first
writes that version's values into those leaves through `.data`, so the graph's saved
weights hold them and its saved activations do not change. An update sums its
micro-batches' gradients in `applies` order, divides by their number (the loss is
unscaled: each update applies a mean gradient), and runs the optimizer on a copy of the
version it updates. An op runs as soon as what it needs exists (its input activation
or output gradient, the version it reads, the gradients an update applies); nothing
follows the ranks' orders, so a runtime that reads the wrong version, applies a
gradient to the wrong update or mis-scales it disagrees. The result compares with the
run like the synchronous reference (`reference.compare`, same tolerance).

With `--predict-weights` a forward (and its recompute) reads its version moved
`gradient_delays` times by the update that made it (`delta`; the last update of the
iteration before for version 0), as backends/versions.py says; its backward reads the
same values (prediction needs a stashing policy).

It keeps every version some op still has to read, and one stage's weights per
micro-batch in flight: a few times the model, fine for the models `--check` is for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.func import functional_call

from pipelang.backends.config import RunConfig
from pipelang.backends.models import LayeredModel
from pipelang.backends.optim import Optimizer
from pipelang.backends.rank_base import make_optimizer
from pipelang.backends.reference import Reference
from pipelang.backends.runtime import full_model_names
from pipelang.diagnostics import InternalError
from pipelang.ir import Kind, Program
from pipelang.weights import WeightVersions, weight_versions

Weights = list[torch.Tensor]
Task = tuple[Kind, int, int]
"""(kind, stage, micro-batch), or (U, stage, update number)."""

_PRIORITY = {Kind.U: 0, Kind.W: 1, Kind.B: 2, Kind.R: 3, Kind.F: 4}
"""Backwards and updates first: fewer micro-batches in flight, less memory."""


def train_async_reference(
    config: RunConfig, program: Program, device: torch.device, threads: int | None = None
) -> Reference:
    """Replay `program`'s versioned forwards, backwards and updates for `config.steps`
    iterations in one process (see the module docstring); `threads` as in
    `reference.train_reference`."""
    if program.weights is None or len(program.pipelines) != 1:
        raise InternalError("the asynchronous reference needs one pipeline and `weights`")
    saved = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        replay = _Replay(config, program, device)
        losses = [replay.iteration(step) for step in range(config.steps)]
        return Reference(losses, replay.final_weights())
    finally:
        torch.set_num_threads(saved)


@dataclass(slots=True)
class _Forward:
    """One micro-batch on one stage: its input, its own copy of the weights, its graph."""

    x: torch.Tensor
    weights: Weights
    version: int
    """The version whose values `weights` hold now."""
    y: torch.Tensor | None = None
    dy: torch.Tensor | None = None


@dataclass(slots=True)
class _Iteration:
    """What one iteration's replay has made so far."""

    versions: list[dict[int, Weights]]
    deltas: list[dict[int, Weights | None]]
    """Per stage, version -> what the update that made it changed (prediction only)."""
    uses: dict[tuple[int, int], int]
    """(stage, version): the tasks still to read it."""
    forwards: dict[tuple[int, int], _Forward] = field(default_factory=dict)
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    input_grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    grads: dict[tuple[int, int], list[torch.Tensor | None]] = field(default_factory=dict)
    done: set[Task] = field(default_factory=set)
    losses: dict[int, float] = field(default_factory=dict)


class _Replay:
    """The stages, their newest weights and optimizers, across iterations."""

    def __init__(self, config: RunConfig, program: Program, device: torch.device) -> None:
        self.program = program
        self.pipeline = program.pipelines[0].name
        self.stashes = program.weights is not None and program.weights.stashes
        self.kinds = program.kinds
        self.device = device
        self.model: LayeredModel = config.spec.build()
        for layer in self.model.layers:
            layer.to(device)
        bounds = self.model.stage_bounds(program.num_stages, config.partition)
        self.modules = [self.model.stage_module(b) for b in bounds]
        self.names: list[list[str]] = []
        self.newest: list[Weights] = []
        self.optimizers: list[Optimizer] = []
        self.lr = config.lr_schedule_at()
        for module in self.modules:
            named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
            self.names.append([n for n, _ in named])
            self.newest.append([p.detach().clone() for _, p in named])
            self.optimizers.append(make_optimizer([p for _, p in named], config))
        self.versions: WeightVersions = weight_versions(program)
        self.delays = self.versions.gradient_delays() if config.predict_weights else {}
        self.last_deltas: list[Weights | None] = [None] * len(self.modules)
        self.tasks = self._tasks()

    def _tasks(self) -> list[Task]:
        tasks: list[Task] = []
        for kind, mb, stage, _ in self.versions.reads:
            assert mb is not None and stage is not None
            tasks.append((kind, stage, mb))
        for stage, _, k in self.versions.applies:
            assert stage is not None
            tasks.append((Kind.U, stage, k))
        return sorted(tasks, key=lambda t: (_PRIORITY[t[0]], t[2], -t[1]))

    def read(self, kind: Kind, stage: int, mb: int) -> int:
        return self.versions.reads[(kind, mb, stage, self.pipeline)]

    def iteration(self, step: int) -> float:
        """Replay one iteration; its mean loss."""
        for optimizer in self.optimizers:
            optimizer.set_lr(self.lr.lr(step))
        uses: dict[tuple[int, int], int] = {}
        for kind, stage, n in self.tasks:
            version = n if kind is Kind.U else self.read(kind, stage, n)
            uses[(stage, version)] = uses.get((stage, version), 0) + 1
        state = _Iteration([{0: w} for w in self.newest], [{0: d} for d in self.last_deltas], uses)
        pending = self.tasks
        while pending:
            waiting = [task for task in pending if not self._try(task, state, step)]
            if len(waiting) == len(pending):
                raise InternalError(f"the asynchronous reference is stuck at {waiting[:3]}")
            pending = waiting
        self.newest = [v[max(v)] for v in state.versions]
        self.last_deltas = [d[max(d)] for d in state.deltas]
        count = self.program.num_microbatches
        return sum(state.losses[mb] for mb in range(count)) / count

    def _try(self, task: Task, state: _Iteration, step: int) -> bool:
        """Run `task` if what it needs exists; whether it ran."""
        kind, stage, n = task
        version = n if kind is Kind.U else self.read(kind, stage, n)
        if version not in state.versions[stage] or not self._inputs_ready(task, state):
            return False
        if kind is Kind.U:
            self._update(stage, n, state)
        elif kind is Kind.F:
            self._forward(stage, n, version, state, step)
        elif kind is Kind.R:
            forward = state.forwards[(stage, n)]
            forward.weights = self._leaves(state, stage, version, n)
            forward.version = version
            forward.y = self._run(stage, n, forward, step)
        else:
            self._backward(kind, stage, n, version, state)
        state.done.add(task)
        state.uses[(stage, version)] -= 1
        newest = max(state.versions[stage])
        if state.uses[(stage, version)] == 0 and version != newest:
            del state.versions[stage][version]
        return True

    def _inputs_ready(self, task: Task, state: _Iteration) -> bool:
        kind, stage, n = task
        done = state.done
        if kind is Kind.U:
            mbs = self.versions.applies[(stage, self.pipeline, n)]
            return all((stage, mb) in state.grads for mb in mbs)
        if kind is Kind.F:
            return stage == 0 or (stage - 1, n) in state.outputs
        if kind is Kind.R:
            return (Kind.F, stage, n) in done
        recomputed = Kind.R not in self.kinds or (Kind.R, stage, n) in done
        if not recomputed or (Kind.F, stage, n) not in done:
            return False
        if kind is Kind.W:
            return (Kind.B, stage, n) in done
        return stage == self.program.num_stages - 1 or (stage + 1, n) in state.input_grads

    def _leaves(
        self, state: _Iteration, stage: int, version: int, mb: int | None = None
    ) -> Weights:
        """Fresh leaves holding `version`; for micro-batch `mb`'s forward, predicted."""
        values = state.versions[stage][version]
        delay = self.delays.get((mb, stage, self.pipeline), 0) if mb is not None else 0
        delta = state.deltas[stage][version] if delay else None
        if delta is not None:
            values = [torch.add(w, d, alpha=delay) for w, d in zip(values, delta, strict=True)]
        return [t.detach().clone().requires_grad_(True) for t in values]

    def _run(self, stage: int, mb: int, forward: _Forward, step: int) -> torch.Tensor:
        """The stage's output on `forward.weights`; on the last stage, the (unscaled) loss."""
        weights = dict(zip(self.names[stage], forward.weights, strict=True))
        y = functional_call(self.modules[stage], weights, (forward.x,))
        if stage < self.program.num_stages - 1:
            return y
        _, targets = self.model.batch(step, mb, self.device)
        return self.model.loss(y, targets)

    def _forward(self, stage: int, mb: int, version: int, state: _Iteration, step: int) -> None:
        if stage == 0:
            x, _ = self.model.batch(step, mb, self.device)
        else:
            x = state.outputs.pop((stage - 1, mb)).detach().requires_grad_(True)
        forward = _Forward(x, self._leaves(state, stage, version, mb), version)
        if Kind.R in self.kinds:
            with torch.no_grad():
                y = self._run(stage, mb, forward, step)
        else:
            y = forward.y = self._run(stage, mb, forward, step)
        state.forwards[(stage, mb)] = forward
        if stage == self.program.num_stages - 1:
            state.losses[mb] = float(y.detach())
        else:
            state.outputs[(stage, mb)] = y.detach()

    def _backward(self, kind: Kind, stage: int, mb: int, version: int, state: _Iteration) -> None:
        forward = state.forwards[(stage, mb)]
        if forward.version != version:
            # `latest`: the graph's saved weights take the newer values; activations stay
            for leaf, value in zip(forward.weights, state.versions[stage][version], strict=True):
                leaf.data.copy_(value)
            forward.version = version
        assert forward.y is not None
        if kind is Kind.W:
            grads = torch.autograd.grad(forward.y, forward.weights, forward.dy, allow_unused=True)
            state.grads[(stage, mb)] = list(grads)
            del state.forwards[(stage, mb)]
            return
        last = stage == self.program.num_stages - 1
        dy = None if last else state.input_grads.pop((stage + 1, mb))
        inputs = [] if stage == 0 else [forward.x]
        if Kind.W in self.kinds:
            if inputs:
                (dx,) = torch.autograd.grad(forward.y, inputs, dy, retain_graph=True)
                state.input_grads[(stage, mb)] = dx
            forward.dy = dy
            return
        grads = torch.autograd.grad(forward.y, inputs + forward.weights, dy, allow_unused=True)
        if inputs:
            state.input_grads[(stage, mb)] = grads[0]
        state.grads[(stage, mb)] = list(grads[len(inputs) :])
        del state.forwards[(stage, mb)]

    def _update(self, stage: int, k: int, state: _Iteration) -> None:
        """Update k of `stage`: the mean of its micro-batches' gradients, applied to a
        copy of version k, is version k + 1."""
        mbs = [mb for mb in self.versions.applies[(stage, self.pipeline, k)] if mb is not None]
        old = state.versions[stage][k]
        if not mbs:
            state.versions[stage][k + 1] = old
            state.deltas[stage][k + 1] = None
            return
        total = state.grads.pop((stage, mbs[0]))
        for mb in mbs[1:]:
            more = state.grads.pop((stage, mb))
            total = [
                g if t is None else t if g is None else t + g
                for t, g in zip(total, more, strict=True)
            ]
        mean = [None if t is None else torch.div(t, len(mbs)) for t in total]
        new = [t.clone() for t in old]
        self.optimizers[stage].apply(new, mean)
        state.versions[stage][k + 1] = new
        if self.delays:
            state.deltas[stage][k + 1] = [n - o for n, o in zip(new, old, strict=True)]

    def final_weights(self) -> dict[str, torch.Tensor]:
        """Every parameter after the last iteration, named as the runtime names them."""
        with torch.no_grad():
            for module, names, newest in zip(self.modules, self.names, self.newest, strict=True):
                params = dict(module.named_parameters())
                for name, value in zip(names, newest, strict=True):
                    params[name].copy_(value)
        return full_model_names(self.model)
