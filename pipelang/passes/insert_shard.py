"""Pass `insert-shard`: a sharded stage copy's all-gathers and reduce-scatter (`--shard`).

Needs: a validated Program after `insert-holds`, compiled with `Options.shard` K > 1 (the
`--dp K` copies each stage copy is sharded over). Its order may hold the `gather()` and
`reshard()` a schedule writes (`gather@s/p`, `reshard@s/p`, docs/language.md); without
`--shard` a program that writes none comes back unchanged (the same object), and one
that writes some is E0322.
Guarantees: on every rank, for each stage copy it holds, the copy is gathered at each of
its ops (F, B, W, R): a `gather@s/p` is inserted right before the copy's first op of the
step unless the order gathers it before that, and after a written `reshard()` the order
must gather it again itself (E0322 otherwise); then one `reduce_scatter@s/p` right after
its last backward (B, or W where W is split off): the gradients the copy accumulated
over its micro-batches are summed over the K copies once per step, each copy keeping
the sum of its own shard, and the gathered parameters are dropped. A copy's gathers and
reshards are numbered in its rank's order (`gather@0/main`, `gather1@0/main`, ...).
They are ops of the op graph (rebuilt here), so `simulate` and `viz` time them (cost
entries `AG` and `RS`; a reshard takes no time); the runtime performs them with FSDP2
(backends/shard.py). A program the runtime cannot shard yet
(`features.REFUSED["--shard"]`) is E0321.

E0322, per rank and stage copy, at the line that wrote it: an op of the copy after its
`reshard()` with no `gather()` between; a `reshard()` of a copy that is not gathered
(never yet, resharded already, or reduced after its last backward); a `gather()` of a
copy gathered already, or one that no op of the copy uses before the copy is resharded
or reduced.

The K copies of a rank run the same list, so they meet in every collective in one order.

    rank 0: F0@0/main F1@0/main B0@0/main B1@0/main           (shard 2)
  =>
    rank 0: gather@0/main F0@0/main F1@0/main B0@0/main B1@0/main reduce_scatter@0/main

    rank 0: F0@0/main reshard@0/main gather1@0/main B0@0/main  (written: reshard, gather)
  =>
    rank 0: gather@0/main F0@0/main reshard@0/main gather1@0/main B0@0/main
            reduce_scatter@0/main
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipelang.diagnostics import Diagnostic, PipelangError, fail, label
from pipelang.features import refuse
from pipelang.ir import COMPUTE_KINDS, SHARD_KINDS, Action, Kind, Program
from pipelang.ir.graph import OpGraph, op_graph
from pipelang.passes.validate.problems import Problem, collapse

if TYPE_CHECKING:
    from pipelang.compiler import Compilation

_USES = COMPUTE_KINDS - {Kind.P}
"""The kinds that use a stage copy's weights (a frozen forward `P` does not)."""
_GRADIENTS = frozenset({Kind.B, Kind.W})
"""The kinds that add to a stage copy's gradients."""
_MANY = {
    "use": "ops use a resharded stage without a `gather()`",
    "reshard": "`reshard()`s drop parameters that are not gathered",
    "gather": "`gather()`s gather parameters that are gathered already",
    "unused": "`gather()`s gather parameters that no op uses",
    "reduced": "`reshard()`s follow their stage's last backward, whose reduce-scatter "
    "reshards it already",
}
_FIX = {
    "use": "write `gather()` before it (after the `reshard()`)",
    "reshard": "drop this `reshard()`, or `gather()` before it",
    "gather": "drop this `gather()`: the stage stays gathered until a `reshard()`",
    "unused": "drop this `gather()`, or move it before the ops that use the stage",
    "reduced": "drop this `reshard()`: the reduce-scatter after the stage's last backward "
    "reshards it",
}

Copy = tuple[int | None, str | None]


class _State(enum.Enum):
    FRESH = "not gathered yet this step"
    GATHERED = "gathered"
    RESHARDED = "resharded"
    REDUCED = "resharded by the reduce-scatter after its last backward"


@dataclass
class _Copy:
    """Where one stage copy stands while its rank's order is walked."""

    last: int
    """The step of its last backward's compound's end (its `reduce_scatter` follows)."""
    state: _State = _State.FRESH
    since: Action | None = None
    """The written action that put it in its state (a `gather`, a `reshard`)."""
    used: bool = True
    """An op used it since its last `gather`."""


def insert_shard(program: Program, shard: int) -> Program:
    """`program` with each stage copy's gathers and reduce-scatter (module docstring);
    `shard` is the number of data-parallel copies each stage is sharded over (1: none).
    Raises E0322 for shard ops written out of place, E0321 for a program that cannot be
    sharded."""
    if shard < 2:
        _unsharded(program)
        return program
    refuse(program, "--shard", "E0321", program.order_span)
    problems: list[Problem] = []
    ranks = tuple(_rank(rank, a, problems) for rank, a in enumerate(program.ranks))
    if problems:
        raise PipelangError(sorted(collapse(problems, _MANY), key=Diagnostic.sort_key))
    return dataclasses.replace(program, ranks=ranks)


def _unsharded(program: Program) -> None:
    """E0322 at the first shard op (by position) of a program compiled without --shard."""
    written = [a for actions in program.ranks for a in actions if a.kind in SHARD_KINDS]
    if not written:
        return
    first = min(written, key=lambda a: a.span.sort_key() if a.span else ("", 0))
    raise fail(
        "E0322",
        f"`{first.kind.value}()` needs sharded stages, and the schedule is compiled "
        "without --shard",
        first.span,
        notes=(f"the order writes {len(written)} shard ops",) if len(written) > 1 else (),
        help="compile it with --dp K --shard (K >= 2), or drop the shard ops",
    )


def _rank(rank: int, actions: tuple[Action, ...], problems: list[Problem]) -> tuple[Action, ...]:
    """One rank's order with its copies' gathers (where none is written) and
    reduce-scatters, every gather and reshard numbered; problems appended."""
    copies: dict[Copy, _Copy] = {}
    for step, action in enumerate(actions):
        if action.kind in _GRADIENTS:
            end = step
            while end + 1 < len(actions) and actions[end + 1].fused:
                end += 1  # after the whole compound
            copies[(action.stage, action.pipeline)] = _Copy(end)
    before: dict[int, list[Action]] = {}
    after: dict[int, list[Action]] = {}
    numbers: dict[tuple[Kind, Copy], int] = {}
    out = list(actions)
    head = 0
    for step, action in enumerate(actions):
        head = head if action.fused else step  # the compound's first step
        copy = copies.get((action.stage, action.pipeline))
        if copy is None:  # a stage copy without a backward here: a written shard op
            continue
        if action.kind in _USES:
            if copy.state is _State.FRESH:
                gather = _number(Action(Kind.GATHER, None, action.stage, action.pipeline), numbers)
                before.setdefault(head, []).append(gather)
            _use(rank, action, copy, problems)
        elif action.kind in SHARD_KINDS:
            out[step] = action = _number(action, numbers)  # as the dump names it
            _written(rank, action, copy, problems)
        if step == copy.last:
            _unused(rank, copy, problems)
            copy.state, copy.since = _State.REDUCED, None
            reduce = Action(Kind.REDUCE_SCATTER, None, action.stage, action.pipeline)
            after.setdefault(step, []).append(reduce)
    found: list[Action] = []
    for step, action in enumerate(out):
        found.extend(before.get(step, ()))
        found.append(action)
        found.extend(after.get(step, ()))
    return tuple(found)


def _use(rank: int, action: Action, copy: _Copy, problems: list[Problem]) -> None:
    """An op of the copy: gathered before it (where the copy is fresh, the caller
    inserts the gather), or a problem."""
    if copy.state is _State.FRESH:
        copy.state = _State.GATHERED
    elif copy.state is not _State.GATHERED:
        where = f" (line {_line(copy.since)})" if copy.since is not None else ""
        problems.append(
            _problem(
                "use",
                rank,
                action,
                f"`{action}` on rank {rank} uses stage {action.stage} after its "
                f"`reshard()`{where} with no `gather()` between",
                copy.since,
                "resharded here",
            )
        )
        copy.state = _State.GATHERED  # one problem per reshard, not per op after it
    copy.used = True


def _written(rank: int, action: Action, copy: _Copy, problems: list[Problem]) -> None:
    """A written `gather` or `reshard` of the copy, checked against where it stands."""
    kind, stage = action.kind, action.stage
    if kind is Kind.GATHER:
        if copy.state is _State.GATHERED:
            detail = f"`gather()` of stage {stage} on rank {rank}, which is gathered already"
            problems.append(_problem("gather", rank, action, detail, copy.since, "gathered here"))
        elif copy.state is _State.REDUCED:
            detail = (
                f"`gather()` of stage {stage} on rank {rank} after its last backward: no op uses it"
            )
            problems.append(_problem("unused", rank, action, detail))
        copy.state, copy.since, copy.used = _State.GATHERED, action, False
        return
    if copy.state is _State.GATHERED:
        _unused(rank, copy, problems)
        copy.state, copy.since = _State.RESHARDED, action
        return
    what = "reduced" if copy.state is _State.REDUCED else "reshard"
    detail = f"`reshard()` of stage {stage} on rank {rank}, which is {copy.state.value}"
    if copy.state is _State.RESHARDED:
        detail += " already"
    where = "resharded here" if copy.state is _State.RESHARDED else ""
    problems.append(_problem(what, rank, action, detail, copy.since, where))


def _unused(rank: int, copy: _Copy, problems: list[Problem]) -> None:
    """A problem where the copy's written `gather` had no op after it."""
    if copy.state is _State.GATHERED and not copy.used and copy.since is not None:
        gather = copy.since
        detail = (
            f"`gather()` of stage {gather.stage} on rank {rank}: no op uses it before it "
            "is resharded"
        )
        problems.append(_problem("unused", rank, gather, detail))
    copy.used = True


def _problem(
    what: str,
    rank: int,
    action: Action,
    detail: str,
    other: Action | None = None,
    other_label: str = "",
) -> Problem:
    labels = label(other.span, other_label) if other is not None and other_label else ()
    return Problem("E0322", action, rank, detail, _FIX[what], labels, what=what)


def _line(action: Action) -> int:
    span = action.span
    return span.line if span is not None else 0


def _number(action: Action, numbers: dict[tuple[Kind, Copy], int]) -> Action:
    """A copy's gather or reshard numbered in its rank's order: None for its first,
    then 1, 2, ... (`numbers` counts them so far, and is advanced)."""
    key = (action.kind, (action.stage, action.pipeline))
    number = numbers.get(key, 0)
    numbers[key] = number + 1
    return action._replace(mb=number or None)


def run(c: Compilation) -> Compilation:
    """The pass: each sharded stage copy's gathers and reduce-scatter (and the op graph
    with them)."""
    program = c.need_program()
    sharded = insert_shard(program, c.options.shard)
    if sharded is program:
        return c
    graph: OpGraph = op_graph(sharded)
    return dataclasses.replace(c, program=sharded, graph=graph)
