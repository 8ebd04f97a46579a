"""The one order in which gradients are summed, so that `--check` can be bitwise.

Floating-point addition is not associative: the same micro-batch gradients summed in
another grouping differ in their last bits, and Adam amplifies such differences step
after step. So every sum a run makes has one fixed grouping, which the `--check`
reference (`backends/reference.py`) repeats:

- **on a stage copy**, micro-batch gradients accumulate in the order the copy's
  backward ops run (autograd adds each new one to `.grad`): a left fold. Where the
  backward is split, W adds the weight gradients in the order the W's run, and B the
  few a split B adds itself (a norm's, a bias alone: `weight_split`); where the W's run
  in another order than the B's, each parameter follows the ops that add it;
- **over a stage's replicas** (Chimera's two pipelines, `--dp` copies) and **over the
  whole run** (`--clip-grad`'s norm, tied weights), the members' parts, ordered by
  process, are summed by `tree_sum`: members past the largest power of two m first fold
  into member i - m, then the m partial sums add pairwise, as a balanced binary tree.
  Every addition has two operands, and a + b == b + a exactly, so each member can compute
  the sum itself from exchanges with one partner per level (recursive doubling,
  `exchange_sum`), and every member ends with the same bits.

With two members the tree is one addition, which any allreduce computes exactly; with more,
a ring allreduce (gloo's, NCCL's) adds in an order that depends on the element's position
and the algorithm, so `DistTransport` exchanges instead (log2 P messages of the whole
gradient, against a ring's 2 (P - 1) / P).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipelang.ir import Kind, Program

__all__ = ["Member", "SumPlan", "Unit", "accumulation", "exchange_sum", "tree_sum"]


def _fold_width(members: int) -> int:
    """The largest power of two not above `members` (at least 1)."""
    return 1 << (members.bit_length() - 1)


def tree_sum(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The members' parts, ordered by process, summed in the fixed tree (a new tensor)."""
    if not parts:
        raise ValueError("tree_sum of no parts")
    width = _fold_width(len(parts))
    level = [
        parts[i] + parts[i + width] if i + width < len(parts) else parts[i].clone()
        for i in range(width)
    ]
    while len(level) > 1:
        level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
    return level[0]


def exchange_sum(flat: torch.Tensor, members: Sequence[int], me: int, group: object) -> None:
    """Replace `flat` by `tree_sum` of every member's `flat`, in place: this process is
    `members[me]` (process ranks, ordered), `group` a process group holding them all.

    Point-to-point exchanges, one partner per level; each pair's send and receive go
    together (`batch_isend_irecv`), so NCCL cannot deadlock on them.
    """
    count = len(members)
    width = _fold_width(count)
    extra = me >= width  # folds into member me - width, then gets the result back
    if extra:
        _send(flat, members[me - width], group)
        _recv_into(flat, members[me - width], group)
        return
    if me + width < count:
        part = torch.empty_like(flat)
        _recv_into(part, members[me + width], group)
        flat.add_(part)
    step = 1
    while step < width:
        partner = members[me ^ step]
        part = torch.empty_like(flat)
        ops = [
            dist.P2POp(dist.isend, flat, partner, group),  # type: ignore[arg-type]
            dist.P2POp(dist.irecv, part, partner, group),  # type: ignore[arg-type]
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        flat.add_(part)
        step *= 2
    if me + width < count:
        _send(flat, members[me + width], group)


def _send(tensor: torch.Tensor, peer: int, group: object) -> None:
    work = dist.isend(tensor, peer, group=group)  # type: ignore[arg-type]
    assert work is not None
    work.wait()


def _recv_into(tensor: torch.Tensor, peer: int, group: object) -> None:
    dist.recv(tensor, peer, group=group)  # type: ignore[arg-type]


Unit = tuple[int, int | None]
"""What one backward adds to a copy's gradients: (micro-batch of the step's K x N, its
sequence chunk or None)."""


@dataclass(frozen=True, slots=True)
class Member:
    """One process's part of a stage's gradient sum."""

    process: int
    """Its rank in the whole run (`replica * R + rank`)."""
    units: tuple[Unit, ...]
    """The backwards whose gradients its copy adds, in the order its B's run."""
    late: tuple[Unit, ...] | None = None
    """Where its W's run in another order than its B's, the order they run in: the
    parameters W adds follow it, those a split B adds (`weight_split`) follow `units`
    (which of them B adds, the reference asks the runtime:
    `reference_runs.added_by_backward`). None where the orders are one."""


@dataclass(frozen=True, slots=True)
class SumPlan:
    """Every gradient sum of a step, as a run makes it (what `--check` repeats)."""

    stages: dict[int, list[Member]]
    """Per stage, the processes holding a copy, ordered, and what each adds."""
    norms: list[list[int]]
    """Per process, the stages whose gradients its part of `--clip-grad`'s norm counts,
    in the order it adds them (`RankRuntime.grad_square_sum`)."""
    shards: int = 1
    """`--dp K --shard`: K, each data-parallel copy's part of the norm counting its shard
    of each gradient (`shard_piece`); 1: whole gradients, in copy 0."""


def shard_piece(tensor: torch.Tensor, k: int, shards: int) -> torch.Tensor:
    """The part of `tensor` that data-parallel copy `k` of `shards` holds under `--shard`:
    its dim-0 piece as FSDP2 cuts it (`torch.chunk`, empty past the last piece)."""
    pieces = torch.chunk(tensor, shards, dim=0)
    return pieces[k] if k < len(pieces) else tensor[:0]


def accumulation(program: Program, dp: int, shard: bool = False) -> SumPlan | None:
    """The gradient sums of a run of `program` with `--dp dp` (and `--shard`). None where
    they cannot be repeated exactly: a rank with two copies of one stage."""
    stages: dict[int, list[Member]] = {}
    norms: list[list[int]] = [[] for _ in range(program.num_ranks * dp)]
    n = program.num_microbatches
    for rank, actions in enumerate(program.ranks):
        held = program.stage_copies(rank)
        if len({stage for stage, _ in held}) < len(held):
            return None
        for stage, pipeline in held:
            order, w_order = (
                tuple(
                    dict.fromkeys(
                        (a.mb or 0, a.chunk)
                        for a in actions
                        if a.kind is kind and (a.stage, a.pipeline) == (stage, pipeline)
                    )
                )
                for kind in (Kind.B, Kind.W)
            )
            late = w_order if w_order and w_order != order else None
            for k in range(dp):
                units, later = (
                    None if o is None else tuple((k * n + mb, chunk) for mb, chunk in o)
                    for o in (order, late)
                )
                assert units is not None
                member = Member(k * program.num_ranks + rank, units, later)
                stages.setdefault(stage, []).append(member)
            if min(program.replicas(stage)) == rank:
                for k in range(dp if shard else 1):  # sharded: each copy its shard
                    norms[k * program.num_ranks + rank].append(stage)
    for members in stages.values():
        members.sort(key=lambda m: m.process)
    return SumPlan(stages, norms, dp if shard else 1)
