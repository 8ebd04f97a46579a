"""Small models with one layer four times heavier than the others, for the planner.

`pipelang run ... --model pipelang.planner.demo:unbalanced` and `pipelang profile
--model pipelang.planner.demo:unbalanced` build the first. Its layers: a token embedding,
one heavy residual MLP block (hidden width 16x the model width), seven light residual MLP
blocks (hidden width 4x), and the vocabulary head. The heavy block does four times the
arithmetic of a light one, so an even split of the layers over two stages puts it, and
three light blocks, on the first stage: the case a planner's partition must fix.

`pipelang.planner.demo:skewed` puts its work in its second half (five light blocks, then
five heavy ones): the layer-count split is far from the best one (see `skewed`).

`pipelang.planner.demo:unbalanced_short` has three light blocks instead of seven (six
layers). There the best two-stage split, the embedding and the heavy block on the first
stage, is the best for any heavy/light ratio from about 2.5 up, and at 4x the even
split's slowest stage takes a quarter longer (a 1F1B iteration of 8 micro-batches, 17%):
a gap that measured runs on a noisy machine show, where the ten-layer model's best split
hinges on the measured ratio (4,6 below about 4.3x, 3,7 above) and the even split's
slowest stage takes 12-17% longer.
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


def unbalanced(seq_len: int = 32, light: int = 7) -> nn.Sequential:
    """Embedding, one heavy block (4x), `light` light blocks, head."""
    layers: list[nn.Module] = [nn.Embedding(VOCAB, WIDTH)]
    layers.append(MLPBlock(WIDTH, 16 * WIDTH))
    layers.extend(MLPBlock(WIDTH, 4 * WIDTH) for _ in range(light))
    layers.append(Head(WIDTH, VOCAB))
    model = nn.Sequential(*layers)
    model.vocab_size = VOCAB  # type: ignore[assignment]
    model.seq_len = seq_len  # type: ignore[assignment]
    return model


def unbalanced_short(seq_len: int = 32) -> nn.Sequential:
    """Embedding, one heavy block (4x), three light blocks, head: six layers."""
    return unbalanced(seq_len, light=3)


def skewed(seq_len: int = 32) -> nn.Sequential:
    """Embedding, five light blocks, five heavy blocks (4x each), head: twelve layers
    whose work sits in the second half. The even split of the layers over two stages
    gives the second stage all the heavy blocks, 20 light units of work against 5; the
    best split (8 layers and 4: 5 + 8 against 12) makes the slowest stage about 40%
    shorter, a gap well above run-to-run noise on a shared machine."""
    layers: list[nn.Module] = [nn.Embedding(VOCAB, WIDTH)]
    layers.extend(MLPBlock(WIDTH, 4 * WIDTH) for _ in range(5))
    layers.extend(MLPBlock(WIDTH, 16 * WIDTH) for _ in range(5))
    layers.append(Head(WIDTH, VOCAB))
    model = nn.Sequential(*layers)
    model.vocab_size = VOCAB  # type: ignore[assignment]
    model.seq_len = seq_len  # type: ignore[assignment]
    return model
