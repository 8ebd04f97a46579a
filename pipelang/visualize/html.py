"""The HTML page: the SVG picture inline, a table comparing the timelines, and hover.

Self-contained (no network): inline CSS, inline script, inline SVG. Hovering an op shows
its token, kind, micro-batch, stage, pipeline, rank, start and end (taken from the
box's SVG `<title>`, moved into a tooltip that follows the pointer). Several schedules
are stacked on one time scale, so equal lengths are equal times; the table at the top
puts their numbers side by side. "Fit to width" scales the picture to the window.
"""

from __future__ import annotations

from collections.abc import Sequence
from html import escape

from pipelang.visualize.panel import Panel, number
from pipelang.visualize.svg import render_svg

CSS = """
body{font:14px system-ui,-apple-system,'Segoe UI','DejaVu Sans',sans-serif;margin:18px;color:#222}
h1{font-size:19px;margin:0 0 10px}
table{border-collapse:collapse;margin:0 0 12px}
th,td{padding:3px 12px;border-bottom:1px solid #ddd;text-align:right}
th:first-child,td:first-child{text-align:left}
.fig{overflow-x:auto;border:1px solid #e3e3e3;padding:6px 0}
.fig.fit svg{width:100%;height:auto}
#tip{position:fixed;display:none;background:#fffffb;border:1px solid #999;border-radius:3px;
padding:5px 8px;font:12px ui-monospace,'DejaVu Sans Mono',monospace;white-space:pre;
pointer-events:none;box-shadow:0 2px 6px rgba(0,0,0,.2);z-index:9}
rect.op:hover,rect.model:hover{stroke:#000;stroke-width:1.5}
"""

SCRIPT = """
const tip = document.getElementById('tip');
for (const box of document.querySelectorAll('rect.op, rect.model, rect.comm')) {
  const title = box.querySelector('title');
  if (title) { box.dataset.tip = title.textContent; title.remove(); }
}
document.addEventListener('mousemove', (ev) => {
  const text = ev.target.dataset && ev.target.dataset.tip;
  if (!text) { tip.style.display = 'none'; return; }
  tip.textContent = text;
  tip.style.display = 'block';
  const x = Math.min(ev.clientX + 14, window.innerWidth - tip.offsetWidth - 4);
  tip.style.left = x + 'px';
  tip.style.top = (ev.clientY + 16) + 'px';
});
document.getElementById('fit').addEventListener('change', (ev) => {
  document.querySelector('.fig').classList.toggle('fit', ev.target.checked);
});
"""


def render_html(panels: Sequence[Panel], comms: bool = False) -> str:
    """The page: title, comparison table, the picture, the tooltip script."""
    names = ", ".join(p.name for p in panels)
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>pipelang: {escape(names)}</title><style>{CSS}</style></head><body>\n"
        f"<h1>{escape(names)}</h1>\n{_table(panels)}\n"
        '<label><input type="checkbox" id="fit" checked> fit to window width</label> '
        "<small>hover over an op for its details</small>\n"
        f'<div class="fig fit">\n{render_svg(panels, comms)}</div>\n'
        f'<div id="tip"></div>\n<script>{SCRIPT}</script>\n</body></html>\n'
    )


def _table(panels: Sequence[Panel]) -> str:
    """One row per timeline: makespan, bubble ratio, peak activations, what it is."""
    head = (
        "<tr><th>schedule</th><th>timeline</th><th>ranks</th><th>micro-batches</th>"
        "<th>makespan</th><th>bubble ratio</th><th>peak activations</th></tr>"
    )
    rows = []
    for panel in panels:
        t = panel.timeline
        program = t.program
        peak = max((t.peak_activations(r) for r in range(program.num_ranks)), default=0)
        unit = f" {panel.unit}" if panel.unit else ""
        rows.append(
            f"<tr><td>{escape(panel.name)}</td><td>{escape(panel.origin)}</td>"
            f"<td>{program.num_ranks}</td><td>{program.num_microbatches}</td>"
            f"<td>{number(t.makespan)}{unit}</td><td>{t.bubble_ratio:.3f}</td>"
            f"<td>{peak}</td></tr>"
        )
    return f"<table>{head}{''.join(rows)}</table>"
