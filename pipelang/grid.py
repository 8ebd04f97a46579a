"""Rank x step and rank x time grids: the compact text pictures of a schedule.

Both grids label ops the same short way (`op_labeler`) and lay cells out the same way
(`render_rows`): one row per rank, every cell padded to the widest label so columns line
up. The deadlock diagnostic draws a rank x step grid (`step_grid`); the simulator's
`Timeline.text_grid` draws a rank x time grid.

    step   |  0    1    2    3         rank 0 | F0 .  .  .  B0 -
    rank 0 |  F0  [B0] [F1]  B1         rank 1 | .  F0 B0 -  .  .
    rank 1 | [F1] [F0] [B0]  B1
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from pipelang.ir import Action, Program, placement
from pipelang.ir.costs import SHARD_COSTS


def op_labeler(program: Program) -> Callable[[int, Action], str]:
    """A function giving the short form of an action on a rank, for grids: `F3`.

    When the program has more than one pipeline, the pipeline's first letter is appended
    (`F3d`; first letter and index for families such as `down0`, `down1`: `F3d1`), and
    `.s<stage>` when the rank holds more than one stage of that pipeline (`F3d.s1`).
    A sharded stage's collectives are `AG` (`gather`) and `RS` (`reduce_scatter`),
    marked the same way. Other actions keep their full token.
    """
    short = _short_names([p.name for p in program.pipelines])
    held = placement.local_stages(program.pipelines)

    def label(rank: int, action: Action) -> str:
        shard = SHARD_COSTS.get(action.kind)
        if not action.kind.is_compute and shard is None:
            return action.text()
        name = shard or f"{action.kind.value}{action.unit()}"
        text = f"{name}{short.get(action.pipeline or '', '')}"
        if len(held.get((action.pipeline or "", rank), ())) > 1:
            text += f".s{action.stage}"
        return text

    return label


def _short_names(names: list[str]) -> dict[str, str]:
    """Pipeline name -> its mark in a grid: none for one pipeline, else the shortest of
    first letter, first letter and trailing digits, or whole name that tells them apart."""
    if len(names) < 2:
        return {}
    for shorten in (lambda n: n[:1], lambda n: n[:1] + n[len(n.rstrip("0123456789")) :]):
        marks = {name: shorten(name) for name in names}
        if len(set(marks.values())) == len(names):
            return marks
    return {name: name for name in names}


def render_rows(rows: Sequence[tuple[str, Sequence[str]]], width_limit: int | None = None) -> str:
    """Lay out rows of cells as `HEAD | c c c`, heads and cells padded to one width each.

    A line longer than `width_limit` characters is cut and ends in `...`.
    """
    head_width = max((len(head) for head, _ in rows), default=0)
    width = max((len(cell) for _, row in rows for cell in row), default=1)
    lines = []
    for head, row in rows:
        cells = " ".join(cell.ljust(width) for cell in row)
        line = f"{head.ljust(head_width)} | {cells}".rstrip()
        if width_limit is not None and len(line) > width_limit:
            line = line[: max(width_limit - 3, 0)] + "..."
        lines.append(line)
    return "\n".join(lines)


def step_grid(
    program: Program,
    ranks: Collection[int],
    steps: Sequence[int],
    marked: Collection[tuple[int, int]] = (),
    width_limit: int | None = None,
) -> str:
    """The actions of `ranks` at `steps` (ascending indices into each rank's list), one row
    per rank under a header row that numbers the steps.

    Actions at the (rank, step) positions in `marked` are drawn in [brackets]; a column of
    `...` stands for skipped steps; a rank whose list is shorter shows nothing there.
    Lines are cut at `width_limit` characters.

        step   |  0    1    2
        rank 0 |  F0  [B0] [F1]
        rank 1 | [F1] [F0]  B0
    """
    label = op_labeler(program)
    columns: list[int | None] = []
    for step in steps:
        if columns and columns[-1] is not None and step > columns[-1] + 1:
            columns.append(None)
        columns.append(step)
    rows: list[tuple[str, Sequence[str]]] = [
        ("step", [" ..." if step is None else f" {step}" for step in columns])
    ]
    for rank in sorted(ranks):
        rows.append((f"rank {rank}", _step_cells(program, label, rank, columns, marked)))
    return render_rows(rows, width_limit)


def _step_cells(
    program: Program,
    label: Callable[[int, Action], str],
    rank: int,
    columns: Sequence[int | None],
    marked: Collection[tuple[int, int]],
) -> list[str]:
    actions = program.ranks[rank]
    row = []
    for step in columns:
        if step is None:
            row.append(" ...")
            continue
        if step >= len(actions):
            row.append("")
            continue
        text = label(rank, actions[step])
        row.append(f"[{text}]" if (rank, step) in marked else f" {text}")
    return row
