"""A small model with one layer four times heavier than the others, for the planner.

`pipelang run ... --model pipelang.planner.demo:unbalanced` and `pipelang profile
--model pipelang.planner.demo:unbalanced` build it. Its layers: a token embedding, one
heavy residual MLP block (hidden width 16x the model width), seven light residual MLP
blocks (hidden width 4x), and the vocabulary head. The heavy block does four times the
arithmetic of a light one, so an even split of the layers over two stages puts it, and
four light blocks, on the first stage: the case a planner's partition must fix.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 256
WIDTH = 128


class MLPBlock(nn.Module):
    """A pre-LayerNorm residual MLP: x + W2 gelu(W1 ln(x)), hidden width `hidden`."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.ln(x))))


class Head(nn.Module):
    """LayerNorm and the projection to the vocabulary: next-token logits."""

    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.lm = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.ln(x))


def unbalanced(seq_len: int = 32) -> nn.Sequential:
    """Embedding, one heavy block (4x), seven light blocks, head: ten layers."""
    layers: list[nn.Module] = [nn.Embedding(VOCAB, WIDTH)]
    layers.append(MLPBlock(WIDTH, 16 * WIDTH))
    layers.extend(MLPBlock(WIDTH, 4 * WIDTH) for _ in range(7))
    layers.append(Head(WIDTH, VOCAB))
    model = nn.Sequential(*layers)
    model.vocab_size = VOCAB  # type: ignore[assignment]
    model.seq_len = seq_len  # type: ignore[assignment]
    return model
