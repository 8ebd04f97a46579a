"""Pass `expand-orders`: placement, micro-batches and the order become a `Program`.

Needs: the AST and the environment `resolve-params` bound.
Guarantees: a Program whose pipelines place every stage `0..S` on a rank `0..R`, every
rank holding at least one stage; micro-batches `0..N` each assigned to one pipeline;
per-rank compute actions in order, each with the span of the statement that made it.
Whether every op appears once and in a valid order is `validate`'s job.

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
from typing import TYPE_CHECKING, TypeVar

from pipelang import ast
from pipelang.diagnostics import InternalError, Label, fail
from pipelang.evaluate import (
    BOOL,
    MAX_OPS,
    Env,
    Scope,
    Value,
    compile_expr,
    compile_int,
    constant_scope,
    eval_range,
    max_ops,
    nesting_limit,
    op_limit,
    too_large,
)
from pipelang.ir import (
    Action,
    BatchShapes,
    Chunks,
    CostModel,
    Dependency,
    Kind,
    Pipeline,
    Program,
    WeightPolicy,
)
from pipelang.orders import Layout
from pipelang.orders.greedy import expand_greedy_order
from pipelang.orders.rank import expand_rank_order
from pipelang.orders.repeat import expand_repeat_order

if TYPE_CHECKING:
    from pipelang.compiler import Compilation

DeclT = TypeVar("DeclT", bound=ast.Node)


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


def schedule_layout(
    file: ast.File, bindings: Mapping[str, Value], most_ops: int = MAX_OPS
) -> Layout:
    """The schedule's declarations evaluated without running its order: placement,
    micro-batches, kinds and costs (what `pipelang plan` bounds a candidate from; its
    `after` dependencies are left empty)."""
    with nesting_limit(file.schedule.span), op_limit(most_ops):
        return _layout(file, bindings, None, None)


def _layout(
    file: ast.File,
    bindings: Mapping[str, Value],
    given: tuple[tuple[int, int], ...] | None,
    extra_costs: CostModel | None,
) -> Layout:
    schedule = file.schedule
    env: Env = dict(bindings)
    scope = constant_scope(env, file.fns)
    kinds = _kinds(schedule)
    pipelines = _pipelines(_declared(schedule, ast.PipelineDecl, "pipeline"), scope, env)
    num_stages = len(pipelines[0].placement)
    costs = _costs(schedule, scope, env, num_stages).merged(extra_costs)
    num_ranks = _check_ranks(schedule, pipelines)
    assignment = _assignment(
        _single(schedule, ast.Microbatches, "microbatches"), pipelines, scope, env
    )
    frozen = _frozen(schedule, scope, env, num_ranks)
    chunks = _chunks(schedule, scope, env)
    shapes = _shapes(schedule, scope, env, len(assignment), given)
    count = 1 if chunks is None else chunks.count
    total = len(assignment) * (num_stages * len(kinds) * count + (frozen is not None))
    if total > max_ops():
        raise too_large(
            f"the schedule has {total} ops, more than the limit of {max_ops()}", schedule.span
        )
    local: dict[tuple[str, int], tuple[int, ...]] = {}
    for p in pipelines:
        for s, r in enumerate(p.placement):
            local[(p.name, r)] = (*local.get((p.name, r), ()), s)
    layout = Layout(
        scope,
        env,
        num_ranks,
        num_stages,
        pipelines,
        assignment,
        kinds,
        costs,
        (),
        local,
        frozen,
        chunks,
        shapes,
    )
    return layout


def _expand(
    file: ast.File,
    bindings: Mapping[str, Value],
    given: tuple[tuple[int, int], ...] | None,
    extra_costs: CostModel | None,
) -> Program:
    schedule = file.schedule
    layout = _layout(file, bindings, given, extra_costs)
    layout = dataclasses.replace(layout, after=_after(schedule, layout))
    frozen, chunks = layout.frozen, layout.chunks
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
    params = tuple((p.name, bindings[p.name]) for p in schedule.params)
    return Program(
        schedule.name,
        file.source.path,
        params,
        layout.num_ranks,
        layout.num_stages,
        layout.pipelines,
        layout.assignment,
        layout.kinds,
        ranks,
        layout.after,
        layout.costs,
        order.span,
        partition=_partition(schedule, layout.scope, layout.env, layout.num_stages),
        weights=_weights(schedule, layout.scope, layout.env),
        frozen=frozen,
        chunks=chunks,
        shapes=layout.shapes,
    )


def _declared(schedule: ast.Schedule, kind: type[DeclT], word: str) -> list[DeclT]:
    """Every declaration of one kind; at least one must exist (E0207)."""
    found: list[DeclT] = [d for d in schedule.body if isinstance(d, kind)]
    if not found:
        raise fail(
            "E0207",
            f"schedule `{schedule.name}` has no `{word}` declaration",
            schedule.span,
            help=f"see docs/language.md for `{word}`",
        )
    return found


def _single(schedule: ast.Schedule, kind: type[DeclT], word: str) -> DeclT:
    """The one declaration of a kind that must appear exactly once (E0207)."""
    first = _declared(schedule, kind, word)[0]  # at least one
    _optional(schedule, kind, word)  # at most one
    return first


def _optional(schedule: ast.Schedule, kind: type[DeclT], word: str) -> DeclT | None:
    """The declaration of a kind that may appear once (E0207), or None."""
    found = [d for d in schedule.body if isinstance(d, kind)]
    if len(found) > 1:
        raise fail(
            "E0207",
            f"schedule `{schedule.name}` has two `{word}` declarations",
            found[1].span,
            help="merge them into one",
        )
    return found[0] if found else None


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


def _kinds(schedule: ast.Schedule) -> tuple[Kind, ...]:
    decl = _optional(schedule, ast.Ops, "ops")
    if decl is None:
        return (Kind.F, Kind.B)
    kinds = decl.kinds
    if "P" in kinds:
        raise fail(
            "E0309",
            "`P` is not declared with `ops`: a `frozen` line declares the frozen part",
            decl.span,
            help="write `frozen on ranks 0..D` (the ranks that hold it) and drop `P` here",
        )
    if "F" not in kinds or "B" not in kinds or len(set(kinds)) != len(kinds):
        raise fail("E0309", "`ops` must list F and B once each, plus W and/or R", decl.span)
    return tuple(Kind(k) for k in ("F", "B", "W", "R") if k in kinds)


def _frozen(
    schedule: ast.Schedule, scope: Scope, env: Env, num_ranks: int
) -> tuple[int, ...] | None:
    """The ranks the `frozen` lines name (E0210 for one outside the schedule's ranks or
    for none at all); None without a `frozen` line."""
    decls = [d for d in schedule.body if isinstance(d, ast.Frozen)]
    if not decls:
        return None
    holders: set[int] = set()
    for decl in decls:
        ranks = eval_range(decl.ranks, scope, env)
        if len(ranks) and not (ranks[0] >= 0 and ranks[-1] < num_ranks):
            outside = ranks[0] if ranks[0] < 0 else ranks[-1]
            raise fail(
                "E0210",
                f"`frozen` names rank {outside}, but the schedule's ranks are 0..{num_ranks}",
                decl.ranks.span,
                help="the frozen part is held by ranks of the schedule: "
                f"`frozen on ranks 0..{num_ranks}` puts it on every rank",
            )
        holders.update(ranks)
    if not holders:
        raise fail(
            "E0210",
            "the `frozen` ranges are empty: no rank holds the frozen part",
            decls[0].span,
            help="`frozen on ranks a..b` needs a < b",
        )
    weights = _optional(schedule, ast.Weights, "weights")
    if weights is not None:
        raise fail(
            "E0210",
            "an asynchronous schedule (`weights`) cannot have frozen work yet",
            decls[0].span,
            labels=(Label(weights.span, "asynchronous here"),),
            help="drop the `frozen` line, or make the schedule synchronous",
        )
    return tuple(sorted(holders))


def _chunks(schedule: ast.Schedule, scope: Scope, env: Env) -> Chunks | None:
    """The `chunks` declaration: at least one chunk, and not (yet) with frozen work,
    evictions or asynchronous weights (E0211); None without one."""
    decl = _optional(schedule, ast.ChunksDecl, "chunks")
    if decl is None:
        return None
    count = compile_int(decl.count, scope)(env)
    if count < 1:
        raise fail(
            "E0211",
            f"`chunks {count}`: a micro-batch splits into at least one chunk",
            decl.count.span,
            help="`chunks 1` is the unsplit micro-batch; Seq1F1B uses 4",
        )
    for other, what in ((ast.Frozen, "frozen work"), (ast.Weights, "asynchronous weights")):
        clash = next((d for d in schedule.body if isinstance(d, other)), None)
        if clash is not None:
            raise fail(
                "E0211",
                f"sequence chunks do not combine with {what} yet",
                decl.span,
                labels=(Label(clash.span, f"{what} here"),),
                help="drop one of the two declarations",
            )
    split = decl.split
    if decl.when is not None and not compile_expr(decl.when, scope, BOOL)(env):
        split = "tokens"
    return Chunks(count, split, decl.span)


def _shapes(
    schedule: ast.Schedule,
    scope: Scope,
    env: Env,
    count: int,
    given: tuple[tuple[int, int], ...] | None,
) -> BatchShapes | None:
    """The micro-batches' shapes: `given` (`--lengths FILE`), else the `lengths` and
    `sizes` lines, one value of at least 1 per micro-batch (E0212); None without them."""
    decls = {d.what: d for d in schedule.body if isinstance(d, ast.ShapeList)}
    microbatches = _single(schedule, ast.Microbatches, "microbatches")
    if given is not None:
        if len(given) != count:
            raise fail(
                "E0212",
                f"--lengths gives {len(given)} micro-batches, but the schedule has {count}",
                microbatches.span,
                help="give one line per micro-batch, or as many micro-batches "
                f"(`-p N={len(given)}`)",
            )
        return BatchShapes(tuple(s for s, _ in given), tuple(n for _, n in given))
    if not decls:
        return None
    for what in ("lengths", "sizes"):
        found = [d for d in schedule.body if isinstance(d, ast.ShapeList) and d.what == what]
        if len(found) > 1:
            raise fail("E0207", f"schedule `{schedule.name}` has two `{what}` lines", found[1].span)
    if "lengths" not in decls:
        raise fail(
            "E0212",
            "`sizes` without `lengths`: a micro-batch's shape needs its sequence length",
            decls["sizes"].span,
            help="add `lengths L0, L1, ...`, one per micro-batch",
        )
    values = {}
    for what, decl in decls.items():
        if len(decl.values) != count:
            raise fail(
                "E0212",
                f"`{what}` gives {len(decl.values)} values, but the schedule has {count} "
                "micro-batches",
                decl.span,
                labels=(Label(microbatches.span, f"{count} micro-batches here"),),
                help="give one value per micro-batch",
            )
        values[what] = tuple(compile_int(v, scope)(env) for v in decl.values)
        for value, expr in zip(values[what], decl.values, strict=True):
            if value < 1:
                raise fail(
                    "E0212",
                    f"a micro-batch of {value} {'tokens' if what == 'lengths' else 'samples'}",
                    expr.span,
                    help=f"every value of `{what}` is at least 1",
                )
    samples = values.get("sizes", (1,) * count)
    return BatchShapes(samples, values["lengths"], decls["lengths"].span)


def _weights(schedule: ast.Schedule, scope: Scope, env: Env) -> WeightPolicy | None:
    """The `weights` declaration of an asynchronous schedule; None when there is none."""
    decl = _optional(schedule, ast.Weights, "weights")
    if decl is None:
        return None
    if decl.count is None:
        return WeightPolicy(decl.policy, None, decl.span)
    count = compile_int(decl.count, scope)(env)
    if count < 1:
        raise fail(
            "E0314",
            f"`weights {count}`: a stage copy holds at least one version of its weights",
            decl.span,
            help="`weights 1` forbids stashing; `weights 2` is PipeDream-2BW's double buffer",
        )
    return WeightPolicy(decl.policy, count, decl.span)


def _costs(schedule: ast.Schedule, scope: Scope, env: Env, num_stages: int) -> CostModel:
    entries: list[tuple[str, int | None, float]] = []
    for decl in schedule.body:
        if isinstance(decl, ast.Cost):
            for item in decl.items:
                stage = None if item.stage is None else compile_int(item.stage, scope)(env)
                if stage is not None and not 0 <= stage < num_stages:
                    raise fail(
                        "E0209",
                        f"`cost {item.kind}[{stage}]`: the schedule has no stage {stage} "
                        f"(its stages are 0..{num_stages - 1})",
                        item.span,
                    )
                entries.append((item.kind, stage, item.value))
    return CostModel().merged(CostModel(tuple(entries)))


def _partition(
    schedule: ast.Schedule, scope: Scope, env: Env, num_stages: int
) -> tuple[int, ...] | None:
    """The `partition` line's layer counts: one per stage, each at least 1 (E0208)."""
    decl = _optional(schedule, ast.Partition, "partition")
    if decl is None:
        return None
    counts = tuple(compile_int(count, scope)(env) for count in decl.counts)
    if len(counts) != num_stages:
        raise fail(
            "E0208",
            f"`partition` gives {len(counts)} layer counts but the schedule has "
            f"{num_stages} stages",
            decl.span,
            help=f"give one count per stage, {num_stages} in all",
        )
    for count, value in zip(decl.counts, counts, strict=True):
        if value < 1:
            raise fail(
                "E0208",
                f"a stage of `partition` holds {value} layers; every stage needs at least one",
                count.span,
            )
    return counts


def _pipelines(decls: list[ast.PipelineDecl], scope: Scope, env: Env) -> tuple[Pipeline, ...]:
    pipelines: list[Pipeline] = []
    names: set[str] = set()
    placed = 0
    for decl in decls:
        indices: list[int | None] = [None]
        if decl.index_range is not None:
            indices = list(eval_range(decl.index_range, scope, env))
        # The stage range cannot use the family's index: every member has as many stages.
        placed += len(indices) * len(eval_range(decl.stages, scope, env))
        if placed > max_ops():
            raise too_large(f"the pipelines place more than {max_ops()} stages", decl.span)
        for j in indices:
            # Family members are `down0`, `down1`, ...; a family of one keeps the plain name.
            name = decl.name if j is None or len(indices) == 1 else f"{decl.name}{j}"
            if name in names:
                raise fail("E0102", f"pipeline `{name}` is declared twice", decl.span)
            names.add(name)
            local = dict(env)
            if j is not None:
                local[decl.index_var] = j  # type: ignore[index]
            pipelines.append(Pipeline(name, _placement(decl, scope, local), decl.span))
    if not pipelines:
        raise fail(
            "E0207",
            "every `pipeline` family is empty; there is no pipeline",
            decls[0].span,
            help="check the family's range: `p[j in 0..f]` needs f >= 1",
        )
    sizes = {len(p.placement) for p in pipelines}
    if len(sizes) > 1:
        raise fail(
            "E0205",
            "pipelines have different numbers of stages: "
            + ", ".join(f"`{p.name}` {len(p.placement)}" for p in pipelines),
            pipelines[-1].span,
            help="every pipeline is a replica of the same model",
        )
    return tuple(pipelines)


def _placement(decl: ast.PipelineDecl, scope: Scope, env: Env) -> tuple[int, ...]:
    stages = eval_range(decl.stages, scope, env)
    if stages.start != 0 or len(stages) == 0:
        raise fail(
            "E0205",
            f"pipeline `{decl.name}` must place stages 0..S with S >= 1, "
            f"not {stages.start}..{stages.stop}",
            decl.stages.span,
        )
    inner = scope.with_name(decl.stage_var, decl.span)
    if decl.index_var is not None:
        inner = inner.with_name(decl.index_var, decl.span)
    rank_of = compile_int(decl.rank, inner)
    placement = []
    for s in stages:
        env[decl.stage_var] = s
        rank = rank_of(env)
        if rank < 0:
            raise fail(
                "E0205",
                f"pipeline `{decl.name}` puts stage {s} on rank {rank}",
                decl.rank.span,
                help="ranks are 0, 1, 2, ...",
            )
        placement.append(rank)
    return tuple(placement)


def _check_ranks(schedule: ast.Schedule, pipelines: tuple[Pipeline, ...]) -> int:
    used = {r for p in pipelines for r in p.placement}
    num_ranks = max(used) + 1
    if num_ranks > max_ops():
        raise too_large(
            f"the placement uses {num_ranks} ranks, more than the limit of {max_ops()}",
            pipelines[0].span,
        )
    idle = sorted(set(range(num_ranks)) - used)
    if idle:
        raise fail(
            "E0205",
            f"rank {idle[0]} holds no stage (ranks are 0..{num_ranks})",
            pipelines[0].span,
            help="ranks must be numbered 0, 1, ... without holes",
        )
    return num_ranks


def _assignment(
    decl: ast.Microbatches, pipelines: tuple[Pipeline, ...], scope: Scope, env: Env
) -> tuple[str, ...]:
    names = {p.name for p in pipelines}
    owner: dict[int, str] = {}
    for item in decl.items:
        rng = eval_range(item.range, scope, env)
        inner = scope if item.var is None else scope.with_name(item.var, item.span)
        index = None if item.pipeline.index is None else compile_int(item.pipeline.index, inner)
        for mb in rng:
            local = dict(env) if item.var is None else {**env, item.var: mb}
            name = _member(item.pipeline.name, None if index is None else index(local), names)
            if name not in names:
                raise fail(
                    "E0107",
                    f"no pipeline named `{name}`",
                    item.pipeline.span,
                    notes=("pipelines: " + ", ".join(f"`{n}`" for n in sorted(names)),),
                )
            if mb in owner:
                raise fail(
                    "E0206",
                    f"micro-batch {mb} is assigned twice (to `{owner[mb]}` and `{name}`)",
                    item.span,
                )
            owner[mb] = name
    if not owner:
        raise fail(
            "E0206",
            "no micro-batches are assigned",
            decl.span,
            help="check the range: `microbatches 0..N -> main` with N >= 1",
        )
    if min(owner) < 0 or max(owner) >= len(owner):
        # Distinct numbers >= 0 with one >= their count leave a hole below their count.
        holes = (mb for mb in range(len(owner)) if mb not in owner)
        what = f"{min(owner)} is negative" if min(owner) < 0 else f"{next(holes)} is not assigned"
        raise fail(
            "E0206",
            f"micro-batch {what}",
            decl.span,
            help="micro-batches must be numbered 0..N without holes",
        )
    return tuple(owner[mb] for mb in range(len(owner)))


def _member(family: str, index: int | None, names: set[str]) -> str:
    """The pipeline `family[index]` names: `family{index}`, or `family` for a family of one."""
    if index is None:
        return family
    if index == 0 and family in names and f"{family}1" not in names:
        return family
    return f"{family}{index}"


def _after(schedule: ast.Schedule, layout: Layout) -> tuple[Dependency, ...]:
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
    if Kind(call.kind) not in layout.kinds:
        declared = ", ".join(k.value for k in layout.kinds)
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
