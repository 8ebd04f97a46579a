"""`pipelang viz`: every renderer against the Timeline it draws.

The text grid is covered by tests/golden/viz/text.pipe. Here: the SVG has exactly one box
per compute op, where the op runs; the Chrome trace has one event per op with the
simulated times; measured traces (recorded by the runtime, tests/data/) read back; the
HTML renders in headless Chromium to a non-blank picture; the PNG is a PNG.
"""

from __future__ import annotations

import itertools
import json
import struct
import subprocess
import xml.etree.ElementTree as ET
import zlib
from collections import Counter
from pathlib import Path

import pytest

from pipelang import PipelangError
from pipelang.api import load_program
from pipelang.ir import Kind
from pipelang.sim.timeline import Timeline
from pipelang.visualize import render
from pipelang.visualize.chrome import SIM_UNIT_US
from pipelang.visualize.measured import TraceError, fitted_costs, read_trace
from pipelang.visualize.panel import Panel, simulated, transfers
from pipelang.visualize.style import KIND_NAME, palette
from pipelang.visualize.svg import LEFT, scale_for
from tests.helpers import replay, run_in_process

DATA = Path(__file__).resolve().parent / "data"
TRACE_1F1B = DATA / "trace_1f1b_D2_N4.json"
TRACE_CHIMERA = DATA / "trace_chimera_D4_N4.json"
SVG = "{http://www.w3.org/2000/svg}"
CHROMIUM = Path("/usr/bin/chromium")

SCHEDULES = [
    ("1f1b", {"D": "4", "N": "8"}),
    ("chimera", {"D": "4", "N": "8"}),
    ("zbv", {"D": "4", "N": "8"}),
    ("interleaved-1f1b", {"D": "4", "N": "8", "v": "2"}),
    ("1f1b", {"D": "32", "N": "64"}),
]


def timeline_of(sched: str, params: dict[str, str]) -> Timeline:
    program = load_program(sched, params)
    return replay(program, program.costs)


def ops(timeline: Timeline) -> int:
    return sum(a.kind.is_compute for actions in timeline.program.ranks for a in actions)


def classes(element: ET.Element) -> list[str]:
    return element.get("class", "").split()


# ---- SVG ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("sched", "params"), SCHEDULES, ids=lambda v: str(v))
def test_svg_has_one_box_per_compute_op_where_it_runs(sched: str, params: dict[str, str]) -> None:
    timeline = timeline_of(sched, params)
    panel = simulated(timeline)
    root = ET.fromstring(render([panel], ".svg"))
    boxes = [r for r in root.iter(f"{SVG}rect") if "op" in classes(r)]
    assert len(boxes) == len(timeline.events) == ops(timeline)
    scale = scale_for([panel])
    by_token = {box.find(f"{SVG}title").text.split()[0]: box for box in boxes}  # type: ignore[union-attr]
    for event in timeline.events:
        box = by_token[event.action.text()]
        assert float(box.get("x", "")) == pytest.approx(LEFT + event.start * scale.px, abs=0.06)
        width = (event.end - event.start) * scale.px
        assert float(box.get("width", "")) == pytest.approx(width, abs=0.06)
    texts = ["".join(t.itertext()) for t in root.iter(f"{SVG}text")]
    assert texts[0] == panel.name
    assert texts[1].startswith("simulated · makespan ")
    assert f"bubble ratio {timeline.bubble_ratio:.3f}" in texts[1]
    assert "idle" in texts
    for kind in timeline.program.kinds:
        assert any(t.startswith(f"{kind.value} ") or t == kind.value for t in texts)


def test_svg_tells_chimera_directions_apart() -> None:
    timeline = timeline_of("chimera", {"D": "4", "N": "4"})
    pal = palette(timeline.program)
    assert pal.names == ("down", "up")
    down, up = pal.fill(Kind.F, 0), pal.fill(Kind.F, 1)
    lightness = [sum(int(c[i : i + 2], 16) for i in (1, 3, 5)) for c in (down, up)]
    assert lightness[1] - lightness[0] > 150  # clearly darker down, lighter up
    svg = render([simulated(timeline)], ".svg")
    assert isinstance(svg, str)
    assert ">F down</text>" in svg and ">F up</text>" in svg
    root = ET.fromstring(svg)
    kinds = {tuple(classes(r)) for r in root.iter(f"{SVG}rect") if "op" in classes(r)}
    assert kinds == {("op", "F0_2"), ("op", "F1_2"), ("op", "B0_2"), ("op", "B1_2")}


def test_svg_labels_drop_when_boxes_are_small() -> None:
    small = ET.fromstring(render([simulated(timeline_of("1f1b", {"D": "8", "N": "512"}))], ".svg"))
    labels = [t for t in small.iter(f"{SVG}text") if "l" in classes(t)]
    assert not labels
    big = ET.fromstring(render([simulated(timeline_of("1f1b", {"D": "4", "N": "8"}))], ".svg"))
    assert len([t for t in big.iter(f"{SVG}text") if "l" in classes(t)]) == 64


def test_svg_comms_draw_one_arrow_per_transfer() -> None:
    timeline = timeline_of("chimera", {"D": "4", "N": "4"})
    root = ET.fromstring(render([simulated(timeline)], ".svg", comms=True))
    arrows = [line for line in root.iter(f"{SVG}line") if "xfer" in classes(line)]
    # one per transfer, plus the legend's swatch
    assert len(arrows) == len(list(transfers(timeline))) + 1 == 4 * 2 * 3 + 1


def test_svg_panels_share_one_time_scale() -> None:
    short, long = timeline_of("chimera", {"D": "4", "N": "4"}), timeline_of("gpipe", {})
    root = ET.fromstring(render([simulated(short), simulated(long)], ".svg"))
    panels = [g for g in root.iter(f"{SVG}g") if "panel" in classes(g)]
    assert [p.get("data-name") for p in panels] == ["chimera(D=4, N=4, f=1)", "gpipe(D=4, N=8)"]
    widths = {}
    for panel in panels:
        rows = [r for r in panel.iter(f"{SVG}rect") if "bg" in classes(r)]
        widths[panel.get("data-name")] = float(rows[0].get("width", ""))
    assert widths["gpipe(D=4, N=8)"] / widths["chimera(D=4, N=4, f=1)"] == pytest.approx(
        long.makespan / short.makespan, rel=1e-3
    )


# ---- Chrome trace -----------------------------------------------------------------------------


@pytest.mark.parametrize(("sched", "params"), SCHEDULES[:4], ids=lambda v: str(v))
def test_chrome_trace_events_match_the_timeline(sched: str, params: dict[str, str]) -> None:
    timeline = timeline_of(sched, params)
    doc = json.loads(render([simulated(timeline)], ".json"))
    events = doc["traceEvents"]
    compute = [e for e in events if e["ph"] == "X" and e["cat"] in "FBWR"]
    assert len(compute) == ops(timeline)
    got = {(e["pid"], e["name"]): (e["ts"], e["dur"], e["tid"]) for e in compute}
    for event in timeline.events:
        ts, dur, tid = got[(event.rank, event.action.text())]
        assert ts == pytest.approx(event.start * SIM_UNIT_US)
        assert dur == pytest.approx((event.end - event.start) * SIM_UNIT_US)
        assert tid == event.rank * 1000
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(timeline.program.num_ranks)}
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"
    }
    assert all(threads[(e["pid"], e["tid"])] for e in events if e["ph"] == "X")
    comm = [e for e in events if e["ph"] == "X" and e["cat"] in ("send", "recv")]
    assert len(comm) == 2 * len(list(transfers(timeline)))
    assert all(threads[(e["pid"], e["tid"])].startswith("comm") for e in comm)
    flows: dict[int, list[str]] = {}
    for e in comm:
        flows.setdefault(e["bind_id"], []).append("out" if e.get("flow_out") else "in")
    assert all(sorted(v) == ["in", "out"] for v in flows.values())
    assert_no_overlap(events)


def assert_no_overlap(events: list[dict[str, object]]) -> None:
    """Viewers need the complete events of one thread to nest; ours never overlap."""
    tracks: dict[tuple[object, object], list[tuple[float, float]]] = {}
    for e in events:
        if e["ph"] == "X":
            start = float(e["ts"])  # type: ignore[arg-type]
            tracks.setdefault((e["pid"], e["tid"]), []).append((start, start + float(e["dur"])))  # type: ignore[arg-type]
    for spans in tracks.values():
        spans.sort()
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert start >= end - 1e-6


def test_chrome_trace_of_several_schedules_keeps_them_apart() -> None:
    panels = [simulated(timeline_of(s, {"D": "4", "N": "4"})) for s in ("1f1b", "chimera")]
    events = json.loads(render(panels, ".json"))["traceEvents"]
    names = sorted(e["args"]["name"] for e in events if e["name"] == "process_name")
    assert names[:2] == ["chimera(D=4, N=4, f=1) rank 0", "chimera(D=4, N=4, f=1) rank 1"]
    assert len({e["pid"] for e in events if e["name"] == "process_name"}) == 8


# ---- measured timelines ----------------------------------------------------------------------


def test_runtime_trace_reads_back() -> None:
    raw = json.loads(TRACE_1F1B.read_text())["traceEvents"]
    last = [e for e in raw if e["ph"] == "X" and e["args"]["step"] == 1]
    measured = read_trace(TRACE_1F1B)
    assert measured.steps == (0, 1) and measured.step == 1
    assert len(measured.timeline.events) + len(measured.extra) == len(last)
    assert len(measured.timeline.events) == 16
    origin = min(e["ts"] for e in last)
    for event in measured.timeline.events:
        (match,) = [e for e in last if e["pid"] == event.rank and e["name"] == event.action.text()]
        assert event.start == pytest.approx((match["ts"] - origin) / 1000)
        assert event.end - event.start == pytest.approx(match["dur"] / 1000)
    program = measured.timeline.program
    assert [p.placement for p in program.pipelines] == [(0, 1)]
    assert program.num_microbatches == 4


def test_runtime_trace_checked_against_the_schedule() -> None:
    program = load_program("chimera", {"D": "4", "N": "4"})
    measured = read_trace(TRACE_CHIMERA, program, step=0)
    assert measured.timeline.program is program
    assert len(measured.timeline.events) == ops(measured.timeline)
    with pytest.raises(TraceError, match="is not a run of one_f_one_b"):
        read_trace(TRACE_CHIMERA, load_program("1f1b", {"D": "4", "N": "4"}))


def test_overlay_draws_both_timelines(tmp_path: Path) -> None:
    out = tmp_path / "run.svg"
    status, stdout, stderr = run_in_process(
        [
            "viz",
            "chimera",
            "-p",
            "D=4",
            "-p",
            "N=4",
            "--trace",
            str(TRACE_CHIMERA),
            "--overlay",
            "--comms",
            "-o",
            str(out),
        ]
    )
    assert (status, stderr) == (0, "")
    assert stdout == f"wrote {out}: chimera(D=4, N=4, f=1)\n"
    root = ET.parse(out).getroot()
    count = {c: sum(c in classes(r) for r in root.iter(f"{SVG}rect")) for c in ("op", "model")}
    assert count == {"op": 32, "model": 32}
    comm = [r for r in root.iter(f"{SVG}rect") if "comm" in classes(r)]
    assert len(comm) == len(read_trace(TRACE_CHIMERA).extra) + 1  # and the legend's swatch


def test_overlay_cost_for_a_stage_the_run_lacks_is_the_one_usage_error() -> None:
    """The overlay's model is the fitted costs with --cost over them, merged and checked
    where every --cost is (`layout.given_costs`): the same words as simulate's."""
    argv = ["viz", "--trace", str(TRACE_1F1B), "--overlay", "--cost", "F=2,F[5]=1"]
    status, out, err = run_in_process(argv)
    assert (status, out) == (2, "")
    assert err == (
        "pipelang viz: error: `--cost F[5]`: trace_1f1b_D2_N4: the schedule has no stage 5 "
        "(its stages are 0..1)\n"
    )


def test_fitted_costs_are_mean_times() -> None:
    timeline = read_trace(TRACE_1F1B).timeline
    costs = fitted_costs(timeline)
    forwards = [e.end - e.start for e in timeline.events if e.action.kind is Kind.F]
    assert costs.of("F") == pytest.approx(sum(forwards) / len(forwards))
    stage1 = [
        e.end - e.start for e in timeline.events if e.action.kind is Kind.F and e.action.stage == 1
    ]
    assert costs.of("F", 1) == pytest.approx(sum(stage1) / len(stage1))
    assert costs.of("C") == 0


def test_trace_with_foreign_events_and_names(tmp_path: Path) -> None:
    """Other events are ignored; `process_name` metadata names the rank."""
    events = [
        {"ph": "M", "name": "process_name", "pid": 900, "args": {"name": "rank 1"}},
        {"ph": "M", "name": "process_name", "pid": 800, "args": {"name": "rank 0"}},
        {"ph": "X", "name": "cudaLaunchKernel", "pid": 800, "ts": 0, "dur": 5},
        {"ph": "X", "name": "F0@0/main", "pid": 800, "ts": 10, "dur": 1000},
        {"ph": "X", "name": "F0@1/main", "pid": 900, "ts": 1500, "dur": 1000},
        {"ph": "X", "name": "B0@1/main", "pid": 900, "ts": 2500, "dur": 2000},
        {"ph": "X", "name": "B0@0/main", "pid": 800, "ts": 4600, "dur": 2000},
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(events))
    measured = read_trace(path)
    assert [(e.rank, e.action.text(), e.start, e.end) for e in measured.timeline.events] == [
        (0, "F0@0/main", 0.0, 1.0),
        (0, "B0@0/main", 4.59, 6.59),
        (1, "F0@1/main", 1.49, 2.49),
        (1, "B0@1/main", 2.49, 4.49),
    ]
    path.write_text(json.dumps({"traceEvents": events[2:3]}))
    with pytest.raises(TraceError, match="no events named like pipelang actions"):
        read_trace(path)


def test_a_run_trace_reads_back_alike_in_viz_and_calibrate(tmp_path: Path) -> None:
    """One format, one reader: what `run --trace` writes (backends/report.py) reads back
    through pipelang/trace.py in `viz --trace` and in `profile --calibrate`, to the same
    ranks, steps and times (to the nanosecond)."""
    from pipelang.backends.calibrate import trace_events
    from pipelang.backends.rank_base import RankResult
    from pipelang.backends.report import write_trace

    program = load_program("1f1b", {"D": "2", "N": "2"})
    results = []
    for rank, actions in enumerate(program.ranks):
        timed = [(step, i, 10**9 * step + 1000 * i + 7, 10**9 * step + 1000 * i + 900)
                 for step in (0, 1) for i in range(len(actions))]  # fmt: skip
        results.append(RankResult(rank, [], events=timed))
    path = tmp_path / "run.json"
    write_trace(path, program, results)
    calibrated = trace_events(path)
    assert len(calibrated) == 2 * sum(len(actions) for actions in program.ranks)
    for e in calibrated:
        assert e.name == program.ranks[e.rank][e.index].text()
        ns = 10**9 * e.step + 1000 * e.index
        near = {"rel": 0, "abs": 1e-7}  # milliseconds: to a tenth of a nanosecond
        assert (e.start, e.end) == (
            pytest.approx((ns + 7) / 1e6, **near),
            pytest.approx((ns + 900) / 1e6, **near),
        )
    measured = read_trace(path, program)
    assert measured.steps == (0, 1)
    drawn = {(e.rank, e.action.text()) for e in (*measured.timeline.events, *measured.extra)}
    assert drawn == {(e.rank, e.name) for e in calibrated if e.step == 1}


def test_calibrate_takes_the_rank_a_process_is_named_as_viz_does(tmp_path: Path) -> None:
    """calibrate took `pid` as the rank; `viz --trace` the `rank r` a `process_name`
    event names (and pid without one): both read ranks by the one rule now."""
    from pipelang.backends.calibrate import trace_events

    events = [
        {"ph": "M", "name": "process_name", "pid": 900, "args": {"name": "rank 1"}},
        {"ph": "M", "name": "process_name", "pid": 800, "args": {"name": "rank 0"}},
        {"ph": "X", "name": "F0@0/main", "pid": 800, "ts": 10, "dur": 1000},
        {"ph": "X", "name": "F0@1/main", "pid": 900, "ts": 1500, "dur": 1000},
        {"ph": "X", "name": "F1@1/main", "pid": 1, "ts": 2500, "dur": 1000},
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert [(e.rank, e.name) for e in trace_events(path)] == [
        (0, "F0@0/main"),
        (1, "F0@1/main"),
        (1, "F1@1/main"),
    ]
    path.write_text(json.dumps([{**events[2], "pid": "r0"}]))  # int("r0") was a ValueError
    with pytest.raises(PipelangError) as caught:
        trace_events(path)
    assert caught.value.diagnostics[0].code == "E0404"
    assert "event `F0@0/main` has no rank (pid 'r0')" in caught.value.diagnostics[0].message


@pytest.mark.parametrize(
    ("event", "words"),
    [
        ({"pid": [1]}, "has no rank (pid [1])"),
        ({"pid": True}, "has no rank (pid True)"),
        ({"args": {"step": "x"}}, "has no whole step or index ('x')"),
        ({"args": {"step": 1e300}}, "has no whole step or index"),
        ({"args": {"action": -1}}, "has no whole step or index (-1)"),
        ({"ts": float("nan")}, "has no time it ran (ts nan, dur 0.0)"),
        ({"ts": "1e400"}, "has no time it ran (ts '1e400', dur 0.0)"),
        ({"dur": -5}, "has no time it ran (ts 1, dur -5)"),
        ({"pid": 10**11}, "is on rank 100,000,000,000; a schedule has fewer than 150,000"),
    ],
)
def test_a_trace_event_without_a_rank_or_a_step_is_named(
    event: dict[str, object], words: str, tmp_path: Path
) -> None:
    """An unhashable pid was an internal TypeError, a step of "x" or a time of NaN a
    ValueError; a step of 1e300 or a negative duration was drawn, a rank of 10^11 ran out
    of memory: each is the trace's error, naming the event (viz: exit 2)."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps([{"ph": "X", "name": "F0@0/main", "pid": 0, "ts": 1, **event}]))
    with pytest.raises(TraceError, match="F0@0/main"):
        read_trace(path)
    status, out, err = run_in_process(["viz", "--trace", str(path)])
    assert (status, out) == (2, "")
    assert words in err and "event `F0@0/main`" in err, err


def test_a_trace_nested_too_deep_is_refused(tmp_path: Path) -> None:
    """json's RecursionError was an internal error."""
    path = tmp_path / "t.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    status, _, err = run_in_process(["viz", "--trace", str(path)])
    assert status == 2 and err.startswith("pipelang viz: error: `")
    assert err.endswith(" nests too deep for a Chrome trace\n") and len(err.splitlines()) == 1


# ---- HTML in a browser, PNG -------------------------------------------------------------------


def test_html_is_self_contained_with_hover_and_comparison() -> None:
    panels = [simulated(timeline_of(s, {"D": "4", "N": "8"})) for s in ("1f1b", "chimera")]
    html = render(panels, ".html")
    assert isinstance(html, str)
    assert "<script src" not in html and "<link" not in html and "@import" not in html
    assert html.count("http") == html.count('xmlns="http://www.w3.org/2000/svg"')
    assert html.count("<title>") == 1 + 2 * 64  # the page's, then one per op
    assert "micro-batch 3, stage 2, pipeline down" in html
    assert html.count("<tr><td>") == 2


NO_CHROMIUM = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="needs Debian's `chromium` package (/usr/bin/chromium) to render the HTML: "
    "apt-get install -y chromium",
)


def chromium(tmp_path: Path, *args: str) -> bytes:
    """Run headless Chromium with no network, sync or first-run work; its stdout."""
    done = subprocess.run(
        [str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--force-color-profile=srgb", f"--user-data-dir={tmp_path / 'ud'}",
         *args],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    return done.stdout


@pytest.mark.slow
@NO_CHROMIUM
def test_html_renders_in_headless_chromium(tmp_path: Path) -> None:
    panels = [simulated(timeline_of(s, {"D": "4", "N": "8"})) for s in ("1f1b", "chimera")]
    page = tmp_path / "cmp.html"
    page.write_text(str(render(panels, ".html")))
    shot = tmp_path / "shot.png"
    chromium(tmp_path, f"--screenshot={shot}", "--window-size=1200,800", page.as_uri())
    width, height, pixels = read_png(shot.read_bytes())
    assert (width, height) == (1200, 800)
    colors = Counter(pixels)
    assert len(colors) > 50
    assert colors[(255, 255, 255)] < 0.9 * len(pixels)
    pal = palette(panels[1].timeline.program)
    for fill in (pal.fill(Kind.F, 0), pal.fill(Kind.F, 1), pal.fill(Kind.B, 0)):
        want = tuple(int(fill[i : i + 2], 16) for i in (1, 3, 5))
        near = sum(
            n
            for color, n in colors.items()
            if max(abs(a - b) for a, b in zip(color, want, strict=True)) <= 3
        )
        assert near > 500, f"{fill} barely on the screenshot ({near} pixels)"


@NO_CHROMIUM
def test_html_hover_shows_the_op(tmp_path: Path) -> None:
    """Move the pointer over one op (a synthetic event) and read the tooltip back."""
    timeline = timeline_of("chimera", {"D": "4", "N": "4"})
    html = str(render([simulated(timeline)], ".html"))
    probe = (
        "<script>const box = document.querySelectorAll('rect.op')[5];"
        "box.dispatchEvent(new MouseEvent('mousemove', {bubbles: true, clientX: 9, clientY: 9}));"
        "const shown = document.getElementById('tip');"
        "document.body.dataset.probe = shown.style.display + '|' + shown.textContent;</script>"
    )
    page = tmp_path / "hover.html"
    page.write_text(html.replace("</body>", probe + "</body>"))
    dom = chromium(tmp_path, "--dump-dom", page.as_uri()).decode()
    event = timeline.events[5]
    a = event.action
    assert (
        f'data-probe="block|{a.text()} on rank {event.rank}\n{a.kind.value} ({KIND_NAME[a.kind]}), '
        f"micro-batch {a.mb}, stage {a.stage}, pipeline {a.pipeline}\n"
        f'start {event.start:g}, end {event.end:g}"'
    ) in dom


def read_png(data: bytes) -> tuple[int, int, list[tuple[int, int, int]]]:
    """A tiny decoder for 8-bit RGB/RGBA non-interlaced PNGs: (width, height, RGB pixels)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        header = body if kind == b"IHDR" else header
        idat += body if kind == b"IDAT" else b""
        pos += 12 + length
    width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", header)
    assert depth == 8 and color in (2, 6) and interlace == 0
    channels = 3 if color == 2 else 4
    raw, stride = zlib.decompress(idat), width * channels
    rows: list[bytearray] = []
    prev = bytearray(stride)
    for y in range(height):
        kind, line = (
            raw[y * (stride + 1)],
            bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)]),
        )
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b, c = prev[i], prev[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + a) & 255
            elif kind == 2:
                line[i] = (line[i] + b) & 255
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(line)
        prev = line
    pixels = [tuple(row[x * channels : x * channels + 3]) for row in rows for x in range(width)]
    return width, height, pixels  # type: ignore[return-value]


def test_png_through_matplotlib(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib is optional: pip install 'pipelang[viz]'")
    data = render([simulated(timeline_of("chimera", {"D": "4", "N": "4"}))], ".png")
    assert isinstance(data, bytes) and data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 1000 and 200 < height < width


def test_png_without_matplotlib_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: object, **kwargs: object) -> object:
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    status, out, err = run_in_process(["viz", "1f1b", "-o", str(tmp_path / "x.png")])
    assert status == 2 and out == ""
    assert "pip install 'pipelang[viz]'" in err
    assert not (tmp_path / "x.png").exists()


def test_every_format_writes_a_file(tmp_path: Path) -> None:
    for suffix in (".svg", ".html", ".json", ".txt"):
        out = tmp_path / f"sub/x{suffix}"
        assert run_in_process(["viz", "1f1b", "-p", "N=4", "-o", str(out)])[0] == 0
        assert out.stat().st_size > 100
    text = (tmp_path / "sub/x.txt").read_text()
    timeline = timeline_of("1f1b", {"N": "4"})
    assert (
        text == f"{Panel(timeline).name}: {simulated(timeline).summary()}\n{timeline.text_grid()}\n"
    )


def test_viz_speed_smoke() -> None:
    """Not the benchmark (benchmarks/viz_speed.py): a check that nothing is quadratic."""
    import time

    timeline = timeline_of("1f1b", {"D": "16", "N": "128"})
    for suffix in (".svg", ".json"):
        start = time.perf_counter()
        render([simulated(timeline)], suffix, comms=True)
        assert time.perf_counter() - start < 2.0
