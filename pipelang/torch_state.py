"""A `PipelineSchedule`'s optimizer and checkpoints: `pipelang run`'s, in the user's loop.

`sched.optimizer(kind, lr=...)` gives every stage copy of the rank the optimizer
`pipelang run --optimizer kind` gives it (backends/optim.py: torch's single-tensor
arithmetic, AdamW decaying matrices and embeddings only, the rate of each step from an
`LrSchedule`), so a loop of the user's own updates the weights bit for bit as `run` does.

`sched.save(DIR)` writes `DIR/step-K` as `pipelang run --save DIR` does
(backends/checkpoint.py `commit`: one DCP directory, `pipelang.json` written last), its
entries named as `run` names a user model that returns a list of stage modules: stage s
is layer s, `model.{s}.{name}` and `optim.{s}.{name}.{field}`, `name` as the user's
module names the parameter. So `pipelang run --model FILE.py:FUNC --resume DIR` goes on
from it where FUNC returns the same stage modules, and `sched.load(DIR)` from a `run
--save DIR` checkpoint. Loading reads the checkpoint as `--resume` does
(backends/checkpoint_read.py: nothing unpickled but DCP's metadata classes, every file
checked against it first), and every process checks its entries before the collective
read; when one finds a problem, every process raises the same PipelangError (`_agree`),
so none waits in a collective for a peer that has stopped.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from pipelang.backends import checkpoint
from pipelang.backends.checkpoint_dirs import find, mark, may_overwrite
from pipelang.backends.checkpoint_read import INFO, CheckpointError, read_info
from pipelang.backends.config import DEFAULT_WEIGHT_DECAY
from pipelang.backends.optim import SGD, Adam, LrSchedule, decays
from pipelang.backends.transport import settled
from pipelang.diagnostics import fail, quote

if TYPE_CHECKING:
    from pipelang.backends.optim import Optimizer
    from pipelang.torch import PipelineSchedule

KINDS = ("sgd", "adam", "adamw")


class PipelineOptimizer:
    """The optimizer of every stage copy of one rank of a `PipelineSchedule`, as `pipelang
    run --optimizer KIND` makes it (`PipelineSchedule.optimizer`). `step()` updates each
    copy from its gradients at the rate `lr` (the schedule's rate of step `steps`) and
    counts the step; `zero_grad()` clears the gradients."""

    def __init__(
        self,
        owner: PipelineSchedule,
        kind: str,
        schedule: LrSchedule,
        parts: dict[tuple[int, str], Optimizer],
    ) -> None:
        self.owner = owner
        self.kind = kind
        self.schedule = schedule
        """The learning rate of each step."""
        self.parts = parts
        """Each stage copy's optimizer, by (stage, pipeline)."""
        self.steps = 0
        """Steps taken: a checkpoint's step (`load` sets it)."""

    @property
    def lr(self) -> float:
        """The learning rate of the next step."""
        return self.schedule.lr(self.steps)

    def step(self) -> None:
        """Update every stage copy from its gradients (summed by the schedule's `step`,
        clipped by `clip_grad_norm_` if the loop clips) at this step's rate."""
        lr = self.lr
        for part in self.parts.values():
            part.set_lr(lr)
            part.step()
        self.steps += 1

    def zero_grad(self) -> None:
        for part in self.parts.values():
            part.zero_grad()


def make_optimizer(
    sched: PipelineSchedule,
    kind: object,
    lr: object,
    betas: object,
    eps: object,
    weight_decay: object,
    decay_all: object,
    momentum: object,
) -> PipelineOptimizer:
    """`PipelineSchedule.optimizer`: each argument checked, PipelangError naming the
    first one that is wrong."""
    if kind not in KINDS:
        raise fail("usage", f"optimizer {quote(repr(kind))}: give one of {', '.join(KINDS)}")
    schedule = lr if isinstance(lr, LrSchedule) else LrSchedule(_number("lr", lr, above=0))
    _number("lr", schedule.peak, above=0)
    pair = tuple(betas) if isinstance(betas, tuple | list) else None
    if pair is None or len(pair) != 2:
        raise fail("usage", f"betas={quote(repr(betas))}: give two numbers in [0, 1)")
    beta1, beta2 = (_number(f"betas[{i}]", b, least=0, below=1) for i, b in enumerate(pair))
    eps_ = _number("eps", eps, above=0)
    decay = (
        DEFAULT_WEIGHT_DECAY
        if weight_decay is None
        else _number("weight_decay", weight_decay, least=0)
    )
    momentum_ = _number("momentum", momentum, least=0, below=1)
    if not isinstance(decay_all, bool):
        raise fail("usage", f"decay_all={quote(repr(decay_all))}: give True or False")
    parts: dict[tuple[int, str], Optimizer] = {}
    for key, copy in sched.copies.items():
        params = copy.trained
        if kind == "sgd":
            parts[key] = SGD(params, schedule.peak, momentum_)
        elif kind == "adam":
            parts[key] = Adam(params, schedule.peak, (beta1, beta2), eps_)
        else:
            marks = [decay_all or decays(p) for p in params]
            parts[key] = Adam(params, schedule.peak, (beta1, beta2), eps_, decay, marks)
    return PipelineOptimizer(sched, str(kind), schedule, parts)


def _number(
    name: str,
    value: object,
    *,
    above: float | None = None,
    least: float | None = None,
    below: float | None = None,
) -> float:
    """`value` as a float, in range; PipelangError naming `name` if not."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    number = float(value) if ok else math.nan  # type: ignore[arg-type]
    if ok and above is not None:
        ok = number > above
    if ok and least is not None:
        ok = number >= least
    if ok and below is not None:
        ok = number < below
    if not ok:
        bounds = [
            f"above {above:g}" if above is not None else "",
            f"at least {least:g}" if least is not None else "",
            f"below {below:g}" if below is not None else "",
        ]
        words = " and ".join(b for b in bounds if b)
        raise fail("usage", f"{name}={quote(repr(value))}: give a finite number {words}")
    return number


# ---- checkpoints ---------------------------------------------------------------------------


def _held(sched: PipelineSchedule, optimizer: PipelineOptimizer | None) -> list[checkpoint.Held]:
    """Every stage copy's trained parameters (the fp32 masters under mixed precision)
    and optimizer, named as `run` names a user model's list of stage modules."""
    if optimizer is not None and optimizer.owner is not sched:
        raise fail("usage", "the optimizer was made by another PipelineSchedule's `optimizer()`")
    return [
        checkpoint.held_by_model(
            nn.Sequential(module),
            optimizer.parts[key] if optimizer is not None else None,
            key[0],
            sched.copies[key].masters,
        )
        for key, module in sched.stages.items()
    ]


def save(
    sched: PipelineSchedule,
    directory: object,
    step: object,
    optimizer: PipelineOptimizer | None,
) -> Path:
    """`PipelineSchedule.save`: write `directory/step-K`; its path."""
    root = _path("directory", directory)
    if step is None:
        if optimizer is None:
            raise fail("usage", "save: give the step (no optimizer of pipelang's counts them)")
        step = optimizer.steps
    if type(step) is not int or step < 1:
        raise fail("usage", f"save: step={quote(repr(step))}: give a positive whole number")
    held = _held(sched, optimizer)
    path = checkpoint.step_dir(str(root), step)
    problem = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        problem = _writable(path)
    _agree(problem, sched.device)
    info: dict[str, object] = {"step": step, "model": sched.model_name}
    info |= {"optimizer": optimizer.kind if optimizer is not None else "none (parameters only)"}
    info |= {"precision": _precision(sched), "schedule": sched.program.name}
    if optimizer is not None:
        info["lr_schedule"] = checkpoint.lr_words(optimizer.schedule)
    try:
        with torch.no_grad():
            checkpoint.commit(held, path, info)
    except CheckpointError as err:
        raise fail("usage", str(err)) from None
    except Exception as err:  # DCP's own, gathered from every process
        raise fail(
            "usage", f"`{path}` cannot be written: {checkpoint.first_failure(err)}"
        ) from None
    return path


def _writable(path: Path) -> str | None:
    """What keeps checkpoint `path` from being written (the first process asks, before
    the collective save), or None."""
    if os.path.lexists(path) and (path.is_symlink() or not path.is_dir()):
        return f"`{path}` is there and is not a directory: not written over"
    if not may_overwrite(path, None, ()):
        return f"`{path}` holds another run's checkpoint: not written over"
    try:
        (path / INFO).unlink(missing_ok=True)
        mark(path, None)
    except OSError as err:
        return f"`{path}` cannot be written: {err.strerror or type(err).__name__}"
    if not os.access(path, os.W_OK):
        return f"`{path}` cannot be written: permission denied"
    return None


def load(sched: PipelineSchedule, source: object, optimizer: PipelineOptimizer | None) -> int:
    """`PipelineSchedule.load`: every stage copy's parameters (and the optimizer's state)
    from a checkpoint; its step."""
    path = _path("path", source)
    held = _held(sched, optimizer)
    problem = None
    found, step, state = path, 0, {}
    try:
        found, step = find(str(path), f"`{path}`")
        info = read_info(found)
        saved = info.get("optimizer")
        if optimizer is not None and saved != optimizer.kind:
            raise CheckpointError(
                f"`{found}` was saved with the optimizer {saved}: it cannot resume "
                f"{optimizer.kind}'s state (load it with optimizer=None for the parameters alone)"
            )
        model = info.get("model")
        hint = f" (saved from {quote(model)})" if model is not None else ""
        state = checkpoint.wanted(held, str(found), f"`{found}`", hint)
    except CheckpointError as err:
        problem = str(err)
    _agree(problem, sched.device)
    try:
        checkpoint.read(held, str(found), state)
    except CheckpointError as err:
        raise fail("usage", str(err)) from None
    for copy in sched.copies.values():
        copy.finish_update()  # the masters' values into the bf16 weights
    if optimizer is not None:
        optimizer.steps = step
    return step


def _path(name: str, value: object) -> Path:
    if not isinstance(value, str | os.PathLike) or not str(value):
        raise fail("usage", f"{name}={quote(repr(value))}: give a directory's path")
    return Path(value)


def _precision(sched: PipelineSchedule) -> str:
    if sched.mixed_precision is not None:
        return f"--mixed-precision {sched.mixed_precision}: fp32 master weights"
    dtype = next((p.dtype for c in sched.copies.values() for p in c.trained), torch.float32)
    return f"--dtype {str(dtype).removeprefix('torch.')}"


def _agree(problem: str | None, device: torch.device) -> None:
    """Raise on every process, as one PipelangError, the problem of the lowest process
    that has one (a collective: every process calls it), so that no process goes on
    into a collective its peers have left."""
    if not dist.is_initialized():
        if problem is not None:
            raise fail("usage", problem)
        return
    me, world = dist.get_rank(), dist.get_world_size()
    who = torch.tensor([world if problem is None else me], dtype=torch.int64, device=device)
    with settled(who):  # torch's threads done with each tensor (transport.let_go)
        dist.all_reduce(who, op=dist.ReduceOp.MIN)
    teller = int(who.item())
    if teller == world:
        return
    data = problem.encode()[:4096] if problem is not None and me == teller else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    with settled(size):
        dist.broadcast(size, src=teller)
    text = torch.zeros(int(size.item()), dtype=torch.uint8, device=device)
    if me == teller:
        text = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    with settled(text):
        dist.broadcast(text, src=teller)
    raise fail("usage", bytes(text.cpu().tolist()).decode("utf-8", errors="replace"))


__all__ = ["PipelineOptimizer", "load", "make_optimizer", "save"]
