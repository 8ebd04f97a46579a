"""The PNG picture, drawn with matplotlib (an optional dependency: `pip install
'pipelang[viz]'`), for papers and slides.

Same content as the SVG: one row per rank (rank 0 at the top), boxes coloured by kind
and shaded by variant, micro-batch numbers where they fit, hatched idle background, a
legend, and a title with the schedule, parameters, makespan and bubble ratio. Several
panels stack with a shared time axis. Boxes go through `broken_barh`, one call per rank
and colour, so large schedules stay fast. A bare `Figure` is used, not pyplot, so that
drawing leaves the caller's matplotlib state (backend, open figures) alone.
"""

from __future__ import annotations

import io
import textwrap
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from pipelang.ir import Kind
from pipelang.sim.timeline import Timeline
from pipelang.visualize import style
from pipelang.visualize.panel import Panel, bands, shared_span, short_op, transfers

DPI = 150
LANE, MODEL_LANE = 0.9, 0.4
"""Box heights in rows; with --overlay a row is 1.5 high, the model lane under the run."""


class MissingMatplotlib(RuntimeError):
    """matplotlib is not installed."""


class TooLarge(ValueError):
    """More than a PNG draws in seconds: matplotlib takes about 0.35 ms per box on a
    2-core VM, and minutes on an image thousands of inches tall."""


PNG_RANKS = 512
"""The most rank rows a PNG draws, over all its panels (.svg and .html take any number)."""
PNG_OPS = 20_000
"""The most ops a PNG draws, over all its panels (about 7 s)."""


def render_png(panels: Sequence[Panel], comms: bool = False) -> bytes:
    """The PNG file's bytes."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise MissingMatplotlib(
            "writing .png needs matplotlib: pip install 'pipelang[viz]' "
            "(or pip install matplotlib); .svg and .html need nothing extra"
        ) from None
    rows = sum(p.timeline.program.num_ranks for p in panels)
    ops = sum(len(p.timeline.events) for p in panels)
    if rows > PNG_RANKS or ops > PNG_OPS:
        raise TooLarge(
            f"a .png draws at most {PNG_RANKS} rank rows and {PNG_OPS:,} ops, and this "
            f"picture has {rows} and {ops:,}; write .svg or .html (any size), or .txt"
        )
    span = shared_span(panels)
    heights = [_pitch(p) * p.timeline.program.num_ranks * 0.28 + 1.3 for p in panels]
    width = min(max(span / short_op(panels) * 0.28, 8.0), 16.0)
    fig = Figure(figsize=(width, sum(heights)))
    axes = fig.subplots(len(panels), 1, squeeze=False, gridspec_kw={"height_ratios": heights})
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        _draw(ax, panel, span, width, comms)
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=DPI)
    return out.getvalue()


def _pitch(panel: Panel) -> float:
    return 1.5 if panel.overlay is not None else 1.0


def _draw(ax: Any, panel: Panel, span: float, width: float, comms: bool) -> None:
    """One panel: idle background, boxes, arrows, axes, title and legend."""
    program = panel.timeline.program
    pal = style.palette(program)
    pitch = _pitch(panel)
    for rank in range(program.num_ranks):
        ax.broken_barh(
            [(0, panel.span)],
            (rank * pitch - LANE / 2, LANE),
            facecolor=style.IDLE,
            edgecolor=style.IDLE_STROKE,
            hatch="////",
            linewidth=0,
        )
    points_per_unit = width * 0.85 / span * 72
    _boxes(ax, panel.timeline, pal, pitch, 0.0, LANE, points_per_unit)
    if panel.overlay is not None:
        _boxes(ax, panel.overlay, pal, pitch, 0.7, MODEL_LANE, 0.0)
    if comms:
        for t in transfers(panel.timeline):
            ax.annotate(
                "",
                xy=(t.used, t.dst * pitch),
                xytext=(t.sent, t.src * pitch),
                arrowprops={"arrowstyle": "->", "color": style.TRANSFER, "lw": 0.5, "alpha": 0.5},
            )
    ranks = range(program.num_ranks)
    ax.set_ylim(program.num_ranks * pitch - pitch / 2 + 0.1, -0.6)
    ax.set_xlim(0, span)
    ax.set_yticks([r * pitch for r in ranks], [f"rank {r}" for r in ranks], fontsize=8)
    ax.set_xlabel(f"time ({panel.unit or 'cost units'})", fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    summary = "\n".join(textwrap.wrap(panel.summary(), int(width * 13)))
    ax.set_title(f"{panel.name}\n{summary}", loc="left", fontsize=10, pad=22)
    _legend(ax, panel, pal)


def _legend(ax: Any, panel: Panel, pal: style.Palette) -> None:
    """Kinds and variants, idle, and the model lane, in a row above the plot."""
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=fill, label=label) for fill, label in pal.legend(panel.kinds())]
    handles.append(
        Patch(facecolor=style.IDLE, edgecolor=style.IDLE_STROKE, hatch="////", label="idle")
    )
    if panel.overlay is not None:
        handles.append(Patch(facecolor="#888", alpha=0.6, label="model (thin bar under each rank)"))
    ax.legend(
        handles=handles,
        loc="lower left",
        bbox_to_anchor=(0, 1.0),
        fontsize=8,
        ncol=min(len(handles), 8),
        frameon=False,
        borderaxespad=0.2,
        handlelength=1.2,
        columnspacing=1.2,
    )


def _boxes(
    ax: Any,
    timeline: Timeline,
    pal: style.Palette,
    pitch: float,
    offset: float,
    height: float,
    points_per_unit: float,
) -> None:
    """Boxes grouped per rank and colour (`offset` moves the lane down, `height` is its
    height), and the micro-batch numbers that fit (0.62 of the font size per digit;
    `points_per_unit` 0 draws none)."""
    Group = tuple[int, tuple[Kind, int], int, int]
    groups: dict[Group, list[tuple[float, float]]] = defaultdict(list)
    for (rank, action, start, end), (band, of) in zip(
        timeline.events, bands(timeline.events), strict=True
    ):
        look = pal.of(action)
        groups[(rank, look, band, of)].append((start, end - start))
        label = style.box_label(action)
        # A band of a compound is 1/of of the lane: its number gets at most that share.
        size = min(7.5, 11 / of, ((end - start) * points_per_unit - 3) / (0.62 * len(label)))
        if size >= 5:
            ax.text(
                (start + end) / 2,
                rank * pitch + offset + height * ((band + 0.5) / of - 0.5),
                label,
                ha="center",
                va="center",
                fontsize=size,
                color=style.text_color(pal.fill(*look)),
            )
    model = height != LANE
    for (rank, look, band, of), bars in groups.items():
        ax.broken_barh(
            bars,
            (rank * pitch + offset - height / 2 + height * band / of, height / of),
            facecolor=pal.fill(*look),
            edgecolor="white",
            linewidth=0.4,
            alpha=0.6 if model else 1.0,
        )
