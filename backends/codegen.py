"""Codegen: one plain, straight-line Python program per rank, from a compiled Program.

Each action becomes one call on the runtime `rt`, with the action's token as a comment:

    F3@1/down               rt.forward(mb=3, stage=1, pipeline="down")
    send:F3@1/down>2        rt.send_activation(mb=3, stage=1, pipeline="down", to=2)
    recv:B3@2/down<2        rt.recv_grad(mb=3, stage=2, pipeline="down", src=2)
    wait:F2@1/down<1        rt.wait("F", mb=2, stage=1, pipeline="down", src=1)
    allreduce@1/down        rt.allreduce(stage=1, pipeline="down")
    step                    rt.step()
    E3@0/main>3             rt.evict(mb=3, stage=0, pipeline="main", to=3)
    U2@1/main               rt.update(stage=1, pipeline="main", version=3)
    F3.1@0/main             rt.forward(mb=3, stage=0, pipeline="main", chunk=1)

(`update` belongs to asynchronous schedules; its `version` counts the copy's updates from
1 in each iteration; see docs/runtime.md.)

This module decides every line; the template (`templates/rank.py.j2`, StrictUndefined)
only loops and substitutes.
"""

from __future__ import annotations

import linecache
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2

from pipelang import __version__
from pipelang.diagnostics import InternalError
from pipelang.ir import Action, Kind, Program
from pipelang.ir.streams import StreamOp, StreamProgram, value_boundary
from pipelang.source import one_line

_METHODS = {
    Kind.F: "forward",
    Kind.B: "backward",
    Kind.W: "weight_grad",
    Kind.R: "recompute",
    Kind.P: "frozen_forward",
}
"""The runtime method of each compute kind."""

_STASH_METHODS = {Kind.E: "evict", Kind.H: "hold", Kind.L: "load"}
"""The runtime method of each eviction action (BPipe; backends/stash.py)."""

_TRANSFERS = {
    (Kind.SEND, Kind.F): "send_activation",
    (Kind.RECV, Kind.F): "recv_activation",
    (Kind.SEND, Kind.B): "send_grad",
    (Kind.RECV, Kind.B): "recv_grad",
    (Kind.SEND, Kind.P): "send_frozen",
    (Kind.RECV, Kind.P): "recv_frozen",
    (Kind.SEND, Kind.E): "send_evicted",
    (Kind.RECV, Kind.E): "recv_evicted",
    (Kind.SEND, Kind.H): "send_held",
    (Kind.RECV, Kind.H): "recv_held",
}
"""The runtime method of each data transfer: (comm kind, kind of the op that made it)."""

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("pipelang.backends", "templates"),
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
    autoescape=False,
)


def action_call(action: Action) -> str:
    """The one runtime call that performs `action` (see the module docstring)."""
    kind = action.kind
    if kind is Kind.STEP:
        return "rt.step()"
    where = f'stage={action.stage}, pipeline="{action.pipeline}"'
    if kind is Kind.ALLREDUCE:
        return f"rt.allreduce({where})"
    if kind is Kind.U:
        return f"rt.update({where}, version={(action.mb or 0) + 1})"
    part = "" if action.chunk is None else f", chunk={action.chunk}"
    if kind.is_compute:
        return f"rt.{_METHODS[kind]}(mb={action.mb}, {where}{part})"
    if kind in _STASH_METHODS:
        to = "" if kind is not Kind.E else f", to={action.peer}"
        return f"rt.{_STASH_METHODS[kind]}(mb={action.mb}, {where}{to})"
    peer = f"to={action.peer}" if kind in (Kind.SEND, Kind.SIGNAL) else f"src={action.peer}"
    if kind in (Kind.SIGNAL, Kind.WAIT):
        assert action.of is not None
        return f'rt.{kind.value}("{action.of.value}", mb={action.mb}, {where}, {peer})'
    method = _TRANSFERS.get((kind, action.of))  # type: ignore[arg-type]
    if method is None:
        raise InternalError(f"the runtime cannot move the result of {action}")
    return f"rt.{method}(mb={action.mb}, {where}, {peer}{part})"


def render_rank_program(program: Program, rank: int) -> str:
    """The source text of rank `rank`'s program."""
    actions = program.ranks[rank]
    calls = [action_call(a) for a in actions]
    width = max((len(c) for c in calls), default=0)
    lines = [
        f"{c:<{width}}  # {i:>3}  {a.text()}"
        for i, (c, a) in enumerate(zip(calls, actions, strict=True))
    ]
    return _ENV.get_template("rank.py.j2").render(
        **_header(program, rank), lines=lines or ["pass  # this rank runs no action"]
    )


GRAPH_WARMUP = 3
"""Eager steps before a capture: NCCL connects peers on first use and autograd and the
optimizer allocate their state then; torch's docs and Megatron warm up 3 times."""


def stream_op_call(op: StreamOp, world: int) -> str:
    """The runtime call that issues one stream op, peers as program ranks (`world` of
    them; a --dp copy's process k*R + r runs rank r's file)."""
    if op.is_event:
        return f'rt.{op.what}_event({op.event}, on="{op.stream}")'
    if op.what == "step":
        return "rt.step()"
    action = Action.parse(op.what)
    kind = action.kind
    where = f'stage={action.stage}, pipeline="{action.pipeline}"'
    if kind is Kind.ALLREDUCE:
        return f"rt.allreduce({where})"
    if kind is Kind.U:
        return f"rt.update({where}, version={(action.mb or 0) + 1})"
    slots = {a.slot for a in (*op.reads, *op.writes) if a.slot.startswith("d")}
    if kind.is_compute:
        data = [(a, False) for a in op.reads] + [(a, True) for a in op.writes]
        named = "".join(
            f', {_ROLE[(kind, out)]}="{a.slot}"' for a, out in data if a.slot.startswith("d")
        )
        part = "" if action.chunk is None else f", chunk={action.chunk}"
        return f"rt.{_METHODS[kind]}(mb={action.mb}, {where}{named}{part})"
    assert action.peer is not None
    peer = action.peer % world
    if kind is Kind.SIGNAL:
        return f"rt.signal(to={peer})"
    if kind is Kind.WAIT:
        return f"rt.wait_signal(src={peer})"
    (slot,) = slots
    value = action.op().text()
    if kind is Kind.SEND:
        return f'rt.send(to={peer}, slot="{slot}", value="{value}")'
    return f'rt.recv(src={peer}, slot="{slot}", value="{value}")'


_ROLE = {
    (Kind.F, False): "x",
    (Kind.F, True): "y",
    (Kind.B, False): "dy",
    (Kind.B, True): "dx",
    (Kind.P, True): "y",
}
"""The keyword naming a compute op's data slot: F reads x, writes y; B reads dy, writes
dx; P writes y."""


def render_stream_rank(
    program: Program, streams: StreamProgram, rank: int, cuda: bool = False, capture: bool = True
) -> str:
    """The source text of rank `rank`'s stream program: one call per op of process `rank`
    (the first data-parallel copy's; every copy runs the same file); for a CPU process
    only those the host must issue (`StreamProgram.host_ops`). `capture`: its driver
    captures the iteration after WARMUP steps and replays it (`--graphs`); otherwise
    every step runs it eagerly."""
    ops = [op for _, op in (streams.by_rank(rank) if cuda else streams.host_ops(rank))]
    calls = [stream_op_call(op, program.num_ranks) for op in ops]
    width = max((len(c) for c in calls), default=0)
    lines = [
        f"{c:<{width}}  # {op.stream:<8} {op.what if op.event is None else f'e{op.event}'}"
        for c, op in zip(calls, ops, strict=True)
    ]
    tenants: dict[str, set[int]] = {}
    for op in ops:
        for a in op.writes:
            if a.slot.startswith("d"):
                tenants.setdefault(a.slot, set()).add(value_boundary(a.value))
    slots = "{" + ", ".join(f'"{s}": {tuple(sorted(b))}' for s, b in tenants.items()) + "}"
    index = {a.text(): i for i, a in enumerate(program.ranks[rank])}
    actions = "".join(f"{index.get(op.what)}, " for op in ops).strip()
    return _ENV.get_template("rank_streams.py.j2").render(
        **_header(program, rank),
        slots=slots,
        actions=textwrap.fill(actions, 92, initial_indent="    ", subsequent_indent="    "),
        warmup=GRAPH_WARMUP if capture else None,
        lines=lines or ["pass  # this rank runs no op"],
    )


def _header(program: Program, rank: int) -> dict[str, object]:
    """What both templates say about the program and the rank at their top."""
    return {
        "version": __version__,
        "source": one_line(program.source),
        "name": program.name,
        "params": _params(program),
        "rank": rank,
        "num_ranks": program.num_ranks,
        "copies": _copies(program, rank),
    }


def _params(program: Program) -> str:
    params = ", ".join(
        f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in program.params
    )
    return f" ({params})" if params else ""


def _copies(program: Program, rank: int) -> str:
    return ", ".join(f"stage {s} of `{p}`" for s, p in program.stage_copies(rank)) or "none"


def write_rank_programs(program: Program, out_dir: Path) -> list[Path]:
    """Write `out_dir/rank{r}.py` for every rank; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for rank in range(program.num_ranks):
        path = out_dir / f"rank{rank}.py"
        path.write_text(render_rank_program(program, rank))
        written.append(path)
    return written


def load_iteration(source: str, filename: str) -> Callable[[Any], None]:
    """The `iteration(rt)` function of a generated program's source text.

    The text is our own generated code (never user input). It is registered with
    linecache so that tracebacks and debuggers show its lines.
    """
    lines = source.splitlines(keepends=True)
    linecache.cache[filename] = (len(source), None, lines, filename)
    namespace: dict[str, Any] = {"__name__": f"pipelang_rank_{Path(filename).stem}"}
    exec(compile(source, filename, "exec"), namespace)
    return namespace["iteration"]  # type: ignore[no-any-return]
