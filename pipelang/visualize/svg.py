"""The SVG picture: one row per rank, one box per compute op, panels stacked on one scale.

Each panel has a title (schedule, parameters), a line of numbers (makespan, bubble
ratio, costs), a legend, then one row per rank. A row's background is hatched grey:
whatever is not covered by a box is idle time. Boxes are coloured by kind and shaded by
variant (see `style`), carry the micro-batch number when it fits, and a `<title>` that
browsers show on hover. Every compute op is one `<rect class="op ...">`, so tests count
them; the simulated boxes of `--overlay` are `class="model ..."` instead.

The time scale is shared by every panel so that lengths compare across schedules: a
short op (`panel.short_op`) gets about `BOX_PX` pixels, within a plot `MIN_PLOT` to
`MAX_PLOT` wide; rows get shorter as ranks get more numerous (28 px at D <= 22, 10 px
at D = 64). Labels shrink to fit their box and are dropped below 6.5 px.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

from pipelang.ir import Kind
from pipelang.sim.timeline import Event, Timeline
from pipelang.visualize import style
from pipelang.visualize.panel import Panel, bands, number, shared_span, short_op, transfers

BOX_PX = 24.0
MIN_PLOT, MAX_PLOT = 720.0, 3200.0
LEFT, RIGHT = 66.0, 76.0
LEGEND_ROW = 18.0
FONT = "system-ui, -apple-system, 'Segoe UI', 'DejaVu Sans', Helvetica, Arial, sans-serif"


@dataclass(frozen=True, slots=True)
class Scale:
    """Pixels per unit of time, lane heights, and the plot's width."""

    px: float
    lane: float
    gap: float
    plot: float

    def x(self, t: float) -> float:
        return LEFT + t * self.px


def scale_for(panels: Sequence[Panel]) -> Scale:
    """One scale for all panels: a short op about BOX_PX wide, rows by rank count."""
    span = shared_span(panels)
    plot = min(max(span / short_op(panels) * BOX_PX, MIN_PLOT), MAX_PLOT)
    ranks = max(p.timeline.program.num_ranks for p in panels)
    lane = min(max(round(640 / ranks), 9), 28)
    return Scale(plot / span, lane, 2.0 if ranks > 16 else 4.0, plot)


def render_svg(panels: Sequence[Panel], comms: bool = False) -> str:
    """The whole SVG document: every panel, top to bottom, on one time scale."""
    scale = scale_for(panels)
    width = LEFT + scale.plot + RIGHT
    parts: list[str] = []
    y = 0.0
    for panel in panels:
        y = _panel(parts, panel, scale, y, width, comms) + 14
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{y:.0f}" '
        f'viewBox="0 0 {width:.0f} {y:.0f}" font-family="{FONT}">'
    )
    return "\n".join([head, _defs(panels, scale), *parts, "</svg>"]) + "\n"


def _defs(panels: Sequence[Panel], scale: Scale) -> str:
    """Hatch pattern for idle time, arrow head, and one CSS class per (kind, variant)."""
    rules = [
        "text{fill:#222}",
        ".title{font-size:17px;font-weight:600}.sub{font-size:12.5px;fill:#555}",
        ".leg{font-size:12px}.rl{font-size:11.5px}.il{font-size:10.5px;fill:#666}",
        ".ax{font-size:10.5px;fill:#555}.axl{stroke:#888;stroke-width:1}",
        f".op{{stroke:#fff;stroke-width:{0.8 if scale.px * short_op(panels) > 6 else 0.3}}}",
        f".model{{opacity:.6}}.l{{font-size:{_label_font(scale):.1f}px;text-anchor:middle}}",
        f".xfer{{stroke:{style.TRANSFER};stroke-width:.8;opacity:.55;fill:none}}",
        f".comm{{fill:{style.COMM_ACTION};opacity:.8}}",
    ]
    seen: set[str] = set()
    for panel in panels:
        pal = style.palette(panel.timeline.program)
        for kind in panel.kinds():
            for v in range(len(pal.names)):
                fill = pal.fill(kind, v)
                cls = _cls(kind, v, len(pal.names))
                if cls not in seen:
                    seen.add(cls)
                    rules.append(f".{cls}{{fill:{fill}}}.t{cls}{{fill:{style.text_color(fill)}}}")
    return (
        "<defs>"
        f'<pattern id="idle" width="6" height="6" patternUnits="userSpaceOnUse" '
        f'patternTransform="rotate(45)"><rect width="6" height="6" fill="{style.IDLE}"/>'
        f'<line x1="0" y1="0" x2="0" y2="6" stroke="{style.IDLE_STROKE}" stroke-width="2"/>'
        "</pattern>"
        '<marker id="arrow" viewBox="0 0 6 6" refX="6" refY="3" markerWidth="5" '
        f'markerHeight="5" orient="auto"><path d="M0,0 L6,3 L0,6 z" fill="{style.TRANSFER}"/>'
        "</marker>"
        f"<style>{''.join(rules)}</style></defs>"
    )


def _cls(kind: Kind, variant: int, count: int) -> str:
    """The CSS class of a fill: `F1_2` is variant 1 of 2 of forwards (the count is in the
    name because one picture may hold schedules with different numbers of variants)."""
    return f"{kind.value}{variant}_{count}"


def _label_font(scale: Scale) -> float:
    return min(11.5, scale.lane * 0.62)


def _panel(
    parts: list[str], panel: Panel, scale: Scale, y: float, width: float, comms: bool
) -> float:
    """Draw one panel from `y` down; returns the y below it."""
    parts.append(f'<g class="panel" data-name="{escape(panel.name)}">')
    parts.append(f'<text class="title" x="{LEFT}" y="{y + 22:.0f}">{escape(panel.name)}</text>')
    parts.append(f'<text class="sub" x="{LEFT}" y="{y + 41:.0f}">{escape(panel.summary())}</text>')
    y = _legend(parts, panel, y + 52, width, comms)
    top = y + 6
    row = scale.lane + (scale.lane * 0.5 + 2 if panel.overlay is not None else 0) + scale.gap
    _rows(parts, panel, scale, top, row)
    _boxes(parts, panel.timeline, panel, scale, top, row, "op")
    if panel.overlay is not None:
        _boxes(parts, panel.overlay, panel, scale, top + scale.lane + 2, row, "model")
    if comms:
        _transfers(parts, panel.timeline, scale, top, row)
        _extra(parts, panel.extra, scale, top, row)
    bottom = top + panel.timeline.program.num_ranks * row
    _axis(parts, panel, scale, bottom)
    parts.append("</g>")
    return bottom + 30


def _legend(parts: list[str], panel: Panel, y: float, width: float, comms: bool) -> float:
    """Swatches for every kind and variant, idle, and what else is drawn; returns the y
    below the legend (it wraps to more rows when it is wider than the picture)."""
    pal = style.palette(panel.timeline.program)
    items = [
        (f'<rect width="12" height="12" fill="{fill}"/>', label)
        for fill, label in pal.legend(panel.kinds())
    ]
    items.append(('<rect width="12" height="12" fill="url(#idle)" stroke="#bbb"/>', "idle"))
    if panel.overlay is not None:
        items.append(
            (
                '<rect y="4" width="12" height="6" fill="#888" opacity=".6"/>',
                "model (simulated, thin bar under each rank)",
            )
        )
    if comms:
        items.append(
            (
                '<line x1="0" y1="10" x2="12" y2="2" class="xfer" marker-end="url(#arrow)"/>',
                "transfer (result to the rank that needs it)",
            )
        )
    if comms and panel.extra:
        items.append(
            (
                '<rect y="9" width="12" height="3" class="comm"/>',
                "send/recv/allreduce/step (measured)",
            )
        )
    x = LEFT
    for swatch, label in items:
        step = 17 + len(label) * 6.4 + 18
        if x + step > width and x > LEFT:
            x, y = LEFT, y + LEGEND_ROW
        parts.append(
            f'<g transform="translate({x:.1f},{y:.1f})">{swatch}'
            f'<text class="leg" x="17" y="10.5">{escape(label)}</text></g>'
        )
        x += step
    return y + LEGEND_ROW


def _rows(parts: list[str], panel: Panel, scale: Scale, top: float, row: float) -> None:
    """Per rank: its label, the hatched idle background, and its idle share."""
    timeline = panel.timeline
    end = scale.x(panel.span)
    makespan = timeline.makespan or 1.0
    for rank in range(timeline.program.num_ranks):
        y = top + rank * row
        mid = y + scale.lane / 2 + 4
        parts.append(
            f'<text class="rl" x="{LEFT - 8}" y="{mid:.1f}" text-anchor="end">rank {rank}</text>'
        )
        parts.append(
            f'<rect class="bg" x="{LEFT}" y="{y:.1f}" width="{end - LEFT:.1f}" '
            f'height="{row - scale.gap:.1f}" fill="url(#idle)"/>'
        )
        idle = 1 - timeline.busy(rank) / makespan
        parts.append(f'<text class="il" x="{end + 6:.1f}" y="{mid:.1f}">idle {idle:.0%}</text>')
        if panel.overlay is not None:
            parts.append(
                f'<text class="il" x="{LEFT - 8}" y="{mid + scale.lane * 0.5 + 1:.1f}" '
                'text-anchor="end">model</text>'
            )


def _boxes(
    parts: list[str],
    timeline: Timeline,
    panel: Panel,
    scale: Scale,
    top: float,
    row: float,
    cls: str,
) -> None:
    """One rect per compute op, with a hover title and, when it fits, its micro-batch.
    (The loop is written for speed: it runs once per op, 10^5 times for big schedules.)"""
    pal = style.palette(timeline.program)
    lane = scale.lane if cls == "op" else scale.lane * 0.5
    font = min(_label_font(scale), lane * 0.62)
    unit = f" {panel.unit}" if panel.unit else ""
    head = "model: " if cls != "op" else ""
    what = {k: f"{k.value} ({style.KIND_NAME.get(k, k.value)})" for k in Kind}
    px, variant, count, append = scale.px, pal.variant, len(pal.names), parts.append
    shapes = timeline.program.shapes
    shape_text = (
        [""]
        if shapes is None
        else [f" ({s} x {n} tokens)" for s, n in zip(shapes.samples, shapes.lengths, strict=True)]
    )
    for (rank, a, start, end), (band, of) in zip(
        timeline.events, bands(timeline.events), strict=True
    ):
        kind = a.kind
        c = f"{kind.value}{variant[(a.pipeline, a.stage)]}_{count}"
        x, w = LEFT + start * px, (end - start) * px
        h = lane / of
        y = top + rank * row + band * h
        append(
            f'<rect class="{cls} {c}" x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" '
            f'height="{h:.1f}"><title>{head}{kind.value}{a.unit()}@{a.stage}/{a.pipeline} '
            f"on rank {rank}\n{what[kind]}, micro-batch {a.unit()}"
            f"{shape_text[(a.mb or 0) if shapes else 0]}, stage {a.stage}, pipeline "
            f"{a.pipeline}\nstart {number(start)}{unit}, end {number(end)}{unit}"
            "</title></rect>"
        )
        label = style.box_label(a)
        size = min(font, (w - 3) / (0.62 * len(label)), h * 0.8)
        if size < 6.5:
            continue
        sized = "" if size >= font else f' style="font-size:{size:.1f}px"'
        append(
            f'<text class="l t{c}" x="{x + w / 2:.1f}" y="{y + h / 2 + size * 0.36:.1f}"'
            f"{sized}>{label}</text>"
        )


def _transfers(parts: list[str], timeline: Timeline, scale: Scale, top: float, row: float) -> None:
    """A thin arrow per result sent between ranks, from the producer's end to the start
    of the op that needs it, edge of row to edge of row."""
    for t in transfers(timeline):
        down = t.dst > t.src
        y1 = top + t.src * row + (scale.lane if down else 0)
        y2 = top + t.dst * row + (0 if down else scale.lane)
        parts.append(
            f'<line class="xfer" x1="{scale.x(t.sent):.1f}" y1="{y1:.1f}" '
            f'x2="{scale.x(t.used):.1f}" y2="{y2:.1f}" marker-end="url(#arrow)"/>'
        )


def _extra(parts: list[str], events: Sequence[Event], scale: Scale, top: float, row: float) -> None:
    """Measured non-compute actions as thin dark strips along the bottom of their row."""
    for e in events:
        y = top + e.rank * row + scale.lane - 3
        w = max((e.end - e.start) * scale.px, 0.6)
        parts.append(
            f'<rect class="comm" x="{scale.x(e.start):.1f}" y="{y:.1f}" '
            f'width="{w:.1f}" height="3"><title>{escape(e.action.text())}</title></rect>'
        )


def _axis(parts: list[str], panel: Panel, scale: Scale, y: float) -> None:
    """The time axis under the rows, with round ticks about every 90 px."""
    span = panel.span
    step = nice_step(span, max(int(scale.plot / 90), 2))
    parts.append(
        f'<line class="axl" x1="{LEFT}" y1="{y + 2:.1f}" x2="{scale.x(span):.1f}" '
        f'y2="{y + 2:.1f}"/>'
    )
    unit = f" {panel.unit}" if panel.unit else ""
    ticks = int(span / step + 1e-9)
    for i in range(ticks + 1):
        x = scale.x(i * step)
        text = number(round(i * step, 9)) + (unit if i == ticks else "")
        parts.append(
            f'<line class="axl" x1="{x:.1f}" y1="{y + 2:.1f}" x2="{x:.1f}" '
            f'y2="{y + 6:.1f}"/><text class="ax" x="{x:.1f}" y="{y + 18:.1f}" '
            f'text-anchor="middle">{text}</text>'
        )


def nice_step(span: float, ticks: int) -> float:
    """A round tick step (1, 2 or 5 times a power of ten) giving about `ticks` ticks."""
    raw = span / max(ticks, 1)
    power = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    for factor in (1, 2, 5, 10):
        if raw <= factor * power:
            return factor * power
    return 10 * power
