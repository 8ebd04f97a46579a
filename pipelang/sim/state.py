"""Each process's bytes of parameters, gradients and optimizer state, predicted: the one
rule that `simulate --model` (and, for the optimizer's share, `plan`) uses, under the
same definitions as the run's measured `param_bytes`, `grad_bytes` and
`optimizer_bytes` (backends/metrics.py, `RankRuntime.held_bytes`): each storage once,
gradients as held at the optimizer step.

Per parameter of a process's stage copies (`Param`, read off the model built on the
meta device, backends/param_shapes.py):

    parameters   its bytes; a frozen part's too (never sharded)
    gradients    its bytes if trained (in fp32 under --mixed-precision: the masters'
                 gradients, the bf16 parameters' own cleared by their hook)
    optimizer    per trained parameter, `OPTIMIZER_STATES` tensors of its size (in fp32
                 under --mixed-precision), plus its fp32 master under --mixed-precision

Under `--dp K --shard` each stage copy is FSDP2-sharded over its K copies: a parameter
of R rows (its dim 0) keeps ceil(R / K) rows per process, padded: FSDP2 allocates every
process's shard at the padded size (`padded_rows`), and the reduce-scatter's output,
which the gradients are views of, is padded the same way, so parameters and gradients
count the padding. The optimizer is built over the local shards themselves (each
process's rows of `torch.chunk`, `shard_rows`: fewer on the last processes where K does
not divide R), so its state counts no padding and may differ between the K copies.
Under `--mixed-precision` the shards are the fp32 masters themselves (FSDP2's
`MixedPrecisionPolicy` gathers them in bf16 for the step, backends/shard.py): fp32
parameters, gradients and states, and no master beside them.

    shard_rows(5, 2) -> 3, 2      padded_rows(5, 2) -> 3
    shard_rows(5, 4) -> 2, 2, 1, 0

Under `--tp T` each process holds its tensor rank's part of each parameter
(`tensor_part`): a parameter `--tp` splits (backends/tensor_parallel.py's plan, read
off the model by `split_dims`: column-parallel weights and biases along dim 0, a fused
projection's each part on its own, row-parallel weights along dim 1) keeps 1/T along
that dimension, unpadded (DTensor's local tensor); the rest (embedding, norms, head, a
row-parallel bias) stays whole on every tensor rank. Its gradient and optimizer state
are the local tensor's size. With `--dp K --shard` too, FSDP2 shards that part's dim 0
over the K copies as above.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipelang.diagnostics import InternalError
from pipelang.ir import Program

OPTIMIZER_STATES = {"sgd": 1, "adam": 2, "adamw": 2}
"""Tensors of optimizer state per trained parameter, each of its size: SGD's momentum
buffer, Adam's and AdamW's two moments (their step count, 0-d, is not counted)."""

MASTER_ITEMSIZE = 4
"""Bytes per element of an fp32 master, of its gradient and of its optimizer state
(--mixed-precision)."""


@dataclass(frozen=True, slots=True)
class Param:
    """One parameter of a stage, as the run holds it."""

    key: int
    """Which storage it is: a parameter two layers of one stage share has one key."""
    rows: int
    """Its dim 0 (1 for a 0-d tensor), what FSDP2 shards."""
    numel: int
    itemsize: int
    """Bytes per element in its dtype (the run's --dtype, or bf16 under --mixed-precision)."""
    trained: bool
    split: int | None = None
    """The dimension `--tp` splits it along (backends/tensor_parallel.py, `split_dims`);
    None: every tensor rank holds it whole."""
    size: int = 0
    """Its size along `split`."""
    parts: int = 1
    """A fused projection's parts, each split over the tensor ranks on its own."""


@dataclass(frozen=True, slots=True)
class ModelParams:
    """The parameters of each stage of a model cut into stages, and of its frozen part."""

    stages: tuple[tuple[Param, ...], ...]
    frozen: tuple[Param, ...] = ()
    tied: bool = False
    """The model ties weights across layers: each stage copy holds its own (the runtime
    deep-copies it), so no parameter is shared between copies."""


@dataclass(frozen=True, slots=True)
class HeldBytes:
    """A process's bytes of parameters, gradients and optimizer state."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0

    def __add__(self, other: HeldBytes) -> HeldBytes:
        return HeldBytes(
            self.params + other.params, self.grads + other.grads, self.optimizer + other.optimizer
        )


def padded_rows(rows: int, shards: int) -> int:
    """The rows FSDP2 gives every one of `shards` processes of a dim 0 of `rows`:
    ceil(rows / shards), the size of torch.chunk's first chunk."""
    return -(-rows // shards)


def shard_rows(rows: int, shards: int, index: int) -> int:
    """The rows process `index` of `shards` holds of a dim 0 of `rows`, unpadded
    (torch.chunk's chunk `index`, empty past the last)."""
    size = padded_rows(rows, shards)
    return min(max(rows - index * size, 0), size)


def tensor_part(param: Param, tp: int, index: int) -> Param:
    """What tensor rank `index` of `tp` holds of `param`: its DTensor's local tensor,
    each of its `parts` cut along `split` as torch.chunk cuts (no padding); whole where
    `--tp` does not split it."""
    if param.split is None or tp == 1:
        return param
    local = param.parts * shard_rows(param.size // param.parts, tp, index)
    numel = param.numel // param.size * local if param.size else 0
    rows = local if param.split == 0 else param.rows
    return Param(param.key, rows, numel, param.itemsize, param.trained)


def param_bytes(
    param: Param, optimizer: str, mixed: bool, shards: int = 1, index: int = 0
) -> HeldBytes:
    """The bytes one parameter takes on process `index` of the `shards` its stage copy
    is sharded over (1: not sharded)."""
    per_row = param.numel // param.rows if param.rows else 0
    padded = padded_rows(param.rows, shards) * per_row
    local = shard_rows(param.rows, shards, index) * per_row
    if not param.trained:
        return HeldBytes(padded * param.itemsize)
    state_size = MASTER_ITEMSIZE if mixed else param.itemsize
    states = OPTIMIZER_STATES[optimizer]
    if mixed and shards > 1:  # the shards are the fp32 masters, gathered in bf16 for a step
        return HeldBytes(padded * state_size, padded * state_size, local * state_size * states)
    states += 1 if mixed else 0  # the fp32 master beside the bf16 parameter
    return HeldBytes(padded * param.itemsize, padded * state_size, local * state_size * states)


def rank_bytes(
    program: Program,
    model: ModelParams,
    optimizer: str,
    mixed: bool = False,
    dp: int = 1,
    shard: bool = False,
    tp: int = 1,
) -> list[HeldBytes]:
    """Per process of a run of `program` with `dp` data-parallel copies and `tp` tensor
    ranks (process `replica * R * tp + rank * tp + tensor`, the run's order,
    backends/mesh.py), its parameter, gradient and optimizer bytes: its stage copies'
    (its tensor rank's part of each, `tensor_part`, then sharded over the `dp` copies
    with `shard`, FSDP2 cutting that part) and its frozen part's. A parameter held by
    two copies on one rank counts once, its optimizer state once per copy (each copy
    has its own optimizer)."""
    if optimizer not in OPTIMIZER_STATES:
        raise InternalError(f"unknown optimizer {optimizer!r}")  # the CLI's choices rule it out
    shards = dp if shard else 1
    found = []
    for replica in range(dp):
        index = replica if shard else 0
        for rank in range(program.num_ranks):
            for tensor in range(tp):
                total, seen = HeldBytes(), set()
                for n, (stage, _) in enumerate(program.stage_copies(rank)):
                    for param in model.stages[stage]:
                        key = (n if model.tied else -1, param.key)
                        part = tensor_part(param, tp, tensor)
                        held = param_bytes(part, optimizer, mixed, shards, index)
                        if key in seen:  # the same tensor: only this copy's optimizer adds
                            held = HeldBytes(0, 0, held.optimizer)
                        seen.add(key)
                        total += held
                if rank in (program.frozen or ()):
                    total += HeldBytes(sum(p.numel * p.itemsize for p in model.frozen))
                found.append(total)
    return found


def state_factor(optimizer: str) -> float:
    """Bytes of weight state per byte of weights, unsharded, in one dtype: the weights,
    their gradients and the optimizer's state (`OPTIMIZER_STATES`); the planner's."""
    return 2.0 + OPTIMIZER_STATES[optimizer]


def totals(held: Sequence[HeldBytes]) -> list[int]:
    """Each process's parameters, gradients and optimizer state together."""
    return [h.params + h.grads + h.optimizer for h in held]
