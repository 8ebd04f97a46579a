"""One op's problem, and the rule that merges many into one diagnostic: a loop that makes
one mistake many times is one mistake. Used by the order checks and the eviction checks."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pipelang.diagnostics import Diagnostic, Label, merged
from pipelang.ir import Action
from pipelang.source import Span


@dataclass(frozen=True, slots=True)
class Problem:
    """One op's problem on `rank` (-1: not known). Problems with one code, one kind of
    mistake (`what`, where a code covers several) and one span merge into one
    diagnostic. An order problem also keeps its (needed, needer) pair of ops as `edge`."""

    code: str
    op: Action
    rank: int
    detail: str
    help: str
    labels: tuple[Label, ...] = ()
    edge: tuple[Action, Action] | None = None
    what: str = ""


def collapse(problems: Iterable[Problem], many: Mapping[str, str]) -> list[Diagnostic]:
    """One diagnostic per (code, kind of mistake, span; rank where there is no span),
    titled by `many[what or code]` when it merges several."""
    groups: dict[tuple[str, str, Span | None, int], list[Problem]] = defaultdict(list)
    for p in problems:
        groups[(p.code, p.what, p.op.span, -1 if p.op.span else p.rank)].append(p)
    return [
        merged(
            code,
            span,
            [p.detail for p in group],
            [p.op for p in group],
            many[what or code],
            group[0].labels,
            group[0].help,
        )
        for (code, what, span, _), group in groups.items()
    ]
