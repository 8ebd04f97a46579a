"""What every part of a rank's runtime shares: the name of a value in flight (`Value`), a
rank's report (`RankResult`), an injected fault (`Fault`), the optimizer of a stage
copy, and the decorators that count, time and guard each action. A stage copy itself is
backends/stage.py."""

from __future__ import annotations

import functools
import hashlib
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from torch import nn

from pipelang.backends.config import DEFAULT_WEIGHT_DECAY, SGD_MOMENTUM, RunConfig
from pipelang.backends.optim import (
    SGD,
    Adam,
    CapturableAdam,
    CapturableSGD,
    Optimizer,
    decays,
)
from pipelang.backends.transport import peer_failures
from pipelang.diagnostics import InternalError

if TYPE_CHECKING:
    from pipelang.backends.runtime import RankRuntime
    from pipelang.ir import deps


def make_optimizer(params: Sequence[nn.Parameter], config: RunConfig) -> Optimizer:
    """The optimizer of one stage copy, and of the `--check` reference: same settings
    (under `--graphs`, the capturable ones, which equal torch's `capturable=True`)."""
    lr = config.lr_schedule_at().lr(config.first_step)
    if config.optimizer == "sgd":
        sgd = CapturableSGD if config.graphs else SGD
        return sgd(params, lr, SGD_MOMENTUM)
    if config.optimizer in ("adam", "adamw"):
        adam = CapturableAdam if config.graphs else Adam
        betas = config.betas or (0.9, 0.999)
        eps = config.eps if config.eps is not None else 1e-8
        if config.optimizer == "adam":
            return adam(params, lr, betas, eps)
        decay = [config.decay_all or decays(p) for p in params]
        weight_decay = config.weight_decay
        if weight_decay is None:
            weight_decay = DEFAULT_WEIGHT_DECAY
        return adam(params, lr, betas, eps, weight_decay, decay)
    raise InternalError(f"unknown optimizer {config.optimizer!r}")


Value = tuple[str, int, int, str, int | None]
"""A value in flight between actions: (kind of the op that made it, micro-batch, stage,
pipeline, chunk), `("F", 3, 1, "main", None)` is the output of F3@1/main."""


def value_of(key: deps.Key) -> Value:
    """The runtime's name for an op's result: its key (`ir.deps`) with the kind's letter."""
    kind, mb, stage, pipeline, chunk = key
    return cast(Value, (kind.value, mb, stage, pipeline, chunk))


def fingerprint(params: Iterable[torch.Tensor]) -> int:
    """A 64-bit hash of the parameters' bytes: equal fingerprints, equal bits (but for
    a collision). Each tensor is hashed where it lies, no copy of its bytes (a sharded
    copy's whole tensors come one at a time: `shard.full_params`)."""
    digest = hashlib.blake2b(digest_size=8)
    for param in params:
        data = param.detach().contiguous().view(-1).view(torch.uint8).cpu()
        digest.update(data.numpy().data)  # its memory, not a copy
        del param, data  # not held while the next tensor is gathered
    return int.from_bytes(digest.digest(), "little")


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
    param_bytes: int = 0
    grad_bytes: int = 0
    optimizer_bytes: int = 0
    """The bytes of its parameters, gradients (the most at an optimizer step) and
    optimizer state (`RankRuntime.held_bytes`, backends/metrics.py)."""
    peak_activation_bytes: int = 0
    """The most bytes of saved activations resident at once, held-for-partner buffers
    included (backends/stash.py); counted with evictions or `count_activations`."""
    copy_weights: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Final parameters of every copy (with `--check`), named as in the whole model."""
    stopped_after: int | None = None
    """The step after which SIGTERM stopped the run (backends/termination.py); None when
    every step ran."""
    fingerprints: list[list[int]] = field(default_factory=list)
    """Per step, a fingerprint of every copy's parameters after it (with `--check`; in
    the order of `copies`): where a check fails, the first step that differs."""
    peak_weight_versions: int = 0
    """The most weight versions in memory at once over this rank's copies (counted in
    asynchronous schedules only; compare `pipelang simulate`'s peak_weight_versions)."""
    slot_bytes: int = 0
    """The bytes of this rank's data slots: a stream program's static buffers (what
    `pipelang simulate --model` plans); 0 for an action list."""
    tp: int = 1
    """The run's tensor ranks per program rank (`--tp`): `rank` runs program rank
    `rank // tp % R` (backends/mesh.py)."""

    @property
    def held_bytes(self) -> tuple[int, int, int]:
        """(parameter, gradient, optimizer) bytes, the summary's columns."""
        return self.param_bytes, self.grad_bytes, self.optimizer_bytes


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
        with peer_failures(kwargs.get("to", kwargs.get("src"))):
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
