"""Tensor-parallel stage copies (`--tp T`): each block of a built-in model (gpt, llama)
split over the T processes of its tensor group with DTensor
(`torch.distributed.tensor.parallel.parallelize_module`), as Megatron and torchtitan cut
a transformer block:

- column-parallel (`ColwiseParallel`: each process holds 1/T of the output features):
  the attention's query, key and value projections and the MLP's first projection
  (gpt: `qkv`, `fc`; llama: `q`, `kv`, `gate_up`), so each process computes 1/T of the
  attention heads (and of the key/value heads) and of the MLP's hidden features;
- row-parallel (`RowwiseParallel`: 1/T of the input features, the partial products
  summed over the group, an all-reduce): the attention's output projection and the
  MLP's second (gpt: `proj`, `out`; llama: `o`, `down`), whose outputs are whole again,
  the same on every process of the group.

A fused projection (gpt's `qkv`, llama's `kv` = [k; v] and `gate_up` = [gate; up]) is
cut per part (`fused_colwise`): process t holds rows t of each part, [q_t; k_t; v_t],
placed `_StridedShard(0, split_factor=parts)` so that its whole tensor (`full_tensor`,
what `--check` compares) is the model's own layout.

The embedding, the norms and the head stay whole (replicated) on every process of the
group: they compute the same values from the same inputs. So activations between stages
are whole, and tensor rank t of a stage sends to tensor rank t of the next.

What a copy trains are the local tensors (`Stage.params`, its optimizer over them): a
parameter's gradient lands on the DTensor, and a hook moves it onto the local tensor
(`_move_grad`) as soon as autograd has accumulated it, so the data-parallel allreduce, the
norm and the optimizer read plain tensors. The gradient norm counts a replicated
parameter on tensor rank 0 only (`RankRuntime.repeated`).

With `--shard`, FSDP2 then shards these DTensors over the mesh's "dp" dimension
(backends/shard.py), which trains their shards instead; a fused projection's shard is
gathered back to its tensor-parallel part where its whole tensor is needed
(`fused_sharded`, `tp_part`). A model of your own is split by the `tp(module, mesh)` its
module defines beside FUNC (`HOOK`), called on each layer of a stage copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as functional
from torch import nn

from pipelang.backends.builtin_models import MODEL_FAMILIES, Block, LlamaBlock
from pipelang.backends.model_error import ModelError
from pipelang.backends.rank_base import make_optimizer
from pipelang.diagnostics import InternalError, clip

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from pipelang.backends.runtime import RankRuntime

PLANS: dict[type[nn.Module], dict[str, str | int]] = {
    Block: {"qkv": 3, "proj": "row", "fc": "col", "out": "row"},
    LlamaBlock: {"q": "col", "kv": 2, "o": "row", "gate_up": 2, "down": "row"},
}
"""Per block class, how each projection is cut: "col", "row", or the number of parts of
a fused column-parallel projection."""
HF_PLAN: dict[str, str | int] = {
    **{f"block.self_attn.{p}_proj": "col" for p in "qkv"},
    "block.self_attn.o_proj": "row",
    "block.mlp.gate_proj": "col",
    "block.mlp.up_proj": "col",
    "block.mlp.down_proj": "row",
}
"""A Hugging Face decoder block of the Llama family (`hf_models.HFBlock` over Llama's,
Qwen2's or Mistral's layer), cut as the built-in llama's and as the family's own
`base_model_tp_plan`: its attention reshapes to heads of `head_dim` by `-1`, so it runs
on the heads a process holds. GPT-2's fused `Conv1D` projections are not cut
(`preflight.tp_refusal`)."""


SPLIT_DIMS: dict[str, dict[str, int]] = {"col": {"weight": 0, "bias": 0}, "row": {"weight": 1}}
"""The dimension along which each style splits a linear layer's parameters over the T
tensor ranks (what `ColwiseParallel` and `RowwiseParallel` place as `Shard(dim)`; a
fused projection's `_StridedShard(0)` is "col"'s): a row-parallel bias stays whole
(`Replicate`), added once after the partial products' sum."""


def block_plans(model: str) -> dict[type[nn.Module], dict[str, str | int]] | None:
    """How `--tp` cuts the blocks of `--model model`: per block class, its plan (`PLANS`,
    `HF_PLAN` for `hf:DIR`); None for a model of your own, which its `tp(module, mesh)`
    hook splits instead. The one place both the run (`parallelize_copies`) and
    `simulate --model --tp` (`split_dims`) read."""
    family = model.partition(":")[0]
    if family == "hf":
        from pipelang.backends.hf_models import HFBlock

        return {HFBlock: HF_PLAN}
    return PLANS if family in MODEL_FAMILIES else None


def split_blocks(
    module: nn.Module, plans: dict[type[nn.Module], dict[str, str | int]]
) -> list[tuple[nn.Module, dict[str, str | int]]]:
    """The blocks of `module` that `--tp` splits, in order, each with its plan."""
    return [(block, plans[type(block)]) for block in module.modules() if type(block) in plans]


def split_dims(
    module: nn.Module, plans: dict[type[nn.Module], dict[str, str | int]]
) -> dict[int, tuple[int, int]]:
    """Per parameter of `module` that `--tp` splits (by `id`), the dimension it is split
    along and its number of fused parts (1 unless a fused projection's, whose parts
    each process holds rows of: `fused_colwise`); a parameter not named stays whole on
    every tensor rank."""
    found = {}
    for block, plan in split_blocks(module, plans):
        for name, how in plan.items():
            style, parts = ("row", 1) if how == "row" else ("col", 1 if how == "col" else int(how))
            for key, param in block.get_submodule(name).named_parameters(recurse=False):
                if key in SPLIT_DIMS[style]:
                    found[id(param)] = (SPLIT_DIMS[style][key], parts)
    return found


def localize(
    module: nn.Module, plans: dict[type[nn.Module], dict[str, str | int]], tp: int
) -> None:
    """Cut each parameter of `module` that `--tp` splits (`split_dims`) to what tensor
    rank 0 of `tp` holds, in place, in one process: a stand-in for a tensor-parallel
    stage whose forward has one tensor rank's shapes (1/T of the heads and MLP features),
    whose saved activations `simulate --model --tp` measures (backends/measure.py)."""
    dims = split_dims(module, plans)
    for sub in list(module.modules()):
        for key, param in list(sub.named_parameters(recurse=False)):
            if id(param) not in dims:
                continue
            dim, parts = dims[id(param)]
            pieces = param.detach().chunk(parts, dim)
            local = torch.cat([p.narrow(dim, 0, -(-p.shape[dim] // tp)) for p in pieces], dim)
            sub.register_parameter(key, nn.Parameter(local.clone(), param.requires_grad))


def parallel_styles(plan: dict[str, str | int]) -> dict[str, Any]:
    """The `parallelize_module` plan of one block: its projections' styles."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles: dict[str, Any] = {}
    for name, how in plan.items():
        if how == "col":
            styles[name] = ColwiseParallel()
        elif how == "row":
            styles[name] = RowwiseParallel()
        else:
            styles[name] = fused_colwise(int(how))
    return styles


def _fused_colwise() -> type:
    from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torch.distributed.tensor.placement_types import _StridedShard

    class _FusedColwise(ColwiseParallel):  # type: ignore[misc]
        """Column-parallel for a projection that fuses `parts` outputs (see the module
        docstring): process t computes part i's rows t of each part, side by side."""

        def __init__(self, parts: int) -> None:
            super().__init__()
            self.parts = parts

        def _partition_linear_fn(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
            placement = [_StridedShard(0, split_factor=self.parts)]
            for key, param in list(module.named_parameters(recurse=False)):
                shard = nn.Parameter(distribute_tensor(param, mesh, placement))
                module.register_parameter(key, shard)

        def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
            if not isinstance(module, nn.Linear):
                raise InternalError(f"a fused column-parallel cut of {type(module).__name__}")
            self._partition_linear_fn("", module, mesh)

            def forward(x: torch.Tensor) -> torch.Tensor:
                # Megatron's f: the identity forward, an all-reduce of the input's
                # gradient backward (each process computed a part of it)
                whole = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                local = whole.to_local(grad_placements=[Partial()])
                weight: Any = module.weight
                bias: Any = module.bias
                return functional.linear(
                    local, weight.to_local(), None if bias is None else bias.to_local()
                )

            module.forward = forward  # type: ignore[method-assign, assignment]
            return module

    return _FusedColwise


def fused_colwise(parts: int) -> Any:
    """A `_FusedColwise` style for a projection of `parts` fused outputs."""
    return _fused_colwise()(parts)


def parallelize_copies(runtime: RankRuntime, mesh: DeviceMesh) -> None:
    """Split every block of every stage copy of `runtime` over `mesh` (the tensor group),
    and give each copy its local tensors to train, with an optimizer over them (with
    `--shard`, `shard.shard_copies` does that next, over the FSDP2 shards of these
    DTensors). Every process of the group calls it, in the same order of copies."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    plans = block_plans(runtime.config.model)
    hook = None if plans is not None else user_hook(runtime.config.model)
    for copy in runtime.copies.values():
        if hook is not None:
            _split_layers(runtime.config.model, hook, copy.module, copy.layers.start, mesh)
        for block, plan in split_blocks(copy.module, plans) if plans is not None else ():
            parallelize_module(block, mesh, parallel_styles(plan))
        if runtime.config.shard:
            continue
        trained = [p for p in copy.module.parameters() if p.requires_grad]
        copy.params = [_local(p) for p in trained]
        for param, local in zip(trained, copy.params, strict=True):
            if isinstance(param, DTensor):
                param.register_post_accumulate_grad_hook(_move_grad(local))
        note_repeated(runtime, trained, copy.params)
        copy.optimizer = make_optimizer(copy.params, runtime.config)


HOOK = "tp"
"""The name of the function beside FUNC, in the module of `--model FILE.py:FUNC`, that
splits a layer of the user's model over its tensor ranks: `tp(module, mesh)`."""


def user_hook(model: str) -> Callable[[nn.Module, DeviceMesh], object] | None:
    """The `tp(module, mesh)` function (`HOOK`) defined beside FUNC in the module that
    `--model FILE.py:FUNC` (or `package.module:FUNC`) names, or None where there is none
    (anything else named `tp` there is a ModelError)."""
    from pipelang.backends.user_models import load_factory, loaded_module

    load_factory(model)  # FUNC is there (a ModelError if not), and its module loaded
    hook = getattr(loaded_module(model), HOOK, None)
    if hook is not None and not callable(hook):
        raise ModelError(
            clip(
                f"`--model {model}`: `{HOOK}` beside it is {type(hook).__name__}, not a "
                f"function `{HOOK}(module, mesh)`"
            )
        )
    return hook  # type: ignore[no-any-return]


def _split_layers(
    model: str,
    hook: Callable[[nn.Module, DeviceMesh], object],
    stage: nn.Sequential,
    first: int,
    mesh: DeviceMesh,
) -> None:
    """Call a user's `tp(module, mesh)` on each layer of a stage copy (the module FUNC's
    model gave, inside pipelang's wrapper where it packs what crosses a boundary), in
    order; it splits the layer in place."""
    from pipelang.backends.user_models import PackedStage, said

    for index, layer in enumerate(stage):
        module = layer.stage if isinstance(layer, PackedStage) else layer
        try:
            given = hook(module, mesh)
        except Exception as err:  # the user's code: its failure, named
            raise ModelError(
                clip(
                    f"`--model {model}`: {HOOK}(module, mesh) failed on layer "
                    f"{first + index}: {said(err)}"
                )
            ) from None
        if given is not None and given is not module:
            raise ModelError(
                clip(
                    f"`--model {model}`: {HOOK}(module, mesh) returned another module for "
                    f"layer {first + index}; it must split the layer in place, as "
                    "parallelize_module does, and return None or the layer"
                )
            )


def note_repeated(
    runtime: RankRuntime,
    params: Sequence[torch.Tensor],
    locals_: Sequence[torch.Tensor],
    before: Sequence[torch.Tensor] = (),
) -> None:
    """Mark in `runtime.repeated` each of `locals_` (the local tensors of `params`) that
    every tensor rank holds alike: a parameter that is no DTensor, or one replicated
    over the "tp" dimension of its mesh (or on a mesh without it: `--shard`'s embedding,
    norms and head, sharded over "dp" alone); `before`, local tensors they replace, are
    unmarked first."""
    from torch.distributed.tensor import DTensor, Replicate

    runtime.repeated.difference_update(id(t) for t in before)
    for param, local in zip(params, locals_, strict=True):
        if isinstance(param, DTensor):
            names = param.device_mesh.mesh_dim_names or ()
            if "tp" in names and param.placements[names.index("tp")] != Replicate():
                continue
        runtime.repeated.add(id(local))


def _local(param: torch.Tensor) -> Any:
    """A DTensor parameter's local tensor (what this process holds), else itself."""
    from torch.distributed.tensor import DTensor

    return param._local_tensor if isinstance(param, DTensor) else param


def _move_grad(local: torch.Tensor) -> Any:
    """The hook that adds a DTensor parameter's new gradient to `local`'s `.grad` (as
    autograd accumulates) and clears the DTensor's."""

    def hook(param: Any) -> None:
        grad = param.grad._local_tensor
        local.grad = grad if local.grad is None else local.grad + grad
        param.grad = None

    return hook


def fused_sharded(param: torch.Tensor) -> bool:
    """Whether `param` is a fused projection's (`_StridedShard` over "tp") that FSDP2
    shards over "dp" too (`--shard --tp`): FSDP2 takes its tensor-parallel part for
    plain rows, so the placements of its DTensor do not say where its rows lie in the
    whole tensor (`full_tensor` would put them elsewhere); `tp_part` says it."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    if not isinstance(param, DTensor) or param.device_mesh.mesh_dim_names != ("dp", "tp"):
        return False
    return isinstance(param.placements[1], _StridedShard)


def tp_part(param: Any) -> Any:
    """A `fused_sharded` DTensor as the tensor-parallel DTensor ("tp" mesh) whose
    FSDP2 shard it is: its "dp" shards gathered (a collective over "dp"; torch.chunk's
    cut of dim 0, as FSDP2 cuts)."""
    from torch.distributed.tensor import DTensor, Shard

    mesh = param.device_mesh
    shape = torch.Size((param.shape[0] // mesh["tp"].size(), *param.shape[1:]))
    stride = torch.empty(shape, device="meta").stride()
    part = DTensor.from_local(
        param._local_tensor, mesh["dp"], [Shard(0)], run_check=False, shape=shape, stride=stride
    )
    return DTensor.from_local(
        part.full_tensor(),
        mesh["tp"],
        [param.placements[1]],
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def dp_piece(part: torch.Tensor, param: Any) -> torch.Tensor:
    """This process's FSDP2 shard of `part`, the tensor-parallel part of the
    `fused_sharded` `param`: `tp_part` undone, without a collective."""
    dp = param.device_mesh["dp"]
    pieces = torch.chunk(part, dp.size(), dim=0)
    rank = dp.get_local_rank()
    return pieces[rank] if rank < len(pieces) else part[:0]
