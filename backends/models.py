"""Models a run trains, cut into pipeline stages, and the synthetic data they train on.

A model is an ordered list of layers (`LayeredModel.layers`); stage `s` is a contiguous
slice of them (`partition`). Every rank builds the whole model from the seed and keeps
only its stages, so replicas of a stage start identical without any communication.

    gpt:tiny | gpt:small | gpt:medium    a GPT from torch.nn (see `GPT_SIZES`)
    package.module:callable              a user's model: `callable()` returns an
                                         nn.Sequential (or a list of modules) whose output
                                         is next-token logits

The data is synthetic next-token prediction: each sequence walks through a fixed random
permutation of the vocabulary, so the next token follows from the current one and the
loss falls within a few steps. `batch(step, mb)` is a pure function
of (seed, step, micro-batch), so every rank and the `--check` reference see the same data.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as functional
from torch import nn


class ModelError(Exception):
    """A model name, partition or dtype that cannot be used; reported before ranks start."""


@dataclass(frozen=True, slots=True)
class GPTConfig:
    """The shape of a GPT: vocabulary, width, heads, blocks, default sequence length."""

    vocab: int
    width: int
    heads: int
    blocks: int
    seq_len: int


GPT_SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab=256, width=64, heads=4, blocks=6, seq_len=32),
    "small": GPTConfig(vocab=50257, width=768, heads=12, blocks=12, seq_len=256),
    "medium": GPTConfig(vocab=50257, width=1024, heads=16, blocks=24, seq_len=256),
}
"""`gpt:NAME` sizes: tiny runs a step on CPU in milliseconds; small and medium are GPT-2's."""

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


class Embedding(nn.Module):
    """Token plus learned position embedding: ids (batch, seq) -> (batch, seq, width)."""

    def __init__(self, cfg: GPTConfig, seq_len: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab, cfg.width)
        self.positions = nn.Embedding(seq_len, cfg.width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        where = torch.arange(ids.shape[-1], device=ids.device)
        return self.tokens(ids) + self.positions(where)


class Block(nn.Module):
    """A pre-LayerNorm transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln_attn = nn.LayerNorm(cfg.width)
        # No bias: the key bias would get a gradient that is zero up to rounding (softmax
        # ignores it), which Adam turns into full-size steps of noise.
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width, bias=False)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.ln_mlp = nn.LayerNorm(cfg.width)
        self.fc = nn.Linear(cfg.width, 4 * cfg.width)
        self.out = nn.Linear(4 * cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.ln_attn(x)).split(width, dim=-1)
        shape = (batch, seq, self.heads, width // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        attn = functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, width))
        return x + self.out(functional.gelu(self.fc(self.ln_mlp(x))))


class Head(nn.Module):
    """Final LayerNorm and the vocabulary projection: (batch, seq, width) -> logits."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.width)
        self.lm = nn.Linear(cfg.width, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.ln(x))


def gpt_layers(cfg: GPTConfig, seq_len: int) -> list[nn.Module]:
    """The layers of a GPT: embedding, `blocks` transformer blocks, head; GPT-2 init."""
    layers: list[nn.Module] = [Embedding(cfg, seq_len)]
    layers.extend(Block(cfg) for _ in range(cfg.blocks))
    layers.append(Head(cfg))
    for layer in layers:
        for name, param in layer.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(param)
            elif param.dim() >= 2:
                # GPT-2 scales the residual projections by 1/sqrt(2 * blocks).
                scale = (
                    1 / math.sqrt(2 * cfg.blocks) if name in ("proj.weight", "out.weight") else 1
                )
                nn.init.normal_(param, 0.0, 0.02 * scale)
    return layers


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What `--model`, `--seq-len`, `--micro-batch-size`, `--dtype` and `--seed` name.

    Building is deterministic: `build()` gives the same weights in every process.
    """

    name: str
    seq_len: int | None = None
    micro_batch_size: int = 4
    dtype: str = "float32"
    seed: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype not in DTYPES:
            raise ModelError(f"unknown dtype `{self.dtype}`; use one of: {', '.join(DTYPES)}")
        return DTYPES[self.dtype]

    def build(self) -> LayeredModel:
        """The whole model in fp32 on the current default device, seeded, then cast."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = self._build_fp32()
        for layer in model.layers:
            layer.to(self.torch_dtype)
        return model

    def _build_fp32(self) -> LayeredModel:
        kind, sep, rest = self.name.partition(":")
        if not sep or not rest:
            raise ModelError(f"`--model {self.name}`: expected gpt:SIZE or module:callable")
        if kind == "gpt":
            if rest not in GPT_SIZES:
                raise ModelError(f"unknown GPT size `{rest}`; use one of: {', '.join(GPT_SIZES)}")
            cfg = GPT_SIZES[rest]
            seq_len = self.seq_len or cfg.seq_len
            return LayeredModel(self, gpt_layers(cfg, seq_len), cfg.vocab, seq_len)
        return _user_model(self, self.name)


@dataclass(slots=True)
class LayeredModel:
    """A model as an ordered list of layers, with its vocabulary and sequence length."""

    spec: ModelSpec
    layers: list[nn.Module]
    vocab: int
    seq_len: int

    def batch(self, step: int, mb: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Input ids and next-token targets of micro-batch `mb` of step `step`."""
        return synthetic_batch(
            self.spec.seed, step, mb, self.spec.micro_batch_size, self.seq_len, self.vocab, device
        )

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of one micro-batch, computed in fp32."""
        return functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)
        )

    def stage_bounds(self, num_stages: int, partition: Sequence[int] | None) -> list[range]:
        """Which layers each stage holds (see `partition`)."""
        return partition_layers(len(self.layers), num_stages, partition, self.spec.name)

    def stage_module(self, bounds: range) -> nn.Sequential:
        """The layers of one stage, as an nn.Sequential (the layers themselves, not copies)."""
        return nn.Sequential(*(self.layers[i] for i in bounds))


def synthetic_batch(
    seed: int, step: int, mb: int, size: int, seq_len: int, vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Walks through a fixed random permutation of the vocabulary from random starts, so
    each token predicts the next; targets are the inputs shifted by one."""
    successor = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed((seed * 1_000_003 + step * 10_007 + mb + 1) % 2**62)
    tokens = torch.empty(size, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (size,), generator=gen)
    for t in range(seq_len):
        tokens[:, t + 1] = successor[tokens[:, t]]
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


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
                "layers; every stage needs at least one",
            )
        base, extra = divmod(num_layers, num_stages)
        counts = [base + (1 if s < extra else 0) for s in range(num_stages)]
    bounds, start = [], 0
    for count in counts:
        bounds.append(range(start, start + count))
        start += count
    return bounds


def _user_model(spec: ModelSpec, name: str) -> LayeredModel:
    module_name, _, attr = name.rpartition(":")
    try:
        factory: Callable[..., object] = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ModelError(
            f"`--model {name}`: cannot load `{attr}` from `{module_name}`: {err}"
        ) from None
    kwargs = {}
    if spec.seq_len and "seq_len" in inspect.signature(factory).parameters:
        kwargs["seq_len"] = spec.seq_len
    built = factory(**kwargs)
    layers = list(built) if isinstance(built, nn.Sequential | list | tuple) else None
    if not layers or not all(isinstance(m, nn.Module) for m in layers):
        raise ModelError(
            f"`--model {name}`: `{attr}()` must return an nn.Sequential or a list of modules"
        )
    vocab = getattr(built, "vocab_size", None)
    if vocab is None and isinstance(layers[0], nn.Embedding):
        vocab = layers[0].num_embeddings
    if vocab is None:
        raise ModelError(
            f"`--model {name}`: cannot tell the vocabulary size; set `vocab_size` on the "
            "returned module or make the first layer an nn.Embedding"
        )
    seq_len = spec.seq_len or int(getattr(built, "seq_len", 32))
    return LayeredModel(spec, layers, int(vocab), seq_len)


Shapes = list[tuple[tuple[int, ...], torch.dtype]]
"""Shape and dtype of the output of every stage, in stage order."""


@dataclass(frozen=True, slots=True)
class StagePlan:
    """How a model splits into stages: each stage's layers and output shape."""

    bounds: list[range]
    shapes: Shapes
    seq_len: int


def plan_stages(spec: ModelSpec, num_stages: int, partition: Sequence[int] | None) -> StagePlan:
    """Split `spec`'s model into `num_stages` stages, without building its weights.

    A GPT's layers and shapes follow from its size. Any other model is built on the meta
    device and run there, which allocates and computes nothing. Raises ModelError when
    the model cannot be split that way.
    """
    spec.torch_dtype  # noqa: B018 - validates --dtype
    kind, _, size = spec.name.partition(":")
    if kind == "gpt" and size in GPT_SIZES:
        cfg = GPT_SIZES[size]
        seq_len = spec.seq_len or cfg.seq_len
        bounds = partition_layers(cfg.blocks + 2, num_stages, partition, spec.name)
        hidden: tuple[int, ...] = (spec.micro_batch_size, seq_len, cfg.width)
        logits: tuple[int, ...] = (spec.micro_batch_size, seq_len, cfg.vocab)
        shapes: Shapes = [(hidden, spec.torch_dtype)] * (num_stages - 1) + [
            (logits, spec.torch_dtype)
        ]
        return StagePlan(bounds, shapes, seq_len)
    with torch.device("meta"):
        model = spec.build()
    bounds = model.stage_bounds(num_stages, partition)
    ids, _ = model.batch(0, 0, torch.device("cpu"))
    x = ids.to("meta")
    shapes = []
    try:
        with torch.no_grad():
            for stage in bounds:
                for i in stage:
                    x = model.layers[i](x)
                shapes.append((tuple(x.shape), x.dtype))
    except Exception as err:
        raise ModelError(f"`{spec.name}` does not run on a batch of token ids: {err}") from None
    return StagePlan(bounds, shapes, model.seq_len)
