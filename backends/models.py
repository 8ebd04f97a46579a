"""Models a run trains, cut into pipeline stages, and the synthetic data they train on.

A model is an ordered list of layers (`LayeredModel.layers`); stage `s` is a contiguous
slice of them (`partition`). A rank materializes only its stages' layers of a built-in or
Hugging Face model (`hf:DIR`, backends/hf_models.py), each from its seed (layer_init.py) or
checkpoint, and a user's model whole from the seed: replicas of a stage start identical.

    gpt:tiny | gpt:small | gpt:medium    a GPT from torch.nn (see `GPT_SIZES`)
    llama:tiny | llama:small             a Llama: RMSNorm, rotary positions, SwiGLU,
                                         grouped-query attention (see `LLAMA_SIZES`)
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

import contextlib
import contextvars
import math
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as functional
from torch import nn

from pipelang.backends.data import DataError, check_tokens, sample_batch, synthetic_batch
from pipelang.backends.layer_init import init_layer, materialize
from pipelang.backends.model_error import ModelError
from pipelang.backends.model_import import trust
from pipelang.backends.user_models import Tie, said, user_model
from pipelang.diagnostics import clip
from pipelang.ir.program import even_split


@dataclass(frozen=True, slots=True)
class GPTConfig:
    """The shape of a GPT: vocabulary, width, heads, blocks, default sequence length."""

    vocab: int
    width: int
    heads: int
    blocks: int
    seq_len: int

    @property
    def init(self) -> tuple[frozenset[str], float]:
        """GPT-2's `init_layer` rule: the residual projections scaled by 1/sqrt(2 * blocks)."""
        return frozenset({"proj.weight", "out.weight"}), 0.02 * (1 / math.sqrt(2 * self.blocks))


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


@dataclass
class SequenceChunk:
    """A forward over one sequence chunk of a micro-batch (`chunks C`, Seq1F1B): its
    tokens start at position `start`, and each attention block reads the keys and values
    the chunks before it made on this stage (`past`, by block) besides its own, which it
    files in `made`. Blocks see it through `sequence_chunk()`; the runtime keeps the
    tensors between chunks (backends/runtime.py)."""

    start: int
    past: dict[int, list[tuple[torch.Tensor, torch.Tensor]]]
    """Per block (by `id`), the (keys, values) of every earlier chunk, oldest first."""
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """Per block (by `id`), this chunk's own (keys, values), as computed (with autograd)."""


_CHUNK: contextvars.ContextVar[SequenceChunk | None] = contextvars.ContextVar(
    "sequence_chunk", default=None
)


@contextlib.contextmanager
def sequence_chunk(chunk: SequenceChunk) -> Iterator[SequenceChunk]:
    """Run the model's layers over one sequence chunk: `Embedding` offsets positions by
    `chunk.start` (a Llama block rotates from it), and blocks attend over the cached keys
    and values (`causal_attention`). A module call takes no extra arguments through an
    nn.Sequential, so they travel in a context variable, set only around one stage's
    forward."""
    token = _CHUNK.set(chunk)
    try:
        yield chunk
    finally:
        _CHUNK.reset(token)


class Embedding(nn.Module):
    """Token plus learned position embedding: ids (batch, seq) -> (batch, seq, width)."""

    def __init__(self, cfg: GPTConfig, seq_len: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab, cfg.width)
        self.positions = nn.Embedding(seq_len, cfg.width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        chunk = _CHUNK.get()
        start = 0 if chunk is None else chunk.start
        where = torch.arange(start, start + ids.shape[-1], device=ids.device)
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
        attn = causal_attention(self, q, k, v)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, width))
        return x + self.out(functional.gelu(self.fc(self.ln_mlp(x))))


def causal_attention(
    block: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """Causal attention of `block`'s (batch, heads, seq, dim) queries; within a sequence
    chunk (`sequence_chunk`), over the keys and values of the chunks before it on this
    stage and its own: query i (position start + i) sees keys 0..start + i."""
    chunk = _CHUNK.get()
    if chunk is None:
        return functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    chunk.made[id(block)] = (k, v)
    past = chunk.past.get(id(block), [])
    # The first chunk attends to its own keys only: no copy to save for the backward.
    keys = torch.cat([*(p[0] for p in past), k], dim=2) if past else k
    values = torch.cat([*(p[1] for p in past), v], dim=2) if past else v
    # lower-right causal: the last query sees every key (SDPA keeps its fused kernels).
    # Imported here: torch.nn.attention.bias imports torch._dynamo, about 1.8 s of every
    # rank's start-up that only a chunked schedule needs.
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(q.shape[2], keys.shape[2])
    return functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


class Head(nn.Module):
    """Final LayerNorm and the vocabulary projection: (batch, seq, width) -> logits."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.width)
        self.lm = nn.Linear(cfg.width, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.ln(x))


def gpt_layers(cfg: GPTConfig, seq_len: int) -> list[nn.Module]:
    """The layers of a GPT: embedding, `blocks` transformer blocks, head; GPT-2 init
    (`GPTConfig.init`) drawn from torch's global generator (none on the meta device)."""
    layers = [Embedding(cfg, seq_len), *(Block(cfg) for _ in range(cfg.blocks)), Head(cfg)]
    for layer in layers:
        init_layer(layer, *cfg.init)
    return layers


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    """The shape of a Llama: vocabulary, width, query and key/value heads (grouped-query
    attention when fewer), blocks, SwiGLU hidden width, default sequence length."""

    vocab: int
    width: int
    heads: int
    kv_heads: int
    blocks: int
    hidden: int
    seq_len: int

    @property
    def init(self) -> tuple[frozenset[str], float]:
        """Llama's `init_layer` rule: the residual outputs scaled by 1/sqrt(2 * blocks)."""
        return frozenset({"o.weight", "down.weight"}), 0.02 / math.sqrt(2 * self.blocks)


LLAMA_SIZES: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(vocab=256, width=64, heads=4, kv_heads=2, blocks=6, hidden=176, seq_len=32),
    "small": LlamaConfig(
        vocab=32000, width=768, heads=12, kv_heads=4, blocks=12, hidden=2048, seq_len=256
    ),
}
"""`llama:NAME` sizes: tiny runs on a CPU in milliseconds; small is about GPT-2 small's size."""


class RMSNorm(nn.Module):
    """x / rms(x) * weight, over the last dimension (computed in fp32)."""

    def __init__(self, width: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def rotary(x: torch.Tensor, start: int = 0, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding of (batch, heads, seq, dim) queries or keys at positions
    `start`, `start` + 1, ...: each pair of dimensions (i, i + dim/2) turned by an angle
    that grows with the position."""
    seq, dim = x.shape[-2], x.shape[-1]
    freqs = base ** (-torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    where = torch.arange(start, start + seq, device=x.device, dtype=torch.float32)
    angles = where[:, None] * freqs
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x[..., : dim // 2], x[..., dim // 2 :]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


class LlamaBlock(nn.Module):
    """RMSNorm, causal grouped-query attention with rotary positions, RMSNorm, SwiGLU."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads = cfg.heads, cfg.kv_heads
        self.head_dim = cfg.width // cfg.heads
        self.norm_attn = RMSNorm(cfg.width)
        self.q = nn.Linear(cfg.width, cfg.heads * self.head_dim, bias=False)
        self.kv = nn.Linear(cfg.width, 2 * cfg.kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(cfg.heads * self.head_dim, cfg.width, bias=False)
        self.norm_mlp = RMSNorm(cfg.width)
        self.gate_up = nn.Linear(cfg.width, 2 * cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden, cfg.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        h = self.norm_attn(x)
        q = self.q(h).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k, v = (
            t.view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
            for t in self.kv(h).chunk(2, dim=-1)
        )
        chunk = _CHUNK.get()
        start = 0 if chunk is None else chunk.start  # a sequence chunk's first position
        group = self.heads // self.kv_heads  # each key/value head serves `group` queries
        k, v = rotary(k, start).repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        attn = causal_attention(self, rotary(q, start), k, v)
        x = x + self.o(attn.transpose(1, 2).reshape(batch, seq, -1))
        gate, up = self.gate_up(self.norm_mlp(x)).chunk(2, dim=-1)
        return x + self.down(functional.silu(gate) * up)


class LlamaHead(nn.Module):
    """Final RMSNorm and the vocabulary projection."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.width)
        self.lm = nn.Linear(cfg.width, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.norm(x))


def llama_layers(cfg: LlamaConfig) -> list[nn.Module]:
    """The layers of a Llama: token embedding (positions are rotary, inside attention),
    `blocks` blocks, head; `LlamaConfig.init` drawn from torch's global generator."""
    layers = [nn.Embedding(cfg.vocab, cfg.width), *(LlamaBlock(cfg) for _ in range(cfg.blocks))]
    layers.append(LlamaHead(cfg))
    for layer in layers:
        init_layer(layer, *cfg.init)
    return layers


MODEL_FAMILIES: dict[str, dict[str, GPTConfig] | dict[str, LlamaConfig]] = {
    "gpt": GPT_SIZES,
    "llama": LLAMA_SIZES,
}
"""The built-in models, `--model FAMILY:SIZE`."""


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

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype not in DTYPES:
            raise ModelError(f"unknown dtype `{self.dtype}`; use one of: {', '.join(DTYPES)}")
        return DTYPES[self.dtype]

    def build(self, layers: Iterable[int] | None = None) -> LayeredModel:
        """The model on the current default device: a built-in one or a Hugging Face
        checkpoint's (backends/hf_models.py) made on the meta device with only `layers`
        (None: all) materialized (`LayeredModel.materialize`), the rest left on meta; a
        user's whole, whatever `layers` says, in fp32 from the seed, then cast."""
        kind, sep, rest = self.name.partition(":")
        if not sep or not rest:
            raise ModelError(
                f"`--model {self.name}`: expected gpt:SIZE, llama:SIZE, hf:DIR, module:FUNC or "
                "file.py:FUNC"
            )
        if kind in MODEL_FAMILIES:
            with torch.device("meta"):
                model = self._built_in(kind, rest)
        elif kind == "hf":  # a Hugging Face checkpoint: the `hf` extra's transformers
            from pipelang.backends.hf_models import hf_model

            model = hf_model(self)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                built = user_model(self)
            model = LayeredModel(
                self, built.layers, built.vocab, built.seq_len, built.stages, built.loss, built.ties
            )
        for layer in model.layers:
            layer.to(self.torch_dtype)
        for layer in model.layers[: self.frozen_layers]:
            layer.requires_grad_(False)
        model.materialize(range(len(model.layers)) if layers is None else layers)
        return model

    def _built_in(self, kind: str, size: str) -> LayeredModel:
        """`gpt:SIZE` or `llama:SIZE` (on the meta device: nothing drawn, nothing made)."""
        sizes = MODEL_FAMILIES[kind]
        if size not in sizes:
            raise ModelError(f"unknown {kind} size `{size}`; use one of: {', '.join(sizes)}")
        cfg, seq_len = sizes[size], self.seq_len or sizes[size].seq_len
        layers = gpt_layers(cfg, seq_len) if isinstance(cfg, GPTConfig) else llama_layers(cfg)
        return LayeredModel(self, layers, cfg.vocab, seq_len, init=cfg.init)


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
    init: tuple[frozenset[str], float] | None = None
    """A built-in model's `layer_init.init_layer` rule; None: a user's, built whole."""

    def materialize(self, indices: Iterable[int]) -> None:
        """Give the layers `indices` still on meta their weights (backends/layer_init.py)."""
        if self.init is not None:
            materialize(self.layers, indices, self.spec.seed, self.spec.torch_dtype, self.init)

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
    with torch.device("meta"):
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


def load_here(spec: list[object]) -> str:
    """The work of `model_import.vet`'s child: `user_model` of the spec on the meta
    device; its error in one line ("" when it loaded). Here, beside `ModelSpec`, so that
    model_import imports neither this module nor user_models."""
    name = str(spec[0])
    try:
        import torch

        with torch.device("meta"):  # torch's own lazy imports (its meta kernels) first
            torch.nn.Linear(2, 2)(torch.nn.Embedding(2, 2)(torch.zeros(1, dtype=torch.long)))
        Path(f"{sys.argv[2]}.started").touch()  # the model's own code runs from here
        trust(name)
        model = ModelSpec(name, spec[1], spec[2], spec[3])  # type: ignore[arg-type]
        with torch.device("meta"):
            user_model(model)
    except ModelError as err:
        return str(err) or "ModelError"
    except BaseException as err:  # whatever the user's code raises, sys.exit() too
        return clip(f"`--model {name}`: loading it failed: {said(err)}")
    return ""
