"""SGD with momentum, Adam and AdamW, per parameter, as torch.optim's single-tensor code
computes them, and the learning-rate schedule.

Our own because constructing a torch.optim optimizer imports torch._dynamo, seconds of
start-up in every rank process; the update formulas are torch's (`foreach=False`; AdamW's
decay decoupled, `param *= 1 - lr * weight_decay` before the moments), and
tests/test_optim.py checks them against torch.optim bit for bit. An update depends only on
its own parameter, so a stage copy's optimizer and the `--check` reference's whole-model
optimizer give the same result for the same gradient. Which parameters decay is a rule
on each alone (`decays`). The learning rate of each step is a function of the step
(`LrSchedule`), set before the step (`set_lr`), so a resumed run goes on with the rate it
would have had.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


class SGD:
    """`torch.optim.SGD(params, lr, momentum)`: buf = momentum * buf + g; p -= lr * buf."""

    def __init__(self, params: Sequence[nn.Parameter], lr: float, momentum: float) -> None:
        self.params = list(params)
        self.lr = lr
        self.momentum = momentum
        self.buffers: list[torch.Tensor | None] = [None] * len(self.params)

    def step(self) -> None:
        """Update every parameter from its `.grad`."""
        self.apply(self.params, [p.grad for p in self.params])

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next steps."""
        self.lr = lr

    @torch.no_grad()
    def apply(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
        """Update `params` in place from `grads`, with the state of `self.params` (the i-th
        tensor is the i-th parameter, possibly a newer version of it); None skips one."""
        for i, (param, grad) in enumerate(zip(params, grads, strict=True)):
            if grad is None:
                continue
            if self.momentum:
                buffer = self.buffers[i]
                if buffer is None:
                    buffer = self.buffers[i] = grad.detach().clone()
                else:
                    buffer.mul_(self.momentum).add_(grad)
                grad = buffer
            param.add_(grad, alpha=-self.lr)

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None

    def state(self, i: int) -> dict[str, torch.Tensor]:
        """Parameter `i`'s optimizer state by field (a checkpoint's entries)."""
        buffer = self.buffers[i]
        return {"momentum": buffer} if buffer is not None else {}

    @torch.no_grad()
    def load_state(self, i: int, state: dict[str, torch.Tensor]) -> None:
        """Set parameter `i`'s state from `state` (as `state` gave it), in place where
        the tensor exists (a captured graph keeps its address)."""
        if "momentum" not in state:
            return
        buffer = self.buffers[i]
        if buffer is None:
            self.buffers[i] = state["momentum"].to(self.params[i]).clone()
        else:
            buffer.copy_(state["momentum"])


class Adam:
    """`torch.optim.Adam(params, lr, betas, eps)`, bias-corrected; with `weight_decay`,
    `torch.optim.AdamW` for the parameters `decay` marks (decoupled: the weight shrinks
    by lr x weight_decay before the moments' step)."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decay: Sequence[bool] | None = None,
    ) -> None:
        self.params = list(params)
        self.lr = lr
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.weight_decay = weight_decay
        self.decay = list(decay) if decay is not None else [True] * len(self.params)
        self.steps = 0
        self.exp_avg = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]

    def step(self) -> None:
        """Update every parameter from its `.grad`."""
        self.apply(self.params, [p.grad for p in self.params])

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next steps."""
        self.lr = lr

    @torch.no_grad()
    def apply(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
        """Update `params` in place from `grads` (see `SGD.apply`); one Adam step."""
        self.steps += 1
        correction1 = 1 - self.beta1**self.steps
        correction2_sqrt = math.sqrt(1 - self.beta2**self.steps)
        step_size = self.lr / correction1
        moments = zip(params, grads, self.exp_avg, self.exp_avg_sq, self.decay, strict=True)
        for param, grad, avg, avg_sq, decays in moments:
            if grad is None:
                continue
            if self.weight_decay and decays:
                param.mul_(1 - self.lr * self.weight_decay)
            avg.lerp_(grad, 1 - self.beta1)
            avg_sq.mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
            denom = (avg_sq.sqrt() / correction2_sqrt).add_(self.eps)
            param.addcdiv_(avg, denom, value=-step_size)

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None

    def state(self, i: int) -> dict[str, torch.Tensor]:
        """Parameter `i`'s optimizer state by field; the step count as a 0-d float32
        tensor, the same in every entry (torch.optim.Adam keeps one per parameter too)."""
        return {
            "step": torch.tensor(float(self.steps)),
            "exp_avg": self.exp_avg[i],
            "exp_avg_sq": self.exp_avg_sq[i],
        }

    @torch.no_grad()
    def load_state(self, i: int, state: dict[str, torch.Tensor]) -> None:
        """Set parameter `i`'s state from `state`, the moments in place."""
        self.exp_avg[i].copy_(state["exp_avg"])
        self.exp_avg_sq[i].copy_(state["exp_avg_sq"])
        self._set_steps(state["step"])

    def _set_steps(self, step: torch.Tensor) -> None:
        self.steps = int(step)


class CapturableSGD(SGD):
    """`SGD` that a CUDA graph can capture: the momentum buffers exist (zeros) from the
    start, so the first step takes no host branch (0 * momentum + g is g, bit for bit,
    so the updates equal torch.optim.SGD's)."""

    def __init__(self, params: Sequence[nn.Parameter], lr: float, momentum: float) -> None:
        super().__init__(params, lr, momentum)
        self.buffers = [torch.zeros_like(p) for p in self.params] if momentum else self.buffers
        self.lr_tensor = _lr_tensor(self.params, lr)

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next steps, written into the tensor a graph reads."""
        self.lr = lr
        self.lr_tensor.fill_(lr)

    @torch.no_grad()
    def apply(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
        """`SGD.apply` with the rate as a tensor (`param - grad * lr`, torch's formula
        for a tensor rate)."""
        for i, (param, grad) in enumerate(zip(params, grads, strict=True)):
            if grad is None:
                continue
            if self.momentum:
                buffer = self.buffers[i]
                assert buffer is not None
                buffer.mul_(self.momentum).add_(grad)
                grad = buffer
            param.addcmul_(grad, self.lr_tensor, value=-1)


class CapturableAdam(Adam):
    """`torch.optim.Adam(..., capturable=True)`: the step count is a tensor on the
    parameters' device and the bias corrections are tensor ops, so a step reads nothing
    back to the host and a CUDA graph can replay it. Its formula is torch's capturable
    one (tests/test_optim.py checks it bit for bit over 10 steps)."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decay: Sequence[bool] | None = None,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, decay)
        device = self.params[0].device if self.params else torch.device("cpu")
        self.step_count = torch.zeros((), dtype=torch.float32, device=device)
        self.lr_tensor = _lr_tensor(self.params, lr)

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next steps, written into the tensor a graph reads."""
        self.lr = lr
        self.lr_tensor.fill_(lr)

    def state(self, i: int) -> dict[str, torch.Tensor]:
        return {**super().state(i), "step": self.step_count}

    def _set_steps(self, step: torch.Tensor) -> None:
        self.step_count.copy_(step)

    @torch.no_grad()
    def apply(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
        """One Adam step of `params` from `grads` (see `SGD.apply`), on the device."""
        self.step_count += 1
        correction1 = 1 - self.beta1**self.step_count
        correction2_sqrt = (1 - self.beta2**self.step_count).sqrt()
        step_size_neg = (self.lr_tensor / correction1).neg()
        moments = zip(params, grads, self.exp_avg, self.exp_avg_sq, self.decay, strict=True)
        for param, grad, avg, avg_sq, decays in moments:
            if grad is None:
                continue
            if self.weight_decay and decays:
                param.mul_(1 - self.lr_tensor * self.weight_decay)
            avg.lerp_(grad, 1 - self.beta1)
            avg_sq.mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
            denom = (avg_sq.sqrt() / (correction2_sqrt * step_size_neg)).add_(
                self.eps / step_size_neg
            )
            param.addcdiv_(avg, denom)


Optimizer = SGD | Adam
"""Either optimizer (AdamW is Adam with a weight decay); the capturable ones are
subclasses."""


def _lr_tensor(params: Sequence[torch.Tensor], lr: float) -> torch.Tensor:
    """The learning rate as a 0-d float32 tensor on the parameters' device: a captured
    step reads it, and `set_lr` rewrites it between replays."""
    device = params[0].device if params else torch.device("cpu")
    return torch.tensor(lr, dtype=torch.float32, device=device)


def decays(param: torch.Tensor) -> bool:
    """Whether AdamW's weight decay applies to `param` by default: matrices and
    embeddings (two dimensions or more), not biases and norms' gains (one), as nanoGPT
    and torchtitan do."""
    return param.dim() >= 2


@dataclass(frozen=True, slots=True)
class LrSchedule:
    """The learning rate of each step: `warmup` steps rising linearly to `peak`, then
    constant, or a cosine or linear decay to `floor` at step `steps` (the run's
    `--steps`, counted from 0 as checkpoints count them)."""

    peak: float
    kind: str = "constant"
    warmup: int = 0
    floor: float = 0.0
    steps: int = 1

    def lr(self, step: int) -> float:
        """The rate of step `step` (0 first)."""
        if step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        if self.kind == "constant":
            return self.peak
        done = min(1.0, (step - self.warmup) / max(1, self.steps - 1 - self.warmup))
        if self.kind == "cosine":
            return self.floor + 0.5 * (self.peak - self.floor) * (1 + math.cos(math.pi * done))
        return self.peak - (self.peak - self.floor) * done
