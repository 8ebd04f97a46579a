"""Pass `expand-orders`: placement, micro-batches and the order become a `Program`.

Needs: the AST and the environment `resolve-params` bound.
Guarantees: a Program whose pipelines place every stage `0..S` on a rank `0..R`, every
rank holding at least one stage; micro-batches `0..N` each assigned to one pipeline;
per-rank compute actions in order, each with the span of the statement that made it.
Whether every op appears once and in a valid order is `validate`'s job. The declarations
are read by `layout.py` (the first half, which the planner's bound reads alone); the
orders by `pipelang/orders/`.

    pipeline main: stage s in 0..2 -> rank s
    microbatches 0..2 -> main
    order rank r { F(0) F(1) B(0) B(1) }
  =>
    rank 0: F0@0/main F1@0/main B0@0/main B1@0/main
    rank 1: F0@1/main F1@1/main B0@1/main B1@1/main
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

from pipelang import ast
from pipelang.diagnostics import InternalError, Label, fail
from pipelang.evaluate import (
    MAX_OPS,
    Env,
    Scope,
    Value,
    compile_int,
    eval_range,
    nesting_limit,
    op_limit,
)
from pipelang.ir import (
    Action,
    CostModel,
    Dependency,
    Kind,
    Program,
)
from pipelang.orders import Layout
from pipelang.orders.greedy import expand_greedy_order
from pipelang.orders.rank import expand_rank_order
from pipelang.orders.repeat import expand_repeat_order
from pipelang.passes.layout import read_layout, read_partition, read_weights

if TYPE_CHECKING:
    from pipelang.compiler import Compilation


def expand_orders(
    file: ast.File,
    bindings: Mapping[str, Value],
    most_ops: int = MAX_OPS,
    shapes: tuple[tuple[int, int], ...] | None = None,
    costs: CostModel | None = None,
) -> Program:
    """Evaluate the declarations of the schedule and run its order, refusing schedules of
    more than `most_ops` ops (E0106); `shapes` (samples, length per micro-batch, from
    `--lengths FILE`) stand for the schedule's `lengths` and `sizes` lines; `costs` come
    after its `cost` lines (`--cost`), for the program and for an order that reads them."""
    with nesting_limit(file.schedule.span), op_limit(most_ops):
        return _expand(file, bindings, shapes, costs)


def _expand(
    file: ast.File,
    bindings: Mapping[str, Value],
    given: tuple[tuple[int, int], ...] | None,
    extra_costs: CostModel | None,
) -> Program:
    schedule = file.schedule
    layout = read_layout(file, bindings, given, extra_costs)
    layout = layout.declaring(after=read_after(schedule, layout))
    frozen, chunks = layout.program.frozen, layout.program.chunks
    order = _order(schedule)
    if isinstance(order, ast.OrderRank):
        ranks = expand_rank_order(order, layout)
    elif isinstance(order, ast.OrderGreedy):
        ranks = expand_greedy_order(order, layout)
    elif frozen is not None:
        raise fail(
            "E0210",
            "an `order repeat` cannot place frozen work: its `P` ops run on any rank "
            "that holds the frozen part, not on a stage's rank",
            order.span,
            help="write the order with `order rank` or `order greedy`",
        )
    elif chunks is not None:
        raise fail(
            "E0211",
            "an `order repeat` cannot place sequence chunks: its block is one micro-batch's "
            "ops, and a chunked micro-batch's ops also wait on each other on one stage",
            order.span,
            labels=(Label(chunks.span, "chunks declared here"),) if chunks.span else (),
            help="write the order with `order rank` or `order greedy`",
        )
    else:
        ranks = expand_repeat_order(order, layout)
    return dataclasses.replace(
        layout.program,
        ranks=ranks,
        order_span=order.span,
        partition=read_partition(schedule, layout.scope, layout.env, layout.program.num_stages),
        weights=read_weights(schedule, layout.scope, layout.env),
    )


def _order(schedule: ast.Schedule) -> ast.Order:
    orders = [
        d for d in schedule.body if isinstance(d, ast.OrderRank | ast.OrderGreedy | ast.OrderRepeat)
    ]
    if len(orders) != 1:
        where = orders[1].span if orders else schedule.span
        count = "no" if not orders else "two"
        raise fail(
            "E0207",
            f"schedule `{schedule.name}` has {count} `order` declarations",
            where,
            help="give exactly one `order rank`, `order greedy` or `order repeat`",
        )
    return orders[0]


def read_after(schedule: ast.Schedule, layout: Layout) -> tuple[Dependency, ...]:
    """The schedule's `after` dependencies under `layout`, each op checked (E0103,
    E0309): an order's, and a placement's that `synthesize` orders."""
    deps: list[Dependency] = []
    for decl in schedule.body:
        if not isinstance(decl, ast.After):
            continue
        for call in (decl.earlier, decl.later):
            _check_after_op(call, layout)
        scope, envs = layout.scope, [dict(layout.env)]
        if decl.var is not None and decl.range is not None:
            scope = layout.scope.with_name(decl.var, decl.span)
            values = eval_range(decl.range, layout.scope, layout.env)
            envs = [{**layout.env, decl.var: value} for value in values]
        for env in envs:
            pair = [_after_op(call, scope, env, layout) for call in (decl.earlier, decl.later)]
            deps.append(Dependency(pair[0], pair[1], decl.span))
    return tuple(deps)


def _check_after_op(call: ast.OpCall, layout: Layout) -> None:
    """An `after` names one declared F, B, W, R or P op fully (`P(mb)` needs no stage);
    checked once per declaration, so that one over an empty range is checked too."""
    if call.kind == "U":
        raise fail("E0103", "an `after` names F, B, W or R ops, not a weight update", call.span)
    if call.kind == "P" and call.mb is not None and call.slot is None:
        return  # `Layout.op` checks the rest: a frozen part, stage 0
    if call.kind in ("gather", "reshard"):
        raise fail(
            "E0103",
            f"an `after` names F, B, W or R ops, not `{call.kind}`",
            call.span,
            help=f"a `{call.kind}()` runs where its rank's order lists it",
        )
    if call.kind in ("E", "L"):
        raise fail(
            "E0103",
            f"an `after` names F, B, W or R ops, not `{call.kind}`",
            call.span,
            help="an eviction's order is its rank's order; a load runs before its backward",
        )
    if call.mb is None or call.stage is None or call.slot is not None:
        raise fail("E0103", f"an `after` names ops fully: `{call.kind}(mb, stage)`", call.span)
    if call.kind == "BW":
        raise fail("E0103", "an `after` names one op: write `B` or `W`, not `BW`", call.span)
    if Kind(call.kind) not in layout.program.kinds:
        declared = ", ".join(k.value for k in layout.program.kinds)
        raise fail(
            "E0309",
            f"an `after` names `{call.kind}`, but the schedule's ops are {declared}",
            call.span,
            help=f"declare it (`ops {declared}, {call.kind}`) or name one of those",
        )


def _after_op(call: ast.OpCall, scope: Scope, env: Env, layout: Layout) -> Action:
    assert call.mb is not None  # `_check_after_op`
    mb = compile_int(call.mb, scope)(env)
    stage = None if call.stage is None else compile_int(call.stage, scope)(env)
    chunk = None if call.chunk is None else compile_int(call.chunk, scope)(env)
    return layout.op(call, Kind(call.kind), mb, stage, None, chunk=chunk)


def run(c: Compilation) -> Compilation:
    """The pass: the Program, every rank's compute ops in order."""
    if c.params is None:
        raise InternalError("expand-orders before resolve-params")
    options = c.options
    program = expand_orders(c.need_file(), c.params, options.max_ops, options.shapes, options.costs)
    return dataclasses.replace(c, program=program)
