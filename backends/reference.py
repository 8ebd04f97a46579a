"""`--check`: train the same model without pipelining and compare.

The reference runs in one process: the whole model, the same seed, data, micro-batches
and optimizer; per step it sums `loss(mb) / N` over the N micro-batches in order, takes
one optimizer step, and records the mean loss. A pipelined run then matches it up to
floating-point summation order: micro-batch gradients accumulate in schedule order, and
replicas add their partial sums in an allreduce. So the comparison is within a tolerance,
not bitwise (it often is bitwise for single-pipeline schedules):

    |pipelined - reference| <= ATOL + RTOL * |reference|, elementwise,

for every parameter of every stage copy and for every step's loss, with (ATOL, RTOL) =
(1e-5, 1e-4) in fp32 and (2e-2, 2e-2) in bf16/fp16. Adam adds lr/20 to ATOL: its step
is lr * m / (sqrt(v) + eps), so where a gradient is within eps (1e-8) of zero, a rounding
difference dg in it moves the weight by about lr * dg / eps, a visible fraction of lr. A
real mistake (a missing micro-batch, an unsynchronised replica) changes most steps by
about lr and still fails.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from pipelang.backends.checkpoint import held_by_model, load
from pipelang.backends.config import RunConfig
from pipelang.backends.precision import copy_back, master_weights
from pipelang.backends.rank_base import RankResult, make_optimizer
from pipelang.backends.runtime import full_model_names

TOLERANCE = {
    torch.float32: (1e-5, 1e-4),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-2, 2e-2),
}
"""(atol, rtol) by dtype."""
ADAM_ATOL_PER_LR = 5e-2
"""With Adam, ATOL grows by this times the learning rate (see the module docstring)."""


def tolerance(config: RunConfig) -> tuple[float, float]:
    """(atol, rtol) of `--check` for this run's dtype and optimizer."""
    atol, rtol = TOLERANCE.get(config.spec.torch_dtype, TOLERANCE[torch.float32])
    if config.optimizer == "adam":
        atol += ADAM_ATOL_PER_LR * config.learning_rate
    return atol, rtol


@dataclass(frozen=True, slots=True)
class Reference:
    """The reference run: mean loss per step, the final parameters by name, and the wall
    time of every step (device work included; empty where the run was not timed)."""

    losses: list[float]
    weights: dict[str, torch.Tensor]
    step_seconds: list[float] = field(default_factory=list)


def train_reference(
    config: RunConfig, num_microbatches: int, device: torch.device, threads: int | None = None
) -> Reference:
    """Train the whole model in one process for `config.steps` steps (from the checkpoint
    of `--resume`, when given, for the steps after it).

    `threads`: CPU threads for the reference, as many as one rank had (kernels then split
    their work the same way, and an oversubscribed machine does not slow it down).
    """
    saved = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _train(config, num_microbatches, device)
    finally:
        torch.set_num_threads(saved)


def _train(config: RunConfig, num_microbatches: int, device: torch.device) -> Reference:
    model = config.spec.build()
    full = nn.Sequential(*model.layers).to(device)
    params = [p for p in full.parameters() if p.requires_grad]
    masters = master_weights(params) if config.mixed_precision else None
    trained = masters or params
    optimizer = make_optimizer(trained, config)
    if config.resume is not None:
        load([held_by_model(full, optimizer, masters=masters)], config.resume)
        if masters is not None:
            copy_back(params, masters)
    scale = 1.0 / num_microbatches
    losses, seconds = [], []
    for step in range(config.first_step, config.steps):
        start = time.perf_counter()
        total = 0.0
        for mb in range(num_microbatches):
            ids, targets = model.batch(step, mb, device)
            loss = model.loss(full(ids), targets)
            (loss * scale).backward()
            total += loss.item()
        if config.clip_grad is not None:
            nn.utils.clip_grad_norm_(trained, config.clip_grad)
        optimizer.step()
        optimizer.zero_grad()
        if masters is not None:
            copy_back(params, masters)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - start)
        losses.append(total / num_microbatches)
    return Reference(losses, full_model_names(model), seconds)


@dataclass(frozen=True, slots=True)
class Comparison:
    """How far a pipelined run is from the reference."""

    max_weight_diff: float
    worst_weight: str
    max_loss_diff: float
    tensors: int
    bitwise: bool
    ok: bool
    atol: float
    rtol: float
    diverged: bool = False
    """The reference's own loss is not finite: there is nothing sound to compare with."""

    def render(self) -> str:
        if self.diverged:
            return (
                "check FAILED: the single-process reference itself diverged (its loss is not "
                "finite); try --dtype bfloat16 or float32, or a smaller --lr"
            )
        verdict = "OK" if self.ok else "FAILED"
        exact = " (bitwise equal)" if self.bitwise else ""
        return (
            f"check {verdict}: {self.tensors} parameter tensors compared with a single-process "
            f"reference{exact}; largest parameter difference {self.max_weight_diff:.3g} "
            f"({self.worst_weight}), largest loss difference {self.max_loss_diff:.3g}; "
            f"tolerance atol {self.atol:g} + rtol {self.rtol:g} x |reference|"
        )


def compare(
    reference: Reference, results: list[RankResult], losses: list[float], config: RunConfig
) -> Comparison:
    """Compare every stage copy's weights and the per-step losses with the reference.

    A NaN anywhere counts as a difference (it never passes the tolerance).
    """
    atol, rtol = tolerance(config)
    worst, worst_name, ok, bitwise, count = 0.0, "-", True, True, 0
    for result in results:
        for (stage, pipeline, _), weights in zip(result.copies, result.copy_weights, strict=True):
            for name, tensor in weights.items():
                expected = reference.weights[name].double()
                diff = (tensor.double() - expected).abs().nan_to_num(math.inf)
                count += 1
                bitwise = bitwise and torch.equal(tensor, reference.weights[name])
                ok = ok and bool((diff <= atol + rtol * expected.abs()).all())
                if float(diff.max()) >= worst:
                    worst = float(diff.max())
                    worst_name = f"stage {stage}/{pipeline} `{name}` on rank {result.rank}"
    pairs = list(zip(losses, reference.losses, strict=True))
    loss_diffs = [abs(a - b) if math.isfinite(a - b) else math.inf for a, b in pairs]
    loss_diff = max(loss_diffs, default=0.0)
    ok = ok and all(d <= atol + rtol * abs(b) for d, (_, b) in zip(loss_diffs, pairs, strict=True))
    bitwise = bitwise and loss_diff == 0.0
    diverged = not all(math.isfinite(b) for b in reference.losses)
    return Comparison(
        worst, worst_name, loss_diff, count, bitwise, ok and not diverged, atol, rtol, diverged
    )
