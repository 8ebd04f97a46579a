"""Train a small model with a pipelang schedule inside your own torch loop, under torchrun.

    torchrun --nproc-per-node 4 examples/train_with_torchrun.py                 # Chimera, D=4
    torchrun --nproc-per-node 4 examples/train_with_torchrun.py zb-h1 D=4 N=8
    torchrun --nproc-per-node 4 examples/train_with_torchrun.py 1f1b D=2 N=4   # 2 copies

Each process builds the stages its rank holds (`build_stage`), and `sched.step` runs the
rank's part of the schedule on the whole batch; the optimizer is plain torch. After the
first step, rank 0 gathers every stage copy's gradients and checks them against one
process running the whole model on the same batch (every data-parallel copy on its own
batch), then all train a few more steps.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

import pipelang
from pipelang.torch import PipelineSchedule

WIDTH, OUT, BATCH = 16, 4, 16


def build_stage(stage: int, stages: int) -> nn.Module:
    """Stage `stage` of a small MLP; seeded, so every process builds the same weights."""
    torch.manual_seed(1000 + stage)
    if stage == stages - 1:
        return nn.Linear(WIDTH, OUT)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())


def batch(step: int, copy: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 * step + copy)
    return torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, OUT, generator=gen)


def reference_grads(stages: int, copies: int) -> list[list[torch.Tensor]]:
    """One process, the whole model, the mean loss over every copy's batch of step 0."""
    model = nn.Sequential(*(build_stage(s, stages) for s in range(stages)))
    loss = sum(
        nn.functional.mse_loss(model(x), y) for x, y in map(lambda c: batch(0, c), range(copies))
    )
    (loss / copies).backward()  # type: ignore[operator]
    return [[p.grad for p in model[s].parameters()] for s in range(stages)]  # type: ignore[misc]


def main(argv: list[str]) -> int:
    name, *pairs = argv or ["chimera", "D=4", "N=4"]
    params = {k: int(v) for k, v in (p.split("=") for p in pairs)}
    dist.init_process_group("gloo")
    prog = pipelang.load(name, **params)
    sched = PipelineSchedule(prog, lambda s: build_stage(s, prog.stages), nn.functional.mse_loss)
    opt = torch.optim.SGD(sched.parameters(), lr=0.05)
    copy = dist.get_rank() // prog.ranks
    for step in range(4):
        x, y = batch(step, copy)
        loss = sched.step(x, target=y)
        if step == 0:
            mine = {
                s: [p.grad.clone() for p in m.parameters()] for (s, _), m in sched.stages.items()
            }
            gathered: list[object] | None = (
                [None] * dist.get_world_size() if dist.get_rank() == 0 else None
            )
            dist.gather_object(mine, gathered, dst=0)
            if gathered is not None:
                expected = reference_grads(prog.stages, dist.get_world_size() // prog.ranks)
                worst = max(
                    float((g - e).abs().max())
                    for grads in gathered
                    for s, got in grads.items()  # type: ignore[attr-defined]
                    for g, e in zip(got, expected[s], strict=True)
                )
                print(f"gradients against one process: largest difference {worst:.2e}", flush=True)
                if worst > 1e-5:
                    print("CHECK FAILED", flush=True)
                    return 1
        opt.step()
        opt.zero_grad()
        if loss is not None:
            print(f"rank {dist.get_rank()} step {step} loss {float(loss):.4f}", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
