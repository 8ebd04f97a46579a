"""How a built-in model's layers get their weights: each layer alone, from a seed of its own.

A built-in model (`--model gpt:SIZE`, `llama:SIZE`, backends/models.py) is made on the
meta device, which allocates nothing, and a process materializes only the layers it
holds (`materialize`): each is given storage on the CPU in fp32 (`empty_on_cpu`),
initialized from a `torch.Generator` seeded with `layer_seed(seed, index)`, cast to the
run's dtype and moved to the default device. Layer i's weights so depend on the run's
seed and on i alone, not on which other layers the process builds nor on which process
builds it: the replicas of a stage (Chimera's copies, `--dp`'s) and the `--check`
reference, which builds every layer, agree bit for bit without any communication. (On
the CPU, always: a CUDA generator draws other numbers.) Layers nobody asks for stay on
meta and take no memory.

The rule is GPT-2's for every parameter (`init_layer`): weight matrices normal(0, 0.02),
the residual projections' (`residual`) scaled by 1/sqrt(2 * blocks), biases zero, a
norm's scale one. New storage holds garbage in every parameter and buffer, so a
parameter the rule does not cover, or any buffer, is an internal error, not a silent
garbage weight: the built-in layers hold neither.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from pipelang.diagnostics import InternalError


class _SkipInit(TorchFunctionMode):
    """Skips `torch.nn.init`'s functions (a module's constructor calls them from its
    `reset_parameters`): on the meta device they set nothing, and running them there
    imports torch's compiler for the meta kernels of `normal_` and `uniform_` (about a
    second of every process's start-up)."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Iterable[type],
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs.get("tensor")
        return func(*args, **kwargs)


@contextmanager
def on_meta() -> Iterator[None]:
    """Make modules on the meta device, their initialization skipped (`_SkipInit`): the
    layers get their weights when materialized (`materialize`, or a user's own
    `reset_parameters` under `--init layers`)."""
    with torch.device("meta"), _SkipInit():
        yield


def layer_seed(seed: int, index: int) -> int:
    """The seed of layer `index` of a run seeded `seed` (0 to 2**64 - 1): the first 8
    bytes, little-endian, of the BLAKE2b digest of the text `"pipelang layer {seed}
    {index}"` (Python's own `hash` differs between processes)."""
    digest = hashlib.blake2b(f"pipelang layer {seed} {index}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def init_layer(
    layer: nn.Module,
    residual: frozenset[str],
    residual_std: float,
    generator: torch.Generator | None = None,
) -> None:
    """Initialize every parameter of `layer` (in `named_parameters` order, drawing from
    `generator`, or torch's global one when None): a bias zero; a matrix normal(0, 0.02),
    or normal(0, `residual_std`) for the names in `residual`; another vector (a norm's
    scale) one. A buffer, or a parameter no rule covers, is an InternalError."""
    for name, _ in layer.named_buffers():
        raise InternalError(f"a built-in layer has a buffer `{name}` that nothing initializes")
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif param.dim() >= 2:
                std = residual_std if name in residual else 0.02
                nn.init.normal_(param, 0.0, std, generator=generator)
            elif name.endswith("weight"):
                nn.init.ones_(param)
            else:
                raise InternalError(f"a built-in layer's parameter `{name}` has no init rule")


def materialize(
    layers: list[nn.Module],
    indices: Iterable[int],
    seed: int,
    dtype: torch.dtype,
    init: tuple[frozenset[str], float],
) -> None:
    """Give each of `layers[i]` for i in `indices` that is still on the meta device its
    weights (see the module docstring): on the CPU in fp32 from `layer_seed(seed, i)`,
    then in `dtype` on the default device. `init` is the model's (`residual`,
    `residual_std`) for `init_layer`. Under a meta default device nothing is made."""
    device = torch.get_default_device()
    if device.type == "meta":
        return
    for i in sorted(set(indices)):
        if not 0 <= i < len(layers):
            raise InternalError(f"layer {i} asked for; the model has {len(layers)}")
        layer = layers[i]
        if not any(t.is_meta for t in (*layer.parameters(), *layer.buffers())):
            continue  # materialized already
        empty_on_cpu(layer)
        generator = torch.Generator(device="cpu").manual_seed(layer_seed(seed, i))
        init_layer(layer, *init, generator)
        layer.to(device=device, dtype=dtype)


def empty_on_cpu(layer: nn.Module) -> None:
    """`layer.to(torch.float32).to_empty(device="cpu")` without the meta decompositions
    `to_empty` runs (they import torch's symbolic shapes, about half a second): each
    parameter and buffer gets new, uninitialized storage on the CPU, a floating one in
    fp32, with its shape and strides."""

    def empty(t: torch.Tensor) -> torch.Tensor:
        dtype = torch.float32 if t.is_floating_point() else t.dtype
        return torch.empty_strided(t.size(), t.stride(), dtype=dtype, device="cpu")

    layer._apply(empty)


class Materializer(Protocol):
    """What gives a model's layers left on the meta device their weights."""

    def materialize(self, indices: Iterable[int]) -> None: ...


@dataclass(frozen=True, slots=True)
class SeededLayers:
    """A built-in model's layers, materialized by `init_layer`'s rule from each layer's
    own seed (`materialize`)."""

    layers: list[nn.Module]
    seed: int
    dtype: torch.dtype
    rule: tuple[frozenset[str], float]

    def materialize(self, indices: Iterable[int]) -> None:
        materialize(self.layers, indices, self.seed, self.dtype, self.rule)
