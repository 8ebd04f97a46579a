"""The parameters of each stage of a model, read off the model built on the meta device
(nothing allocated, nothing computed): what `pipelang simulate --model` counts each
process's parameter, gradient and optimizer bytes from (pipelang/sim/state.py).

The model is built as a rank builds it (`ModelSpec.build`, its layers cast to the
spec's dtype, its frozen layers without gradients) and cut as the run cuts it
(`LayeredModel.stage_bounds`): a built-in model and a Hugging Face checkpoint's from
their configs, a user's model by its function, on the meta device, after the child
process that vets it (backends/model_import.py) has loaded it once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn

from pipelang.backends.layer_init import on_meta
from pipelang.backends.models import ModelSpec
from pipelang.backends.tensor_parallel import block_plans, split_dims
from pipelang.sim.state import ModelParams, Param


def model_params(spec: ModelSpec, num_stages: int, partition: Sequence[int] | None) -> ModelParams:
    """The parameters of each of the `num_stages` stages of `spec`'s model (cut by
    `partition`, or as evenly as the run cuts it) and of its frozen part, each with the
    dimension `--tp` splits it along (`tensor_parallel.split_dims` over the plan the run
    applies, `block_plans`; none for a model of your own, which its hook splits). Raises
    ModelError where the model cannot be built or cut so."""
    with on_meta():
        model = spec.build(layers=())
    bounds = model.stage_bounds(num_stages, partition)
    plans = block_plans(spec.name)
    splits = {} if plans is None else split_dims(nn.ModuleList(model.layers), plans)
    stages = tuple(_params((model.layers[i] for i in layers), splits) for layers in bounds)
    frozen = _params((model.layers[i] for i in model.frozen_bounds), {})
    return ModelParams(stages, frozen, tied=bool(model.ties))


def _params(layers: Iterable[nn.Module], splits: dict[int, tuple[int, int]]) -> tuple[Param, ...]:
    """The distinct parameters of `layers` (as `nn.Sequential(*layers).parameters()`
    gives them: a parameter two layers share, once), with their `--tp` `splits`."""
    module = nn.Sequential(*layers)
    found = []
    for p in module.parameters():
        split, parts = splits.get(id(p), (None, 1))
        found.append(
            Param(
                key=id(p),
                rows=p.shape[0] if p.dim() else 1,
                numel=p.numel(),
                itemsize=p.element_size(),
                trained=p.requires_grad,
                split=split,
                size=0 if split is None else p.shape[split],
                parts=parts,
            )
        )
    return tuple(found)
