"""The built-in models, `--model gpt:SIZE` and `llama:SIZE`, as layers built from torch.nn,
and the sequence chunks their attention runs over (Seq1F1B).

    gpt:tiny | gpt:small | gpt:medium    a GPT (see `GPT_SIZES`)
    llama:tiny | llama:small             a Llama: RMSNorm, rotary positions, SwiGLU,
                                         grouped-query attention (see `LLAMA_SIZES`)

backends/models.py makes them (`ModelSpec.build`) on the meta device; each layer's
weights come from layer_init.py's rule and the layer's own seed.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as functional
from torch import nn

from pipelang.backends.layer_init import init_layer


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
        # chunks and -1 (not `width`, `self.heads`): under --tp a process computes 1/T
        # of the heads (backends/tensor_parallel.py)
        q, k, v = self.qkv(self.ln_attn(x)).chunk(3, dim=-1)
        shape = (batch, seq, -1, width // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        attn = causal_attention(self, q, k, v)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, -1))
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
        # -1 heads: under --tp a process computes 1/T of them (backends/tensor_parallel.py)
        q = self.q(h).view(batch, seq, -1, self.head_dim).transpose(1, 2)
        k, v = (
            t.view(batch, seq, -1, self.head_dim).transpose(1, 2)
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
