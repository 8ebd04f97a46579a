"""Mixed precision, `run --mixed-precision bfloat16`: bf16 compute, fp32 master weights.

A stage computes with bfloat16 parameters and activations (messages between ranks are
bf16). Each such parameter has an fp32 master copy, made from it once: the optimizer
updates the masters (its state is fp32 too) and each step ends by rounding them back
into the bf16 parameters. Gradients reach the masters as they accumulate: a hook on every
bf16 parameter adds its fresh gradient, in fp32, to its master's and clears its own, so
micro-batch gradients sum in fp32 (as Megatron's fp32 `main_grad` buffers do) and so do
the replicas' allreduces, clipping and checkpoints, which all see the masters.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["copy_back", "master_weights"]


def master_weights(params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
    """fp32 masters of `params`, collecting their gradients from now on."""
    masters = []
    for param in params:
        master = nn.Parameter(param.detach().float().clone())
        param.register_post_accumulate_grad_hook(functools.partial(_collect, master))
        masters.append(master)
    return masters


def _collect(master: nn.Parameter, param: torch.Tensor) -> None:
    """Move `param`'s accumulated gradient into `master`'s, in fp32."""
    grad = param.grad
    assert grad is not None
    if master.grad is None:
        master.grad = grad.float()
    else:
        master.grad.add_(grad)
    param.grad = None


@torch.no_grad()
def copy_back(params: Sequence[nn.Parameter], masters: Sequence[nn.Parameter]) -> None:
    """Round the masters into the parameters the model computes with."""
    for param, master in zip(params, masters, strict=True):
        param.copy_(master)
