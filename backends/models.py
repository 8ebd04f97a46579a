"""Models a run trains, cut into pipeline stages, and the synthetic data they train on.

A model is an ordered list of layers (`LayeredModel.layers`); stage `s` is a contiguous
slice of them (`partition`). A rank materializes only its stages' layers of a built-in or
Hugging Face model (`hf:DIR`, backends/hf_models.py), each from its seed (layer_init.py) or
checkpoint, and a user's model whole from the seed (or, with `--init layers`, its layers
alone, backends/user_init.py): replicas of a stage start identical.

    gpt:SIZE, llama:SIZE                 the built-in models (backends/builtin_models.py)
    hf:DIR                               a Hugging Face checkpoint (backends/hf_models.py)
    package.module:FUNC, file.py:FUNC    a user's model: `FUNC()` returns an nn.Sequential
                                         (its layers, split into stages by pipelang) or a
                                         list of modules (one per stage), whose output is
                                         next-token logits

The data is synthetic next-token prediction: each sequence walks through a fixed random
permutation of the vocabulary, so the next token follows from the current one and the
loss falls within a few steps. `batch(step, mb)` is a pure function
of (seed, step, micro-batch), so every rank and the `--check` reference see the same data.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as functional
from torch import nn

from pipelang.backends.builtin_models import (
    MODEL_FAMILIES,
    GPTConfig,
    gpt_layers,
    llama_layers,
)
from pipelang.backends.data import DataError, check_tokens, sample_batch, synthetic_batch
from pipelang.backends.layer_init import Materializer, SeededLayers, on_meta
from pipelang.backends.model_error import ModelError
from pipelang.backends.user_init import user_layers
from pipelang.backends.user_models import Tie, user_model
from pipelang.ir.program import even_split

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What `--model`, `--seq-len`, `--micro-batch-size`, `--dtype`, `--seed` and `--data`
    name. Building is deterministic: `build()` gives the same weights in every process."""

    name: str
    seq_len: int | None = None
    micro_batch_size: int = 4
    dtype: str = "float32"
    seed: int = 0
    data: str | None = None
    """A token file (backends/data.py); None: synthetic batches."""
    frozen_layers: int = 0
    """The model's first layers that are its frozen part (a schedule's `frozen` line):
    built without gradients, run by `P` ops, and left out of the stages."""
    shapes: tuple[tuple[int, int], ...] | None = None
    """(samples, length) of each micro-batch of a step when they differ (a schedule's
    `lengths`, DynaPipe); micro-batch m of a step with more (`--dp`) has shape m mod
    their count. None: every one is `micro_batch_size` x `seq_len`."""
    init: str = "factory"
    """How a user's model gets its weights (`--init`, backends/user_init.py): "factory",
    built whole by its function; "layers", made on the meta device and each layer
    materialized alone by its modules' `reset_parameters()`."""

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype not in DTYPES:
            raise ModelError(f"unknown dtype `{self.dtype}`; use one of: {', '.join(DTYPES)}")
        return DTYPES[self.dtype]

    def build(self, layers: Iterable[int] | None = None) -> LayeredModel:
        """The model on the current default device: a built-in one or a Hugging Face
        checkpoint's (backends/hf_models.py) made on the meta device with only `layers`
        (None: all) materialized (`LayeredModel.materialize`), the rest left on meta; a
        user's whole, whatever `layers` says, in fp32 from the seed, then cast (with
        `--init layers`, made on meta too and only `layers` materialized)."""
        kind, sep, rest = self.name.partition(":")
        if not sep or not rest:
            raise ModelError(
                f"`--model {self.name}`: expected gpt:SIZE, llama:SIZE, hf:DIR, module:FUNC or "
                "file.py:FUNC"
            )
        if kind in MODEL_FAMILIES:
            with on_meta():
                model = self._built_in(kind, rest)
        elif kind == "hf":  # a Hugging Face checkpoint: the `hf` extra's transformers
            from pipelang.backends.hf_models import hf_model

            built = hf_model(self)
            model = LayeredModel(
                self, built.layers, built.vocab, built.seq_len, ties=built.ties, materializer=built
            )
        else:
            model = self._user()
        for layer in model.layers:
            layer.to(self.torch_dtype)
        for layer in model.layers[: self.frozen_layers]:
            layer.requires_grad_(False)
        model.materialize(range(len(model.layers)) if layers is None else layers)
        return model

    def _user(self) -> LayeredModel:
        """A user's model: built whole from the seed by its function (`--init factory`),
        or made on the meta device with each layer left to materialize alone
        (`--init layers`, backends/user_init.py)."""
        rule = None
        if self.init == "layers":
            with on_meta():
                built = user_model(self)
            rule = user_layers(self.name, built.layers, self.seed, self.torch_dtype, built.ties)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                built = user_model(self)
        return LayeredModel(
            self,
            built.layers,
            built.vocab,
            built.seq_len,
            built.stages,
            built.loss,
            built.ties,
            materializer=rule,
        )

    def _built_in(self, kind: str, size: str) -> LayeredModel:
        """`gpt:SIZE` or `llama:SIZE` (on the meta device: nothing drawn, nothing made)."""
        sizes = MODEL_FAMILIES[kind]
        if size not in sizes:
            raise ModelError(f"unknown {kind} size `{size}`; use one of: {', '.join(sizes)}")
        cfg, seq_len = sizes[size], self.seq_len or sizes[size].seq_len
        layers = gpt_layers(cfg, seq_len) if isinstance(cfg, GPTConfig) else llama_layers(cfg)
        rule = SeededLayers(layers, self.seed, self.torch_dtype, cfg.init)
        return LayeredModel(self, layers, cfg.vocab, seq_len, materializer=rule)


@dataclass(slots=True)
class LayeredModel:
    """A model as an ordered list of layers, with its vocabulary and sequence length."""

    spec: ModelSpec
    layers: list[nn.Module]
    vocab: int
    seq_len: int
    stages: bool = False
    """The layers are the stages, as the model function gave them (a list, or split by
    torch's `pipeline`): a schedule must have exactly that many stages, and
    `--partition` does not apply."""
    own_loss: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
    """The model function's `loss(output, targets)`; None: next-token cross-entropy."""
    ties: tuple[Tie, ...] = ()
    """Parameters shared by several layers (a user model's tied weights)."""
    materializer: Materializer | None = None
    """What gives the layers left on the meta device their weights: a built-in model's
    seeded rule (`layer_init.SeededLayers`), a checkpoint's files (`hf_models.HFLayers`);
    a user's model's `reset_parameters()` under `--init layers` (`user_init.UserLayers`);
    None: a user's model, built whole."""

    def materialize(self, indices: Iterable[int]) -> None:
        """Give the layers `indices` still on meta their weights."""
        if self.materializer is not None:
            self.materializer.materialize(indices)

    def batch(self, step: int, mb: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Input ids and next-token targets of micro-batch `mb` of step `step`."""
        size, length = self.shape(mb)
        if self.spec.data is not None:
            return sample_batch(self.spec.data, self.spec.seed, step, mb, size, length, device)
        return synthetic_batch(self.spec.seed, step, mb, size, length, self.vocab, device)

    def shape(self, mb: int) -> tuple[int, int]:
        """(samples, tokens each) of micro-batch `mb` (`ModelSpec.shapes`)."""
        shapes = self.spec.shapes
        if shapes is None:
            return self.spec.micro_batch_size, self.seq_len
        return shapes[mb % len(shapes)]

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of one micro-batch: the model's own, or the mean cross-entropy of
        the logits, computed in fp32."""
        if self.own_loss is not None:
            return self.own_loss(logits, targets)
        return functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)
        )

    def stage_bounds(self, num_stages: int, partition: Sequence[int] | None) -> list[range]:
        """Which layers each stage holds (see `partition`): the layers after the frozen
        ones."""
        frozen = self.spec.frozen_layers
        if frozen:
            if self.stages:
                raise ModelError(
                    f"`--model {self.spec.name}` gives its stages itself, so no layers can "
                    "be split off them as the schedule's frozen part; give a model of "
                    "layers (an nn.Sequential) instead"
                )
            return _after_frozen(len(self.layers), num_stages, partition, self.spec)
        if self.stages:
            count = len(self.layers)
            if num_stages != count:
                raise ModelError(
                    f"`--model {self.spec.name}` gives {count} stage{'s' * (count > 1)} (a "
                    f"list of stage modules, or split at pipe_split() or a split_spec) but "
                    f"the schedule has {num_stages}"
                )
            if partition is not None and list(partition) != [1] * count:
                raise ModelError(
                    f"`--model {self.spec.name}` gives its stages itself; --partition (or "
                    "the schedule's `partition` line) cannot split them again"
                )
            return [range(s, s + 1) for s in range(count)]
        return partition_layers(len(self.layers), num_stages, partition, self.spec.name)

    @property
    def frozen_bounds(self) -> range:
        """The layers of the frozen part (empty without one)."""
        return range(self.spec.frozen_layers)

    def stage_module(self, bounds: range) -> nn.Sequential:
        """The layers of one stage, as an nn.Sequential (the layers themselves, not copies)."""
        return nn.Sequential(*(self.layers[i] for i in bounds))


def partition_layers(
    num_layers: int, num_stages: int, partition: Sequence[int] | None, name: str = "the model"
) -> list[range]:
    """Layer ranges of `num_stages` contiguous stages.

    With `partition` (layers per stage) it is taken as given; without, layers are split as
    evenly as possible, earlier stages taking one more.
    """
    if partition is not None:
        if len(partition) != num_stages:
            raise ModelError(
                f"--partition gives {len(partition)} stages but the schedule has {num_stages}"
            )
        if sum(partition) != num_layers or min(partition) < 1:
            raise ModelError(
                f"--partition {','.join(map(str, partition))} must give every stage at least "
                f"one layer and add up to the {num_layers} layers of {name}"
            )
        counts = list(partition)
    else:
        if num_stages > num_layers:
            raise ModelError(
                f"the schedule has {num_stages} stages but {name} has only {num_layers} "
                f"layer{'s' * (num_layers != 1)}; every stage needs at least one",
            )
        counts = list(even_split(num_layers, num_stages))
    bounds, start = [], 0
    for count in counts:
        bounds.append(range(start, start + count))
        start += count
    return bounds


def _after_frozen(
    num_layers: int, num_stages: int, partition: Sequence[int] | None, spec: ModelSpec
) -> list[range]:
    """`partition_layers` over the layers after the `spec.frozen_layers` frozen ones."""
    frozen = spec.frozen_layers
    if frozen >= num_layers:
        raise ModelError(
            f"--frozen-layers {frozen}: {spec.name} has {num_layers} layers, and the "
            "stages need at least one of them"
        )
    name = f"{spec.name} after its {frozen} frozen layer{'s' * (frozen > 1)}"
    bounds = partition_layers(num_layers - frozen, num_stages, partition, name)
    return [range(b.start + frozen, b.stop + frozen) for b in bounds]


Shapes = dict[int, tuple[tuple[int, ...], torch.dtype]]
"""Shape and dtype of the output of every stage, by stage; with a frozen part, key -1
is its output (stage 0's input)."""


@dataclass(frozen=True, slots=True)
class StagePlan:
    """How a model splits into stages: each stage's layers and output shape."""

    bounds: list[range]
    shapes: Shapes
    seq_len: int
    ties: tuple[Tie, ...] = ()


def plan_stages(spec: ModelSpec, num_stages: int, partition: Sequence[int] | None) -> StagePlan:
    """Split `spec`'s model into `num_stages` stages, without building its weights.

    A built-in model's layers and shapes follow from its size. Any other model is built on the meta
    device and run there, which allocates and computes nothing. Raises ModelError when
    the model cannot be split that way.
    """
    spec.torch_dtype  # noqa: B018 - validates --dtype
    kind, _, size = spec.name.partition(":")
    family = MODEL_FAMILIES.get(kind, {})
    if size in family:  # embedding, blocks, head: the shapes follow from the config
        cfg = family[size]
        seq_len = spec.seq_len or cfg.seq_len
        if spec.frozen_layers:
            bounds = _after_frozen(cfg.blocks + 2, num_stages, partition, spec)
        else:
            bounds = partition_layers(cfg.blocks + 2, num_stages, partition, spec.name)
        hidden = ((spec.micro_batch_size, seq_len, cfg.width), spec.torch_dtype)
        logits = ((spec.micro_batch_size, seq_len, cfg.vocab), spec.torch_dtype)
        shapes: Shapes = {s: hidden for s in range(-1 if spec.frozen_layers else 0, num_stages)}
        shapes[num_stages - 1] = logits
        _check_data(spec, cfg.vocab, seq_len)
        return StagePlan(bounds, shapes, seq_len)
    with on_meta():
        model = spec.build()
    bounds = model.stage_bounds(num_stages, partition)
    _check_data(spec, model.vocab, model.seq_len)
    ids, _ = model.batch(0, 0, torch.device("cpu"))
    x = ids.to("meta")
    traced: Shapes = {}
    parts = [(-1, model.frozen_bounds)] if spec.frozen_layers else []
    try:
        with torch.no_grad():
            for stage, layers in [*parts, *enumerate(bounds)]:
                for i in layers:
                    x = model.layers[i](x)
                traced[stage] = (tuple(x.shape), x.dtype)
    except Exception as err:
        raise ModelError(f"`{spec.name}` does not run on a batch of token ids: {err}") from None
    return StagePlan(bounds, traced, model.seq_len, model.ties)


def _check_data(spec: ModelSpec, vocab: int, seq_len: int) -> None:
    """Raise ModelError when `--data` cannot feed this model."""
    if spec.data is not None:
        try:
            check_tokens(spec.data, vocab, seq_len)
        except DataError as err:
            raise ModelError(str(err)) from None
