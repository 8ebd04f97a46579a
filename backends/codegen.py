"""Codegen: one plain, straight-line Python program per rank, from a compiled Program:
what `pipelang compile -o DIR` writes, a readable listing of each rank's actions.

Each action becomes the one call on the runtime `rt` that the executor makes for it
(backends/executor.py, `action_call`: the table both read), with the action's token as a
comment:

    rt.forward(mb=0, stage=0, pipeline="main")                 #   0  F0@0/main
    rt.send_activation(mb=0, stage=0, pipeline="main", to=1)   #   1  send:F0@0/main>1

Started by hand, a rank file runs its rank of schedule.json (next to it) through the
executor (`pipelang.cli.rank.rank_file_main`); nothing generated is executed. This module
decides every line; the template (`templates/rank.py.j2`, StrictUndefined) only loops and
substitutes.
"""

from __future__ import annotations

from pathlib import Path

import jinja2

from pipelang import __version__
from pipelang.backends.executor import action_call
from pipelang.ir import Program
from pipelang.source import one_line

_ENV = jinja2.Environment(
    loader=jinja2.PackageLoader("pipelang.backends", "templates"),
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
    autoescape=False,
)


def render_rank_program(program: Program, rank: int) -> str:
    """The source text of rank `rank`'s program."""
    actions = program.ranks[rank]
    calls = [action_call(a).text() for a in actions]
    width = max((len(c) for c in calls), default=0)
    lines = [
        f"{c:<{width}}  # {i:>3}  {a.text()}"
        for i, (c, a) in enumerate(zip(calls, actions, strict=True))
    ]
    return _ENV.get_template("rank.py.j2").render(
        version=__version__,
        source=one_line(program.source),
        name=program.name,
        params=_params(program),
        rank=rank,
        num_ranks=program.num_ranks,
        copies=_copies(program, rank),
        lines=lines or ["pass  # this rank runs no action"],
    )


def _params(program: Program) -> str:
    params = ", ".join(
        f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in program.params
    )
    return f" ({params})" if params else ""


def _copies(program: Program, rank: int) -> str:
    return ", ".join(f"stage {s} of `{p}`" for s, p in program.stage_copies(rank)) or "none"


def write_rank_programs(program: Program, out_dir: Path) -> list[Path]:
    """Write `out_dir/rank{r}.py` for every rank; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for rank in range(program.num_ranks):
        path = out_dir / f"rank{rank}.py"
        path.write_text(render_rank_program(program, rank))
        written.append(path)
    return written
