"""`PipelineSchedule`: run a compiled schedule inside your own torch training loop.

    from pipelang.torch import PipelineSchedule
    sched = PipelineSchedule(prog, build_stage=make_stage, loss_fn=loss_fn)
    opt = torch.optim.SGD(sched.parameters(), lr=0.1)
    loss = sched.step(x, target=y)      # x, y: the whole batch
    opt.step(); opt.zero_grad()

Every process of an initialised process group (torchrun, gloo or nccl) builds one;
`dist.get_rank()` says which rank of the schedule it runs (with `--dp`-style copies,
process `k * R + r` runs rank r of copy k, on its own batch). It builds every stage copy
the rank holds by calling `build_stage(stage)` (Chimera's replicas included) and makes
the replicas of a stage equal by broadcasting the first one's parameters.

A stage may hand the next several tensors (a tuple, a list, a dict of them), passed on
whole (`x = stage(x)`): the value crosses the boundary packed into one flat tensor, as
`pipelang run` packs it (`backends/user_models.Boundary`), its structure announced with
the first message.

`step` splits the batch into the schedule's micro-batches, runs this rank's actions in
the compiled order (forwards, backwards, split weight gradients, recomputes; sends and
receives on one process group per directed rank pair) on each stage copy as `pipelang
run` does, through the same `Stage` (backends/stage.py: a split backward keeps after B
only what W reads, and a W right after its B runs with it as one backward), and sums
each stage's gradients over its replicas (and copies). The gradients are those of the
mean of the micro-batch losses over the whole batch of every copy, as torch's schedules
give with `scale_grads=True`: after `opt.step()` the parameters equal single-process training on
the whole batch. What it cannot run yet (asynchronous schedules, frozen work, chunks,
shapes, evictions) it refuses by `features.refusal`.

`sched.optimizer("adamw", lr=...)` is `pipelang run`'s optimizer on every stage copy, and
`sched.save(DIR, optimizer=opt)` / `sched.load(DIR, optimizer=opt)` write and read `run`'s
checkpoints, so that each resumes the other bit for bit (pipelang/torch_state.py).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from pipelang.backends.config import SGD_MOMENTUM
from pipelang.backends.model_error import ModelError
from pipelang.backends.optim import LrSchedule
from pipelang.backends.precision import master_weights
from pipelang.backends.rank_sync import clip_coefficient
from pipelang.backends.stage import Settings, Stage
from pipelang.backends.stash import Stash
from pipelang.backends.transport import DistTransport, Handle, settled
from pipelang.backends.user_models import Boundary
from pipelang.diagnostics import clip, fail, quote
from pipelang.features import refusal
from pipelang.ir import Action, Kind, deps
from pipelang.ir.placement import reduce_ranks
from pipelang.ir.program import whole_backwards
from pipelang.schedule import Schedule
from pipelang.torch_state import PipelineOptimizer, load, make_optimizer, save

__all__ = ["LrSchedule", "PipelineOptimizer", "PipelineSchedule"]
"""`LrSchedule` is `pipelang run`'s learning rate per step (warm-up, then constant, cosine
or linear to a floor), for a loop of your own: `lr = LrSchedule(3e-3, "cosine", warmup=10,
floor=3e-4, steps=1000).lr(step)`."""

HEADER = 10
"""Length of the int64 header that precedes the first message of each kind and stage on a
channel: [dims, dtype, *shape] (later ones reuse the shape it announced); for a value of
several tensors, [PACKED, n], and n bytes that describe its `Boundary` follow."""
PACKED = -1
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32)


class PipelineSchedule:
    """One rank's part of a compiled schedule, run on the caller's models and data."""

    def __init__(
        self,
        schedule: Schedule,
        build_stage: Callable[[int], nn.Module],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        timeout: float = 300.0,
        mixed_precision: str | None = None,
    ) -> None:
        program = schedule.program
        if mixed_precision not in (None, "bfloat16"):
            raise fail(
                "usage",
                f"mixed_precision={quote(repr(mixed_precision))}: give 'bfloat16' (bf16 compute, "
                "fp32 master weights) or None",
            )
        self.mixed_precision = mixed_precision
        refused = refusal(program, "PipelineSchedule")
        if refused is not None:
            raise fail("usage", refused)
        if not dist.is_initialized():
            raise fail(
                "usage",
                "PipelineSchedule needs an initialised process group "
                "(torch.distributed.init_process_group, or torchrun)",
            )
        world = dist.get_world_size()
        if world % program.num_ranks:
            raise fail(
                "usage",
                f"`{program.name}` has {program.num_ranks} ranks, but the process "
                f"group has {world} processes (a multiple is needed)",
            )
        self.program = program
        self.copies_count = world // program.num_ranks
        self.replica, self.rank = divmod(dist.get_rank(), program.num_ranks)
        self.loss_fn = loss_fn
        self.model_name = "PipelineSchedule of " + _named(build_stage)
        """What a checkpoint's `pipelang.json` says it was saved from."""
        self.boundaries: dict[int, Boundary] = {}
        """What stage s hands on where it is more than one tensor: how it is packed."""
        split, recomputes = Kind.W in program.kinds, Kind.R in program.kinds
        settings = Settings(
            self._loss,
            split,
            recomputes,
            whole_backwards(program.ranks[self.rank]) if split else frozenset(),
            # each forward's saved tensors, so that B releases all but what W reads
            Stash() if split and not recomputes else None,
        )
        self.stages: dict[tuple[int, str], nn.Module] = {
            (s, p): build_stage(s) for s, p in program.stage_copies(self.rank)
        }
        """The caller's module of each stage copy this rank holds, by (stage, pipeline)."""
        self.copies = {key: self._stage(*key, m, settings) for key, m in self.stages.items()}
        """The same as stage copies that run the ops (backends/stage.py)."""
        self.device = next(
            (t.device for m in self.stages.values() for t in m.parameters()), torch.device("cpu")
        )
        self.transport = DistTransport(
            program, self.rank, self.device, timeout, self.replica, self.copies_count
        )
        self._make_replicas_equal(timeout)
        if mixed_precision is not None:
            for copy in self.copies.values():
                copy.masters = master_weights(copy.params)
        self.announced: set[tuple[str, int, int]] = set()
        self.shapes: dict[tuple[str, int, int], tuple[tuple[int, ...], torch.dtype]] = {}

    def _stage(self, stage: int, pipeline: str, module: nn.Module, settings: Settings) -> Stage:
        """The user's module of `stage` as a stage copy (backends/stage.py), whose input
        and output cross boundaries packed (`_Packing`); the optimizer is the caller's."""
        last = stage == self.program.num_stages - 1
        packing = _Packing(module, stage, last, self.boundaries)
        trained = [p for p in module.parameters() if p.requires_grad]
        if self.mixed_precision is not None:  # bf16 compute; masters once replicas agree
            module.to(torch.bfloat16)
        return Stage(stage, pipeline, range(0), packing, stage == 0, last, trained, None, settings)

    def parameters(self) -> Iterator[nn.Parameter]:
        """The parameters of every stage copy this rank holds, for its optimizer; with
        `mixed_precision`, their fp32 masters, which the next `step` rounds into the bf16
        parameters the stages compute with (backends/precision.py)."""
        for (stage, pipeline), module in self.stages.items():
            masters = self.copies[(stage, pipeline)].masters
            yield from module.parameters() if masters is None else masters

    def optimizer(
        self,
        kind: str = "adamw",
        lr: float | LrSchedule = 3e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float | None = None,
        decay_all: bool = False,
        momentum: float = SGD_MOMENTUM,
    ) -> PipelineOptimizer:
        """`pipelang run --optimizer KIND`'s optimizer on every stage copy of this rank
        (`sgd` with `momentum`, `adam`, or `adamw` with `weight_decay`, default 0.1, on
        matrices and embeddings unless `decay_all`), its rate of each step from `lr` (a
        number, or an `LrSchedule`); the updates are `run`'s bit for bit, and `save` and
        `load` keep its state (pipelang/torch_state.py)."""
        return make_optimizer(self, kind, lr, betas, eps, weight_decay, decay_all, momentum)

    def save(
        self,
        directory: str | os.PathLike[str],
        step: int | None = None,
        optimizer: PipelineOptimizer | None = None,
    ) -> Path:
        """Write `directory/step-K` (K: `step`, or the steps `optimizer` has taken) as
        `pipelang run --save directory` does: the parameters, and the optimizer's state
        when given; a collective, so every process calls it. Returns the path."""
        return save(self, directory, step, optimizer)

    def load(self, path: str | os.PathLike[str], optimizer: PipelineOptimizer | None = None) -> int:
        """Set the parameters (and `optimizer`'s state and step count, when given) from
        checkpoint `path`, a `step-K` directory or the latest complete one under `path`,
        written by `save` or by `pipelang run --save`; a collective. Returns its step."""
        return load(self, path, optimizer)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """After `step`: scale every gradient of every process so that their global norm
        is at most `max_norm`, as `torch.nn.utils.clip_grad_norm_` does on one model;
        returns the norm before clipping. Each stage counts once however many copies
        hold it (replicas and data-parallel copies hold the same sums after `step`), so
        every process must call it."""
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        counted: set[int] = set()
        for copy in self.copies.values():
            holders = self.program.replicas(copy.stage)
            if self.replica == 0 and min(holders) == self.rank and copy.stage not in counted:
                counted.add(copy.stage)
                for param in copy.trained:
                    if param.grad is not None:
                        total += param.grad.detach().float().square().sum()
        with settled(total):
            dist.all_reduce(total)
        coefficient = clip_coefficient(total, max_norm)
        with torch.no_grad():
            for copy in self.copies.values():
                for param in copy.trained:
                    if param.grad is not None:
                        param.grad.mul_(coefficient.to(param.grad.dtype))
        return total.sqrt()

    def _make_replicas_equal(self, timeout: float) -> None:
        """Every copy of a stage takes the parameters of the first process holding one
        (every process joins every group's creation, in the same order)."""
        me = dist.get_rank()
        for stage in range(self.program.num_stages):
            ranks = reduce_ranks(self.program, stage, self.copies_count)
            if len(ranks) < 2:
                continue
            group, _ = self.transport.reduce_groups.get(stage, (None, []))
            copies = [m for (s, _), m in self.stages.items() if s == stage]
            if me in ranks and group is not None and copies:
                for param in copies[0].parameters():
                    data = param.data
                    with settled(data):
                        dist.broadcast(data, src=ranks[0], group=group)
                for other in copies[1:]:
                    for a, b in zip(other.parameters(), copies[0].parameters(), strict=True):
                        a.data.copy_(b.data)

    # ---- one step --------------------------------------------------------------------------

    def step(self, x: object, target: object) -> torch.Tensor | None:
        """Forward and backward of the whole batch `x` (split along dim 0 into the
        schedule's micro-batches; a tensor, or a tuple, list or dict of tensors, as is
        `target`); afterwards every parameter's `.grad` holds its share of the gradient
        of the mean loss. Returns the mean loss of the micro-batches whose last stage ran
        on this rank, or None if none did."""
        n = self.program.num_microbatches
        for copy in self.copies.values():
            copy.finish_update()  # mixed precision: the masters' values into the bf16 copies
        if self.mixed_precision is not None:
            x = pytree.tree_map(_bf16, x)
        self.inputs = _micro_batches(x, n, "the batch")
        self.targets = _micro_batches(target, n, "the target")
        self.scale = 1.0 / (n * self.copies_count)
        self.values: dict[deps.Key, torch.Tensor] = {}
        self.losses: list[torch.Tensor] = []
        self.reducing: list[tuple[Stage, torch.Tensor, list[torch.Tensor], Handle]] = []
        for action in self.program.ranks[self.rank]:
            self._run(action)
        self.transport.end_step()
        return torch.stack(self.losses).mean() if self.losses else None

    def _run(self, a: Action) -> None:
        handler = _HANDLERS.get(a.kind)
        if handler is not None:
            handler(self, a)

    def _signal(self, a: Action) -> None:
        if a.peer is not None:
            self.transport.send(torch.ones(1, device=self.device), a.peer)

    def _wait(self, a: Action) -> None:
        if a.peer is not None:
            self.transport.recv((1,), torch.float32, a.peer)

    def _allreduce_action(self, a: Action) -> None:
        if a.stage is not None:
            self._allreduce(a.stage)

    def _loss(self, mb: int, y: Any, record: bool, chunk: int | None) -> torch.Tensor:
        """The last stage's loss of micro-batch `mb` (`Settings.loss`), scaled by
        1/(N * copies); recorded once (not again by a recompute)."""
        if self.mixed_precision is not None:  # the loss in fp32, as `pipelang run`'s
            y = pytree.tree_map(_fp32, y)
        loss = self.loss_fn(y, self.targets[mb])
        if record:
            self.losses.append(loss.detach())
        return loss * self.scale

    def _forward(self, a: Action) -> None:
        mb, stage, pipe = _where(a)
        if stage == 0:
            x = self.inputs[mb]
        else:
            x = (
                self.values.pop(deps.forward_input(mb, stage, pipe, None))
                .detach()
                .requires_grad_(True)
            )
        y = self.copies[(stage, pipe)].forward(mb, x)
        if stage < self.program.num_stages - 1:
            self.values[(Kind.F, mb, stage, pipe, None)] = y.detach()

    def _recompute(self, a: Action) -> None:
        mb, stage, pipe = _where(a)
        self.copies[(stage, pipe)].recompute(mb)

    def _backward(self, a: Action) -> None:
        mb, stage, pipe = _where(a)
        copy = self.copies[(stage, pipe)]
        y = copy.saved[copy.key(mb)].y
        if y is not None and not y.requires_grad:
            what = "loss" if copy.last else "output (no tensor of it requires a gradient)"
            raise fail(
                "usage",
                f"stage {stage}'s {what} for micro-batch {mb} has no gradient to go back by",
            )
        dy = None if copy.last else self.values.pop(deps.gradient_input(mb, stage, pipe, None))
        dx = copy.backward(mb, dy)
        if dx is not None:
            self.values[(Kind.B, mb, stage, pipe, None)] = dx

    def _weight_grad(self, a: Action) -> None:
        mb, stage, pipe = _where(a)
        self.copies[(stage, pipe)].weight_grad(mb)

    # ---- messages: the first of each kind and stage on a channel announces its shape --------

    def _send(self, a: Action) -> None:
        mb, stage, pipe = _where(a)
        assert a.of is not None and a.peer is not None
        tensor = self.values.pop((a.of, mb, stage, pipe, None))
        channel = (a.of.value, stage, a.peer)
        if channel not in self.announced:
            packed = self.boundaries.get(stage) if a.of is Kind.F else None
            if packed is None:
                header = [tensor.dim(), _DTYPES.index(tensor.dtype), *tensor.shape]
            else:
                text = _boundary_text(packed)
                header = [PACKED, len(text)]
            header += [0] * (HEADER - len(header))
            self.transport.send(torch.tensor(header, dtype=torch.int64, device=self.device), a.peer)
            if packed is not None:
                data = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(self.device)
                self.transport.send(data, a.peer)
            self.announced.add(channel)
        self.transport.send(tensor, a.peer)

    def _recv(self, a: Action) -> None:
        mb, stage, pipe = _where(a)
        assert a.of is not None and a.peer is not None
        channel = (a.of.value, stage, a.peer)
        if channel not in self.shapes:
            header = self.transport.recv((HEADER,), torch.int64, a.peer).tolist()
            if header[0] == PACKED:  # several tensors, packed: how, then the flat size
                data = self.transport.recv((header[1],), torch.uint8, a.peer)
                packed = self.boundaries[stage] = _boundary_of_text(bytes(data.cpu().tolist()))
                size = sum(math.prod(shape) for shape, _ in packed.leaves)
                self.shapes[channel] = ((size,), packed.dtype)
            else:
                self.shapes[channel] = (tuple(header[2 : 2 + header[0]]), _DTYPES[header[1]])
        shape, dtype = self.shapes[channel]
        self.values[(a.of, mb, stage, pipe, None)] = self.transport.recv(shape, dtype, a.peer)

    # ---- replicas --------------------------------------------------------------------------

    def _allreduce(self, stage: int) -> None:
        if len(reduce_ranks(self.program, stage, self.copies_count)) < 2:
            return
        copy = next(c for (s, _), c in self.copies.items() if s == stage)
        flat, grads = copy.flat_gradients()  # a frozen parameter's gradient is not summed
        # the work stays in `reducing` until the next step; torch's worker thread lets go
        # of it a moment after `wait`, so that thread is not the one to free the sum
        # (transport.let_go says why that matters at exit)
        self.reducing.append((copy, flat, grads, self.transport.allreduce(stage, flat)))

    def _finish(self) -> None:
        """At `step`: stages with no allreduce of their own (no replica in the schedule,
        but `--dp`-style copies) are summed now; then every sum is written back."""
        reduced = {id(c) for c, *_ in self.reducing}
        for (stage, _), copy in self.copies.items():
            if id(copy) not in reduced:
                self._allreduce(stage)
        # in stage order on every process: a sum over more than two copies runs here
        for copy, flat, grads, handle in sorted(self.reducing, key=lambda r: r[0].stage):
            handle.wait()
            copy.set_gradients(flat, grads)


class _Packing(nn.Module):
    """A user's stage as `Stage` runs it: the input unpacked where the stage before hands
    on several tensors, the output packed into one where this one does (not on the last
    stage, whose output goes to the loss)."""

    def __init__(
        self, stage: nn.Module, index: int, last: bool, boundaries: dict[int, Boundary]
    ) -> None:
        super().__init__()
        self.stage = stage
        self.index = index
        self.last = last
        self.boundaries = boundaries

    def forward(self, x: torch.Tensor) -> Any:
        takes = self.boundaries.get(self.index - 1) if self.index > 0 else None
        y = self.stage(x if takes is None else takes.unpack(x))
        return y if self.last else self._packed(y)

    def _packed(self, y: object) -> torch.Tensor:
        """`y` as it crosses to the next stage: a tensor as it is, several packed into
        one (each micro-batch's of the structure and shapes the first had)."""
        if isinstance(y, torch.Tensor) and y.is_floating_point():
            return y  # an integer tensor crosses as floats, as `run` sends it (Boundary)
        try:
            found = Boundary.of(y, f"stage {self.index}")
        except ModelError as err:
            raise fail("usage", clip(str(err))) from None
        known = self.boundaries.setdefault(self.index, found)
        if found != known:
            raise fail(
                "usage",
                f"stage {self.index} hands on {_described(found)}, but before it handed on "
                f"{_described(known)}: every micro-batch's must have one structure and shape",
            )
        return known.pack(y)


def _named(function: object) -> str:
    """`module:qualname` of a function, as far as it tells."""
    module = getattr(function, "__module__", None) or "?"
    name = getattr(function, "__qualname__", None) or type(function).__name__
    return clip(f"{module}:{name}")


def _bf16(value: object) -> object:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.to(torch.bfloat16)
    return value


def _fp32(value: object) -> object:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float()
    return value


def _micro_batches(value: object, n: int, what: str) -> list[Any]:
    """`value` (a tensor, or a tuple, list or dict of them) split along dim 0 into `n`
    equal micro-batches of its structure."""
    leaves, tree = pytree.tree_flatten(value)
    if not leaves or not all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in leaves):
        kinds = sorted({type(t).__name__ for t in leaves}) or ["nothing"]
        raise fail(
            "usage",
            f"{what} holds {', '.join(kinds)}: give a tensor (or a tuple, list or dict of "
            "tensors) of at least one dimension, split along dim 0",
        )
    sizes = sorted({len(t) for t in leaves})
    if len(sizes) > 1 or sizes[0] % n or sizes[0] < n:
        size = " and ".join(map(str, sizes))
        raise fail("usage", f"a batch of {size} does not split into {n} equal micro-batches")
    parts = [t.chunk(n) for t in leaves]
    return [pytree.tree_unflatten([p[i] for p in parts], tree) for i in range(n)]


def _boundary_text(boundary: Boundary) -> bytes:
    """A Boundary as the bytes that announce it on a channel (`_boundary_of_text`)."""
    leaves = [[list(shape), str(dtype).removeprefix("torch.")] for shape, dtype in boundary.leaves]
    doc = {"tree": pytree.treespec_dumps(boundary.tree), "leaves": leaves}
    return json.dumps(doc).encode()


def _boundary_of_text(text: bytes) -> Boundary:
    doc = json.loads(text)
    leaves = tuple((tuple(shape), getattr(torch, dtype)) for shape, dtype in doc["leaves"])
    return Boundary(pytree.treespec_loads(doc["tree"]), leaves)


def _described(boundary: Boundary) -> str:
    shapes = ", ".join(f"{list(shape)} {str(dtype)[6:]}" for shape, dtype in boundary.leaves)
    return f"{len(boundary.leaves)} tensors ({shapes})"


def _where(a: Action) -> tuple[int, int, str]:
    """(micro-batch, stage, pipeline) of an action about a compute op."""
    assert a.mb is not None and a.stage is not None and a.pipeline is not None
    return a.mb, a.stage, a.pipeline


_HANDLERS: dict[Kind, Callable[[PipelineSchedule, Action], None]] = {
    Kind.F: PipelineSchedule._forward,
    Kind.R: PipelineSchedule._recompute,
    Kind.B: PipelineSchedule._backward,
    Kind.W: PipelineSchedule._weight_grad,
    Kind.SEND: PipelineSchedule._send,
    Kind.RECV: PipelineSchedule._recv,
    Kind.SIGNAL: PipelineSchedule._signal,
    Kind.WAIT: PipelineSchedule._wait,
    Kind.ALLREDUCE: PipelineSchedule._allreduce_action,
    Kind.STEP: lambda self, a: self._finish(),
}
