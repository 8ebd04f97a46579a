"""`--check`: train the same model without pipelining and compare.

The reference runs in one process: the whole model, the same seed, data, micro-batches
and optimizer; per step it sums `loss(mb) / N` over the N micro-batches in order, takes
one optimizer step, and records the mean loss. A pipelined run then matches it up to
floating-point summation order: micro-batch gradients accumulate in schedule order, and
replicas add their partial sums in an allreduce. So the comparison is within a tolerance,
not bitwise (it often is bitwise for single-pipeline schedules):

    |pipelined - reference| <= ATOL + RTOL * |reference|, elementwise,

for every parameter of every stage copy and for every step's loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pipelang.backends.runtime import RankResult, RunConfig, full_model_names, make_optimizer
from torch import nn

TOLERANCE = {
    torch.float32: (1e-5, 1e-4),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-2, 2e-2),
}
"""(atol, rtol) by dtype."""


@dataclass(frozen=True, slots=True)
class Reference:
    """The reference run: mean loss per step and the final parameters by name."""

    losses: list[float]
    weights: dict[str, torch.Tensor]


def train_reference(config: RunConfig, num_microbatches: int, device: torch.device) -> Reference:
    """Train the whole model in one process for `config.steps` steps."""
    model = config.spec.build()
    full = nn.Sequential(*model.layers).to(device)
    params = [p for p in full.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, config)
    scale = 1.0 / num_microbatches
    losses = []
    for step in range(config.steps):
        total = 0.0
        for mb in range(num_microbatches):
            ids, targets = model.batch(step, mb, device)
            loss = model.loss(full(ids), targets)
            (loss * scale).backward()
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / num_microbatches)
    return Reference(losses, full_model_names(model))


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

    def render(self) -> str:
        verdict = "OK" if self.ok else "FAILED"
        exact = " (bitwise equal)" if self.bitwise else ""
        return (
            f"check {verdict}: {self.tensors} parameter tensors compared with a single-process "
            f"reference{exact}; largest parameter difference {self.max_weight_diff:.3g} "
            f"({self.worst_weight}), largest loss difference {self.max_loss_diff:.3g}; "
            f"tolerance atol {self.atol:g} + rtol {self.rtol:g} x |reference|"
        )


def compare(
    reference: Reference, results: list[RankResult], losses: list[float], dtype: torch.dtype
) -> Comparison:
    """Compare every stage copy's weights and the per-step losses with the reference."""
    atol, rtol = TOLERANCE.get(dtype, TOLERANCE[torch.float32])
    worst, worst_name, ok, bitwise, count = 0.0, "-", True, True, 0
    for result in results:
        for (stage, pipeline, _), weights in zip(result.copies, result.copy_weights, strict=True):
            for name, tensor in weights.items():
                expected = reference.weights[name]
                diff = (tensor.double() - expected.double()).abs()
                count += 1
                bitwise = bitwise and torch.equal(tensor, expected)
                ok = ok and bool((diff <= atol + rtol * expected.double().abs()).all())
                if float(diff.max()) >= worst:
                    worst = float(diff.max())
                    worst_name = f"stage {stage}/{pipeline} `{name}` on rank {result.rank}"
    loss_diff = max(
        (abs(a - b) for a, b in zip(losses, reference.losses, strict=True)), default=0.0
    )
    ok = ok and all(
        abs(a - b) <= atol + rtol * abs(b) for a, b in zip(losses, reference.losses, strict=True)
    )
    bitwise = bitwise and loss_diff == 0.0
    return Comparison(worst, worst_name, loss_diff, count, bitwise, ok, atol, rtol)
