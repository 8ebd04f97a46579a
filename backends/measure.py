"""`pipelang profile`'s measuring half: a model's layers timed into a `Profile`
(`pipelang.planner.profile` holds the data and reads it back).

The model is built as `pipelang run` builds it, one micro-batch is pushed through the
layers once to get every layer's input, then each layer is timed on its own input,
`repeats` times after `warmup` runs, and the median is kept. The whole backward is one
`torch.autograd.grad` with respect to the input and the weights; split as the runtime
splits it, the input gradient is taken first keeping the graph, then the weight gradient
on that graph (the two cost more than the one pass). The last layer's forward and
backward include the loss, as the runtime's last stage does. Saved activations are the
distinct tensor storages autograd packs during the forward
(`torch.autograd.graph.saved_tensors_hooks`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pipelang.backends.config import SGD_MOMENTUM
from pipelang.backends.models import ModelSpec
from pipelang.backends.optim import SGD, Adam
from pipelang.planner.profile import LayerCost, Profile


@dataclass(frozen=True, slots=True)
class ProfileOptions:
    """What `pipelang profile` was asked to measure."""

    model: str
    micro_batch_size: int = 4
    seq_len: int | None = None
    dtype: str = "float32"
    device: str = "cpu"
    threads: int | None = None
    repeats: int = 5
    warmup: int = 2
    seed: int = 0


def measure(
    options: ProfileOptions, progress: Callable[[int, int, str], None] | None = None
) -> Profile:
    """Build the model and time every layer (see the module docstring)."""

    if options.threads:
        torch.set_num_threads(options.threads)
    device = torch.device(options.device)
    spec = ModelSpec(
        options.model, options.seq_len, options.micro_batch_size, options.dtype, options.seed
    )
    with device:
        model = spec.build()
    ids, targets = model.batch(0, 0, device)
    inputs: list[torch.Tensor] = [ids]
    with torch.no_grad():
        for layer in model.layers[:-1]:
            inputs.append(layer(inputs[-1]))
    costs = []
    last = len(model.layers) - 1
    for index, layer in enumerate(model.layers):
        if progress is not None:
            progress(index, len(model.layers), type(layer).__name__)

        def run(
            x: torch.Tensor, layer: torch.nn.Module = layer, index: int = index
        ) -> torch.Tensor:
            y = layer(x)
            return model.loss(y, targets) if index == last else y

        costs.append(
            _measure_layer(type(layer).__name__, layer, inputs[index], run, options, device)
        )
    return Profile(
        model=options.model,
        device=str(device),
        dtype=options.dtype,
        micro_batch_size=options.micro_batch_size,
        seq_len=model.seq_len,
        layers=tuple(costs),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        repeats=options.repeats,
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    )


def _measure_layer(
    name: str,
    layer: torch.nn.Module,
    x_in: torch.Tensor,
    run: Callable[[torch.Tensor], torch.Tensor],
    options: ProfileOptions,
    device: torch.device,
) -> LayerCost:

    params = [p for p in layer.parameters() if p.requires_grad]
    differentiable = x_in.is_floating_point()

    def fresh() -> tuple[torch.Tensor, torch.Tensor]:
        x = x_in.detach().requires_grad_(differentiable)
        return x, run(x)

    forward = _median_ms(fresh, options, device)

    def backward(*passes: Callable[[torch.Tensor], list[torch.Tensor]]) -> list[float]:
        return _backward_ms(fresh, passes, options, device)

    def of_input(x: torch.Tensor) -> list[torch.Tensor]:
        return [x]

    def of_weights(x: torch.Tensor) -> list[torch.Tensor]:
        return list(params)

    def of_both(x: torch.Tensor) -> list[torch.Tensor]:
        return [x, *params]

    if differentiable and params:
        (full,) = backward(of_both)
        # As the runtime splits it: the input gradient keeping the graph, then the
        # weight gradient on that graph.
        input_grad, weight_grad = backward(of_input, of_weights)
    elif differentiable:
        (full,) = backward(of_input)
        input_grad, weight_grad = full, 0.0
    elif params:
        (full,) = backward(of_weights)
        input_grad, weight_grad = 0.0, full
    else:
        full = input_grad = weight_grad = 0.0
    with torch.no_grad():
        out = layer(x_in.detach())
    sgd_step, adam_step = (_step_ms(params, kind, options, device) for kind in ("sgd", "adam"))
    return LayerCost(
        name=name,
        forward_ms=round(forward, 6),
        backward_input_ms=round(input_grad, 6),
        backward_weight_ms=round(weight_grad, 6),
        backward_ms=round(full, 6),
        activation_bytes=float(_saved_bytes(fresh, layer)),
        weight_bytes=float(sum(p.numel() * p.element_size() for p in layer.parameters())),
        output_bytes=float(out.numel() * out.element_size()),
        sgd_step_ms=round(sgd_step, 6),
        adam_step_ms=round(adam_step, 6),
    )


def _median_ms(action: Callable[[], Any], options: ProfileOptions, device: torch.device) -> float:
    """The median time of `action`, in ms, over `options.repeats` runs after the warm-up."""
    samples = []
    for i in range(options.warmup + options.repeats):
        _sync(device)
        start = time.perf_counter()
        action()
        _sync(device)
        if i >= options.warmup:
            samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _backward_ms(
    fresh: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    passes: Sequence[Callable[[torch.Tensor], list[torch.Tensor]]],
    options: ProfileOptions,
    device: torch.device,
) -> list[float]:
    """Median times of backward passes run one after the other on one graph (`fresh`
    makes it), each with respect to what its function picks (the input x, the weights)."""

    samples: list[list[float]] = [[] for _ in passes]
    for i in range(options.warmup + options.repeats):
        x, y = fresh()
        grad = torch.ones_like(y) if y.dim() == 0 else torch.randn_like(y)
        for index, select in enumerate(passes):
            keep = index < len(passes) - 1
            _sync(device)
            start = time.perf_counter()
            torch.autograd.grad(y, select(x), grad, retain_graph=keep, allow_unused=True)
            _sync(device)
            if i >= options.warmup:
                samples[index].append((time.perf_counter() - start) * 1e3)
    return [statistics.median(s) for s in samples]


def _step_ms(
    params: list[torch.nn.Parameter],
    optimizer: str,
    options: ProfileOptions,
    device: torch.device,
) -> float:
    """The median time of the runtime's optimizer step on `params` (its own SGD with
    momentum, or Adam): the update from fresh gradients, then clearing them. It changes
    the weights (by a learning rate of 1e-6), so it runs after the layer's other
    measurements."""

    if not params:
        return 0.0
    grads = [torch.randn_like(p) for p in params]
    step = SGD(params, 1e-6, SGD_MOMENTUM) if optimizer == "sgd" else Adam(params, 1e-6)
    samples = []
    for i in range(options.warmup + options.repeats):
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad.clone()  # the runtime's step finds new gradients each time
        _sync(device)
        start = time.perf_counter()
        step.step()
        step.zero_grad()
        _sync(device)
        if i >= options.warmup:
            samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def _saved_bytes(forward: Callable[[], Any], layer: torch.nn.Module) -> int:
    """Bytes of the distinct storages autograd saves for the backward during `forward`,
    the layer's own parameters left out (they are weights, counted apart)."""

    weights = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(seen.values())


def _sync(device: torch.device) -> None:

    if device.type == "cuda":
        torch.cuda.synchronize(device)
