"""The listing and the order of a Program's ops: every op once, on its placement's rank,
after the ops it needs on its own rank.

E0301 wrong rank (or an op the schedule does not have), E0302 duplicate, E0303 missing,
E0309 undeclared op kind, E0304 B before its F, E0305 W before its B or R outside F..B,
E0317 a frozen forward `P` on a rank that does not hold the frozen part, E0318 a stage-0
F before its own P on one rank, E0320 a chunk's F before the F of the chunk before it or
its B before the B of the chunk after it. Problems with one code and one span merge into
one diagnostic (`collapse`)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from pipelang.diagnostics import Diagnostic, label, listing
from pipelang.ir import COMPUTE_KINDS, Action, Kind, Program, deps, placement
from pipelang.ir.graph import Edge, Key, OpGraph, op_key
from pipelang.passes.validate.problems import Problem


@dataclass(frozen=True, slots=True)
class _Census:
    """Where each op is listed: `placed` holds the first occurrence (rank, step, action)
    of every op listed on its right rank, `misplaced` the ops listed elsewhere (reported
    there, so not also as missing); `problems` what the listing got wrong."""

    placed: dict[Key, tuple[int, int, Action]]
    misplaced: set[Key]
    problems: list[Problem]


MANY = {  # what a merged diagnostic of many problems says, by code
    "E0301": "ops are listed on the wrong rank",
    "E0302": "ops are listed twice",
    "E0304": "backwards run before their forward",
    "E0305": "ops run outside their forward..backward order",
    "E0309": "ops use an op kind the schedule does not declare",
    "E0317": "frozen forwards run on ranks that do not hold the frozen part",
    "E0318": "forwards run before the frozen forward that makes their input",
    "E0320": "chunks of one micro-batch run out of order",
}


def listed_right(program: Program, graph: OpGraph) -> bool:
    """Whether every op the schedule needs is listed once, on the rank its placement
    names, and of a declared kind: what most programs are. It is checked over the
    numbered ops alone; the census, which walks every listing, runs only when it will
    find something."""
    ops = graph.ops
    if graph.listed != len(ops) or len(ops) != _needed(program):
        return False
    owner, travels = _owners(program)
    declared = _declared(program)
    holders = frozenset(program.frozen or ())
    return all(
        (rank in holders if op.kind is Kind.P else owner.get((op.stage, op.pipeline)) == rank)
        and travels.get(op.mb) == op.pipeline
        and op.kind in declared
        for op, rank in zip(ops, graph.ranks, strict=True)
    )


def _needed(program: Program) -> int:
    """How many ops the schedule must run: every kind on every (micro-batch, stage), and
    a `P` per micro-batch when it has a frozen part."""
    chunks = 1 if program.chunks is None else program.chunks.count
    per_mb = program.num_stages * len(program.kinds) * chunks + (program.frozen is not None)
    return program.num_microbatches * per_mb


def _declared(program: Program) -> frozenset[Kind]:
    """The compute kinds the schedule declares: its `ops`, and `P` with a frozen part."""
    return frozenset((*program.kinds, Kind.P) if program.frozen is not None else program.kinds)


def _owners(
    program: Program,
) -> tuple[dict[tuple[int | None, str | None], int], dict[int | None, str]]:
    """The rank of each (stage, pipeline), and the pipeline of each micro-batch."""
    return placement.owners(program.pipelines), dict(enumerate(program.assignment))


def take_census(program: Program) -> _Census:
    """E0301, E0302, E0309, for each compute action where it stands.

    An op listed on the wrong rank is reported as that alone, not also as a duplicate of
    its copy on the right rank.
    """
    owner, travels = _owners(program)
    declared, compute = _declared(program), COMPUTE_KINDS
    holders = frozenset(program.frozen or ())
    placed: dict[Key, tuple[int, int, Action]] = {}
    misplaced: set[Key] = set()
    problems = []
    for rank, actions in enumerate(program.ranks):
        for step, action in enumerate(actions):
            kind, mb, stage, pipe = action.kind, action.mb, action.stage, action.pipeline
            if kind not in compute:
                continue
            key = op_key(action)
            if kind not in declared:
                problems.append(_undeclared(action, rank))
            if kind is Kind.P and stage == 0 and travels.get(mb) == pipe:
                if rank not in holders:
                    problems.append(_not_a_holder(program, action, rank))
                    misplaced.add(key)
                    continue
            elif owner.get((stage, pipe)) != rank or travels.get(mb) != pipe:
                problems.append(_misplaced(program, owner, action, rank))
                misplaced.add(key)
                continue
            first = placed.setdefault(key, (rank, step, action))
            if first[1] != step or first[0] != rank:
                problems.append(_duplicate(first, action, rank, step))
    return _Census(placed, misplaced, problems)


def _undeclared(action: Action, rank: int) -> Problem:
    kind = action.kind.value
    return Problem(
        "E0309",
        action,
        rank,
        f"`{action}` uses op kind `{kind}`, which the schedule does not declare",
        f"declare it: `ops F, B, {kind}`",
    )


def _not_a_holder(program: Program, action: Action, rank: int) -> Problem:
    return Problem(
        "E0317",
        action,
        rank,
        f"`{action}` runs the frozen part on rank {rank}, which does not hold it "
        f"(held by {_holders(program)})",
        f"list it on a rank that holds the frozen part, or add rank {rank} to `frozen`",
    )


def _holders(program: Program) -> str:
    """`rank 0` or `ranks 0, 1`: the ranks that hold the frozen part."""
    ranks = program.frozen or ()
    return f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"


def _misplaced(
    program: Program, owner: dict[tuple[int | None, str | None], int], action: Action, rank: int
) -> Problem:
    reason = _not_an_op(program, action)
    if reason is not None or action.stage is None or action.pipeline is None:
        return Problem(
            "E0301",
            action,
            rank,
            f"`{action}` is not an op of this schedule: {reason}",
            "remove it, or fix its micro-batch or stage",
        )
    right = owner[(action.stage, action.pipeline)]
    return Problem(
        "E0301",
        action,
        rank,
        f"`{action}` is listed on rank {rank}, but pipeline `{action.pipeline}` places "
        f"stage {action.stage} on rank {right}",
        f"move it to rank {right}'s order: the placement decides where an op runs, "
        "the order only when",
    )


def _not_an_op(program: Program, action: Action) -> str | None:
    """Why `action` names no op of the schedule, or None when it does."""
    mb, stage, pipe = action.mb, action.stage, action.pipeline
    placement = next((p.placement for p in program.pipelines if p.name == pipe), None)
    if placement is None:
        return f"there is no pipeline `{pipe}`"
    if stage is None or not 0 <= stage < len(placement):
        return f"there is no stage {stage} (stages are 0..{len(placement)})"
    if mb is None or not 0 <= mb < program.num_microbatches:
        return f"there is no micro-batch {mb} (micro-batches are 0..{program.num_microbatches})"
    if program.assignment[mb] != pipe:
        return f"micro-batch {mb} travels through pipeline `{program.assignment[mb]}`"
    return None


def _duplicate(first: tuple[int, int, Action], action: Action, rank: int, step: int) -> Problem:
    first_rank, first_step, original = first
    labels = label(original.span, "first listed here")
    return Problem(
        "E0302",
        action,
        rank,
        f"`{action}` is listed twice: rank {first_rank} step {first_step} "
        f"and rank {rank} step {step}",
        "each op runs exactly once; remove one of them",
        labels,
    )


def missing(program: Program, census: _Census) -> list[Diagnostic]:
    """E0303, one diagnostic per rank that should run ops nobody lists (or lists only on
    the wrong rank)."""
    declared = _declared(program)
    listed = sum(1 for kind, *_ in census.placed if kind in declared)
    if listed == _needed(program):
        return []
    found = _missing_frozen(program, census)
    absent: dict[int, list[Action]] = defaultdict(list)
    for op in program.compute_ops():
        key = op_key(op)
        if op.kind is not Kind.P and key not in census.placed and key not in census.misplaced:
            absent[program.rank_of(op.stage, op.pipeline)].append(op)  # type: ignore[arg-type]
    names = [k.value for k in program.kinds]
    kinds = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
    return found + [
        Diagnostic(
            "E0303",
            f"rank {rank} never runs "
            + (f"`{ops[0]}`" if len(ops) == 1 else f"{len(ops)} required ops: {listing(ops)}"),
            program.order_span,
            help=f"add them to rank {rank}'s order: every micro-batch"
            + (" (each of its chunks)" if program.chunks is not None else "")
            + f" needs {kinds} on every stage of its pipeline",
        )
        for rank, ops in sorted(absent.items())
    ]


def _missing_frozen(program: Program, census: _Census) -> list[Diagnostic]:
    """E0303 for the micro-batches whose frozen forward no rank runs."""
    if program.frozen is None:
        return []
    absent = [
        Action(Kind.P, mb, 0, pipe)
        for mb, pipe in enumerate(program.assignment)
        if (Kind.P, mb, 0, pipe, None) not in census.placed
        and (Kind.P, mb, 0, pipe, None) not in census.misplaced
    ]
    if not absent:
        return []
    what = f"`{absent[0]}`" if len(absent) == 1 else listing(absent)
    return [
        Diagnostic(
            "E0303",
            f"no rank runs the frozen forward of {len(absent)} micro-batch"
            f"{'es' * (len(absent) > 1)}: {what}",
            program.order_span,
            help=f"list `P(mb)` once per micro-batch on a rank that holds the frozen part "
            f"({_holders(program)})",
        )
    ]


@dataclass(frozen=True, slots=True)
class _OrderRule:
    """How to report `needer` listed before `needed`, both of one (micro-batch, stage)."""

    code: str
    message: str
    label: str
    at_needed: bool = False
    """Report at `needed` (an R listed after its B is the R's mistake)."""


_ORDER_RULES = {
    (Kind.F, Kind.B): _OrderRule(
        "E0304",
        "`{needer}` runs before its forward `{needed}` on rank {rank}",
        "the forward is listed here",
    ),
    (Kind.B, Kind.W): _OrderRule(
        "E0305",
        "`{needer}` runs before its backward `{needed}` on rank {rank}",
        "the backward is listed here",
    ),
    (Kind.F, Kind.R): _OrderRule(
        "E0305",
        "`{needer}` runs before the forward `{needed}` it recomputes, on rank {rank}",
        "the forward is listed here",
    ),
    (Kind.P, Kind.F): _OrderRule(
        "E0318",
        "`{needer}` runs before the frozen forward `{needed}` that makes its input, on rank {rank}",
        "the frozen forward is listed here",
    ),
    (Kind.R, Kind.B): _OrderRule(
        "E0305",
        "`{needed}` runs after the backward `{needer}` that needs it, on rank {rank}",
        "the backward is listed here",
        at_needed=True,
    ),
    (Kind.F, Kind.F): _OrderRule(
        "E0320",
        "`{needer}` runs before `{needed}`, whose keys and values it reads, on rank {rank}",
        "the chunk before it is listed here",
    ),
    (Kind.B, Kind.B): _OrderRule(
        "E0320",
        "`{needer}` runs before `{needed}`, which hands it the gradients of its keys and "
        "values, on rank {rank}",
        "the chunk after it is listed here",
    ),
}
"""Keyed by (kind of the needed op, kind of the op that needs it)."""


def order_problems(graph: OpGraph) -> list[Problem]:
    """E0304, E0305: an op listed before an op of its own (micro-batch, stage) it needs:
    a `data` edge that points back up one rank's list. For a program that lists every
    op once, on its rank."""
    ops, ranks = graph.ops, graph.ranks
    return [
        _order_problem(ops[u], ops[v], ranks[v])
        for u, v in graph.data
        if u > v and ranks[u] == ranks[v] and ops[u][1:4] == ops[v][1:4]
    ]  # (one micro-batch, stage and pipeline: its chunks too, in order)


def order_problems_in(program: Program, census: _Census) -> list[Problem]:
    """`order_problems` for any program: between the occurrences on the right rank, of
    the inputs (`deps.inputs`) an op has on its own micro-batch and stage."""
    problems = []
    placed = census.placed
    chunks = None if program.chunks is None else program.chunks.count
    for (kind, mb, stage, pipe, chunk), (rank, step, needer) in placed.items():
        if stage is None:
            continue
        for key in deps.inputs(kind, mb, stage, pipe, chunk, program.num_stages, chunks):
            if key[1:4] != (mb, stage, pipe) or (key[0], kind) not in _ORDER_RULES:
                continue
            found = placed.get(key)
            if found is not None and found[0] == rank and found[1] > step:
                problems.append(_order_problem(found[2], needer, rank))
    return problems


def _order_problem(needed: Action, needer: Action, rank: int) -> Problem:
    rule = _ORDER_RULES[(needed.kind, needer.kind)]
    at, other = (needed, needer) if rule.at_needed else (needer, needed)
    return Problem(
        rule.code,
        at,
        rank,
        rule.message.format(needed=needed, needer=needer, rank=rank),
        f"on rank {rank}, list `{needed}` before `{needer}`",
        label(other.span, rule.label),
        (needed, needer),
    )


def edges_of(graph: OpGraph, problems: list[Problem]) -> frozenset[Edge]:
    """The graph edges of order problems: already reported, so not a deadlock too."""
    edges = set()
    for problem in problems:
        if problem.edge is not None:
            u, v = (graph.find(op) for op in problem.edge)
            if u is not None and v is not None:
                edges.add((u, v))
    return frozenset(edges)
