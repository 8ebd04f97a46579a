"""Draw timelines, simulated or measured: `pipelang viz`.

panel.py     what is drawn: a Timeline plus its origin, unit and extras
style.py     colours: hue by op kind, shade by pipeline or chunk
text.py      .txt and the terminal: header + `Timeline.text_grid`
svg.py       .svg: one row per rank, one box per op, legend, title
html.py      .html: the SVG inline, hover, a table comparing schedules
png.py       .png through matplotlib (optional dependency)
chrome.py    .json: Chrome trace events for Perfetto and chrome://tracing
measured.py  read the runtime's trace (`pipelang run --trace`) into a Panel
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pipelang.visualize.panel import Panel

FORMATS = (".svg", ".html", ".png", ".json", ".txt")
"""The suffixes `render` knows."""


def render(panels: Sequence[Panel], suffix: str, comms: bool = False) -> str | bytes:
    """The file for `suffix` (one of FORMATS): text for all but `.png`, which is bytes."""
    return _renderer(suffix)(panels, comms)


def _renderer(suffix: str) -> Callable[[Sequence[Panel], bool], str | bytes]:
    if suffix == ".svg":
        from pipelang.visualize.svg import render_svg

        return render_svg
    if suffix == ".html":
        from pipelang.visualize.html import render_html

        return render_html
    if suffix == ".png":
        from pipelang.visualize.png import render_png

        return render_png
    if suffix == ".json":
        from pipelang.visualize.chrome import render_chrome

        return lambda panels, comms: render_chrome(panels)  # comm tracks cost nothing there
    if suffix == ".txt":
        from pipelang.visualize.text import render_text

        return lambda panels, comms: render_text(panels)
    raise ValueError(f"no renderer for `{suffix}`; known: {', '.join(FORMATS)}")
