"""One executor: what a rank's program does, op by op, as a table from op kind to handler.

A rank runs its action list (schedule.json's) or its part of the stream program. Each
op is one `Call`, a method of the rank's runtime with its arguments, which the handler
of the op's kind makes (`ACTION_CALLS` for an action, `STREAM_CALLS` for a stream op):

    F3@1/down               rt.forward(mb=3, stage=1, pipeline="down")
    send:F3@1/down>2        rt.send_activation(mb=3, stage=1, pipeline="down", to=2)
    recv:B3@2/down<2        rt.recv_grad(mb=3, stage=2, pipeline="down", src=2)
    wait:F2@1/down<1        rt.wait("F", mb=2, stage=1, pipeline="down", src=1)
    allreduce@1/down        rt.allreduce(stage=1, pipeline="down")
    gather@1/down           rt.gather(stage=1, pipeline="down")          (--shard)
    reshard@1/down          rt.reshard(stage=1, pipeline="down")         (--shard)
    reduce_scatter@1/down   rt.reduce_scatter(stage=1, pipeline="down")  (--shard)
    step                    rt.step()
    E3@0/main>3             rt.evict(mb=3, stage=0, pipeline="main", to=3)
    U2@1/main               rt.update(stage=1, pipeline="main", version=3)
    F3.1@0/main             rt.forward(mb=3, stage=0, pipeline="main", chunk=1)

(`update` belongs to asynchronous schedules; its `version` counts the copy's updates from
1 in each iteration; see docs/runtime.md.) A stream op's call names its data slots
(`rt.slot_forward(mb=0, stage=1, pipeline="main", x="d0")`), its events and its peers
(backends/stream_runtime.py).

`RankProgram` binds a rank's calls to its runtime once and runs them each step; for a
stream program it is also the driver: the step's inputs into static buffers, then the
iteration eagerly (every step, or the first `GRAPH_WARMUP` under `--graphs`), captured
once and replayed. Nothing is generated and executed: `pipelang compile -o DIR` writes
the same calls as text (`Call.text`, backends/codegen.py), so a rank file and what runs
cannot disagree; the CPU stream executor runs an action through `action_call` too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipelang.diagnostics import InternalError
from pipelang.ir import Action, Kind, Program
from pipelang.ir.streams import StreamOp, StreamProgram, value_boundary

if TYPE_CHECKING:
    from pipelang.backends.runtime import RankRuntime
    from pipelang.backends.stream_runtime import StreamRankRuntime

GRAPH_WARMUP = 3
"""Eager steps before a capture: NCCL connects peers on first use and autograd and the
optimizer allocate their state then; torch's docs and Megatron warm up 3 times."""


@dataclass(frozen=True, slots=True)
class Call:
    """One method call on a rank's runtime: what one op does."""

    method: str
    args: tuple[Any, ...] = ()
    kwargs: tuple[tuple[str, Any], ...] = ()

    def text(self) -> str:
        """The call as Python: `rt.forward(mb=3, stage=1, pipeline="down")`."""
        given = [_literal(a) for a in self.args] + [f"{k}={_literal(v)}" for k, v in self.kwargs]
        return f"rt.{self.method}({', '.join(given)})"

    def run(self, runtime: RankRuntime) -> None:
        """Perform the call on `runtime`."""
        getattr(runtime, self.method)(*self.args, **dict(self.kwargs))


def _literal(value: object) -> str:
    return f'"{value}"' if isinstance(value, str) else str(value)


# ---- actions ---------------------------------------------------------------------------

_COMPUTE = {
    Kind.F: "forward",
    Kind.B: "backward",
    Kind.W: "weight_grad",
    Kind.R: "recompute",
    Kind.P: "frozen_forward",
}
"""The runtime method of each compute kind."""

_SLOT_COMPUTE = {
    **_COMPUTE,
    Kind.F: "slot_forward",
    Kind.B: "slot_backward",
    Kind.P: "slot_frozen_forward",
}
"""The same in a stream program, whose F, B and P read and write data slots."""

_STASH = {Kind.E: "evict", Kind.H: "hold", Kind.L: "load"}
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


def _where(action: Action) -> tuple[tuple[str, Any], ...]:
    return (("stage", action.stage), ("pipeline", action.pipeline))


def _op(action: Action) -> tuple[tuple[str, Any], ...]:
    return (("mb", action.mb), *_where(action))


def _chunk(action: Action) -> tuple[tuple[str, Any], ...]:
    return () if action.chunk is None else (("chunk", action.chunk),)


def _compute(action: Action) -> Call:
    return Call(_COMPUTE[action.kind], (), (*_op(action), *_chunk(action)))


def _stash(action: Action) -> Call:
    to = (("to", action.peer),) if action.kind is Kind.E else ()
    return Call(_STASH[action.kind], (), (*_op(action), *to))


def _transfer(action: Action) -> Call:
    method = _TRANSFERS.get((action.kind, action.of))  # type: ignore[arg-type]
    if method is None:
        raise InternalError(f"the runtime cannot move the result of {action}")
    peer = ("to" if action.kind is Kind.SEND else "src", action.peer)
    return Call(method, (), (*_op(action), peer, *_chunk(action)))


def _signal(action: Action) -> Call:
    assert action.of is not None
    peer = ("to" if action.kind is Kind.SIGNAL else "src", action.peer)
    return Call(action.kind.value, (action.of.value,), (*_op(action), peer))


def _update(action: Action) -> Call:
    return Call("update", (), (*_where(action), ("version", (action.mb or 0) + 1)))


ACTION_CALLS: Mapping[Kind, Callable[[Action], Call]] = {
    **dict.fromkeys(_COMPUTE, _compute),
    **dict.fromkeys(_STASH, _stash),
    Kind.SEND: _transfer,
    Kind.RECV: _transfer,
    Kind.SIGNAL: _signal,
    Kind.WAIT: _signal,
    Kind.ALLREDUCE: lambda action: Call("allreduce", (), _where(action)),
    Kind.GATHER: lambda action: Call("gather", (), _where(action)),
    Kind.RESHARD: lambda action: Call("reshard", (), _where(action)),
    Kind.REDUCE_SCATTER: lambda action: Call("reduce_scatter", (), _where(action)),
    Kind.STEP: lambda action: Call("step"),
    Kind.U: _update,
}
"""Per action kind, the call that performs an action of it on a `RankRuntime`."""


def action_call(action: Action) -> Call:
    """The one runtime call that performs `action`."""
    return ACTION_CALLS[action.kind](action)


# ---- stream ops --------------------------------------------------------------------------

_ROLE = {
    (Kind.F, False): "x",
    (Kind.F, True): "y",
    (Kind.B, False): "dy",
    (Kind.B, True): "dx",
    (Kind.P, True): "y",
}
"""The keyword naming a compute op's data slot: F reads x, writes y; B reads dy, writes
dx; P writes y."""


def _stream_compute(op: StreamOp, action: Action, world: int) -> Call:
    data = [(a, False) for a in op.reads] + [(a, True) for a in op.writes]
    named = tuple((_ROLE[(action.kind, out)], a.slot) for a, out in data if _is_data(a.slot))
    return Call(_SLOT_COMPUTE[action.kind], (), (*_op(action), *named, *_chunk(action)))


def _stream_transfer(op: StreamOp, action: Action, world: int) -> Call:
    assert action.peer is not None
    (slot,) = {a.slot for a in (*op.reads, *op.writes) if _is_data(a.slot)}
    peer = ("to" if action.kind is Kind.SEND else "src", action.peer % world)
    value = action.op().text()
    return Call(action.kind.value, (), (peer, ("slot", slot), ("value", value)))


def _stream_signal(op: StreamOp, action: Action, world: int) -> Call:
    assert action.peer is not None
    if action.kind is Kind.SIGNAL:
        return Call("send_signal", (), (("to", action.peer % world),))
    return Call("wait_signal", (), (("src", action.peer % world),))


STREAM_CALLS: Mapping[Kind, Callable[[StreamOp, Action, int], Call]] = {
    **dict.fromkeys(_COMPUTE, _stream_compute),
    Kind.SEND: _stream_transfer,
    Kind.RECV: _stream_transfer,
    Kind.SIGNAL: _stream_signal,
    Kind.WAIT: _stream_signal,
    Kind.ALLREDUCE: lambda op, action, world: ACTION_CALLS[Kind.ALLREDUCE](action),
    Kind.STEP: lambda op, action, world: Call("step"),
    Kind.U: lambda op, action, world: _update(action),
}
"""Per kind of the action a stream op performs, the call that issues the op on a
`StreamRankRuntime`, its peers as program ranks (of `world`: a --dp copy's process
k*R + r runs rank r's part); an event is `record_event`/`wait_event` (`stream_call`)."""


def stream_call(op: StreamOp, world: int) -> Call:
    """The runtime call that issues one stream op."""
    if op.is_event:
        return Call(f"{op.what}_event", (op.event,), (("on", op.stream),))
    action = Action.parse(op.what)
    return STREAM_CALLS[action.kind](op, action, world)


def _is_data(slot: str) -> bool:
    return slot.startswith("d")


@dataclass(frozen=True, slots=True)
class StreamRank:
    """A rank's part of a stream program as its runtime issues it: every op on a GPU,
    on a CPU those the host must issue (`StreamProgram.host_ops`)."""

    ops: tuple[StreamOp, ...]
    calls: tuple[Call, ...]
    slots: dict[str, tuple[int, ...]]
    """Data slot -> the stage boundaries whose values it holds (b: the output of stage
    b): its bytes are the largest of them."""
    actions: tuple[int | None, ...]
    """Per op, the index of the action it performs in the rank's action list, or None
    for an event: what `--trace` records it as."""


def stream_rank(program: Program, streams: StreamProgram, rank: int, cuda: bool) -> StreamRank:
    """Rank `rank`'s part of `streams` (the first data-parallel copy's; every copy issues
    the same ops)."""
    ops = tuple(op for _, op in (streams.by_rank(rank) if cuda else streams.host_ops(rank)))
    tenants: dict[str, set[int]] = {}
    for op in ops:
        for a in op.writes:
            if _is_data(a.slot):
                tenants.setdefault(a.slot, set()).add(value_boundary(a.value))
    index = {a.text(): i for i, a in enumerate(program.ranks[rank])}
    return StreamRank(
        ops,
        tuple(stream_call(op, program.num_ranks) for op in ops),
        {slot: tuple(sorted(bounds)) for slot, bounds in tenants.items()},
        tuple(index.get(op.what) for op in ops),
    )


# ---- a rank's program on its runtime -----------------------------------------------------


class RankProgram:
    """A rank's calls bound to its runtime's methods (looked up once), run each step."""

    def __init__(
        self, runtime: RankRuntime, calls: Sequence[Call], warmup: int | None = None
    ) -> None:
        self.runtime = runtime
        self.calls = tuple(calls)
        self.bound = [(getattr(type(runtime), c.method), c.args, dict(c.kwargs)) for c in calls]
        self.warmup = warmup
        """A stream program's eager steps before its capture (`--graphs`); None: every
        step eager. An action list ignores it."""

    def iteration(self, runtime: RankRuntime) -> None:
        """One training iteration: every call, in order, on `runtime` (the bound one)."""
        for method, args, kwargs in self.bound:
            method(runtime, *args, **kwargs)

    def run(self, step: int) -> None:
        """The ops of step `step` (between the runtime's `begin_step` and `end_step`)."""
        self.iteration(self.runtime)


class StreamRankProgram(RankProgram):
    """A rank's part of a stream program, with its driver: each step loads its inputs
    into static buffers, then runs the iteration eagerly (every step, or the first
    `warmup`), captures it once and replays it. On a CPU nothing is captured: a replay
    runs the iteration again."""

    runtime: StreamRankRuntime

    def run(self, step: int) -> None:
        rt = self.runtime
        rt.load_inputs(step)
        if self.warmup is None or step < self.warmup:
            rt.run_eager(self.iteration)
            return
        if rt.graph is None:
            rt.capture(self.iteration)
        rt.replay()
