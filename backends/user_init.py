"""`--init layers`: a user's model made on the meta device, each layer materialized alone
by the modules' own `reset_parameters()` under a seed of its own.

By default (`--init factory`) a user's `--model FILE.py:FUNC` is built whole from the
seed on every rank, with whatever initialization `FUNC` does, and each rank keeps its
stages. Under `--init layers` `FUNC` is called with the meta device as the default device
(`torch.device("meta")`), which allocates nothing, and a process gives storage only to
the layers it holds (`UserLayers.materialize`): each on the CPU in fp32
(`layer_init.empty_on_cpu`), then `reset_parameters()` of every submodule that has one, in
module order, drawing from torch's global generator seeded with
`layer_init.layer_seed(seed, layer)` (restored after), then cast to the run's dtype and
moved to the default device. Layer i's weights so depend on the seed and i alone: the
replicas of a stage and the `--check` reference, which builds every layer so, agree bit
for bit. What `FUNC` itself set (a `nn.init` call, a copied tensor) is not kept.

So every module that holds parameters or buffers itself needs a `reset_parameters()`
that sets all of them (torch's layers have one; `nn.MultiheadAttention` has only a
private `_reset_parameters`): `check` refuses a model with such a module before any rank
starts, naming it, and that storage is filled with NaN first, so a parameter or
floating-point buffer that no `reset_parameters()` sets is found and named too, not
trained as garbage. A parameter tied across layers takes the value of its first use (the
lowest layer), made aside where this process does not hold that layer; where it holds
both, the layers share one tensor again, as the factory's model did.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from pipelang.backends.layer_init import empty_on_cpu, layer_seed
from pipelang.backends.model_error import ModelError
from pipelang.backends.user_models import PackedStage, Tie, said
from pipelang.diagnostics import InternalError, clip

INITS = ("factory", "layers")
"""`--init`: the factory's own initialization of the whole model (the default), or each
layer alone by its modules' `reset_parameters()` (this module)."""


def _inner(layer: nn.Module) -> tuple[nn.Module, str]:
    """The user's own module of a layer (a `PackedStage` wraps it) and the prefix of its
    names inside the layer."""
    return (layer.stage, "stage.") if isinstance(layer, PackedStage) else (layer, "")


def _where(index: int, name: str) -> str:
    """Module `name` of layer `index` named as in the whole model (`3.attn.norm`)."""
    return f"{index}.{name}" if name else str(index)


def _owns(module: nn.Module) -> bool:
    """Whether `module` holds parameters or buffers itself (not only in submodules)."""
    return any(True for _ in module.parameters(recurse=False)) or any(
        True for _ in module.buffers(recurse=False)
    )


def check(model: str, layers: list[nn.Module]) -> None:
    """ModelError naming the first module (in layer, then module order) that holds
    parameters or buffers itself and has no `reset_parameters()`."""
    for index, layer in enumerate(layers):
        inner, _ = _inner(layer)
        for name, module in inner.named_modules():
            if _owns(module) and type(module).__module__.startswith("torch.export"):
                raise ModelError(
                    f"`--model {model}`: --init layers calls the modules' "
                    "reset_parameters(), which the stages torch's pipeline() splits off "
                    "do not keep (their modules become torch.export's InterpreterModule); "
                    "return a list of stage modules or an nn.Sequential, or use --init "
                    "factory"
                )
            if _owns(module) and not callable(getattr(module, "reset_parameters", None)):
                kind = type(module).__name__
                raise ModelError(
                    clip(
                        f"`--model {model}`: --init layers initializes each module by its "
                        f"reset_parameters(), and `{_where(index, name)}` ({kind}) holds "
                        f"parameters or buffers itself but has none: give {kind} a "
                        "`reset_parameters(self)` that sets them, or use --init factory"
                    )
                )


@dataclass(frozen=True, slots=True)
class UserLayers:
    """A user's model made on the meta device under `--init layers`: what materializes its
    layers (see the module docstring)."""

    model: str
    """The `--model` name, for messages."""
    layers: list[nn.Module]
    seed: int
    dtype: torch.dtype
    ties: tuple[Tie, ...]

    def materialize(self, indices: Iterable[int]) -> None:
        """Give each of `layers[i]` for i in `indices` still on meta its weights; under a
        meta default device nothing is made."""
        device = torch.get_default_device()
        if device.type == "meta":
            return
        made = []
        for i in sorted(set(indices)):
            if not 0 <= i < len(self.layers):
                raise InternalError(f"layer {i} asked for; the model has {len(self.layers)}")
            layer = self.layers[i]
            if any(t.is_meta for t in (*layer.parameters(), *layer.buffers())):
                self._initialize(i, layer)
                layer.to(device=device, dtype=self.dtype)
                made.append(i)
        self._tie(made)

    def _initialize(self, index: int, layer: nn.Module) -> None:
        """Layer `index` given storage on the CPU in fp32 and set by its modules'
        `reset_parameters()` from the layer's seed."""
        shared = _shared_inside(layer)
        empty_on_cpu(layer)
        for names in shared:  # a tensor was made per use: one again
            param = layer.get_parameter(names[0])
            for name in names[1:]:
                _set(layer, name, param)
        with torch.no_grad():
            for tensor in (*layer.parameters(), *layer.buffers()):
                tensor.fill_(float("nan") if tensor.is_floating_point() else 0)
        inner, prefix = _inner(layer)
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.default_generator.manual_seed(layer_seed(self.seed, index))
            for name, module in inner.named_modules():
                reset = getattr(module, "reset_parameters", None)
                if not callable(reset):
                    continue
                try:
                    with torch.no_grad():
                        reset()
                except BaseException as err:  # the user's code: sys.exit() too
                    raise ModelError(
                        clip(
                            f"`--model {self.model}`: --init layers: "
                            f"`{_where(index, name)}` ({type(module).__name__}) "
                            f"reset_parameters() failed: {said(err)}"
                        )
                    ) from None
        for name, tensor in (*layer.named_parameters(), *layer.named_buffers()):
            if tensor.is_floating_point() and bool(tensor.isnan().any()):
                owner = inner.get_submodule(name.removeprefix(prefix).rpartition(".")[0])
                raise ModelError(
                    clip(
                        f"`--model {self.model}`: --init layers: no reset_parameters() sets "
                        f"`{_where(index, name.removeprefix(prefix))}` (of "
                        f"{type(owner).__name__}) in full; make its module's "
                        "reset_parameters() set it, or use --init factory"
                    )
                )

    def _tie(self, made: list[int]) -> None:
        """Every use of a tied parameter in the layers just made takes its first use's
        tensor (the same tensor where this process holds that layer, else its value)."""
        for tie in self.ties:
            (first, name), rest = tie[0], tie[1:]
            mine = [(i, n) for i, n in rest if i in made]
            if not mine:
                continue
            layer = self.layers[first]
            if any(t.is_meta for t in layer.parameters()):  # not held here: made aside
                aside = copy.deepcopy(layer)
                self._initialize(first, aside)
                value = aside.get_parameter(name).to(dtype=self.dtype)
                for i, n in mine:
                    with torch.no_grad():
                        self.layers[i].get_parameter(n).copy_(value)
            else:
                param = layer.get_parameter(name)
                for i, n in mine:
                    _set(self.layers[i], n, param)


def _shared_inside(layer: nn.Module) -> list[list[str]]:
    """The names of each parameter that `layer` holds under more than one name."""
    names: dict[int, list[str]] = {}
    for name, param in layer.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [n for n in names.values() if len(n) > 1]


def _set(layer: nn.Module, name: str, param: nn.Parameter) -> None:
    """Put `param` in `layer` under its qualified `name`."""
    owner, _, leaf = name.rpartition(".")
    setattr(layer.get_submodule(owner), leaf, param)


def user_layers(
    model: str, layers: list[nn.Module], seed: int, dtype: torch.dtype, ties: tuple[Tie, ...]
) -> UserLayers:
    """The materializer of a user's meta-device layers (`check`ed first)."""
    check(model, layers)
    return UserLayers(model, layers, seed, dtype, ties)
