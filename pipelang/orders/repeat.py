"""`order repeat k every T { ... }`: one micro-batch's ops at slots, repeated.

The body describes the k-th micro-batch of a pipeline: each op names its stage and the
slot it runs in. Micro-batch k of every pipeline gets the same block shifted by `k * T`
slots; each rank then runs its ops in slot order. Warm-up and cool-down fall out: the
first blocks have nothing before them, the last nothing after; `squeeze` after `every T`
closes the idle time they leave (`orders/squeeze.py`).

    order repeat k every 2 {                 # 1F1B, and Chimera's two directions
        for s in 0..D { F(stage=s) @ s   B(stage=s) @ 2 * D - 1 - s }
    }
"""

from __future__ import annotations

from pipelang import ast
from pipelang.diagnostics import Label, fail
from pipelang.evaluate import compile_int
from pipelang.ir import SHARD_KINDS, STASH_KINDS, Action, Kind
from pipelang.orders import Layout
from pipelang.orders.squeeze import squeeze
from pipelang.orders.statements import Budget, compile_block


def expand_repeat_order(order: ast.OrderRepeat, layout: Layout) -> tuple[tuple[Action, ...], ...]:
    """Place every op at its slot, then sort each rank by slot (two in one slot: E0310)."""
    scope = layout.scope.with_name(order.var, order.span)
    body = compile_block(order.body, scope, Budget())
    every = 0 if order.every is None else compile_int(order.every, layout.scope)(layout.env)
    placed: list[dict[int, Action]] = [{} for _ in range(layout.program.num_ranks)]
    first: list[int] = []  # the slots of each pipeline's first block, and of its last
    last: list[int] = []
    for pipeline in layout.program.pipelines:
        mbs = [mb for mb, p in enumerate(layout.program.assignment) if p == pipeline.name]
        for k, mb in enumerate(mbs):

            def emit(
                call: ast.OpCall,
                kind: Kind,
                mb_arg: int | None,
                stage: int | None,
                slot: int | None,
                fused: bool,
                peer: int | None,
                chunk: int | None,
            ) -> None:
                if chunk is not None:
                    raise layout.chunk_error(call, chunk)
                _check_op(call, kind, fused)
                if mb_arg is not None or stage is None or slot is None:
                    raise fail(
                        "E0103",
                        f"in a `repeat` block write `{call.kind}(stage=s) @ slot`",
                        call.span,
                        notes=("the micro-batch is the block's own",),
                    )
                if not 0 <= stage < layout.program.num_stages:
                    raise fail(
                        "E0103",
                        f"stage {stage} does not exist",
                        call.span,
                        notes=(f"stages are 0..{layout.program.num_stages}",),
                    )
                action = Action(kind, mb, stage, pipeline.name, span=call.span)  # noqa: B023
                _place(placed[pipeline.placement[stage]], slot + k * every, action)  # noqa: B023
                if k == 0:  # noqa: B023
                    first.append(slot)
                if k == len(mbs) - 1:  # noqa: B023
                    last.append(slot + k * every)  # noqa: B023

            env = dict(layout.env)
            env[order.var] = k
            body(env, emit)
    if order.squeeze:
        # The steady state runs from the first block's last op to the last block's first.
        return squeeze(placed, (max(first, default=0), min(last, default=0)), layout)
    return tuple(tuple(slots[s] for s in sorted(slots)) for slots in placed)


def _check_op(call: ast.OpCall, kind: Kind, fused: bool) -> None:
    """E0103 for an op a `repeat` block cannot place: an update, a frozen forward, an
    eviction or load, a sharded stage's `gather` or `reshard`, a fused pair."""
    if kind is Kind.U:
        raise fail(
            "E0103",
            "a weight update `U` belongs in an `order rank`",
            call.span,
            help="write the asynchronous schedule with `order rank`",
        )
    if kind is Kind.P:
        raise fail(
            "E0103",
            "a frozen forward `P` belongs in an `order rank` or `order greedy`",
            call.span,
            help="a `repeat` block places ops by stage, and `P` runs on any "
            "rank that holds the frozen part",
        )
    if kind in SHARD_KINDS:
        raise fail(
            "E0103",
            f"`{kind.value}()` belongs in an `order rank`",
            call.span,
            help="write the schedule's order with `order rank r { ... }`",
        )
    if kind in STASH_KINDS:
        raise fail(
            "E0103",
            "evicting and loading activations (`E`, `L`) belong in an `order rank`",
            call.span,
            help="write the schedule's order with `order rank r { ... }`",
        )
    if fused:
        raise fail(
            "E0103",
            "`&` and `BW` belong in an `order rank`",
            call.span,
            help="in a `repeat` block give each op its own slot",
        )


def _place(slots: dict[int, Action], slot: int, action: Action) -> None:
    other = slots.get(slot)
    if other is None:
        slots[slot] = action
        return
    raise fail(
        "E0310",
        f"`{action}` and `{other}` both land in slot {slot} of their rank",
        action.span,
        labels=(Label(other.span, f"`{other}` is placed here"),) if other.span else (),
        help="change the offsets or the `every` interval so each slot holds one op",
    )
