"""A small GPT whose attention is written out (`softmax(q k^T) v`), so autograd saves the
attention probabilities: the zero-bubble paper's setting (its 5as^2b term), where the
weight gradient needs far less than the backward (M_W / M_B about 0.4). The built-in
models use fused attention (SDPA), which saves no score matrix.

    pipelang run zb-h1 -p D=4 --model benchmarks/models/softmax_gpt.py:model --check
"""

from __future__ import annotations

import math

import torch
from torch import nn

WIDTH, HEADS, BLOCKS, VOCAB, SEQ = 64, 4, 6, 256, 512


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.fc1, self.fc2 = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        mask = torch.full((SEQ, SEQ), float("-inf")).triu(1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(WIDTH // HEADS) + self.mask[:s, :s]
        attn = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b, s, WIDTH)
        x = x + self.proj(attn)
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x))))


def model() -> dict[str, object]:
    """Embedding, blocks, head: an `nn.Sequential` pipelang splits into stages."""
    torch.manual_seed(0)
    layers = nn.Sequential(
        nn.Embedding(VOCAB, WIDTH),
        *(Block() for _ in range(BLOCKS)),
        nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)),
    )
    return {"model": layers, "vocab_size": VOCAB, "seq_len": SEQ}
