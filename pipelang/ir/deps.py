"""The dependency rule: which ops an op waits for. The one definition: the op graph
(`build-dag`) and `Program.inputs_of` (and through it the greedy and squeezed orders)
both read `inputs`, and the executors find the value an op reads with `forward_input`
and `gradient_input`.

F(m, s) needs F(m, s-1), and F(m, 0) needs P(m, 0) when there is a frozen part; P needs
nothing; B(m, s) needs F(m, s), R(m, s) when recompute is on, L(m, s) when the
activations were evicted, and B(m, s+1) (the loss on the last stage); W(m, s) needs
B(m, s); R(m, s) needs F(m, s), and L(m, s) when evicted. With sequence chunks each of
these is about the same chunk, and on its stage F(m, c) also needs F(m, c-1) (the keys
and values of the tokens before it) and B(m, c) needs B(m, c+1) (which hands back their
gradients). The evicted activations' own trips: E(m, s) needs F(m, s), the partner's
H(m, s) needs E(m, s), and L(m, s) needs E(m, s) and H(m, s).

    inputs(B, 3, 1, "main", None, num_stages=4, chunks=None)
  =>
    F3@1/main, R3@1/main, L3@1/main, B3@2/main   (those the schedule has)
"""

from __future__ import annotations

from pipelang.ir.action import Action, Kind

Key = tuple[Kind, int | None, int | None, str | None, int | None]
"""An op's identity without its span: (kind, micro-batch, stage, pipeline, chunk)."""

_F, _B, _W, _R, _P, _E, _H, _L = (
    Kind.F,
    Kind.B,
    Kind.W,
    Kind.R,
    Kind.P,
    Kind.E,
    Kind.H,
    Kind.L,
)


def op_key(action: Action) -> Key:
    """The identity of an op, cheap to hash."""
    return (action.kind, action.mb, action.stage, action.pipeline, action.chunk)


def forward_input(mb: int | None, stage: int, pipe: str | None, c: int | None) -> Key:
    """The result a forward reads: the stage before's forward of the same chunk, or on
    stage 0 the frozen part's (`P`; a schedule without one reads the batch itself)."""
    return (_F, mb, stage - 1, pipe, c) if stage else (_P, mb, 0, pipe, None)


def gradient_input(mb: int | None, stage: int, pipe: str | None, c: int | None) -> Key:
    """The result a backward of a stage before the last reads: the next stage's
    backward (the gradient of this stage's output)."""
    return (_B, mb, stage + 1, pipe, c)


def boundary(kind: Kind, stage: int) -> int:
    """The stage boundary that the result of a `kind` op on `stage` crosses to the op
    that reads it (boundary b joins stages b and b + 1; its tensor is the runtime's
    `shapes[b]`): a forward's output (F, R) crosses `stage`, a backward's (the gradient
    of the stage's input) `stage - 1`, and the frozen part's (P) is stage 0's input, -1.
    An evicted activation's trips (E, H, L) are counted on `stage - 1` too."""
    if kind is _F or kind is _R:
        return stage
    return -1 if kind is _P else stage - 1


def inputs(
    kind: Kind, mb: int | None, stage: int, pipe: str | None, c: int | None, num_stages: int,
    chunks: int | None,
) -> tuple[Key, ...]:  # fmt: skip
    """Every op the op (kind, mb, stage, pipe, c) waits for, by key, under the rule of
    the module docstring; `chunks` is the number of sequence chunks (None: micro-batches
    are not split). Ops a schedule may lack (R without recompute, P without a frozen
    part, L without evictions) are listed all the same: callers keep those that exist.
    It runs once per op of large schedules, so it is written for speed."""
    if kind is _F:
        before = forward_input(mb, stage, pipe, c)
        return (before, (_F, mb, stage, pipe, c - 1)) if c else (before,)
    if kind is _B:
        found: tuple[Key, ...] = (
            (_F, mb, stage, pipe, c),
            (_R, mb, stage, pipe, c),
            (_L, mb, stage, pipe, c),
        )
        if stage + 1 < num_stages:
            found += (gradient_input(mb, stage, pipe, c),)
        if c is not None and chunks is not None and c + 1 < chunks:
            found += ((_B, mb, stage, pipe, c + 1),)
        return found
    if kind is _W:
        return ((_B, mb, stage, pipe, c),)
    if kind is _R:
        return ((_F, mb, stage, pipe, c), (_L, mb, stage, pipe, c))
    if kind is _E:
        return ((_F, mb, stage, pipe, c),)
    if kind is _H:
        return ((_E, mb, stage, pipe, c),)
    if kind is _L:
        return ((_E, mb, stage, pipe, c), (_H, mb, stage, pipe, c))
    return ()  # P
