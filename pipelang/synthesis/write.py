"""The `.pipe` text `synthesize` writes: the placement, `cost` lines with the costs the
order was found for, each parameter required to be its value, explicit `order rank`
blocks, and a header of the inputs and results."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import TYPE_CHECKING

from pipelang import ast
from pipelang.compiler import Compilation, Options, run_passes
from pipelang.diagnostics import InternalError, PipelangError, clip, fail
from pipelang.evaluate import Value
from pipelang.import_torch import placement_expr
from pipelang.ir import Action, CostModel, Kind, deps
from pipelang.parser import parse_text
from pipelang.sim.timeline import as_number
from pipelang.source import SourceFile, one_line
from pipelang.synthesis.problem import Problem, amount

if TYPE_CHECKING:
    from pipelang.synthesis import Synthesized

OPS_PER_LINE = 8

NESTED_STAGES = 50
"""The most stages one `if ... then ... else` chain of a placement expression covers
(the parser takes 100 levels): a longer placement chains functions of this many."""


def write_pipe(problem: Problem, orders: Sequence[Sequence[Action]], name: str, header: str) -> str:
    """The `.pipe` text of the placement with each rank's compute ops in `orders` (an op
    fused to the one before it written with it: `F(i, a) & B(j, b)`, `BW(j, b)`), under
    `cost` lines that give the problem's costs. The names it declares (`r`, `s`, `m`,
    functions) are none of the schedule's parameters'."""
    layout = problem.layout
    taken = {key for key, _ in problem.params}
    r, s, m = (_fresh(base, taken) for base in ("r", "s", "m"))
    lines = [header.rstrip("\n")] if header else []
    declared = ", ".join(
        f"{key}: {'bool' if isinstance(v, bool) else 'int'} = {_value(v)}"
        for key, v in problem.params
    )
    body: list[str] = []
    for pipe in layout.program.pipelines:
        expr = _placement(pipe.placement, layout.program.num_ranks, s, taken, lines)
        body.append(
            f"    pipeline {pipe.name}: stage {s} in 0..{len(pipe.placement)} -> rank {expr}"
        )
    lines.append(f"schedule {name}({declared}) {{")
    for key, v in problem.params:
        lines.append(
            f'    require {key} == {_value(v)} : "this order was synthesized for '
            f'{key} = {_value(v)}: synthesize again for another"'
        )
    lines.append("    ops " + ", ".join(k.value for k in problem.kinds))
    if problem.partition is not None:
        lines.append("    partition " + ", ".join(map(str, problem.partition)))
    lines += [
        f"    cost {item}" for item in _cost_items(layout.program.costs, layout.program.num_stages)
    ]
    lines += body
    runs: list[tuple[int, int, str]] = []
    for mb, pipe_name in enumerate(layout.program.assignment):
        if runs and runs[-1][2] == pipe_name:
            runs[-1] = (runs[-1][0], mb + 1, pipe_name)
        else:
            runs.append((mb, mb + 1, pipe_name))
    lines.append("    microbatches " + ", ".join(f"{m} in {a}..{b} -> {p}" for a, b, p in runs))
    lines += [  # the `after` edges between the ops ordered (the solver kept them too)
        f"    {_op(dep.later)} after {_op(dep.earlier)}"
        for dep in layout.program.after
        if deps.op_key(dep.later) in problem.index and deps.op_key(dep.earlier) in problem.index
    ]
    lines.append(f"    order rank {r} {{")
    _rank_blocks(lines, orders, r, 0, len(orders), 2)
    lines += ["    }", "}", ""]
    return "\n".join(lines)


FLAT_RANKS = 8
"""The most blocks of ranks written one after another: more are halved by `if r < m`
first, so that a rank tests a few conditions, not one per rank, and nothing nests
deeper than the parser takes."""


def _rank_blocks(
    lines: list[str], orders: Sequence[Sequence[Action]], r: str, lo: int, hi: int, depth: int
) -> None:
    """The order blocks of ranks `lo..hi` at `depth` levels of indentation: consecutive
    ranks whose orders are alike but for their stage, offset from the rank by the same
    amount, in one block (`if r >= a and r < b`, stages `r + d`)."""
    shapes = [_shape(orders[rank], rank) for rank in range(len(orders))]
    runs: list[tuple[int, int]] = []
    for rank in range(lo, hi):
        if runs and shapes[runs[-1][0]] == shapes[rank]:
            runs[-1] = (runs[-1][0], rank + 1)
        else:
            runs.append((rank, rank + 1))
    _run_blocks(lines, orders, r, runs, depth)


def _run_blocks(
    lines: list[str],
    orders: Sequence[Sequence[Action]],
    r: str,
    runs: Sequence[tuple[int, int]],
    depth: int,
) -> None:
    pad = "    " * depth
    if len(runs) > FLAT_RANKS:
        mid = len(runs) // 2
        lines.append(f"{pad}if {r} < {runs[mid][0]} {{")
        _run_blocks(lines, orders, r, runs[:mid], depth + 1)
        lines.append(f"{pad}}} else {{")
        _run_blocks(lines, orders, r, runs[mid:], depth + 1)
        lines.append(f"{pad}}}")
        return
    for first, end in runs:
        if end - first == 1:
            lines.append(f"{pad}if {r} == {first} {{")
            texts = _steps(orders[first])
        else:
            lines.append(f"{pad}if {r} >= {first} and {r} < {end} {{")
            texts = _steps(orders[first], (r, first))
        for k in range(0, len(texts), OPS_PER_LINE):
            lines.append(f"{pad}    " + " ".join(texts[k : k + OPS_PER_LINE]))
        lines.append(f"{pad}}}")


def _fresh(base: str, taken: set[str]) -> str:
    """`base`, or `base` with underscores before it, whichever is not `taken` (which it
    joins)."""
    name = base
    while name in taken:
        name = "_" + name
    taken.add(name)
    return name


def _placement(
    placement: tuple[int, ...], ranks: int, var: str, taken: set[str], lines: list[str]
) -> str:
    """The `rank` expression over `var` for a placement: a pattern's (`s`, `s % D`, a V)
    where it has one, else a chain of `if`s, over functions declared in `lines` (before
    the schedule) where it is longer than `NESTED_STAGES`."""
    expr, style = placement_expr(placement, ranks)
    if style != "as listed" or len(placement) <= NESTED_STAGES:
        return re.sub(r"\bs\b", var, expr)
    below = str(placement[-1])  # what the chain gives past its stages
    fn = ""
    for first in range(0, len(placement) - 1, NESTED_STAGES):
        fn = _fresh(f"place{first}", taken)
        chain = below
        for stage in range(min(first + NESTED_STAGES, len(placement) - 1) - 1, first - 1, -1):
            chain = f"if x == {stage} then {placement[stage]} else {chain}"
        lines.append(f"fn {fn}(x) = {chain}")
        below = f"{fn}(x)"
    return f"{fn}({var})"


def _shape(row: Sequence[Action], rank: int) -> tuple[tuple[object, ...], ...]:
    """A rank's order with each stage as its offset from the rank."""
    return tuple((a.kind, a.mb, (a.stage or 0) - rank, a.fused) for a in row if a.kind.is_compute)


def _steps(row: Sequence[Action], relative: tuple[str, int] | None = None) -> list[str]:
    """A rank's compute ops as the order writes them, each compound as one step; with
    `relative` (the rank's name and number), each stage as an offset from the rank."""
    groups: list[list[Action]] = []
    for action in row:
        if not action.kind.is_compute:
            continue
        if action.fused and groups:
            groups[-1].append(action)
        else:
            groups.append([action])
    steps = []
    for group in groups:
        calls: list[str] = []
        for k, action in enumerate(group):
            before = group[k - 1] if k else None
            if (
                action.kind is Kind.W
                and before is not None
                and before.kind is Kind.B
                and (before.mb, before.stage) == (action.mb, action.stage)
            ):
                calls[-1] = "BW" + calls[-1][1:]
            else:
                calls.append(_op(action, relative))
        if len(calls) > 2:
            raise InternalError(f"a compound of {len(calls)} steps: {' & '.join(calls)}")
        steps.append(" & ".join(calls))
    return steps


def _op(op: Action, relative: tuple[str, int] | None = None) -> str:
    """A compute op as the order and `after` lines name it: `F(mb, stage)`; with
    `relative` (a rank's name and number), its stage as an offset from it (`r + 1`)."""
    stage = str(op.stage)
    if relative is not None:
        name, rank = relative
        offset = (op.stage or 0) - rank
        stage = name if offset == 0 else f"{name} {'+' if offset > 0 else '-'} {abs(offset)}"
    return f"{op.kind.value}({op.mb}, {stage})"


def _cost_items(costs: CostModel, stages: int) -> list[str]:
    """The `cost` lines' items for the times and the W share the order was found for:
    every kind's value on one line (and `FB` where it is given), then a line per kind
    that differs on some stage."""
    kinds = ("F", "B", "W", "C", "MW") + (("FB",) if costs.gives("FB") else ())
    items = [", ".join(f"{kind} = {_number(costs.of(kind))}" for kind in kinds)]
    for kind in kinds:
        base = costs.of(kind)
        differ = [s for s in range(stages) if costs.of(kind, s) != base]
        if differ:
            items.append(", ".join(f"{kind}[{s}] = {_number(costs.of(kind, s))}" for s in differ))
    return items


def _value(value: Value) -> str:
    """A parameter's value as a `.pipe` literal."""
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _number(value: float) -> str:
    """A cost as the grammar's NUMBER writes it, digits and a decimal point, no exponent:
    exactly the number it prints as (`repr`), so that it reads back as the same float."""
    text = format(Decimal(repr(float(value))), "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text or "0"


def check_text(text: str) -> Compilation:
    """The written text compiled and checked, as `pipelang check` would, its functions
    with it (an error here is a bug of the writer, and shows as one)."""
    source = SourceFile.of("<synthesized>", text)
    try:
        items = parse_text(source)
    except PipelangError as err:
        if any(d.code == "E0106" for d in err.diagnostics):  # past what a .pipe may hold
            raise fail(
                "E0605",
                f"the order found would be written in a file larger than a .pipe may be "
                f"({clip(err.diagnostics[0].message)})",
                help="synthesize for fewer ranks or micro-batches",
            ) from None
        raise
    schedule = next(i for i in items if isinstance(i, ast.Schedule))
    fns = {i.name: i for i in items if isinstance(i, ast.FnDecl)}
    return run_passes(ast.File(source, schedule, fns), Options(), "validate")


def header(
    result: Synthesized,
    problem: Problem,
    sched: str,
    params: Mapping[str, str] | None,
    costs: CostModel | None,
    cap: float | None,
    time_limit: float,
) -> str:
    """The comment block at the top of the written file: inputs and results."""
    given = " ".join(f"-p {k}={v}" for k, v in (params or {}).items())
    stdlib = result.best_stdlib
    rows = [
        f"Synthesized by `pipelang synthesize` from the placement of {sched} {given}".rstrip(),
        f"ops {', '.join(k.value for k in problem.kinds)}; costs on the `cost` lines below; "
        + (
            "no cap on activations"
            if cap is None
            else f"at most {amount(cap, problem)} of activations per rank"
        ),
        f"makespan {as_number(result.makespan)}; lower bound {as_number(result.bound)} "
        f"(gap {result.gap:.1%}); solver: {result.status} in {result.seconds:.1f} s "
        f"(limit {time_limit:g} s), {result.ops} ops",
        f"started from {result.start.name} (makespan {as_number(result.start.makespan)})",
        "best stdlib schedule on this placement within the cap: "
        + (
            "none"
            if stdlib is None
            else f"{stdlib.name.removeprefix('stdlib ')} (makespan {as_number(stdlib.makespan)})"
        ),
        f"peak activations {amount(result.peak, problem)} on a rank (least possible "
        f"{amount(result.least_cap, problem)})",
    ]
    if not result.exact_times:
        rows.append(
            "the solver saw the times rounded down (too many digits to scale exactly): the "
            "bound holds, and the order is optimal only where it meets it"
        )
    if result.note:
        rows.append(f"not proven optimal: {result.note}")
    if costs is not None and costs.link() is not None:
        rows.append("C[b] is the link between stages b and b + 1")
    return "".join(f"# {one_line(row)}\n" for row in rows) + "\n"
