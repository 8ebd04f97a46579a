"""`viz -o X.json`: timelines as a Chrome trace (its format: pipelang/trace.py).

One process per rank (`pid` = rank when there is one panel), named `rank r` (with the
schedule's name in front when several schedules share a file). Inside it, the thread
`compute` holds the compute ops as complete events (`ph: "X"`); transfers, and a
measured run's send/recv/allreduce/step, go on threads of their own (`comm`, `comm 2`,
... so that no two events on one thread overlap, which the viewers require). A send and
the recv of the same result are joined by a flow arrow (Perfetto's flow v2: a numeric
`bind_id` with `flow_out` / `flow_in`). Simulated transfers are a send lasting the
transfer time C and a recv from the result's arrival to the start of the op using it.

`ts` and `dur` are microseconds. A simulated timeline has no real unit: one cost unit is
written as one millisecond, so a Perfetto ruler reading `3 ms` means 3 cost units.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from pipelang.ir import Kind
from pipelang.sim.timeline import Timeline
from pipelang.trace import complete, document, metadata, rank_name
from pipelang.visualize import style
from pipelang.visualize.panel import Panel, transfers

SIM_UNIT_US = 1000.0
"""Microseconds written for one simulated cost unit."""


Comm = tuple[float, bool, int, float, str, str, "tuple[str, int, int] | None"]
"""A communication slice as (start, is_recv, rank, end, name, category, flow): on `rank`
from `start` to `end`; `flow` names the result and the two ranks, the same on a send and
its recv (None for allreduce and step). Plain tuples, sorted by (start, is_recv, rank)
so that at equal times a send comes before its recv: there are 10^5 of them."""


def render_chrome(panels: Sequence[Panel], comms: bool = True) -> str:
    """The trace JSON of every panel (and of its overlay, as processes of its own)."""
    tracks: list[tuple[str, Timeline, Panel, bool]] = []
    for panel in panels:
        tracks.append((panel.name if len(panels) > 1 else "", panel.timeline, panel, True))
        if panel.overlay is not None:
            tracks.append((f"model of {panel.name}", panel.overlay, panel, False))
    lines: list[str] = []
    for index, (prefix, timeline, panel, primary) in enumerate(tracks):
        base = index * 1000 if len(tracks) > 1 else 0
        scale = 1000.0 if panel.unit == "ms" else SIM_UNIT_US
        _processes(lines, timeline, base, prefix)
        _compute(lines, timeline, base, scale)
        if comms:
            comm = _measured_comms(panel) if primary and panel.extra else _simulated_comms(timeline)
            _comm_events(lines, comm, base, scale)
    other = {
        "generator": "pipelang viz",
        "timelines": [
            {"name": p.name, "summary": p.summary(), "unit": p.unit or "cost units"} for p in panels
        ],
    }
    return document(lines, other)


def _processes(lines: list[str], timeline: Timeline, base: int, prefix: str) -> None:
    for rank in range(timeline.program.num_ranks):
        pid = base + rank
        lines.append(metadata("process_name", pid, 0, name=rank_name(rank, prefix)))
        lines.append(metadata("process_sort_index", pid, 0, sort_index=pid))
        lines.append(metadata("thread_name", pid, _tid(pid, 0), name="compute"))


def _compute(lines: list[str], timeline: Timeline, base: int, scale: float) -> None:
    """One complete event per compute op, with kind, micro-batch, stage and pipeline."""
    kind_names = {k: json.dumps(style.KIND_NAME.get(k, k.value)) for k in Kind}
    append = lines.append
    for rank, a, start, end in timeline.events:
        pid = base + rank
        kind = a.kind
        args = (
            f',"args":{{"kind":{kind_names[kind]},"mb":{json.dumps(a.mb)},"stage":{a.stage},'
            f'"pipeline":"{a.pipeline}"' + ("" if a.chunk is None else f',"chunk":{a.chunk}') + "}"
        )
        name = f"{kind.value}{a.unit()}@{a.stage}/{a.pipeline}"
        append(
            complete(
                name, kind.value, pid, _tid(pid, 0), start * scale, (end - start) * scale, args
            )
        )


def _simulated_comms(timeline: Timeline) -> list[Comm]:
    """For every result that crosses ranks: a send on the producer's rank lasting the
    transfer time C, and a recv on the consumer's rank from the result's arrival to the
    start of the op using it (as the runtime's blocking recv ends where its op starts)."""
    delay = timeline.costs.of("C")
    comm: list[Comm] = []
    append = comm.append
    for src, dst, sent, used, of in transfers(timeline):
        token = f"{of.kind.value}{of.unit()}@{of.stage}/{of.pipeline}"
        arrival = sent + delay
        key = (token, src, dst)
        append((sent, False, src, arrival, f"send:{token}>{dst}", "send", key))
        append((arrival, True, dst, max(used, arrival), f"recv:{token}<{src}", "recv", key))
    return comm


def _measured_comms(panel: Panel) -> list[Comm]:
    """A measured run's send, recv, signal, wait, allreduce and step actions."""
    comm: list[Comm] = []
    for rank, a, start, end in panel.extra:
        key = None
        if a.kind in (Kind.SEND, Kind.RECV) and a.peer is not None:
            src, dst = (rank, a.peer) if a.kind is Kind.SEND else (a.peer, rank)
            key = (a.op().text(), src, dst)
        comm.append((start, a.kind is not Kind.SEND, rank, end, a.text(), a.kind.value, key))
    return comm


def _comm_events(lines: list[str], comm: list[Comm], base: int, scale: float) -> None:
    """Comm slices on lanes 1, 2, ... of each rank, so that none overlaps another on its
    thread; a numeric flow id joins a send to its recv."""
    lanes: dict[int, list[float]] = {}
    flows: dict[tuple[str, int, int], int] = {}
    comm.sort()
    for start, is_recv, rank, end, name, cat, key in comm:
        ends = lanes.setdefault(rank, [])
        lane = 0
        while lane < len(ends) and ends[lane] > start:
            lane += 1
        pid = base + rank
        if lane == len(ends):
            ends.append(end)
            label = "comm" if lane == 0 else f"comm {lane + 1}"
            lines.append(metadata("thread_name", pid, _tid(pid, 1 + lane), name=label))
        ends[lane] = end
        flow = ""
        if key is not None:
            direction = "flow_in" if is_recv else "flow_out"
            flow = f',"bind_id":{flows.setdefault(key, len(flows) + 1)},"{direction}":true'
        tid = _tid(pid, 1 + lane)
        lines.append(complete(name, cat, pid, tid, start * scale, (end - start) * scale, flow))


def _tid(pid: int, lane: int) -> int:
    """Thread ids unique over the whole trace (Perfetto ties a tid to one process):
    lane 0 (compute) of process p is 1000p, its comm lanes 1000p+1, 1000p+2, ..."""
    return pid * 1000 + lane
