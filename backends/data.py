"""Training data from a file, `run --data FILE`.

A file is one long stream of token ids: a `.npy` array of integers, a `.bin` of
little-endian uint16 ids (the layout nanoGPT's `prepare.py` writes), or anything else read
as bytes (tokens 0-255, so any text file). Every batch is a function of (seed, step,
micro-batch) alone, so each rank and the one-process `--check` reference read the same
windows without talking to each other.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

__all__ = ["DataError", "check_tokens", "load_tokens", "sample_batch", "synthetic_batch"]


class DataError(Exception):
    """A data file that cannot be read as tokens, or does not fit the model."""


@functools.cache
def load_tokens(path: str) -> np.ndarray:
    """The token ids of `path` as a read-only 1-D integer array (memory-mapped)."""
    file = Path(path)
    if not file.is_file():
        raise DataError(f"`--data {path}`: no such file")
    try:
        if file.suffix == ".npy":
            tokens = np.load(file, mmap_mode="r", allow_pickle=False)
        elif file.suffix == ".bin":
            if file.stat().st_size % 2:
                raise DataError(
                    f"`--data {path}`: a .bin file holds uint16 token ids, but its size "
                    f"({file.stat().st_size} bytes) is odd"
                )
            tokens = np.memmap(file, dtype="<u2", mode="r")
        else:
            tokens = np.memmap(file, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as err:
        raise DataError(f"`--data {path}`: cannot read it: {err}") from None
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise DataError(
            f"`--data {path}`: expected a 1-D array of integer token ids, found "
            f"{tokens.ndim}-D {tokens.dtype}"
        )
    return tokens


def check_tokens(path: str, vocab: int, seq_len: int) -> None:
    """Raise DataError unless `path` holds a window of `seq_len` + 1 ids, all below
    `vocab`."""
    tokens = load_tokens(path)
    if len(tokens) < seq_len + 1:
        raise DataError(
            f"`--data {path}` holds {len(tokens)} tokens; a sequence of {seq_len} needs "
            f"at least {seq_len + 1} (lower --seq-len or give more data)"
        )
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        raise DataError(
            f"`--data {path}` holds token id {bad}, outside the model's vocabulary 0..{vocab - 1}"
        )


def sample_batch(
    path: str, seed: int, step: int, mb: int, size: int, seq_len: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """`size` windows of `seq_len` + 1 tokens at seeded random offsets: the ids and the
    next-token targets (the same window shifted by one)."""
    tokens = load_tokens(path)
    starts = torch.randint(0, len(tokens) - seq_len, (size,), generator=_generator(seed, step, mb))
    windows = np.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()]).astype(np.int64)
    batch = torch.from_numpy(windows).clone()  # memory of torch's own, as a synthetic batch's
    return batch[:, :-1].to(device), batch[:, 1:].to(device)


def synthetic_batch(
    seed: int, step: int, mb: int, size: int, seq_len: int, vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Without `--data`: walks through a fixed random permutation of the vocabulary from
    random starts, so each token predicts the next; targets are the inputs shifted by one."""
    successor = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    gen = _generator(seed, step, mb)
    tokens = torch.empty(size, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (size,), generator=gen)
    for t in range(seq_len):
        tokens[:, t + 1] = successor[tokens[:, t]]
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def _generator(seed: int, step: int, mb: int) -> torch.Generator:
    """The random stream of one micro-batch of one step."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step * 10_007 + mb + 1) % 2**62)
