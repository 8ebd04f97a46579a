"""The first half of `expand-orders`: a schedule's declarations read into a `Layout`
(placement, micro-batches, op kinds, costs, frozen part, chunks, shapes), without running
its order. `expand-orders` runs the order on it; `pipelang plan` bounds a candidate from
it (`schedule_layout`) without expanding the order at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

from pipelang import ast
from pipelang.diagnostics import Label, fail
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
    BatchShapes,
    Chunks,
    CostModel,
    Kind,
    Pipeline,
    Program,
    WeightPolicy,
    placement,
    stage_problem,
)
from pipelang.orders import Layout

DeclT = TypeVar("DeclT", bound=ast.Node)


def schedule_layout(
    file: ast.File,
    bindings: Mapping[str, Value],
    most_ops: int = MAX_OPS,
    costs: CostModel | None = None,
) -> Layout:
    """The schedule's declarations evaluated without running its order: placement,
    micro-batches, kinds and costs, `costs` over its own (what `pipelang plan` bounds a
    candidate from, and `synthesize` orders; its `after` dependencies are left empty)."""
    with nesting_limit(file.schedule.span), op_limit(most_ops):
        return read_layout(file, bindings, None, costs)


def read_layout(
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
    costs = _costs(schedule, scope, env, num_stages)
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
    declared = Program(
        schedule.name,
        file.source.path,
        tuple((p.name, bindings[p.name]) for p in schedule.params),
        num_ranks,
        num_stages,
        pipelines,
        assignment,
        kinds,
        ranks=(),
        costs=given_costs(costs, extra_costs, schedule.name, num_stages),
        frozen=frozen,
        chunks=chunks,
        shapes=shapes,
    )
    return Layout(scope, env, declared, placement.local_stages(pipelines))


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


def read_weights(schedule: ast.Schedule, scope: Scope, env: Env) -> WeightPolicy | None:
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
                problem = None if stage is None else stage_problem(item.kind, stage, num_stages)
                if problem is not None:
                    raise fail("E0209", f"`cost {item.kind}[{stage}]`: {problem}", item.span)
                entries.append((item.kind, stage, item.value))
    return CostModel().merged(CostModel(tuple(entries)))


def given_costs(costs: CostModel, given: CostModel | None, name: str, num_stages: int) -> CostModel:
    """A schedule's `costs` with the `given` entries over them (`--cost`, the API's
    `costs`: `Options.costs`): the one place they are merged with a schedule and checked
    against its stages. An entry for a stage or boundary the schedule `name` does not
    have is a usage error (exit 2), whichever command took it."""
    for kind, stage, _ in () if given is None else given.entries:
        problem = None if stage is None else stage_problem(kind, stage, num_stages)
        if problem is not None:
            raise fail("usage", f"`--cost {kind}[{stage}]`: {name}: {problem}")
    return costs.merged(given)


def read_partition(
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
