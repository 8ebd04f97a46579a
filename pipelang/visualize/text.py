"""The text picture: a header line per panel, then `Timeline.text_grid` (rank x time).

    one_f_one_b(D=2, N=2): simulated · makespan 6 · bubble ratio 0.333 · costs F=1 B=1 C=0
    rank 0 | F0 F1 .  B0 .  B1
    rank 1 | .  F0 B0 F1 B1 .

A measured timeline has no natural cell: its times are first snapped to a grid of about
`MEASURED_CELLS` cells (every op keeps at least one cell, pushing the next ones on its
rank right when ops are shorter than a cell), and the header says how long a cell is.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipelang.sim.timeline import Event, Timeline
from pipelang.visualize.panel import Panel, number

MEASURED_CELLS = 40


def render_text(panels: Sequence[Panel], width_limit: int | None = None) -> str:
    """Every panel's header and grid (and its overlay's), blank lines between panels."""
    blocks = []
    for panel in panels:
        cell = (panel.timeline.makespan or 1.0) / MEASURED_CELLS if panel.unit else None
        grid, note = _grid(panel.timeline, cell, panel.unit, width_limit)
        blocks.append(f"{panel.name}: {panel.summary()}{note}\n{grid}")
        if panel.overlay is not None:
            grid, note = _grid(panel.overlay, cell, panel.unit, width_limit)
            blocks.append(f"model of the same order{note}\n{grid}")
    return "\n\n".join(blocks) + "\n"


def _grid(
    timeline: Timeline, cell: float | None, unit: str, width_limit: int | None
) -> tuple[str, str]:
    """The grid, and a note on the cell length when the times were snapped to `cell`."""
    if cell is None:
        return timeline.text_grid(width_limit), ""
    events, ends = [], [0] * timeline.program.num_ranks
    for e in timeline.events:
        first = max(round(e.start / cell), ends[e.rank])
        last = max(round(e.end / cell), first + 1)
        ends[e.rank] = last
        events.append(Event(e.rank, e.action, float(first), float(last)))
    # text_grid's cell is the shortest op, which may have come out longer than one cell.
    shortest = min((e.end - e.start for e in events), default=1.0)
    snapped = Timeline(timeline.program, timeline.costs, tuple(events))
    return snapped.text_grid(width_limit), f" (one cell = {number(cell * shortest)} {unit})"
