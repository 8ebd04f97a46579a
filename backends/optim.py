"""SGD with momentum and Adam, per parameter, as torch.optim's single-tensor code computes them.

Our own because constructing a torch.optim optimizer imports torch._dynamo, seconds of
start-up in every rank process; the update formulas are torch's (`foreach=False`,
no weight decay), and tests/test_runtime.py checks them against torch.optim. An update
depends only on its own parameter, so a stage copy's optimizer and the `--check`
reference's whole-model optimizer give the same result for the same gradient.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

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
    """`torch.optim.Adam(params, lr, betas, eps)`, bias-corrected, no weight decay."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        self.params = list(params)
        self.lr = lr
        self.beta1, self.beta2 = betas
        self.eps = eps
        self.steps = 0
        self.exp_avg = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]

    def step(self) -> None:
        """Update every parameter from its `.grad`."""
        self.apply(self.params, [p.grad for p in self.params])

    @torch.no_grad()
    def apply(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]) -> None:
        """Update `params` in place from `grads` (see `SGD.apply`); one Adam step."""
        self.steps += 1
        correction1 = 1 - self.beta1**self.steps
        correction2_sqrt = math.sqrt(1 - self.beta2**self.steps)
        step_size = self.lr / correction1
        moments = zip(params, grads, self.exp_avg, self.exp_avg_sq, strict=True)
        for param, grad, avg, avg_sq in moments:
            if grad is None:
                continue
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
    ) -> None:
        super().__init__(params, lr, betas, eps)
        device = self.params[0].device if self.params else torch.device("cpu")
        self.step_count = torch.zeros((), dtype=torch.float32, device=device)

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
        step_size_neg = (self.lr / correction1).neg()
        moments = zip(params, grads, self.exp_avg, self.exp_avg_sq, strict=True)
        for param, grad, avg, avg_sq in moments:
            if grad is None:
                continue
            avg.lerp_(grad, 1 - self.beta1)
            avg_sq.mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
            denom = (avg_sq.sqrt() / (correction2_sqrt * step_size_neg)).add_(
                self.eps / step_size_neg
            )
            param.addcdiv_(avg, denom)


Optimizer = SGD | Adam
"""Either optimizer; the capturable ones are subclasses."""
