"""The three ways to write the per-rank order: `rank` loops, `greedy` policy, `repeat` block.

Each module turns one kind of `order` declaration into per-rank lists of compute
`Action`s; `passes/expand_orders.py` picks the module by the declaration's type.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipelang import ast
from pipelang.diagnostics import fail
from pipelang.evaluate import Env, Scope
from pipelang.ir import (
    STASH_KINDS,
    Action,
    Kind,
    Program,
)

_make = tuple.__new__
"""Builds an Action without NamedTuple's Python-level __new__: this runs once per op."""


@dataclass(frozen=True)
class Layout:
    """What an order needs to know about the schedule: its declarations, evaluated (a
    `Program` without ranks: placement, micro-batches, kinds, costs, `after` edges,
    chunks and shapes), and the scope its expressions are compiled in."""

    scope: Scope
    env: Env
    program: Program
    """The schedule's declarations; its `ranks` are what the order makes."""
    local_stages: dict[tuple[str, int], tuple[int, ...]]
    """(pipeline, rank) -> the stages of that pipeline the rank holds, ascending."""

    def declaring(self, **changes: Any) -> Layout:
        """This layout with some of its declarations changed (`after`, `costs`)."""
        return dataclasses.replace(self, program=dataclasses.replace(self.program, **changes))

    def op_time(self) -> Callable[[Action], float]:
        """How long each op runs, as `simulate` times it: `costs` as the schedule's ops
        are timed (`CostModel.for_kinds`), each chunk its share and each shaped
        micro-batch its factor (`CostModel.timer`). Greedy and squeezed orders are built
        with it."""
        program = self.program
        return program.costs.for_kinds(program.kinds).timer(program.chunks, program.shapes)

    def op(
        self,
        call: ast.OpCall,
        kind: Kind,
        mb: int | None,
        stage: int | None,
        rank: int | None,
        fused: bool = False,
        chunk: int | None = None,
    ) -> Action:
        """The Action an op statement names; `rank` picks the stage when it is left out;
        `fused` joins it to the action before it (`&`, `BW`)."""
        if kind is Kind.P:
            if chunk is not None:
                raise fail("E0319", "`P` runs on a whole micro-batch and names no chunk", call.span)
            return self._frozen_op(call, mb, stage)
        if kind in STASH_KINDS and self.program.chunks is not None:
            raise fail(
                "E0211",
                "sequence chunks do not combine with evictions (`E`, `L`) yet",
                call.span,
                help="drop the eviction, or the `chunks` declaration",
            )
        if (chunk is None) != (self.program.chunks is None) or (
            chunk is not None and not 0 <= chunk < self.program.chunks.count  # type: ignore[union-attr]
        ):
            raise self.chunk_error(call, chunk)
        # The fast path first: this runs once per op of the schedule.
        if mb is not None and 0 <= mb < len(self.program.assignment):
            pipeline = self.program.assignment[mb]
            if stage is None:
                stages = self.local_stages.get((pipeline, rank), ())  # type: ignore[arg-type]
                if len(stages) == 1:
                    return _make(
                        Action,
                        (kind, mb, stages[0], pipeline, None, None, chunk, call.span, fused),
                    )
            elif 0 <= stage < self.program.num_stages:
                return _make(
                    Action, (kind, mb, stage, pipeline, None, None, chunk, call.span, fused)
                )
        raise self._bad_op(call, mb, stage, rank)

    def chunk_error(self, call: ast.OpCall, chunk: int | None) -> Exception:
        """An op that names a chunk where there are none, names none where there are,
        or names one that does not exist (E0319)."""
        if self.program.chunks is None:
            return fail(
                "E0319",
                f"`{call.kind}` names a chunk, but the schedule does not split micro-batches",
                call.span,
                help="declare the chunks (`chunks 4`), or drop `chunk=`",
            )
        if chunk is None:
            return fail(
                "E0319",
                f"`{call.kind}` names no chunk, and the schedule splits every micro-batch "
                f"into {self.program.chunks.count}",
                call.span,
                help=f"write `{call.kind}(mb, chunk=c)` with c in 0..{self.program.chunks.count}",
            )
        return fail(
            "E0319",
            f"chunk {chunk} does not exist",
            call.span,
            notes=(f"chunks are 0..{self.program.chunks.count}",),
        )

    def _frozen_op(self, call: ast.OpCall, mb: int | None, stage: int | None) -> Action:
        """`P(mb)`: the frozen forward that feeds F(mb, 0), on whichever rank lists it
        (`validate` checks that the rank holds the frozen part, E0317)."""
        if self.program.frozen is None:
            raise fail(
                "E0309",
                "`P` runs the frozen part, and the schedule declares none",
                call.span,
                help="declare the ranks that hold it: `frozen on ranks 0..D`",
            )
        if stage not in (None, 0):
            raise fail(
                "E0103",
                f"`P` feeds stage 0 and takes no other stage (here {stage})",
                call.span,
                help="write `P(mb)`",
            )
        if mb is None or not 0 <= mb < len(self.program.assignment):
            raise self._bad_op(call, mb, 0, None)
        return Action(Kind.P, mb, 0, self.program.assignment[mb], span=call.span)

    def update(
        self, call: ast.OpCall, stage: int | None, rank: int, counts: dict[tuple[int, str], int]
    ) -> Action:
        """The `U` action a `U()` / `U(stage=s)` statement names on `rank`, numbered by
        `counts` (the updates of each stage copy on this rank so far, which it advances)."""
        return self.copy_op(call, Kind.U, stage, rank, counts)

    def copy_op(
        self,
        call: ast.OpCall,
        kind: Kind,
        stage: int | None,
        rank: int,
        counts: dict[tuple[int, str], int],
    ) -> Action:
        """The action of a statement that names a stage copy of `rank`, not a
        micro-batch (`U()`, `gather(stage=s)`, `reshard()`), numbered by `counts` (the
        actions of each copy so far, which it advances): a `U` from 0, a `gather` or
        `reshard` None for its first, then 1, 2, ... (Kind.GATHER)."""
        copies = [
            (s, p.name)
            for p in self.program.pipelines
            for s in self.local_stages.get((p.name, rank), ())
            if stage is None or s == stage
        ]
        if len(copies) != 1:
            held = sorted(
                {
                    s
                    for p in self.program.pipelines
                    for s in self.local_stages.get((p.name, rank), ())
                }
            )
            what = "several stage copies" if copies else f"no copy of stage {stage}"
            name = "U" if kind is Kind.U else f"{kind.value}()"
            written = "U(stage=s)" if kind is Kind.U else f"{kind.value}(stage=s)"
            raise fail(
                "E0103",
                f"`{name}` on rank {rank} names {what}",
                call.span,
                notes=(f"rank {rank} holds stages {', '.join(map(str, held))}",),
                help=f"write `{written}` with a stage this rank holds",
            )
        copy = copies[0]
        number = counts.get(copy, 0)
        counts[copy] = number + 1
        if kind is not Kind.U and number == 0:
            return Action(kind, None, copy[0], copy[1], span=call.span)
        return Action(kind, number, copy[0], copy[1], span=call.span)

    def _bad_op(
        self, call: ast.OpCall, mb: int | None, stage: int | None, rank: int | None
    ) -> Exception:
        if mb is None:
            return fail(
                "E0103",
                f"`{call.kind}` needs a micro-batch here",
                call.span,
                help=f"write `{call.kind}(mb)` or `{call.kind}(mb, stage)`",
            )
        if not 0 <= mb < len(self.program.assignment):
            return fail(
                "E0103",
                f"micro-batch {mb} does not exist",
                call.span,
                notes=(f"micro-batches are 0..{len(self.program.assignment)}",),
            )
        if stage is not None:
            return fail(
                "E0103",
                f"stage {stage} does not exist",
                call.span,
                notes=(f"stages are 0..{self.program.num_stages}",),
            )
        pipeline = self.program.assignment[mb]
        stages = self.local_stages.get((pipeline, rank), ()) if rank is not None else ()
        if not stages:
            return fail(
                "E0301",
                f"rank {rank} holds no stage of pipeline `{pipeline}`",
                call.span,
                help="name the stage, or check the placement",
            )
        listed = ", ".join(map(str, stages))
        return fail(
            "E0103",
            f"`{call.kind}` needs a stage: rank {rank} holds stages {listed} "
            f"of pipeline `{pipeline}`",
            call.span,
            help=f"write `{call.kind}(mb, stage)`",
        )
