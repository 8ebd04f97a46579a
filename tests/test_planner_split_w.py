"""The planner's B and W of a stage, when a schedule splits the weight gradient off, against
the work the runtime's own B and W actions do.

Oracle: the runtime itself. The demo model runs on the local backend under a zero-bubble
schedule, and torch's FLOP counter (`torch.utils.flop_counter`) counts the matrix
products of every B and W action the runtime runs. The profile those costs are planned
from holds, per layer, the FLOPs of the passes `pipelang profile` times (the whole
backward, then B up to the weight ops and W from what B kept), counted the same way:
exact numbers, so the planner's sums must equal the runtime's counts.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from pipelang.api import load_program
from pipelang.backends.config import RunConfig
from pipelang.backends.local import run_local
from pipelang.backends.measure import split_passes
from pipelang.backends.models import ModelSpec, plan_stages
from pipelang.backends.runtime import RankRuntime
from pipelang.backends.stash import Stash
from pipelang.ir.program import whole_backwards
from pipelang.planner.plans import Inputs
from pipelang.planner.search import Planner
from pipelang.planner.topology import Link, Topology
from pipelang.profile import LayerCost, Profile

MODEL = "pipelang.planner.demo:unbalanced"
SEQ, MB = 8, 2


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def flops(action: Callable[[], Any]) -> int:
    with FlopCounterMode(display=False) as counter:
        action()
    return counter.get_total_flops()


def flop_profile() -> Profile:
    """The demo model's layers with FLOPs in place of milliseconds."""
    model = ModelSpec(MODEL, SEQ, MB, "float32", 0).build()
    ids, targets = model.batch(0, 0, torch.device("cpu"))
    inputs = [ids]
    with torch.no_grad():
        for layer in model.layers[:-1]:
            inputs.append(layer(inputs[-1]))
    last = len(model.layers) - 1

    def loss(index: int) -> Callable[[torch.Tensor], torch.Tensor]:
        layer = model.layers[index]
        return lambda x: model.loss(layer(x), targets) if index == last else layer(x)

    return Profile(
        MODEL,
        "cpu",
        "float32",
        MB,
        SEQ,
        tuple(
            layer_flops(type(layer).__name__, layer, inputs[i], loss(i))
            for i, layer in enumerate(model.layers)
        ),
    )


def layer_flops(
    name: str,
    layer: torch.nn.Module,
    x_in: torch.Tensor,
    run: Callable[[torch.Tensor], torch.Tensor],
) -> LayerCost:
    """One layer's backward FLOPs: whole, then split as `pipelang profile` times it
    (`split_passes`: B up to the weight ops, then W from what B kept)."""
    params = list(layer.parameters())
    differentiable = x_in.is_floating_point()

    def graph() -> tuple[torch.Tensor, torch.Tensor]:
        x = x_in.detach().requires_grad_(differentiable)
        return x, run(x)

    x, y = graph()
    wrt = [x, *params] if differentiable else params
    full = flops(lambda: torch.autograd.grad(y, wrt, torch.ones_like(y)))
    stash = Stash()
    with stash.recording((0, 0, "", None), name, layer):
        x, y = graph()
    b_pass, w_pass, _ = split_passes(x, y, torch.ones_like(y), layer, params, stash)
    b = flops(b_pass)
    w = flops(w_pass)
    return LayerCost(name, 0.0, b, w, 0.0, 0.0, 0.0, backward_ms=full)


def runtime_flops(monkeypatch: pytest.MonkeyPatch, partition: tuple[int, ...]) -> dict:
    """FLOPs of every B and W action of one step of interleaved-zb (D=2, v=2), per
    (kind, stage): the set of one stage's counts over its micro-batches."""
    counted: dict[tuple[str, int], set[int]] = defaultdict(set)

    def counting(kind: str, original: Callable) -> Callable:
        def action(self: RankRuntime, mb: int, stage: int, pipeline: str) -> None:
            counted[(kind, stage)].add(flops(lambda: original(self, mb, stage, pipeline)))

        return action

    for kind, name in (("B", "backward"), ("W", "weight_grad")):
        monkeypatch.setattr(RankRuntime, name, counting(kind, getattr(RankRuntime, name)))
    program = load_program("interleaved-zb", {"D": "2", "N": "4", "v": "2"})
    config = RunConfig(
        model=MODEL,
        backend="local",
        steps=1,
        optimizer="sgd",
        micro_batch_size=MB,
        seq_len=SEQ,
        partition=partition,
    )
    shapes = plan_stages(config.spec, program.num_stages, partition).shapes
    run_local(program, config, shapes, lambda *_: None)
    return counted


@pytest.mark.slow
@pytest.mark.parametrize("partition", [(2, 3, 3, 2), (1, 4, 3, 2), (3, 1, 2, 4)])
def test_split_stage_costs_equal_the_runtimes_work(
    monkeypatch: pytest.MonkeyPatch, partition: tuple[int, ...]
) -> None:
    counted = runtime_flops(monkeypatch, partition)
    link = Link(1e12, 0.0)
    topology = Topology(("a", "b"), (1e12, 1e12), ((None, link), (link, None)))
    planner = Planner(Inputs(flop_profile(), topology, 4))
    costs = planner.costs.stage_costs(partition, split_w=True)
    # a W right after its B runs whole at B (`whole_backwards`): B does both, W nothing
    program = load_program("interleaved-zb", {"D": "2", "N": "4", "v": "2"})
    whole = {key[:2] for actions in program.ranks for key in whole_backwards(actions)}
    for stage, (_, b, w) in enumerate(costs):
        fused = {(mb, stage) in whole for mb in range(program.num_microbatches)}
        assert counted[("B", stage)] == {b + w if f else b for f in fused}, f"B of stage {stage}"
        assert counted[("W", stage)] == {0 if f else w for f in fused}, f"W of stage {stage}"
    # the first stage's B makes no input gradient but runs its layers' backward up to
    # their weight ops (for the weights of the layers before them), past an embedding
    assert (costs[0][1] > 0) == (partition[0] > 1)
