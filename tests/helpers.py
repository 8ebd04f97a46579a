"""Build Programs straight from IR text, and the per-rank orders of known schedules.

`program_from_dump` turns one line of tokens per rank into a Program whose actions carry
spans into that text (file `<dump>`, line r+1 for rank r), so diagnostics point at the
token that caused them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from pipelang.diagnostics import PipelangError
from pipelang.ir import Action, CostModel, Dependency, Kind, Pipeline, Program
from pipelang.passes.build_dag import op_graph
from pipelang.passes.insert_comms import insert_comms
from pipelang.passes.validate import validate
from pipelang.simulate import Timeline, simulate
from pipelang.source import SourceFile, Span


def program_from_dump(
    lines: Sequence[str],
    *,
    pipelines: Mapping[str, Sequence[int]] | None = None,
    assignment: Sequence[str] | None = None,
    kinds: str = "FB",
    after: Sequence[tuple[str, str]] = (),
    name: str = "test",
    params: Mapping[str, int] | None = None,
    costs: CostModel | None = None,
) -> Program:
    """A Program from one line of action tokens per rank (`rank r:` prefixes allowed).

    By default one pipeline `main` places stage s on rank s (as many stages as lines) and
    every micro-batch named in the text travels through `main`.
    """
    source = SourceFile.of("<dump>", "\n".join(lines))
    ranks: list[tuple[Action, ...]] = []
    offset = 0
    for line in lines:
        body = re.sub(r"^\s*rank\s+\d+\s*:", lambda m: " " * len(m.group()), line)
        ranks.append(
            tuple(
                Action.parse(m.group(), Span(source, offset + m.start(), offset + m.end()))
                for m in re.finditer(r"\S+", body)
            )
        )
        offset += len(line) + 1
    placements = dict(pipelines) if pipelines else {"main": range(len(lines))}
    if assignment is None:
        count = 1 + max((a.mb for r in ranks for a in r if a.mb is not None), default=-1)
        assignment = [next(iter(placements))] * count
    return Program(
        name=name,
        source="<dump>",
        params=tuple((params or {}).items()),
        num_ranks=len(lines),
        num_stages=len(next(iter(placements.values()))),
        pipelines=tuple(Pipeline(n, tuple(p)) for n, p in placements.items()),
        assignment=tuple(assignment),
        kinds=tuple(Kind(k) for k in kinds),
        ranks=tuple(ranks),
        after=tuple(Dependency(Action.parse(a), Action.parse(b)) for a, b in after),
        costs=costs or CostModel(),
        order_span=Span(source, 0, len(lines[0])) if lines else None,
    )


def one_f_one_b(num_ranks: int, num_mbs: int) -> list[str]:
    """1F1B: min(D-r-1, N) forwards, then F and B in turn, then the remaining Bs."""
    lines = []
    for r in range(num_ranks):
        warm = min(num_ranks - r - 1, num_mbs)
        ops = [f"F{i}@{r}/main" for i in range(warm)]
        for i in range(num_mbs - warm):
            ops += [f"F{warm + i}@{r}/main", f"B{i}@{r}/main"]
        ops += [f"B{i}@{r}/main" for i in range(num_mbs - warm, num_mbs)]
        lines.append(" ".join(ops))
    return lines


def gpipe(num_ranks: int, num_mbs: int) -> list[str]:
    """GPipe: every forward, then every backward."""
    return [
        " ".join(
            [f"F{i}@{r}/main" for i in range(num_mbs)] + [f"B{i}@{r}/main" for i in range(num_mbs)]
        )
        for r in range(num_ranks)
    ]


def interleaved(num_ranks: int, num_mbs: int, chunks: int) -> list[str]:
    """Megatron's interleaved 1F1B; stage s on rank s % D, N a multiple of D."""
    d, total = num_ranks, num_mbs * chunks
    lines = []
    for r in range(d):
        warm = min((d - r - 1) * 2 + (chunks - 1) * d, total)

        def fwd(k: int, r: int = r) -> str:
            mb, stage = (k // (d * chunks)) * d + k % d, ((k // d) % chunks) * d + r
            return f"F{mb}@{stage}/main"

        def bwd(i: int, r: int = r) -> str:
            mb, stage = (i // (d * chunks)) * d + i % d, (chunks - 1 - (i // d) % chunks) * d + r
            return f"B{mb}@{stage}/main"

        ops = [fwd(k) for k in range(warm)]
        for i in range(total - warm):
            ops += [fwd(warm + i), bwd(i)]
        ops += [bwd(i) for i in range(total - warm, total)]
        lines.append(" ".join(ops))
    return lines


CHIMERA_4 = [
    "F0@0/down F1@0/down F2@3/up B2@3/up F3@3/up B3@3/up B0@0/down B1@0/down",
    "F0@1/down F2@2/up F1@1/down F3@2/up B2@2/up B0@1/down B3@2/up B1@1/down",
    "F2@1/up F0@2/down F3@1/up F1@2/down B0@2/down B2@1/up B1@2/down B3@1/up",
    "F2@0/up F3@0/up F0@3/down B0@3/down F1@3/down B1@3/down B2@0/up B3@0/up",
]
"""Chimera D = 4, N = 4 (papers.md section 1.1): mbs 0, 1 down, 2, 3 up."""

CHIMERA_4_PIPELINES = {"down": (0, 1, 2, 3), "up": (3, 2, 1, 0)}
CHIMERA_4_ASSIGNMENT = ("down", "down", "up", "up")


def chimera_4(costs: CostModel | None = None) -> Program:
    """The Chimera D = 4, N = 4 program of papers.md section 1.1."""
    return program_from_dump(
        CHIMERA_4,
        pipelines=CHIMERA_4_PIPELINES,
        assignment=CHIMERA_4_ASSIGNMENT,
        name="chimera",
        params={"D": 4, "N": 4},
        costs=costs,
    )


def costs(**values: float) -> CostModel:
    """A CostModel from keyword times: `costs(F=1, B=2)`."""
    return CostModel().merged(CostModel(tuple((k, None, float(v)) for k, v in values.items())))


def replay(program: Program, model: CostModel) -> Timeline:
    """Simulate a Program made outside the compiler (a dump, a hand-built order): build
    its op graph and validate it first, as the compiler does (raises PipelangError); a
    backward that is not split takes B + W, as the compiler times it."""
    graph = op_graph(program)
    problems = validate(program, graph, None)
    if problems:
        raise PipelangError(problems)
    return simulate(program, graph, model.for_kinds(program.kinds))


def with_comms(program: Program) -> Program:
    """Pass `insert-comms` on a Program made outside the compiler."""
    return insert_comms(program, op_graph(program))
