"""Op kinds and `Action`, the one type of every entry of a rank's list, with its
one-token text form (`F3.1@0/main`, `send:F3@1/down>2`) that `Action.parse` reads back
(the forms are listed in pipelang/ir/__init__.py)."""

from __future__ import annotations

import enum
import re
from typing import NamedTuple

from pipelang.diagnostics import InternalError
from pipelang.source import Span


class Kind(enum.StrEnum):
    """What an action does. A str enum: `Kind.F == "F"`, and it prints as its letter."""

    F = "F"
    """Forward of one micro-batch through one stage. Roughly: `y = stage(x); save(x, y)`."""
    B = "B"
    """Backward: input gradient (and weight gradient too unless `W` is split off).
    Roughly: `dx = grad(y, x, dy)`."""
    W = "W"
    """Weight gradient alone, split off `B` (zero-bubble). Roughly: `dw += grad(y, w, dy)`."""
    R = "R"
    """Recompute a forward whose activations were dropped. Roughly: `y = stage(x)` again."""
    P = "P"
    """Frozen forward: the model's non-trainable part (a frozen encoder) on one
    micro-batch, without gradients; its output is the input of F(mb, 0), so the action
    names stage 0 of the micro-batch's pipeline: `P3@0/main`. It runs on any rank that
    holds the frozen part (`Program.frozen`). Roughly: `x0 = frozen(ids)`."""
    SEND = "send"
    """Send the output of a compute op to the rank that consumes it (non-blocking)."""
    RECV = "recv"
    """Receive the output of a compute op from the rank that produced it (blocking)."""
    SIGNAL = "signal"
    """Tell another rank a compute op finished; carries no data (an `after` dependency)."""
    WAIT = "wait"
    """Block until another rank signals that a compute op finished."""
    ALLREDUCE = "allreduce"
    """Sum one stage's gradients over all its replicas (Chimera's two directions)."""
    STEP = "step"
    """Optimizer step on every stage copy the rank holds; ends the iteration."""
    U = "U"
    """Weight update of one stage copy in an asynchronous schedule: the optimizer applies
    the gradients accumulated since the copy's previous update and makes a new version
    of its weights. Its `mb` field numbers the copy's updates 0, 1, ...; update k makes
    version k + 1 (version 0 is the initial weights)."""
    E = "E"
    """Evict: move the activations F(mb, stage) kept off this rank to the partner rank
    `peer` (BPipe), freeing them here until their `L`. Written `E3@0/main>3`."""
    L = "L"
    """Load: take the activations an `E` evicted back from the partner, before the ops
    of that (micro-batch, stage) that need them (`R`, `B`)."""
    H = "H"
    """Hold, on the partner: receive activations another rank evicts and keep them until
    that rank loads them back. Inserted by the compiler (`insert-holds`), never written."""
    GATHER = "gather"
    """All-gather one stage copy's parameters from its shards over its `--dp` copies
    (`--shard`): FSDP2's `unshard()`; they stay gathered until a `reshard` or the
    copy's `reduce_scatter`. Written `gather()` in an `order rank`, or inserted by the
    compiler (`insert-shard`) before the copy's first op of the step where none is
    written. Its `mb` field numbers the copy's gathers of the step after the first (None
    for the first): `gather@1/main`, then `gather1@1/main`, ..."""
    RESHARD = "reshard"
    """Drop one stage copy's gathered parameters, keeping its shard (`--shard`): FSDP2's
    `reshard()`; the gradients its micro-batches accumulated so far are kept, and a
    later use of the copy needs a `gather` again. Written `reshard()` in an `order
    rank`, never inserted. Numbered like `gather`: `reshard@1/main`, `reshard1@1/main`."""
    REDUCE_SCATTER = "reduce_scatter"
    """Sum one stage copy's gradients over its `--dp` copies, each keeping the sum of its
    own shard, and drop the gathered parameters (`--shard`), after the copy's last
    backward of the step: FSDP2's post-backward, once per step. Inserted by the compiler
    (`insert-shard`), never written. Written `reduce_scatter@1/main`."""

    # Members are singletons compared by identity, so hash them by identity too, in C:
    # Enum's own __hash__ is a Python call, and every Action hash goes through it.
    __hash__ = object.__hash__

    @property
    def is_compute(self) -> bool:
        return self in COMPUTE_KINDS


COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.W, Kind.R, Kind.P})
COMM_KINDS = frozenset({Kind.SEND, Kind.RECV, Kind.SIGNAL, Kind.WAIT})
STASH_KINDS = frozenset({Kind.E, Kind.L, Kind.H})
"""Evicting activations to a partner rank and loading them back (BPipe). These are ops
of the dependency graph like the compute kinds, but no (micro-batch, stage) must run
them and they take no compute time."""
SHARD_KINDS = frozenset({Kind.GATHER, Kind.RESHARD, Kind.REDUCE_SCATTER})
"""A sharded stage copy's collectives over its data-parallel copies (`--shard`). Ops of
the dependency graph, so that the simulator times them (the cost entries `AG`, `RS`;
`reshard` takes no time), but no (micro-batch, stage) must run them; they name a stage
copy, not a micro-batch."""
_TOKENS = {kind: kind.value for kind in Kind}
_ARROWS = {Kind.SEND: ">", Kind.SIGNAL: ">"}
GRAPH_KINDS = COMPUTE_KINDS | STASH_KINDS | SHARD_KINDS
"""The kinds of the actions that are nodes of the dependency graph (`build-dag`)."""


class Action(NamedTuple):
    """One thing a rank does.

    Compute actions use `kind`, `mb`, `stage`, `pipeline`, and `chunk` in a schedule
    that splits micro-batches into sequence chunks (None otherwise). Communication
    actions name the compute op whose result they move (`of`) and the other rank
    (`peer`). `allreduce`, `gather` and `reduce_scatter` name a stage and pipeline;
    `step` names nothing; `U` uses `mb` for its number.
    `span` is where the action came from; it takes no part in equality or hashing.

    `fused` marks a compute action that starts together with the one before it on its
    rank, as one step: `F(i, a) & B(j, b)` (an overlapped pair, torch's OVERLAP_F_B) or a
    full backward `BW(j, b)` in a split schedule (its B, then its W fused to it). A run of
    actions joined this way is a *compound*: it starts when the inputs of all its ops are
    ready and all of them end together. Every pass that needs no timing treats them as
    ops in order. Like `span`, `fused` takes no part in equality or hashing.

    Immutable like every IR node, but a NamedTuple rather than a frozen dataclass: a
    large schedule makes 4 x 10^5 actions per compile, and a tuple is built several
    times faster (see "Compile speed" in benchmarks/RESULTS.md).
    """

    kind: Kind
    mb: int | None = None
    stage: int | None = None
    pipeline: str | None = None
    peer: int | None = None
    of: Kind | None = None
    chunk: int | None = None
    span: Span | None = None
    fused: bool = False

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Action):
            return NotImplemented
        return self[:7] == other[:7]

    def __ne__(self, other: object) -> bool:
        if not isinstance(other, Action):
            return NotImplemented
        return self[:7] != other[:7]

    def __hash__(self) -> int:
        return hash(self[:7])

    def __repr__(self) -> str:
        return f"Action({self.text()})"

    def op(self) -> Action:
        """The compute op this action is about (itself for compute, stash and shard
        actions)."""
        if self.kind.is_compute or self.kind in STASH_KINDS or self.kind in SHARD_KINDS:
            return self
        if self.of is None:
            raise InternalError(f"{self} names no compute op")
        return Action(self.of, self.mb, self.stage, self.pipeline, chunk=self.chunk, span=self.span)

    def unit(self) -> str:
        """The micro-batch, with its chunk if it names one: `3`, or `3.1` for chunk 1; ""
        for an action that names no micro-batch (a sharded stage's `gather`)."""
        if self.mb is None:
            return ""
        return str(self.mb) if self.chunk is None else f"{self.mb}.{self.chunk}"

    def unfused(self) -> Action:
        """This action without the `fused` mark."""
        return self._replace(fused=False) if self.fused else self

    def text(self) -> str:
        """The one-token text form; `Action.parse(a.text()) == a`."""
        kind = self.kind
        mb = self.unit()
        if kind in COMPUTE_KINDS:  # the common case, without Enum's `.value` descriptor
            fused = "&" if self.fused else ""
            return f"{fused}{_TOKENS[kind]}{mb}@{self.stage}/{self.pipeline}"
        if kind is Kind.STEP:
            return "step"
        if kind in STASH_KINDS:
            to = "" if self.peer is None else f">{self.peer}"
            return f"{kind.value}{mb}@{self.stage}/{self.pipeline}{to}"
        if kind is Kind.U:
            return f"U{self.mb}@{self.stage}/{self.pipeline}"
        if kind is Kind.ALLREDUCE or kind in SHARD_KINDS:
            return f"{kind.value}{mb}@{self.stage}/{self.pipeline}"
        assert self.of is not None
        return (
            f"{_TOKENS[kind]}:{_TOKENS[self.of]}{mb}@{self.stage}/{self.pipeline}"
            f"{_ARROWS.get(kind, '<')}{self.peer}"
        )

    def __str__(self) -> str:
        return self.text()

    @staticmethod
    def parse(token: str, span: Span | None = None) -> Action:
        """Read the one-token text form back; raises ValueError on anything else."""
        match = _TOKEN.fullmatch(token.strip())
        if match is None:
            raise ValueError(f"not an action: {token!r}")
        g = match.groupdict()
        if g["step"]:
            return Action(Kind.STEP, span=span)
        if g["ar_stage"] is not None:
            number = None if g["ar_n"] is None else int(g["ar_n"])
            if number is not None and g["ar"] not in (Kind.GATHER, Kind.RESHARD):
                raise ValueError(f"only `gather` and `reshard` are numbered: {token!r}")
            return Action(Kind(g["ar"]), number, int(g["ar_stage"]), g["ar_pipe"], span=span)
        if g["u_mb"] is not None:
            return Action(Kind.U, int(g["u_mb"]), int(g["u_stage"]), g["u_pipe"], span=span)
        op_kind, mb, stage, pipe = Kind(g["op"]), int(g["mb"]), int(g["stage"]), g["pipe"]
        chunk = None if g["chunk"] is None else int(g["chunk"])
        if g["comm"] is None and op_kind in STASH_KINDS:
            if chunk is not None:
                raise ValueError(f"evictions do not name a chunk: {token!r}")
            return _stash_action(token, op_kind, mb, stage, pipe, g, span)
        if g["comm"] is None:
            return Action(op_kind, mb, stage, pipe, chunk=chunk, span=span, fused=bool(g["fused"]))
        if g["fused"]:
            raise ValueError(f"only a compute action can be fused (`&`): {token!r}")
        comm = Kind(g["comm"])
        wants = ">" if comm in (Kind.SEND, Kind.SIGNAL) else "<"
        if g["arrow"] != wants:
            raise ValueError(f"`{comm.value}` takes `{wants}`, not `{g['arrow']}`: {token!r}")
        return Action(comm, mb, stage, pipe, int(g["peer"]), op_kind, chunk, span=span)


def _stash_action(
    token: str, kind: Kind, mb: int, stage: int, pipe: str, g: dict[str, str], span: Span | None
) -> Action:
    """`E3@0/main>3` (an eviction names its partner), `L3@0/main`, `H3@0/main`."""
    if g["fused"]:
        raise ValueError(f"only a compute action can be fused (`&`): {token!r}")
    if g["arrow"] is None:
        return Action(kind, mb, stage, pipe, span=span)
    if kind is not Kind.E or g["arrow"] != ">":
        raise ValueError(f"only an eviction names a partner, as `E3@0/main>3`: {token!r}")
    return Action(kind, mb, stage, pipe, int(g["peer"]), span=span)


_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_TOKEN = re.compile(
    rf"(?P<step>step)"
    rf"|(?P<ar>allreduce|gather|reshard|reduce_scatter)(?P<ar_n>\d+)?@(?P<ar_stage>\d+)/(?P<ar_pipe>{_NAME})"
    rf"|U(?P<u_mb>\d+)@(?P<u_stage>\d+)/(?P<u_pipe>{_NAME})"
    rf"|(?P<fused>&)?(?:(?P<comm>send|recv|signal|wait):)?(?P<op>[FBWRPEHL])(?P<mb>\d+)(?:\.(?P<chunk>\d+))?@(?P<stage>\d+)/(?P<pipe>{_NAME})"
    rf"(?:(?P<arrow>[<>])(?P<peer>\d+))?"
)
