"""The `.pipe` text `synthesize` writes: the placement, `cost` lines with the costs the
order was found for, each parameter required to be its value, explicit `order rank`
blocks, and a header of the inputs and results."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from pipelang.compiler import Compilation
from pipelang.evaluate import Value
from pipelang.import_torch import check_pipe, placement_expr
from pipelang.ir import Action, CostModel, deps
from pipelang.sim.timeline import as_number
from pipelang.source import one_line
from pipelang.synthesis.problem import Problem, amount

if TYPE_CHECKING:
    from pipelang.synthesis import Synthesized

OPS_PER_LINE = 6


def write_pipe(problem: Problem, orders: Sequence[Sequence[Action]], name: str, header: str) -> str:
    """The `.pipe` text of the placement with each rank's compute ops in `orders`, under
    `cost` lines that give the problem's costs."""
    layout = problem.layout
    lines = [header.rstrip("\n")] if header else []
    declared = ", ".join(
        f"{key}: {'bool' if isinstance(v, bool) else 'int'} = {_value(v)}"
        for key, v in problem.params
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
    lines += [f"    cost {item}" for item in _cost_items(layout.costs, layout.num_stages)]
    used = set(layout.assignment)
    for pipe in layout.pipelines:
        if pipe.name in used:
            expr, _ = placement_expr(pipe.placement, layout.num_ranks)
            stages = len(pipe.placement)
            lines.append(f"    pipeline {pipe.name}: stage s in 0..{stages} -> rank {expr}")
    runs: list[tuple[int, int, str]] = []
    for mb, pipe_name in enumerate(layout.assignment):
        if runs and runs[-1][2] == pipe_name:
            runs[-1] = (runs[-1][0], mb + 1, pipe_name)
        else:
            runs.append((mb, mb + 1, pipe_name))
    lines.append("    microbatches " + ", ".join(f"m in {a}..{b} -> {p}" for a, b, p in runs))
    lines += [  # the `after` edges between the ops ordered (the solver kept them too)
        f"    {_op(dep.later)} after {_op(dep.earlier)}"
        for dep in layout.after
        if deps.op_key(dep.later) in problem.index and deps.op_key(dep.earlier) in problem.index
    ]
    lines.append("    order rank r {")
    for rank, row in enumerate(orders):
        head = "if" if rank == 0 else "} else if"
        lines.append(f"        {head} r == {rank} {{")
        texts = [_op(op) for op in row if op.kind.is_compute]
        for k in range(0, len(texts), OPS_PER_LINE):
            lines.append("            " + " ".join(texts[k : k + OPS_PER_LINE]))
    lines += ["        }", "    }", "}", ""]
    return "\n".join(lines)


def _op(op: Action) -> str:
    """A compute op as the order and `after` lines name it."""
    return f"{op.kind.value}(mb={op.mb}, stage={op.stage})"


def _cost_items(costs: CostModel, stages: int) -> list[str]:
    """The `cost` lines' items for the times and the W share the order was found for:
    every kind's value on one line, then a line per kind that differs on some stage."""
    kinds = ("F", "B", "W", "C", "MW")
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
    """A cost as the grammar's NUMBER writes it: digits and a decimal point, no exponent."""
    text = f"{value:.15f}".rstrip("0").rstrip(".")
    return text or "0"


def check_text(text: str) -> Compilation:
    """The written text compiled and checked, as `pipelang check` would (an error here is
    a bug of the writer, and shows as one)."""
    return check_pipe(text, "<synthesized>")


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
        rows.append("the solver saw the times rounded; the bound is for the rounded times")
    if costs is not None and costs.link() is not None:
        rows.append("C[b] is the link between stages b and b + 1")
    return "".join(f"# {one_line(row)}\n" for row in rows) + "\n"
